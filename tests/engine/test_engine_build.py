"""`flashnorm build`: what FlashNorm asks TensorRT for, and how it fails.

Without TensorRT (CI): one line saying what to install, non-zero exit, no file. With a
stand-in `tensorrt` module (fake_tensorrt.py) that records the request: a strongly typed
network, the parser's plugin override, the profile from --shapes, the workspace, the timing
cache read and written back, progress, every FlashNormMatMul node a plugin layer, an atomic
output. With the real TensorRT and a GPU (not in CI): a deferred model built with the plugin
runs under Polygraphy against ONNX Runtime.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from flashnorm import cli, modelio
from flashnorm.engine import BuildOptions, ShapeRange, build_engine_file, loader
from flashnorm.errors import FlashNormError
from flashnorm.passes import run_passes
from flashnorm.progress import Progress
from synthetic import build_norm_model

import fake_tensorrt

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
PROFILE = ShapeRange((1, 1, 32), (2, 8, 32), (4, 64, 32))


@pytest.fixture
def deferred_model(rng, tmp_path, monkeypatch) -> Path:
    """A synthetic q|k|v block after fold and defer, saved as flashnorm optimize saves it;
    input x is [batch, seq, 32]."""
    monkeypatch.setattr(Progress, "enabled", False)
    graph, _ = run_passes(gs.import_onnx(build_norm_model("pow_div", rng, consumer="qkv")), ["fold", "defer"])
    path = tmp_path / "model.flashnorm.onnx"
    modelio.save(graph, path)
    return path


@pytest.fixture
def fake_trt(monkeypatch):
    module = fake_tensorrt.make_module()
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr(loader, "_loaded", {})
    return module


@pytest.fixture
def plugin_file(tmp_path) -> Path:
    path = tmp_path / "libflashnorm_plugin.so"
    path.write_bytes(b"\x7fELF stand-in")
    return path


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture
def no_tensorrt(monkeypatch):
    """A process where neither TensorRT nor TensorRT-RTX can be imported."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)


@pytest.mark.parametrize("backend, message", [
    ("auto", "no TensorRT backend is installed: pip install tensorrt-cu13"),
    ("tensorrt", "pip install tensorrt-cu13"),
    ("tensorrt-rtx", "pip install tensorrt-rtx-cu13==1.7.1.116"),
])
def test_without_tensorrt_says_what_to_install(no_tensorrt, deferred_model, tmp_path, capsys, backend, message):
    plan = tmp_path / "model.plan"
    code = cli.main(["build", str(deferred_model), "-o", str(plan), "--shapes", "x:1x1x32,2x8x32,4x64x32",
                     "--backend", backend])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err, err
    assert not plan.exists() and not leftovers(tmp_path)


def test_compare_with_trt_without_tensorrt_says_what_to_install(no_tensorrt, deferred_model):
    from flashnorm.engine import trt_runner_factory

    with pytest.raises(FlashNormError, match="pip install tensorrt"):
        trt_runner_factory(plugins=[])(str(deferred_model), "candidate")


def test_auto_prefers_tensorrt(fake_trt, deferred_model, tmp_path):
    report = build_engine_file(deferred_model, tmp_path / "model.plan", BuildOptions(shapes={"x": PROFILE}))
    assert report["backend"] == "tensorrt" and report["tensorrt"] == fake_trt.__version__


def test_report_says_what_the_engine_is_made_of(fake_trt, deferred_model, plugin_file, tmp_path):
    report = build_engine_file(deferred_model, tmp_path / "model.plan",
                               BuildOptions(plugins=[plugin_file], shapes={"x": PROFILE}))
    network = report["network"]
    assert network["flashnorm_plugin_layers"] == 1 and network["layer_types"]["PLUGIN_V3"] == 1
    assert network["layers"] == sum(network["layer_types"].values())
    # No GPU in the stand-in: the inspector says why it has nothing to show.
    assert report["engine_inspector"] == {
        "available": False, "reason": "the engine cannot be deserialized here: no CUDA device in this stand-in"}


def test_build_request(fake_trt, deferred_model, plugin_file, tmp_path):
    plan, cache = tmp_path / "model.plan", tmp_path / "timing.cache"
    options = BuildOptions(plugins=[plugin_file], shapes={"x": PROFILE}, timing_cache=cache, workspace_bytes=1 << 30)
    report = build_engine_file(deferred_model, plan, options)
    request = json.loads(plan.read_bytes())
    assert request == {
        "strongly_typed": True,
        "parser_flags": [fake_trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE],
        "profiles": [{"x": [[1, 1, 32], [2, 8, 32], [4, 64, 32]]}],
        "workspace": 1 << 30,
        "timing_cache": "",
        "progress_monitor": True,
    }
    assert report["flashnorm_nodes"] == report["flashnorm_plugin_layers"] == 1
    assert report["profile"] == {"x": "1x1x32,2x8x32,4x64x32"}
    assert report["plugins"] == [str(plugin_file.resolve())]
    assert cache.read_bytes() == b"+timed"
    assert not leftovers(tmp_path)

    # A second build starts from the cache the first one wrote.
    build_engine_file(deferred_model, plan, options)
    assert json.loads(plan.read_bytes())["timing_cache"] == "+timed"
    assert cache.read_bytes() == b"+timed+timed"


def test_cli_build(fake_trt, deferred_model, plugin_file, tmp_path, capsys):
    plan = tmp_path / "model.plan"
    code = cli.main(["build", str(deferred_model), "-o", str(plan), "--plugin", str(plugin_file),
                     "--shapes", "x:1x1x32,2x8x32,4x64x32", "--workspace", "256", "--report", "-"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["output"] == str(plan) and plan.is_file()
    assert json.loads(plan.read_bytes())["workspace"] == 256 << 20


def test_dynamic_input_needs_shapes(fake_trt, deferred_model, plugin_file, tmp_path):
    plan = tmp_path / "model.plan"
    with pytest.raises(FlashNormError, match=r"dynamic input\(s\) x\[-1, -1, 32\] need --shapes"):
        build_engine_file(deferred_model, plan, BuildOptions(plugins=[plugin_file]))
    assert not plan.exists()


@pytest.mark.parametrize("shapes, message", [
    ({"y": PROFILE}, "unknown input"),
    ({"x": ShapeRange((1, 1, 16), (1, 1, 16), (1, 1, 16))}, "does not fit"),
    ({"x": ShapeRange((1, 32), (1, 32), (1, 32))}, "does not fit"),
])
def test_shapes_must_match_the_network(fake_trt, deferred_model, plugin_file, tmp_path, shapes, message):
    with pytest.raises(FlashNormError, match=message):
        build_engine_file(deferred_model, tmp_path / "model.plan", BuildOptions(plugins=[plugin_file], shapes=shapes))


def test_library_without_the_creator_is_refused(fake_trt, deferred_model, tmp_path):
    other = tmp_path / "libother.so"
    other.write_bytes(b"\x7fELF")
    with pytest.raises(FlashNormError, match="no FlashNormMatMul1 creator"):
        build_engine_file(deferred_model, tmp_path / "model.plan", BuildOptions(plugins=[other], shapes={"x": PROFILE}))


def test_missing_plugin_file(fake_trt, deferred_model, tmp_path):
    with pytest.raises(FlashNormError, match="does not exist"):
        build_engine_file(deferred_model, tmp_path / "model.plan",
                          BuildOptions(plugins=[tmp_path / "missing.so"], shapes={"x": PROFILE}))


def test_without_plugin_the_report_says_reference_functions(fake_trt, deferred_model, tmp_path):
    report = build_engine_file(deferred_model, tmp_path / "model.plan", BuildOptions(shapes={"x": PROFILE}))
    assert report["flashnorm_plugin_layers"] == 0 and "reference functions" in report["note"]


def test_failed_build_leaves_no_file(fake_trt, deferred_model, plugin_file, tmp_path, monkeypatch):
    monkeypatch.setattr(fake_trt.Builder, "fail", True)
    plan = tmp_path / "model.plan"
    with pytest.raises(FlashNormError, match="could not build"):
        build_engine_file(deferred_model, plan, BuildOptions(plugins=[plugin_file], shapes={"x": PROFILE}))
    assert not plan.exists() and not leftovers(tmp_path)


def _external(model: Path) -> Path:
    """The model saved again with its weights in `<name>.data` (size_threshold 0: every one)."""
    external = model.with_name("external.onnx")
    onnx.save(onnx.load(str(model)), str(external), save_as_external_data=True, location="external.onnx.data",
              size_threshold=0)
    return external


@pytest.mark.parametrize("spoil, message", [
    (lambda data: os.truncate(data, 10), "is truncated: tensor"),
    (lambda data: (data.unlink(), os.mkfifo(data)), "is a FIFO, not a regular file"),
])
def test_bad_external_data_is_explained_before_the_parser_reads_it(fake_trt, deferred_model, tmp_path, spoil, message):
    """Our own reader checks the model's data (sizes, regular file, confinement) before
    TensorRT's parser opens it by name: one line of ours, never a wait on a FIFO."""
    model = _external(deferred_model)
    spoil(model.with_name("external.onnx.data"))
    with pytest.raises(FlashNormError) as excinfo:
        build_engine_file(model, tmp_path / "model.plan", BuildOptions(shapes={"x": PROFILE}))
    assert message in str(excinfo.value) and "parser" not in str(excinfo.value)
    assert not (tmp_path / "model.plan").exists()


def test_a_model_changed_during_the_build_is_refused(fake_trt, deferred_model, tmp_path, monkeypatch):
    """TensorRT reads the files by name: a model or data file replaced while it builds gives
    an engine of neither version, so no plan is written."""
    model = _external(deferred_model)
    data = model.with_name("external.onnx.data")
    real_build = fake_trt.Builder.build_serialized_network

    def build_while_replaced(self, network, config):
        data.with_name("new.data").write_bytes(data.read_bytes())
        os.replace(data.with_name("new.data"), data)
        return real_build(self, network, config)

    monkeypatch.setattr(fake_trt.Builder, "build_serialized_network", build_while_replaced)
    with pytest.raises(FlashNormError, match="external.onnx.data changed while flashnorm was reading it"):
        build_engine_file(model, tmp_path / "model.plan", BuildOptions(shapes={"x": PROFILE}))
    assert not (tmp_path / "model.plan").exists() and not leftovers(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TENSORRT, reason="tensorrt is not installed (pip install tensorrt-cu13)")
def test_tensorrt_with_plugin_matches_onnx_runtime(rng, tmp_path, monkeypatch):
    """The real thing: needs TensorRT, a GPU and FLASHNORM_PLUGIN_LIB=path/to/libflashnorm_plugin.so."""
    plugin = os.environ.get("FLASHNORM_PLUGIN_LIB")
    if not plugin:
        pytest.skip("FLASHNORM_PLUGIN_LIB is not set")
    from flashnorm.engine import trt_runner_factory
    from flashnorm.validate.comparison import compare_models
    from flashnorm.validate.runners import onnxrt_runner_factory

    monkeypatch.setattr(Progress, "enabled", False)
    model = build_norm_model("pow_div", rng, consumer="qkv", hidden=64)
    folded, _ = run_passes(gs.import_onnx(model), ["fold"])
    deferred, _ = run_passes(gs.import_onnx(model), ["fold", "defer"])
    folded_path, deferred_path = tmp_path / "folded.onnx", tmp_path / "deferred.onnx"
    modelio.save(folded, folded_path)
    modelio.save(deferred, deferred_path)
    feeds = [{"x": (rng.standard_normal((2, 7, 64)) * 2).astype(np.float32)}]
    shapes = {"x": ShapeRange((1, 1, 64), (2, 7, 64), (4, 32, 64))}
    report = compare_models(folded_path, deferred_path, feeds,
                            runners=(onnxrt_runner_factory(), trt_runner_factory(plugins=[plugin], shapes=shapes)))
    assert report.passed, report.to_dict()
