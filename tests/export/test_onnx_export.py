"""Torch → ONNX: both exporters on small modules and a tiny Llama, checked against torch; the
KV-cache signature; re-tying the legacy exporter's copy of a tied head; large-model saving."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from flashnorm.export import (
    ExportSpec, causal_lm_spec, export_causal_lm, export_module, past_names, present_names, retie_lm_head, save_model,
)
from flashnorm.export.onnx_export import lm_head_shares_embedding, strip_initializer_prefix
from flashnorm.passes import optimize_file
from flashnorm.progress import Progress
from flashnorm.validate import compare_models, make_session
from models import cache

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


class NormThenProject(torch.nn.Module):
    """x → RMSNorm(x)·g → two projections (one with bias) → sum: the smallest foldable site,
    written either the way model code writes it or as torch.nn.RMSNorm."""

    def __init__(self, hidden: int, out: int, rng: np.random.Generator, torch_module: bool) -> None:
        super().__init__()
        gain = rng.uniform(0.5, 1.5, hidden) * np.where(rng.random(hidden) < 0.25, -1, 1)
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-5) if torch_module else None
        self.gain = torch.nn.Parameter(torch.from_numpy(gain.astype(np.float32)))
        if self.norm is not None:
            self.norm.weight = self.gain
        self.first = torch.nn.Linear(hidden, out, bias=False)
        self.second = torch.nn.Linear(hidden, out, bias=True)
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            normed = self.norm(x)
        else:
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain
        return self.first(normed) + torch.nn.functional.silu(self.second(normed))


@pytest.mark.parametrize("torch_module", [False, True], ids=["handwritten", "nn.RMSNorm"])
@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy17", "dynamo23"])
def test_small_module_exports_fold_and_match(tmp_path, rng, dynamo, torch_module):
    torch.manual_seed(int(rng.integers(2**31)))
    module = NormThenProject(48, 40, rng, torch_module).eval()
    x = torch.from_numpy(rng.standard_normal((3, 7, 48)).astype(np.float32))
    spec = ExportSpec(["x"], ["y"], (x,), {"x": {0: "batch", 1: "sequence"}, "y": {0: "batch", 1: "sequence"}})
    path = tmp_path / "module.onnx"
    if torch_module and not dynamo:
        # The TorchScript exporter has no symbolic for aten::rms_norm at opset 17: the user
        # gets one line that points at --dynamo instead of a traceback.
        from flashnorm.errors import FlashNormError

        with pytest.raises(FlashNormError, match=r"aten::rms_norm.*\(try with --dynamo\)"):
            export_module(module, path, spec, dynamo=dynamo)
        return
    save_model(export_module(module, path, spec, dynamo=dynamo), path)
    opset = {(o.domain or "ai.onnx"): o.version for o in onnx.load(str(path)).opset_import}["ai.onnx"]
    assert opset == (23 if dynamo else 17)

    other = torch.from_numpy(rng.standard_normal((2, 5, 48)).astype(np.float32))  # other shape: dynamic axes
    (y,) = make_session(path).run(None, {"x": other.numpy()})
    with torch.no_grad():
        expected = module(other).double().numpy()
    assert np.abs(y - expected).max() / np.abs(expected).max() < 1e-5

    optimized = tmp_path / "module.flashnorm.onnx"
    report = optimize_file(path, optimized, ("fold",))
    assert report["norm_sites"] == 1 and report["summary"]["fold.folded"] == 1
    comparison = compare_models(path, optimized, [{"x": rng.standard_normal((2, 9, 48)).astype(np.float32)}])
    assert comparison.output("y").rel_l2 < 1e-5 and comparison.output("y").scaled_max_abs < 1e-5
    assert comparison.output("y").max_abs > 0


def _torch_logits(model, feeds, past=()):
    from transformers import DynamicCache

    with torch.no_grad():
        output = model(
            **{k: torch.from_numpy(v) for k, v in feeds.items() if not k.startswith("past")},
            cache=DynamicCache(ddp_cache_data=[(torch.from_numpy(k), torch.from_numpy(v)) for k, v in past]) if past else None,
            use_cache=bool(past),
        )
    return output


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy17", "dynamo23"])
@pytest.mark.parametrize("kv_cache", [False, True], ids=["logits", "kv"])
def test_causal_lm_matches_torch(session_tmp, rng, dynamo, kv_cache):
    model = cache.tiny_llama_model()
    path = cache.tiny_llama_export(session_tmp, dynamo=dynamo, kv_cache=kv_cache)
    session = make_session(path)
    names = [i.name for i in session.get_inputs()]
    expected_inputs = ["input_ids", "attention_mask", "position_ids"]
    if kv_cache:
        expected_inputs += [name for layer in range(2) for name in past_names(layer)]
        assert [o.name for o in session.get_outputs()] == ["logits"] + [n for layer in range(2) for n in present_names(layer)]
    assert names == expected_inputs

    batch, sequence, past_length = 3, 6, (4 if kv_cache else 0)
    ids = rng.integers(0, 128, (batch, sequence))
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones((batch, past_length + sequence), np.int64),
        "position_ids": np.tile(np.arange(past_length, past_length + sequence), (batch, 1)),
    }
    past = []
    for layer in range(2 if kv_cache else 0):
        pair = tuple(rng.standard_normal((batch, 2, past_length, 16)).astype(np.float32) for _ in range(2))
        past.append(pair)
        feeds.update(dict(zip(past_names(layer), pair)))
    outputs = session.run(None, feeds)
    reference = _torch_logits(model, feeds, past)
    expected = reference.logits.numpy()
    assert np.abs(outputs[0] - expected).max() / np.abs(expected).max() < 1e-5
    if kv_cache:
        for index, layer in enumerate(reference.cache.layers):
            np.testing.assert_allclose(outputs[1 + 2 * index], layer.keys.numpy(), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(outputs[2 + 2 * index], layer.values.numpy(), rtol=1e-4, atol=1e-5)
            assert outputs[1 + 2 * index].shape == (batch, 2, past_length + sequence, 16)


def test_kv_cache_accepts_empty_past(session_tmp, rng):
    """Generation starts with no past: zero-length past tensors must run."""
    path = cache.tiny_llama_export(session_tmp, kv_cache=True)
    ids = rng.integers(0, 128, (1, 5))
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, 5), np.int64), "position_ids": np.arange(5)[None]}
    for layer in range(2):
        feeds.update({name: np.zeros((1, 2, 0, 16), np.float32) for name in past_names(layer)})
    logits = make_session(path).run(["logits"], feeds)[0]
    expected = _torch_logits(cache.tiny_llama_model(), {k: v for k, v in feeds.items() if not k.startswith("past")}).logits.numpy()
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-5


def test_legacy_export_keeps_tied_head_tied(session_tmp):
    model = onnx.load(str(cache.tiny_llama_export(session_tmp)))
    assert lm_head_shares_embedding(model)
    tables = [t for t in model.graph.initializer if sorted(t.dims) == [64, 128]]
    assert [t.name for t in tables] == ["model.embed_tokens.weight"]
    props = {p.key: p.value for p in model.metadata_props}
    assert props["flashnorm.exporter"] == "legacy" and props["flashnorm.tied_lm_head"] == "true"


def _head_model(table: np.ndarray, head: np.ndarray) -> onnx.ModelProto:
    """input_ids → Gather(table) → MatMul(head) → logits."""
    graph = oh.make_graph(
        [oh.make_node("Gather", ["table", "input_ids"], ["hidden"]), oh.make_node("MatMul", ["hidden", "head"], ["logits"])],
        "head",
        [oh.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["b", "s"])],
        [oh.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["b", "s", table.shape[0]])],
        [onh.from_array(table, "table"), onh.from_array(head, "head")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def _assert_logits_match(path, table: np.ndarray, ids: np.ndarray) -> None:
    """The saved head model's logits equal table[ids] · tableᵀ up to fp32 rounding: against a
    float64 reference, within the K-term dot product's error bound K·eps·(|a|·|b|) per element
    (ONNX Runtime and numpy may sum in different orders; a wrong weight is off by O(1))."""
    logits = make_session(path).run(None, {"input_ids": ids})[0]
    rows, head = table[ids].astype(np.float64), table.T.astype(np.float64)
    bound = table.shape[1] * np.finfo(np.float32).eps * (np.abs(rows) @ np.abs(head))
    error = np.abs(logits - rows @ head)
    assert (error <= bound).all(), f"largest error {error.max():.3g}, its bound {bound.flat[error.argmax()]:.3g}"


def test_retie_replaces_exact_transposed_copy(rng, tmp_path):
    table = rng.standard_normal((11, 6)).astype(np.float32)
    model = _head_model(table, table.T.copy())
    assert not lm_head_shares_embedding(model)
    assert retie_lm_head(model) == "table"
    assert lm_head_shares_embedding(model)
    assert [t.name for t in model.graph.initializer] == ["table"]
    onnx.checker.check_model(model)
    path = tmp_path / "retied.onnx"
    save_model(model, path)
    ids = rng.integers(0, 11, (2, 3))
    _assert_logits_match(path, table, ids)


def test_retie_leaves_a_different_head_alone(rng):
    table = rng.standard_normal((11, 6)).astype(np.float32)
    head = table.T.copy()
    head[rng.integers(6), rng.integers(11)] += 1e-3  # one element differs: not a tie
    model = _head_model(table, head)
    assert retie_lm_head(model) is None
    assert sorted(t.name for t in model.graph.initializer) == ["head", "table"]


def test_strip_prefix_renames_consistently(rng):
    table = rng.standard_normal((5, 4)).astype(np.float32)
    model = _head_model(table, table.T.copy())
    for tensor in model.graph.initializer:
        tensor.name = f"wrapped.{tensor.name}"
    model.graph.node[0].input[0] = "wrapped.table"
    model.graph.node[1].input[1] = "wrapped.head"
    strip_initializer_prefix(model, "wrapped.")
    assert sorted(t.name for t in model.graph.initializer) == ["head", "table"]
    onnx.checker.check_model(model)


def test_large_models_are_saved_with_external_data(rng, tmp_path, monkeypatch):
    import flashnorm.export.onnx_export as onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 1000)
    table = rng.standard_normal((64, 32)).astype(np.float32)
    path = tmp_path / "big.onnx"
    save_model(_head_model(table, table.T.copy()), path)
    assert (tmp_path / "big.onnx.data").stat().st_size >= 2 * table.nbytes
    assert path.stat().st_size < table.nbytes
    ids = rng.integers(0, 64, (1, 4))
    _assert_logits_match(path, table, ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]


def test_spec_examples_are_consistent():
    spec = causal_lm_spec(50, None)
    ids, mask, positions = spec.example_inputs
    assert ids.shape == mask.shape == positions.shape and int(ids.max()) < 50
    assert spec.dynamic_axes["logits"] == {0: "batch", 1: "sequence"}


def test_export_refuses_missing_directory(tmp_path):
    from flashnorm.errors import FlashNormError

    with pytest.raises(FlashNormError, match="does not exist"):
        export_causal_lm(cache.tiny_llama_model(), tmp_path / "missing" / "model.onnx")


class Untraceable(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: torch.export refuses it
            return x * 2
        return x


def test_exporter_failure_is_one_line(tmp_path, rng):
    from flashnorm.errors import FlashNormError

    x = torch.from_numpy(rng.standard_normal((2, 3)).astype(np.float32))
    spec = ExportSpec(["x"], ["y"], (x,), {"x": {0: "batch"}})
    with pytest.raises(FlashNormError, match=r"the dynamo exporter failed: .*\(try without --dynamo\)") as caught:
        export_module(Untraceable(), tmp_path / "u.onnx", spec, dynamo=True)
    assert "\n" not in str(caught.value)
