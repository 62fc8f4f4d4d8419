"""flashnorm.modelio: load/save with external data, atomic writes, one-line errors for bad input."""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from flashnorm import files, modelio
from flashnorm.errors import FlashNormError
from flashnorm.modelio import loading, saving, wire
from flashnorm.modelio.values import stored_values

HIDDEN, FFN = 256, 1024


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A norm gain, three projections (~2.5 MB in all) and a tiny shape tensor."""
    return {
        "gain": (1.0 + 0.5 * rng.standard_normal(HIDDEN)).astype(np.float32),
        "w_up": rng.standard_normal((HIDDEN, FFN)).astype(np.float32) / 16,
        "w_down": rng.standard_normal((FFN, HIDDEN)).astype(np.float32) / 32,
        "w_half": rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float16),
        "shape": np.array([-1, HIDDEN], dtype=np.int64),
    }


def _model(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """x → RMS-normalise (decomposed) · gain → up → Relu → down, plus an fp16 branch, a
    model-local function in a custom domain, and model metadata."""
    scale_fn = helper.make_function(
        "flashnorm.test", "Scale", ["a", "b"], ["c"], [helper.make_node("Mul", ["a", "b"], ["c"])],
        [helper.make_opsetid("", 17)],
    )
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Div", ["x", "rms"], ["xn"]),
        helper.make_node("Scale", ["xn", "gain"], ["xg"], domain="flashnorm.test"),
        helper.make_node("MatMul", ["xg", "w_up"], ["up"]),
        helper.make_node("Relu", ["up"], ["act"]),
        helper.make_node("MatMul", ["act", "w_down"], ["down"]),
        helper.make_node("Reshape", ["down", "shape"], ["y"]),
        helper.make_node("Cast", ["xg"], ["xh"], to=TensorProto.FLOAT16),
        helper.make_node("MatMul", ["xh", "w_half"], ["z"]),
    ]
    initializers = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    initializers.append(numpy_helper.from_array(np.array(1e-5, dtype=np.float32), "eps"))
    graph = helper.make_graph(
        nodes, "io_test",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", HIDDEN]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT16, ["batch", HIDDEN])],
        initializers,
    )
    model = helper.make_model(
        graph, functions=[scale_fn], producer_name="flashnorm-tests", producer_version="7",
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("flashnorm.test", 1)],
    )
    model.ir_version = 8
    model.doc_string = "io round trip"
    helper.set_model_props(model, {"source": "tests/test_modelio.py"})
    return model


def _save_external(model: onnx.ModelProto, path: Path, location: str) -> None:
    onnx.save(model, str(path), save_as_external_data=True, location=location, size_threshold=1024)


def _run(path: Path, x: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def _constant(graph, name: str):
    return graph.tensors()[name]


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture
def external_model(tmp_path, rng):
    weights = _weights(rng)
    source = tmp_path / "in" / "model.onnx"
    source.parent.mkdir()
    _save_external(_model(weights), source, "weights.bin")
    return source, weights


def test_external_round_trip_modify_one_tensor(external_model, tmp_path, rng):
    source, weights = external_model
    data = source.with_name("weights.bin")
    before = (_digest(source), _digest(data))

    graph = modelio.load(source)
    up = _constant(graph, "w_up")
    assert isinstance(stored_values(up), modelio.ExternalValues)
    gain = rng.uniform(0.5, 2.0, HIDDEN).astype(np.float32)
    up.values = up.values * gain[:, None]  # the fold pass's edit: scale row k by g[k]
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    modelio.save(graph, out)

    assert (_digest(source), _digest(data)) == before, "the input model or its data changed"
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx", "model.onnx.data"]

    expected_weights = dict(weights, w_up=weights["w_up"] * gain[:, None])
    reference = tmp_path / "reference.onnx"
    onnx.save(_model(expected_weights), str(reference))
    x = rng.standard_normal((3, HIDDEN)).astype(np.float32)
    for got, want in zip(_run(out, x), _run(reference, x)):
        np.testing.assert_array_equal(got, want)

    saved = onnx.load(str(out), load_external_data=False)
    locations = {t.name: {e.key: e.value for e in t.external_data} for t in saved.graph.initializer}
    assert {n for n, e in locations.items() if e} == {"gain", "w_up", "w_down", "w_half"}
    assert all(e["location"] == "model.onnx.data" for e in locations.values() if e)
    assert not locations["shape"] and not locations["eps"], "tiny tensors stay inside the model"
    assert int(locations["w_up"]["offset"]) % 65536 == 0
    onnx.checker.check_model(str(out), full_check=True)


def test_load_keeps_model_fields_and_lazy_values_read_once(external_model):
    source, weights = external_model
    graph = modelio.load(source)
    down = _constant(graph, "w_down")
    lazy = stored_values(down)
    np.testing.assert_array_equal(down.values, weights["w_down"])
    np.testing.assert_array_equal(_constant(graph, "w_half").values, weights["w_half"])
    assert not lazy.tensor.HasField("raw_data"), "reading a weight must not keep a second copy in the proto"

    out = source.with_name("copy.onnx")
    modelio.save(graph, out)
    saved, original = onnx.load(str(out), load_external_data=False), onnx.load(str(source), load_external_data=False)
    assert saved.ir_version == original.ir_version == 8
    assert (saved.producer_name, saved.producer_version) == ("flashnorm-tests", "7")
    assert saved.doc_string == "io round trip"
    assert {p.key: p.value for p in saved.metadata_props} == {"source": "tests/test_modelio.py"}
    assert {(o.domain, o.version) for o in saved.opset_import} == {("", 17), ("flashnorm.test", 1)}
    assert [(f.domain, f.name) for f in saved.functions] == [("flashnorm.test", "Scale")]


def test_a_copy_of_a_loaded_graph_saves_with_the_models_fields(external_model):
    # inspect's dry run folds graph.copy(); onnx-graphsurgeon's own Graph.copy() drops the
    # producer and anything kept beside the Graph, so a copy saved without them.
    source, weights = external_model
    graph = modelio.load(source)
    copied = graph.copy().copy()
    assert isinstance(copied, modelio.ModelGraph)
    copied.model_fields.metadata_props.add(key="copied", value="yes")
    assert len(graph.model_fields.metadata_props) == 1, "a copy owns its fields"

    out = source.with_name("copied.onnx")
    modelio.save(copied, out)
    saved = onnx.load(str(out))
    assert saved.ir_version == 8 and (saved.producer_name, saved.producer_version) == ("flashnorm-tests", "7")
    assert saved.doc_string == "io round trip"
    assert {p.key: p.value for p in saved.metadata_props} == {"source": "tests/test_modelio.py", "copied": "yes"}
    assert [(f.domain, f.name) for f in saved.functions] == [("flashnorm.test", "Scale")]
    for tensor in saved.graph.initializer:
        if tensor.name in weights:
            assert numpy_helper.to_array(tensor).tobytes() == weights[tensor.name].tobytes(), tensor.name


def test_only_values_reads_graphsurgeons_private_values():
    # `Constant.values = ...` sets lazy values publicly; only reading them unloaded has no
    # public API, and modelio.values.stored_values is its one reader.
    package = Path(modelio.__file__).resolve().parents[1]
    readers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if "._values" in p.read_text())
    assert readers == ["modelio/values.py"]


def test_unchanged_tensors_are_copied_byte_for_byte(external_model):
    source, weights = external_model
    graph = modelio.load(source)
    out = source.with_name("same.onnx")
    modelio.save(graph, out)
    saved = onnx.load(str(out))
    for name, values in weights.items():
        stored = next(t for t in saved.graph.initializer if t.name == name)
        assert numpy_helper.to_array(stored).tobytes() == values.tobytes(), name


def test_save_over_the_input_itself(external_model, rng):
    source, weights = external_model
    graph = modelio.load(source)
    modelio.save(graph, source)  # weights.bin → model.onnx.data, same model path
    graph = modelio.load(source)
    up = _constant(graph, "w_up")
    up.values = up.values * 3.0
    modelio.save(graph, source)  # now the input's own data file is replaced while it is read
    assert _leftovers(source.parent) == []

    x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
    reference = source.with_name("reference.onnx")
    onnx.save(_model(dict(weights, w_up=weights["w_up"] * 3.0)), str(reference))
    for got, want in zip(_run(source, x), _run(reference, x)):
        np.testing.assert_array_equal(got, want)
    # Lazily loaded constants of the saved graph now read from the new data file.
    np.testing.assert_array_equal(_constant(graph, "w_down").values, weights["w_down"])
    np.testing.assert_array_equal(_constant(graph, "w_up").values, weights["w_up"] * 3.0)


def test_refuses_to_replace_another_models_data(tmp_path, rng):
    weights = _weights(rng)
    source = tmp_path / "a.onnx"
    _save_external(_model(weights), source, "b.onnx.data")
    graph = modelio.load(source)
    before = _digest(tmp_path / "b.onnx.data")
    with pytest.raises(FlashNormError, match="b.onnx.data"):
        modelio.save(graph, tmp_path / "b.onnx")
    assert _digest(tmp_path / "b.onnx.data") == before
    assert not (tmp_path / "b.onnx").exists() and _leftovers(tmp_path) == []


def _saved_copy_then_changed(external_model):
    """The input saved as out.onnx (external data), then its graph's w_up changed in memory."""
    source, _ = external_model
    graph = modelio.load(source)
    out = source.with_name("out.onnx")
    modelio.save(graph, out)
    up = _constant(graph, "w_up")
    up.values = up.values * 2.0
    return graph, out, up


def test_failed_save_leaves_previous_files_untouched(external_model, monkeypatch, rng):
    graph, out, up = _saved_copy_then_changed(external_model)
    before = (_digest(out), _digest(out.with_name("out.onnx.data")))
    calls = {"n": 0}
    real_copy = saving._copy_range

    def copy_then_fail(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # half-way through the data file
            raise OSError(28, "No space left on device")
        real_copy(*args, **kwargs)

    monkeypatch.setattr(saving, "_copy_range", copy_then_fail)
    with pytest.raises(OSError):
        modelio.save(graph, out)
    assert (_digest(out), _digest(out.with_name("out.onnx.data"))) == before
    assert _leftovers(out.parent) == []
    # The graph is intact after the failure and saves fine once the disk is back.
    monkeypatch.setattr(saving, "_copy_range", real_copy)
    modelio.save(graph, out)
    np.testing.assert_array_equal(_constant(modelio.load(out), "w_up").values, up.values)


def _pair_at(out: Path) -> dict[str, np.ndarray]:
    """The weights the model at `out` reads, through onnx's own loader: a model whose data file
    is missing or too short fails here."""
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}


def _same(weights: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> bool:
    return weights.keys() == expected.keys() and all(np.array_equal(weights[k], expected[k]) for k in weights)


# Every file-system step of `files.commit_with_data` and the staged writes it makes.
_COMMIT_STEPS = ("replace", "link", "unlink", "fsync")


def _count_steps(monkeypatch, on_step) -> None:
    """Call `on_step(name)` after each file-system step; it may raise to make the next one fail."""
    for name in _COMMIT_STEPS:
        real = getattr(os, name)

        def step(*args, _real=real, _name=name, **kwargs):
            on_step(_name, before=True)
            result = _real(*args, **kwargs)
            on_step(_name, before=False)
            return result

        monkeypatch.setattr(os, name, step)


def test_replacing_a_model_and_its_data_keeps_a_complete_pair_at_every_step(external_model, monkeypatch):
    """Saving over an earlier output: after every rename, link, unlink and fsync, the model at
    the destination reads either all the old weights or all the new ones (a SIGKILL at any
    instant leaves one pair), and one data file is left: the new one."""
    graph, out, up = _saved_copy_then_changed(external_model)
    old, new_up = _pair_at(out), np.array(up.values)
    states: list[str] = []

    def observe(name, before):
        if not before:
            weights = _pair_at(out)
            states.append("old" if _same(weights, old) else "new")
            assert states[-1] == "old" or np.array_equal(weights["w_up"], new_up), (name, len(states))

    _count_steps(monkeypatch, observe)
    modelio.save(graph, out)
    monkeypatch.undo()
    assert "old" in states and states[-1] == "new"
    assert states == sorted(states, key=["old", "new"].index), "never back to the old pair once switched"
    # The earlier data file's name was taken: the new one has its own, and the earlier one went.
    names = sorted(p.name for p in out.parent.iterdir())
    assert names[:2] == ["model.onnx", "out.onnx"] and names[3:] == ["weights.bin"], names
    assert re.fullmatch(r"out\.onnx\.[a-z0-9_]{8}\.data", names[2]), names
    np.testing.assert_array_equal(_pair_at(out)["w_up"], up.values)
    modelio.save(graph, out)  # and the next save over it takes the usual name again
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx", "out.onnx", "out.onnx.data", "weights.bin"]


def test_a_failure_at_any_step_leaves_the_old_pair_or_the_new_one(external_model, tmp_path, monkeypatch):
    """Failure injection at each step of a save over an earlier output: a save that raises
    leaves the old model and data exactly as they were and no file of its own; one that
    returns leaves the new pair and no other data file."""
    source, _ = external_model

    def fresh(run: str):
        folder = tmp_path / run
        folder.mkdir()
        for name in ("model.onnx", "weights.bin"):
            (folder / name).write_bytes((source.parent / name).read_bytes())
        return _saved_copy_then_changed((folder / "model.onnx", None))

    steps: list[str] = []
    graph, out, _ = fresh("count")
    _count_steps(monkeypatch, lambda name, before: before and steps.append(name))
    modelio.save(graph, out)  # one clean run: which steps there are
    monkeypatch.undo()
    assert {"fsync", "replace", "unlink"} <= set(steps), steps
    for failing in range(1, len(steps) + 1):
        graph, out, up = fresh(f"fail{failing}")
        before = {p.name: _digest(p) for p in out.parent.iterdir()}
        count = {"n": 0}

        def fail(name, before, failing=failing):
            if before:
                count["n"] += 1
                if count["n"] == failing:
                    raise OSError(5, "Input/output error")

        _count_steps(monkeypatch, fail)
        try:
            modelio.save(graph, out)
            raised = False
        except OSError:
            raised = True
        monkeypatch.undo()
        if raised:
            assert {p.name: _digest(p) for p in out.parent.iterdir()} == before, steps[failing - 1]
        else:
            np.testing.assert_array_equal(_pair_at(out)["w_up"], up.values)
            data = [p.name for p in out.parent.iterdir() if p.name.startswith("out.onnx.")]
            assert len(data) == 1 and _leftovers(out.parent) == [], (steps[failing - 1], data)


def test_exported_models_replace_an_earlier_output_as_one_pair(tmp_path, rng, monkeypatch):
    """export's writer (onnx.save_model's files, adopted) goes through the same commit: the
    second export over the first leaves the new model reading the new data, one data file."""
    from flashnorm.export import onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 0)
    out = tmp_path / "m.onnx"
    for weights in (_weights(rng), _weights(rng)):
        onnx_export.save_model(_model(weights), out)
        assert _same({k: v for k, v in _pair_at(out).items() if k != "eps"}, weights)
        assert len([p for p in tmp_path.iterdir() if p.name.endswith(".data")]) == 1
    assert _leftovers(tmp_path) == [] and not any(p.name.startswith(".flashnorm-save-") for p in tmp_path.iterdir())


def test_inline_models_stay_inline_and_round_trip(tmp_path, rng):
    weights = _weights(rng)
    source = tmp_path / "inline.onnx"
    onnx.save(_model(weights), str(source))
    graph = modelio.load(source)
    out = tmp_path / "inline_out.onnx"
    modelio.save(graph, out)
    assert not out.with_name("inline_out.onnx.data").exists()
    onnx.checker.check_model(str(out), full_check=True)
    x = rng.standard_normal((4, HIDDEN)).astype(np.float32)
    for got, want in zip(_run(out, x), _run(source, x)):
        np.testing.assert_array_equal(got, want)


def test_external_model_saved_inline_on_request(external_model, rng):
    source, _ = external_model
    graph = modelio.load(source)
    half = _constant(graph, "w_half")
    half.values = (half.values * np.float16(0.5)).astype(np.float16)
    out = source.with_name("inline.onnx")
    modelio.save(graph, out, external_data=False)
    assert not out.with_name("inline.onnx.data").exists()
    saved = onnx.load(str(out), load_external_data=False)
    assert not any(t.external_data for t in saved.graph.initializer)
    x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
    ref_graph = modelio.load(source)
    _constant(ref_graph, "w_half").values = half.values
    reference = source.with_name("reference.onnx")
    modelio.save(ref_graph, reference, external_data=True)
    for got, want in zip(_run(out, x), _run(reference, x)):
        np.testing.assert_array_equal(got, want)


def test_large_in_memory_graph_goes_external_automatically(tmp_path, monkeypatch, rng):
    weights = _weights(rng)
    source = tmp_path / "inline.onnx"
    onnx.save(_model(weights), str(source))
    graph = modelio.load(source)
    monkeypatch.setattr(saving, "EXTERNAL_DATA_THRESHOLD", sum(v.nbytes for v in weights.values()) // 2)
    modelio.save(graph, tmp_path / "auto.onnx")
    assert (tmp_path / "auto.onnx.data").exists()


def test_inline_save_over_protobuf_limit_is_refused(tmp_path, monkeypatch, rng):
    source = tmp_path / "inline.onnx"
    onnx.save(_model(_weights(rng)), str(source))
    graph = modelio.load(source)
    monkeypatch.setattr(wire, "PROTOBUF_LIMIT", 1 << 20)
    with pytest.raises(FlashNormError, match="external data"):
        modelio.save(graph, tmp_path / "big.onnx", external_data=False)
    assert not (tmp_path / "big.onnx").exists() and _leftovers(tmp_path) == []


def test_subgraph_initializers_round_trip(tmp_path, rng):
    w_then = rng.standard_normal((8, 300)).astype(np.float32)
    w_else = rng.standard_normal((8, 300)).astype(np.float32)

    def branch(name, w):
        return helper.make_graph(
            [helper.make_node("MatMul", ["x", f"w_{name}"], [f"y_{name}"])], name, [],
            [helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, [2, 300])],
            [numpy_helper.from_array(w, f"w_{name}")],
        )

    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=branch("then", w_then), else_branch=branch("else", w_else))],
        "if_test",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 300])],
    )
    source = tmp_path / "if.onnx"
    _save_external(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source, "if.bin")
    loaded = modelio.load(source)
    out = tmp_path / "if_out.onnx"
    modelio.save(loaded, out)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, 8)).astype(np.float32)
    for cond, w in ((True, w_then), (False, w_else)):
        (y,) = session.run(None, {"cond": np.array(cond), "x": x})
        np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad input: one-line FlashNormError naming the file


def _assert_one_line(excinfo, *fragments: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_missing_file(tmp_path):
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(tmp_path / "nope.onnx")
    _assert_one_line(excinfo, "nope.onnx", "does not exist")


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(tmp_path)
    _assert_one_line(excinfo, "not a file")


@pytest.mark.parametrize("content", [b"", b"\x08\x07 not a protobuf \xff\xfe\x00" * 40, b"ir_version: 8\n"])
def test_not_an_onnx_file(tmp_path, content):
    path = tmp_path / "junk.onnx"
    path.write_bytes(content)
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(path)
    _assert_one_line(excinfo, "junk.onnx")
    assert "not an ONNX model" in str(excinfo.value) or "not a valid ONNX model" in str(excinfo.value)


def test_checker_rejects_model(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "undefined_weight"], ["y"])], "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    path = tmp_path / "invalid.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(path)
    _assert_one_line(excinfo, "invalid.onnx", "not a valid ONNX model", "undefined_weight")


@pytest.mark.parametrize("storage", ["external", "inline"])
def test_read_interface_lists_what_callers_feed_without_reading_weights(external_model, storage):
    source, weights = external_model
    if storage == "external":
        source.with_name("weights.bin").unlink()  # read_interface must not need the weights
        model = onnx.load(str(source), load_external_data=False)
    else:
        model = _model(weights)
    # Older exporters also list initializers among the graph inputs; they are not fed.
    model.graph.input.append(helper.make_tensor_value_info("eps", TensorProto.FLOAT, []))
    source.write_bytes(model.SerializeToString())
    interface = modelio.read_interface(source)
    assert interface.inputs == (model.graph.input[0],)
    assert interface.outputs == tuple(model.graph.output)
    assert [value.name for value in interface.inputs] == ["x"]
    assert [value.name for value in interface.outputs] == ["y", "z"]
    assert interface.metadata == {"source": "tests/test_modelio.py"}
    with pytest.raises(FlashNormError) as excinfo:
        modelio.read_interface(source.with_name("absent.onnx"))
    _assert_one_line(excinfo, "absent.onnx", "does not exist")


@pytest.mark.parametrize("storage", ["external", "inline"])
def test_read_header_keeps_initializer_names_types_and_shapes_not_values(external_model, storage):
    """What `validate.bfloat16.precision` needs (each initializer's element type) without the
    weights: an inline payload is skipped unread, an external one is not opened."""
    source, weights = external_model
    if storage == "external":
        source.with_name("weights.bin").unlink()
        expected = onnx.load(str(source), load_external_data=False)
    else:
        expected = _model(weights)
        source.write_bytes(expected.SerializeToString())
    header = modelio.read_header(source)
    assert [(t.name, t.data_type, list(t.dims)) for t in header.graph.initializer] == [
        (t.name, t.data_type, list(t.dims)) for t in expected.graph.initializer]
    assert TensorProto.FLOAT16 in {t.data_type for t in header.graph.initializer}
    assert all(not t.raw_data and not t.float_data and not t.int64_data for t in header.graph.initializer)
    assert [t.data_location for t in header.graph.initializer] == [t.data_location for t in expected.graph.initializer]
    assert list(header.graph.node) == list(expected.graph.node)
    assert header.ByteSize() < 20_000 < expected.ByteSize() or storage == "external"


def test_read_interface_of_a_truncated_inline_model(tmp_path, rng):
    data = _model(_weights(rng)).SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(FlashNormError) as excinfo:
        modelio.read_interface(path)
    _assert_one_line(excinfo, "cut.onnx", "not an ONNX model")


def test_missing_external_data(external_model):
    source, _ = external_model
    source.with_name("weights.bin").unlink()
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(source)
    _assert_one_line(excinfo, "weights.bin")


def test_truncated_external_data(external_model):
    source, _ = external_model
    data = source.with_name("weights.bin")
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(source)
    _assert_one_line(excinfo, "weights.bin", "truncated")


def test_unreadable_external_data(external_model, monkeypatch):
    source, _ = external_model
    data = source.with_name("weights.bin")
    real_access = os.access
    # chmod alone does not stop root, so deny read access the way the OS would report it.
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == data else real_access(p, mode))
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(source)
    _assert_one_line(excinfo, "weights.bin", "not readable")


def test_save_into_missing_directory(external_model, tmp_path):
    source, _ = external_model
    graph = modelio.load(source)
    with pytest.raises(FlashNormError) as excinfo:
        modelio.save(graph, tmp_path / "no" / "such" / "dir" / "m.onnx")
    _assert_one_line(excinfo, "does not exist")


def test_derived_values_are_computed_while_saving(external_model, tmp_path, rng):
    """A pass describes W* = diag(g)·W without computing it; save computes, writes, frees."""
    source, weights = external_model
    graph = modelio.load(source)
    gain = rng.uniform(0.5, 2.0, HIDDEN)
    calls = {"n": 0}

    def fold(w):
        calls["n"] += 1
        return (w.astype(np.float64) * gain[:, None]).astype(w.dtype)

    for name in ("w_up", "w_half"):
        weight = _constant(graph, name)
        folded = gs.Constant(f"{name}.folded", modelio.DerivedValues(weight, fold))
        assert folded.shape == list(weights[name].shape) and folded.dtype == weights[name].dtype
        for node in list(weight.outputs):
            node.inputs[node.inputs.index(weight)] = folded
    assert calls["n"] == 0, "describing the change must not compute it"
    # A tiny derived tensor (kept inside the model) and a derived tensor of a new dtype.
    eps = _constant(graph, "eps")
    eps_node = eps.outputs[0]
    eps_node.inputs[eps_node.inputs.index(eps)] = gs.Constant("eps.derived", modelio.DerivedValues(eps, lambda e: e * 2))

    out = tmp_path / "derived.onnx"
    modelio.save(graph, out)
    assert calls["n"] == 2
    assert isinstance(stored_values(_constant(graph, "w_up.folded")), modelio.ExternalValues), "rebound to the saved data"

    expected = dict(weights, w_up=fold(weights["w_up"]), w_half=fold(weights["w_half"]))
    calls["n"] = 0
    saved = modelio.load(out)
    np.testing.assert_array_equal(_constant(saved, "w_up.folded").values, expected["w_up"])
    np.testing.assert_array_equal(_constant(saved, "w_half.folded").values, expected["w_half"])
    np.testing.assert_array_equal(_constant(saved, "eps.derived").values, np.float32(2e-5))
    assert calls["n"] == 0

    inline = tmp_path / "derived_inline.onnx"
    modelio.save(graph, inline, external_data=False)
    np.testing.assert_array_equal(_constant(modelio.load(inline), "w_up.folded").values, expected["w_up"])


def test_derived_values_check_their_declared_shape(external_model):
    source, _ = external_model
    graph = modelio.load(source)
    bad = modelio.DerivedValues(_constant(graph, "w_up"), lambda w: w.T)
    with pytest.raises(ValueError, match="declared"):
        bad.load()


def test_copy_without_kernel_support(external_model, monkeypatch, rng):
    """Where copy_file_range is refused (other file system, old kernel), pread/write copies."""
    source, weights = external_model

    def refuse(*args, **kwargs):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    out = source.with_name("fallback.onnx")
    modelio.save(modelio.load(source), out)
    saved = modelio.load(out)
    for name, values in weights.items():
        np.testing.assert_array_equal(_constant(saved, name).values, values)


def _single_matmul(weight: TensorProto) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("size", [7, 65])
def test_raw_data_size_must_match_shape(tmp_path, size):
    path = tmp_path / "short.onnx"
    weight = TensorProto(name="W", dims=[4, 4], data_type=TensorProto.FLOAT, raw_data=b"\x01" * size)
    path.write_bytes(_single_matmul(weight).SerializeToString())
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(path)
    _assert_one_line(excinfo, "short.onnx", "'W'", f"{size} bytes", "need 64")


@pytest.mark.parametrize("location", ["/etc/passwd", "../outside.bin"])
def test_external_data_must_stay_beside_the_model(tmp_path, location):
    path = tmp_path / "escape.onnx"
    weight = TensorProto(name="W", dims=[4, 4], data_type=TensorProto.FLOAT, data_location=TensorProto.EXTERNAL)
    weight.external_data.add(key="location", value=location)
    path.write_bytes(_single_matmul(weight).SerializeToString())
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(path)
    _assert_one_line(excinfo, location, "relative path")


def _external_weight(tmp_path: Path, location: str = "w.bin", **entries: str) -> Path:
    """model/escape.onnx whose weight W is 64 bytes at `location` (w.bin written beside it)."""
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "w.bin").write_bytes(np.arange(16, dtype=np.float32).tobytes())
    weight = TensorProto(name="W", dims=[4, 4], data_type=TensorProto.FLOAT, data_location=TensorProto.EXTERNAL)
    weight.external_data.add(key="location", value=location)
    for key, value in entries.items():
        weight.external_data.add(key=key, value=value)
    path = folder / "escape.onnx"
    path.write_bytes(_single_matmul(weight).SerializeToString())
    return path


def test_external_data_may_not_leave_the_folder_through_a_symlink(tmp_path):
    """As ONNX Runtime decides: the location resolved, symlinks included, stays in the folder."""
    path = _external_weight(tmp_path, "link.bin")
    os.symlink("w.bin", path.with_name("link.bin"))  # inside: fine
    np.testing.assert_array_equal(_constant(modelio.load(path), "W").values.reshape(-1), np.arange(16))
    (tmp_path / "outside.bin").write_bytes(path.with_name("w.bin").read_bytes())
    path.with_name("link.bin").unlink()
    os.symlink("../outside.bin", path.with_name("link.bin"))
    for read in (modelio.load, modelio.external_data_files):
        with pytest.raises(FlashNormError) as excinfo:
            read(path)
        _assert_one_line(excinfo, "'link.bin'", "through a symbolic link", str(tmp_path / "outside.bin"))


@pytest.mark.parametrize("entries, why", [
    ({"location": "w\x00.bin"}, "NUL byte"),
    ({"offset": "+0"}, "malformed external data offset"),
    ({"offset": "1_0"}, "malformed external data offset"),
    ({"length": "\u0666\u0664"}, "malformed external data offset"),  # Arabic-Indic digits: int() takes them
    ({"offset": str(1 << 70)}, "truncated"),
])
def test_external_data_entries_are_read_strictly(tmp_path, entries, why):
    entries = dict(entries)
    path = _external_weight(tmp_path, entries.pop("location", "w.bin"), **entries)
    for read in (modelio.load, modelio.external_data_files):
        with pytest.raises(FlashNormError) as excinfo:
            read(path)
        _assert_one_line(excinfo, why)


def test_a_negative_dimension_is_refused(tmp_path):
    path = _external_weight(tmp_path)
    model = onnx.load(str(path), load_external_data=False)
    del model.graph.initializer[0].dims[:]
    model.graph.initializer[0].dims.extend([-4, -4])
    path.write_bytes(model.SerializeToString())
    with pytest.raises(FlashNormError) as excinfo:
        modelio.external_data_files(path)
    _assert_one_line(excinfo, "negative dimension")


def test_a_sparse_file_of_zeros_is_refused_at_once(tmp_path):
    """Protobuf's field number 0 does not exist: refused at the second byte, not parsed as a
    1 GiB run of empty fields (about 45 minutes at the rate the walk reads them)."""
    path = tmp_path / "zeros.onnx"
    with open(path, "wb") as handle:
        handle.truncate(1 << 30)
    started = time.monotonic()
    with pytest.raises(FlashNormError) as excinfo:
        modelio.read_interface(path)
    _assert_one_line(excinfo, "not an ONNX model", "field number 0")
    assert time.monotonic() - started < 1
    with open(path, "wb") as handle:
        handle.truncate(wire.PROTOBUF_LIMIT)
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(path)
    _assert_one_line(excinfo, "over protobuf's 2 GiB limit")


@pytest.mark.parametrize("content, why", [
    (wire.varint(7 << 3 | 2) + wire.varint(1 << 60), "runs past"),  # a graph longer than the file: nothing allocated
    (wire.varint(8 << 3 | 2) + wire.varint(1 << 40) + b"x", "runs past"),
    (b"\x08" + b"\xff" * 11, "varint too long"),
    (wire.varint(1 << 3 | 3), "unsupported wire type 3"),
])
def test_lengths_are_checked_against_the_file_before_reading(tmp_path, content, why):
    path = tmp_path / "framing.onnx"
    path.write_bytes(content)
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(path)
    _assert_one_line(excinfo, "not an ONNX model", why)


def test_a_model_of_countless_tiny_fields_is_refused(tmp_path, monkeypatch):
    """Legal protobuf (ir_version, again and again), but more fields than any model has: the
    walk stops at the limit instead of running for as long as the file lasts."""
    monkeypatch.setattr(wire, "MAX_MODEL_FIELDS", 1000)
    monkeypatch.setattr(wire, "MAX_GRAPH_FIELDS", 1000)
    path = tmp_path / "fields.onnx"
    path.write_bytes(b"\x08\x01" * 1001)
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(path)
    _assert_one_line(excinfo, "more than 1000 fields in the model")
    nodes = b"\x0a\x00" * 1001  # empty nodes
    path.write_bytes(wire.MODEL_GRAPH_KEY + wire.varint(len(nodes)) + nodes)
    with pytest.raises(FlashNormError) as excinfo:
        modelio.read_interface(path)
    _assert_one_line(excinfo, "more than 1000 fields in the graph")


def test_fields_onnx_does_not_define_are_skipped_unread(tmp_path, rng):
    model = _model(_weights(rng))
    unknown = wire.varint(99 << 3 | 2) + wire.varint(3) + b"abc"
    path = tmp_path / "unknown.onnx"
    path.write_bytes(unknown + model.SerializeToString())
    assert loading._parse_model(loading._open_model(path)) == model


def test_refuses_to_replace_data_a_derived_tensor_reads(tmp_path, rng):
    source = tmp_path / "a.onnx"
    weight = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")
    onnx.save(_single_matmul(weight), str(source), save_as_external_data=True, location="b.onnx.data", size_threshold=0)
    graph = modelio.load(source)
    w = _constant(graph, "W")
    node = w.outputs[0]
    node.inputs[1] = gs.Constant("W.scaled", modelio.DerivedValues(w, lambda values: values * 2))
    assert not any(isinstance(stored_values(c), modelio.ExternalValues) for c in graph.tensors().values() if isinstance(c, gs.Constant))
    with pytest.raises(FlashNormError, match="b.onnx.data"):
        modelio.save(graph, tmp_path / "b.onnx")
    modelio.save(graph, tmp_path / "c.onnx")
    np.testing.assert_array_equal(_constant(modelio.load(tmp_path / "c.onnx"), "W.scaled").values,
                                  numpy_helper.to_array(weight) * 2)


def test_written_files_get_ordinary_permissions(external_model, tmp_path):
    """Temporary files are private (mkstemp: 0600); the files they become are not."""
    mask = os.umask(0o022)
    os.umask(mask)
    source, _ = external_model
    out = tmp_path / "perm.onnx"
    modelio.save(modelio.load(source), out)
    with files.atomic_write(tmp_path / "report.json", "w") as handle:
        handle.write("{}")
    for path in (out, out.with_name("perm.onnx.data"), tmp_path / "report.json"):
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path


@pytest.mark.parametrize("keep", [0.3, 0.999])
def test_truncated_inline_model(tmp_path, rng, keep):
    path = tmp_path / "cut.onnx"
    data = _model(_weights(rng)).SerializeToString()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(FlashNormError) as excinfo:
        modelio.load(path)
    _assert_one_line(excinfo, "cut.onnx", "not an ONNX model")


def test_inline_model_is_parsed_exactly(tmp_path, rng):
    """The one-initializer-at-a-time reader yields the same ModelProto as protobuf's parser."""
    model = _model(_weights(rng))
    path = tmp_path / "exact.onnx"
    path.write_bytes(model.SerializeToString())
    assert loading._parse_model(loading._open_model(path)) == onnx.load(str(path))


_PEAK_SCRIPT = """
import sys
import numpy as np
import onnx_graphsurgeon as gs
from flashnorm import modelio

def peak_mb():
    with open("/proc/self/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith("VmHWM:"))) / 1024

source, destination, derived = sys.argv[1], sys.argv[2], sys.argv[3] == "derived"
before = peak_mb()
graph = modelio.load(source)
if derived:
    weight = graph.tensors()["w0"]
    node = weight.outputs[0]
    node.inputs[1] = gs.Constant("w0.scaled", modelio.DerivedValues(weight, lambda w: np.multiply(w, 2, out=w)))
modelio.save(graph, destination)
print(peak_mb() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
@pytest.mark.parametrize("derived", [False, True])
def test_external_save_holds_at_most_one_tensor(tmp_path, rng, derived):
    """96 MB of external weights (three 32 MB tensors) load and save with the process peak
    growing by less than one tensor (nothing read), or by about one tensor when one weight
    is changed as DerivedValues (read, scaled in place, written, freed)."""
    import subprocess
    import sys

    count, shape = 3, (2048, 4096)
    tensor_mb = int(np.prod(shape)) * 4 / 2**20
    source = tmp_path / "big.onnx"
    data = tmp_path / "big.bin"
    nodes, weights, previous = [], [], "x"
    with open(data, "wb") as handle:
        for i in range(count):
            dims = shape if i % 2 == 0 else shape[::-1]  # a chain: [1,2048]·[2048,4096]·[4096,2048]…
            values = rng.standard_normal(dims, dtype=np.float32)
            weight = TensorProto(name=f"w{i}", dims=list(dims), data_type=TensorProto.FLOAT,
                                 data_location=TensorProto.EXTERNAL)
            for key, value in (("location", "big.bin"), ("offset", str(handle.tell())), ("length", str(values.nbytes))):
                weight.external_data.add(key=key, value=value)
            values.tofile(handle)
            weights.append(weight)
            nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], [f"h{i}"]))
            previous = f"h{i}"
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, shape[0]])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, [1, shape[count % 2]])],
                              weights)
    source.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())

    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(source), str(tmp_path / "out.onnx"),
                             "derived" if derived else "plain"], capture_output=True, text=True, check=True)
    growth_mb = float(result.stdout.split()[-1])
    limit = 1.5 * tensor_mb if derived else 0.5 * tensor_mb
    assert growth_mb < limit, f"peak grew by {growth_mb:.1f} MB (one tensor is {tensor_mb:.0f} MB)"
    saved = modelio.load(tmp_path / "out.onnx")
    scale = 2 if derived else 1
    name = "w0.scaled" if derived else "w0"
    expected = np.fromfile(data, dtype=np.float32, count=int(np.prod(shape))).reshape(shape) * scale
    np.testing.assert_array_equal(_constant(saved, name).values, expected)


def test_derived_values_may_work_in_place(tmp_path, rng):
    """The function gets a fresh array each time, so scaling in place never touches the
    source: not an in-memory array, not a lazily loaded tensor, not a chain of derivations."""
    original = rng.standard_normal((8, 16)).astype(np.float32)
    source = tmp_path / "inplace.onnx"
    onnx.save(_single_matmul_shaped(original), str(source))
    graph = modelio.load(source)
    lazy = _constant(graph, "W")
    in_memory = gs.Constant("M", original.copy())
    doubled = gs.Constant("D", modelio.DerivedValues(lazy, lambda w: np.multiply(w, 2, out=w)))
    for constant in (lazy, in_memory, doubled):
        derived = modelio.DerivedValues(constant, lambda w: np.multiply(w, 3, out=w))
        factor = 6 if constant is doubled else 3
        np.testing.assert_array_equal(derived.load(), original * factor)
        np.testing.assert_array_equal(derived.load(), original * factor)  # twice: same result
    np.testing.assert_array_equal(in_memory.values, original)
    np.testing.assert_array_equal(lazy.values, original)


def test_derived_values_of_a_bfloat16_weight_are_bfloat16_without_a_warning(tmp_path, rng, capfd):
    """A bfloat16 initializer reaches the function as onnx reads it, in bfloat16 (ml_dtypes).
    onnx-graphsurgeon's own loader casts it to float32 and prints a warning for each tensor,
    which the bf16 fold of SmolLM2-135M turned into 150 warnings on standard output."""
    import ml_dtypes

    original = rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "one",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [1, 16])],
        [numpy_helper.from_array(original, "W")],
    )
    source = tmp_path / "bf16.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(source))
    weight = _constant(modelio.load(source), "W")
    capfd.readouterr()
    # onnx-graphsurgeon reports an unread bfloat16 constant's dtype as the ONNX type number.
    derived = modelio.DerivedValues(weight, lambda w: np.multiply(w, 2, out=w), dtype=ml_dtypes.bfloat16)
    values = derived.load()
    assert values.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(values.astype(np.float32), original.astype(np.float32) * 2)
    printed = capfd.readouterr()
    assert "Accessing the values" not in printed.out + printed.err


def _single_matmul_shaped(weight: np.ndarray) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weight.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, weight.shape[1]])],
        [numpy_helper.from_array(weight, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_onnxruntime_optimized_model_loads(tmp_path, rng):
    """ONNX Runtime's optimizer saves its fused RMSNorm as `SimplifiedLayerNormalization` in
    the default domain, which the ONNX checker alone rejects ("No Op registered"): such a
    file loads, keeps its node as it was, and runs unchanged after a save."""
    hidden = 16
    gain = (rng.standard_normal(hidden) + 1.0).astype(np.float32)
    weight = rng.standard_normal((hidden, 8)).astype(np.float32)
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["x", "gain"], ["normed"], axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["normed", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "ort_optimized",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])],
        [numpy_helper.from_array(gain, "gain"), numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    source, copy = tmp_path / "ort.onnx", tmp_path / "copy.onnx"
    onnx.save(model, str(source))
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model)

    graph = modelio.load(source)
    assert [(n.op, n.domain or "") for n in graph.nodes][0] == ("SimplifiedLayerNormalization", "")
    modelio.save(graph, copy)
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(copy), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
