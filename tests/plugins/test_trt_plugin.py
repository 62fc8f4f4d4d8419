"""libflashnorm_plugin.so on a machine without a GPU or TensorRT's builder.

Where TensorRT headers are found (TENSORRT_INCLUDE_DIR, TENSORRT_ROOT, or third_party/ in
the checkout) the plugin and its harness are built with CMake, and the library's shape is
checked: only TensorRT's loader entry points exported, no link to any TensorRT library, loads
in a process without TensorRT. Where TensorRT's lean runtime is also present (the PyPI wheel
tensorrt-lean-cu13-libs, or FLASHNORM_TRT_LEAN_LIB), the harness registers the plugin through
that runtime's plugin registry — IPluginRegistry::loadLibrary and plain dlopen — and creates,
inspects, serializes and clones plugins as TensorRT would (its CPU part; the GPU part runs on
the GPU machine through plugins/flashnorm/tests/run_gpu_trt_harness.sh).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"getCreators", "setLoggerFinder"}


def _tensorrt_include_dir() -> Optional[Path]:
    candidates = [
        os.environ.get("TENSORRT_INCLUDE_DIR"),
        os.environ.get("TENSORRT_ROOT") and os.path.join(os.environ["TENSORRT_ROOT"], "include"),
        REPO / "third_party" / "TensorRT" / "include",
    ]
    for candidate in candidates:
        if candidate and (Path(candidate) / "NvInferRuntime.h").is_file():
            return Path(candidate)
    return None


def _lean_runtime() -> Optional[Path]:
    explicit = os.environ.get("FLASHNORM_TRT_LEAN_LIB")
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("tensorrt_lean_libs")
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(location).glob("libnvinfer_lean.so.*"))
        if found:
            return found[0]
    return None


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    include = _tensorrt_include_dir()
    if include is None:
        pytest.skip("TensorRT headers not found (set TENSORRT_INCLUDE_DIR or TENSORRT_ROOT): plugin not built")
    if shutil.which("nvcc") is None or shutil.which("cmake") is None:
        pytest.skip("nvcc or cmake not found: the kernel library inside the plugin cannot be built")
    build = tmp_path_factory.mktemp("flashnorm-trt-build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = _run(["cmake", "-S", str(REPO), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                      f"-DTENSORRT_INCLUDE_DIR={include}", f"-DPython3_EXECUTABLE={sys.executable}"])
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    assert "FlashNorm TensorRT plugin: building against TensorRT" in configure.stdout
    make = _run(["cmake", "--build", str(build), "--target", "flashnorm_trt_harness", "--parallel", "2"])
    assert make.returncode == 0, make.stdout[-4000:] + make.stderr[-4000:]
    paths = {"plugin": build / "lib" / "libflashnorm_plugin.so",
             "harness": build / "plugins" / "flashnorm" / "tests" / "flashnorm_trt_harness"}
    assert all(p.is_file() for p in paths.values()), paths
    return paths


def test_cmake_skips_the_plugin_with_a_reason_without_headers(tmp_path):
    """Headers not where TENSORRT_INCLUDE_DIR points: configuring still succeeds and says why
    the plugin is not built."""
    if shutil.which("cmake") is None or shutil.which("nvcc") is None:
        pytest.skip("cmake or nvcc not found")
    empty = tmp_path / "no-tensorrt"
    empty.mkdir()
    configure = _run(["cmake", "-S", str(REPO), "-B", str(tmp_path / "build"), f"-DTENSORRT_INCLUDE_DIR={empty}",
                      f"-DPython3_EXECUTABLE={sys.executable}"])
    assert configure.returncode == 0, configure.stderr[-3000:]
    assert "FlashNorm TensorRT plugin: SKIPPED - NvInferRuntime.h not found" in configure.stdout
    assert "libflashnorm_plugin.so" in configure.stdout  # the message says what is not built


def test_exports_only_the_loader_entry_points(built):
    if shutil.which("nm") is None:
        pytest.skip("nm not found")
    symbols = _run(["nm", "-D", "--defined-only", str(built["plugin"])])
    assert symbols.returncode == 0
    exported = {line.split()[-1] for line in symbols.stdout.splitlines() if line.strip()}
    assert exported == ENTRY_POINTS


def test_does_not_link_tensorrt(built):
    if shutil.which("readelf") is None:
        pytest.skip("readelf not found")
    dynamic = _run(["readelf", "-d", str(built["plugin"])]).stdout
    needed = [line.split("[")[-1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed and not [n for n in needed if n.startswith("libnvinfer")], needed
    assert not [n for n in needed if n.startswith("libflashnorm")], "the kernel library must be linked in statically"


def test_loads_in_a_process_without_tensorrt(built):
    """The static initializer finds no TensorRT library and registers nothing; loading works."""
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "assert lib.getCreators and lib.setLoggerFinder; print('loaded')")
    result = _run([sys.executable, "-c", code, str(built["plugin"])])
    assert result.returncode == 0 and "loaded" in result.stdout, result.stderr


@pytest.mark.parametrize("route", ["loadLibrary", "dlopen"])
def test_lean_runtime_registry(built, route):
    lean = _lean_runtime()
    if lean is None or not lean.is_file():
        pytest.skip("TensorRT lean runtime not found (pip install --no-deps tensorrt-lean-cu13-libs, "
                    "or set FLASHNORM_TRT_LEAN_LIB)")
    result = _run([str(built["harness"]), "--runtime", str(lean), "--plugin", str(built["plugin"]), "--route", route],
                  timeout=120)
    lines = result.stdout.splitlines()
    failures = [line for line in lines if line.startswith("FAIL")]
    assert result.returncode == 0 and not failures, result.stdout[-4000:] + result.stderr[-2000:]
    passed = [line for line in lines if line.startswith("PASS")]
    assert len(passed) >= 45, result.stdout
    assert "PASS registry holds each of FlashNormMatMul1..8 exactly once" in lines
    assert "PASS FlashNormMatMul3 refuses splits of 2 sizes" in lines
    assert "PASS serialized fields round-trip through createPlugin(kRUNTIME)" in lines
    if route == "loadLibrary":
        assert "PASS deregisterLibrary removes the creators" in lines


RTX_PROBE = """
import ctypes, sys
import tensorrt_rtx as trt

route, plugin, model = sys.argv[1:4]
registry = trt.get_plugin_registry()
if route == "loadLibrary":
    registry.load_library(plugin)
else:
    ctypes.CDLL(plugin)
creators = [c.name for c in registry.all_creators if c.name.startswith("FlashNormMatMul")]
logger = trt.Logger(trt.Logger.ERROR)
network = trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
parser = trt.OnnxParser(network, logger)
parsed = parser.parse_from_file(model)
plugins = sum(network.get_layer(i).type == trt.LayerType.PLUGIN_V3 for i in range(network.num_layers))
print("creators", len(creators), "parsed", parsed, "errors", parser.num_errors, "plugin_layers", plugins)
"""


@pytest.mark.parametrize("route", ["loadLibrary", "dlopen"])
def test_tensorrt_rtx_registry_gets_no_creators_and_never_aborts(built, route, tmp_path, rng):
    """TensorRT-RTX has no plugin layers; with a FlashNormMatMul creator registered its parser
    creates the plugin and then aborts the process. Loaded into TensorRT-RTX by either route,
    the library registers nothing, and a deferred model with 1-, 2- and 3-output nodes parses
    from its reference functions in a process that exits normally."""
    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.skip("tensorrt_rtx not installed (pip install tensorrt-rtx-cu13==1.7.1.116)")
    import onnx_graphsurgeon as gs

    from flashnorm import modelio
    from flashnorm.passes import run_passes
    from synthetic import build_multi_arity_model

    graph, _ = run_passes(gs.import_onnx(build_multi_arity_model(rng)), ["fold", "defer"])
    model = tmp_path / "deferred.onnx"
    modelio.save(graph, model)
    result = _run([sys.executable, "-c", RTX_PROBE, route, str(built["plugin"]), str(model)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "creators 0 parsed True errors 0 plugin_layers 0" in result.stdout, result.stdout + result.stderr[-2000:]
    assert route == "dlopen" or "TensorRT for RTX has no plugin layers" in result.stderr
