"""`optimize`'s options on every kind of input: each combination of --passes, --for-quantization,
--quant-limit and input (float, weight-quantized: MatMulNBits and DequantizeLinear int4/int8,
activation-quantized: static QDQ and ONNX Runtime's dynamic int8, mixed) does what
docs/QUANTIZATION.md and the options' help say, site by site, or is refused in one line
(FlashNormError; exit 2 on the command line).

The rules walked here:
- an option none of the chosen passes takes is refused (--quant-limit, --for-quantization and
  --untie belong to fold);
- --for-quantization on a model whose norms already have quantized consumers is refused (the
  selection judges float weights a quantizer has yet to see);
- fold: float weights fold (with --for-quantization, only the selected sites); an exact quantized
  fold always; a requantized one iff its noise ratio is within the limit; a quantized activation
  never, static or dynamic ("fold first, then quantize");
- cancel: a norm whose only path reaches the next norm through a bias-free MatMul is cancelled;
- defer: a folded site with float or graph-dequantized weights is deferred; a weight dequantized
  inside the op or a quantized activation is refused with that reason, whatever fold did; a gain
  left by fold is "run fold first"."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from flashnorm import cli
from flashnorm.errors import FlashNormError
from flashnorm.match import find_norm_sites
from flashnorm.passes import run_passes
from flashnorm.passes.quantized import DEFAULT_QUANT_LIMIT
from synthetic import GraphBuilder, axes_input, random_gain
from test_fold_quantized import EPS, HIDDEN, _float_model, dq_model, ort_nbits

PASS_LISTS = ["fold", "cancel", "defer", "fold,cancel", "fold,defer", "cancel,defer", "fold,cancel,defer"]
FORMATS = [None, "int4", "int4-b32", "int8"]
LIMITS = [None, 0.0, 1.0]
SPREAD = np.where(np.arange(HIDDEN) % 2 == 0, 3.0, 0.5)  # kept by every format's selection
EVEN = 1.3 * np.where(np.arange(HIDDEN) % 5 == 0, -1.0, 1.0)  # folds under every format


def _input():
    return [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])]


def _weight(b, rng, columns):
    return b.const((rng.standard_normal((HIDDEN, columns)) / np.sqrt(HIDDEN)).astype(np.float32), "w")


def _activation_quantized(b, y, rng):
    """ModelOpt int8: a static Q → DQ on the normalized activation, a DequantizeLinear int8 weight."""
    scale, zero = b.const(np.array(0.05, np.float32)), b.const(np.array(0, np.int8))
    a = b.op("DequantizeLinear", [b.op("QuantizeLinear", [y, scale, zero]), scale, zero])
    codes = rng.integers(-127, 128, (HIDDEN, 24)).astype(np.int8)
    weight = b.op("DequantizeLinear", [b.const(codes, "w_q"), b.const(np.full(24, 0.01, np.float32), "w_s")], axis=1)
    return b.op("MatMul", [a, weight])


def _models(folder) -> dict[str, tuple[onnx.ModelProto, list[str]]]:
    """Input kind → (model, the role of each norm site in graph order)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(49)
    b = GraphBuilder(21)  # float: norm(even gain) → MatMul → norm(spread gain) → MatMul (256 wide)
    h = b.op("MatMul", [axes_input(b, "x", EVEN.astype(np.float32), EPS), _weight(b, rng, HIDDEN)])
    out = b.op("MatMul", [axes_input(b, h, SPREAD.astype(np.float32), EPS), _weight(b, rng, 256)])
    models = {"float": (b.model(_input(), [out]), ["float-even", "float-spread"])}
    models["nbits"] = (ort_nbits(_float_model(rng, widths=(40, 24))[0], 4, 32, False), ["nbits"])
    models["dq-int4"] = (dq_model(rng, "int4", "blocked-K32", "kn", False)[0], ["requantized"])
    models["dq-int8"] = (dq_model(rng, "int8", "per-axis-K", "kn", False)[0], ["exact"])
    b = GraphBuilder(21)
    out = _activation_quantized(b, axes_input(b, "x", random_gain(rng, HIDDEN), EPS), rng)
    models["static-qdq"] = (b.model(_input(), [out]), ["activation"])
    b = GraphBuilder(21)  # mixed: a float site feeding a ModelOpt-int8 one
    h = b.op("MatMul", [axes_input(b, "x", random_gain(rng, HIDDEN), EPS), _weight(b, rng, HIDDEN)])
    out = _activation_quantized(b, axes_input(b, h, random_gain(rng, HIDDEN), EPS), rng)
    models["mixed"] = (b.model(_input(), [out]), ["float", "activation"])
    onnx.save(_float_model(rng, widths=(40, 24))[0], str(folder / "float.onnx"))  # ONNX Runtime's dynamic int8:
    quantize_dynamic(str(folder / "float.onnx"), str(folder / "dynamic.onnx"), weight_type=QuantType.QInt8)
    models["dynamic-int8"] = (onnx.load(str(folder / "dynamic.onnx")), ["activation"])  # DynamicQuantizeLinear
    return models


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _models(tmp_path_factory.mktemp("models"))


def _refusal(kind: str, passes: list[str], fmt, limit) -> str | None:
    """The one line a combination is refused with, or None."""
    if limit is not None and "fold" not in passes:
        return "--quant-limit is an option of the fold pass"
    if fmt is not None and "fold" not in passes:
        return "--for-quantization is an option of the fold pass"
    if fmt is not None and kind != "float":
        return "is quantized already"
    return None


def _check_fold(role: str, decision, fmt, limit: float) -> bool:
    """Whether the site was folded; asserts the decision is the documented one."""
    if role == "activation":
        assert decision.action == "skipped" and "(route: fold first, then quantize)" in decision.reason
        return False
    if role == "float-spread" and fmt is not None:
        assert decision.action == "skipped" and f"kept the gain for {fmt} quantization" in decision.reason
        assert decision.details["predicted_error_ratio"] > 1.1
        return False
    if role in ("nbits", "requantized"):
        ratio = decision.details["quantized"]["noise_ratio"]
        assert ratio > 0 and decision.action == ("folded" if ratio <= limit else "skipped"), (ratio, limit, decision)
        if decision.action == "skipped":
            assert f"above the quant limit {limit:g}" in decision.reason
        return decision.action == "folded"
    assert decision.action == "folded", decision
    if role == "exact":
        assert decision.details["quantized"]["exact"]
    if fmt is not None:
        assert decision.details["predicted_error_ratio"] == pytest.approx(1.0, abs=1e-6)
    return True


def _check_defer(role: str, decision, folded: bool) -> None:
    if role == "nbits":
        assert decision.action == "skipped" and "dequantizes its weight inside the op" in decision.reason
    elif role == "activation":
        assert decision.action == "skipped" and "quantizes the normalized activation" in decision.reason
    elif folded:
        assert decision.action == "deferred", decision
    else:
        assert decision.action == "skipped" and "run fold first" in decision.reason, decision


def _walk(model: onnx.ModelProto, roles: list[str], kind: str, passes: list[str], fmt, limit) -> None:
    graph = gs.import_onnx(model)
    names = [site.name for site in find_norm_sites(graph)]
    assert len(names) == len(roles)
    refusal = _refusal(kind, passes, fmt, limit)
    if refusal is not None:
        with pytest.raises(FlashNormError, match=refusal.replace("(", r"\(").replace(")", r"\)")) as caught:
            run_passes(graph, passes, quant_limit=limit, for_quantization=fmt)
        assert "\n" not in str(caught.value)
        return
    graph, reports = run_passes(graph, passes, quant_limit=limit, for_quantization=fmt)
    onnx.checker.check_model(gs.export_onnx(graph))
    assert [r.name for r in reports] == passes
    folded = {name: False for name in names}
    cancelled: set[str] = set()
    for report in reports:
        decisions = {d.site: d for d in report.decisions}
        assert all(d.reason and "\n" not in d.reason for d in report.decisions if d.action == "skipped")
        if report.name == "fold":
            assert list(decisions) == names
            for name, role in zip(names, roles):
                folded[name] = _check_fold(role, decisions[name], fmt, DEFAULT_QUANT_LIMIT if limit is None else limit)
        elif report.name == "cancel":
            assert list(decisions) == names
            for name, role in zip(names, roles):
                first_of_two = len(names) == 2 and name == names[0]  # its MatMul feeds the second norm
                assert decisions[name].action == ("cancelled" if first_of_two else "skipped"), decisions[name]
                if first_of_two:
                    cancelled.add(name)
        else:
            assert list(decisions) == [n for n in names if n not in cancelled]
            for name, role in zip(names, roles):
                if name not in cancelled:
                    _check_defer(role, decisions[name], folded[name])


def test_every_combination_does_what_the_docs_say_or_is_one_line(models):
    walked = 0
    for (kind, (model, roles)), passes, fmt, limit in itertools.product(models.items(), PASS_LISTS, FORMATS, LIMITS):
        try:
            _walk(model, roles, kind, passes.split(","), fmt, limit)
        except AssertionError as exc:
            raise AssertionError(f"{kind} --passes {passes} --for-quantization {fmt} --quant-limit {limit}: {exc}")
        walked += 1
    assert walked == 7 * 7 * 4 * 3


@pytest.mark.parametrize("limit", [-1.0, float("nan")])
def test_a_quant_limit_out_of_range_is_one_line(models, limit):
    model, _ = models["nbits"]
    with pytest.raises(FlashNormError, match=f"--quant-limit must be at least 0, got {limit}"):
        run_passes(gs.import_onnx(model), ["fold"], quant_limit=limit)
    _, (report,) = run_passes(gs.import_onnx(model), ["fold"], quant_limit=float("inf"))  # the library takes inf
    assert report.count("folded") == 1


@pytest.fixture(scope="module")
def quantized_file(models, tmp_path_factory):
    path = tmp_path_factory.mktemp("quantized") / "q.onnx"
    onnx.save(models["nbits"][0], str(path))
    return path


@pytest.mark.parametrize("argv,words", [
    (["--passes", "fold", "--for-quantization", "int8", "--quant-limit", "100"], "is quantized already"),
    (["--passes", "fold", "--for-quantization", "int4"], "is quantized already"),
    (["--passes", "cancel", "--for-quantization", "int4"], "--for-quantization is an option of the fold pass"),
    (["--passes", "defer", "--quant-limit", "1"], "--quant-limit is an option of the fold pass"),
    (["--passes", "cancel,defer", "--untie"], "--untie is an option of the fold pass"),
    (["--quant-limit", "-1"], "--quant-limit: must be at least 0"),
    (["--quant-limit", "nan"], "--quant-limit: 'nan' is not a finite number"),
    (["--quant-limit", "inf"], "--quant-limit: 'inf' is not a finite number"),
    (["--for-quantization", "int3"], "--for-quantization: invalid choice: 'int3'"),
])
def test_refusals_on_the_command_line_are_one_line_exit_2(quantized_file, tmp_path, capsys, argv, words):
    """The crash of issue 49 (an AttributeError traceback from fold --for-quantization int8 on a
    quantized file) among them."""
    out = tmp_path / "out.onnx"
    assert cli.main(["optimize", str(quantized_file), "-o", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and err.startswith("flashnorm optimize: error: "), err
    assert not out.exists()
