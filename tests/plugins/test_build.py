"""The kernel library builds with nvcc on a machine without a GPU (as in CI), exports its C ABI,
and loads: the calls that need no GPU answer, and context creation fails cleanly.

Without nvcc or cuBLASLt (CMake then skips the library and says why) the tests skip with that
reason, except in CI (CI=true), which must build the library: there they fail.
"""

from __future__ import annotations

import csv
import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden" / "auto_dispatch.csv"
"""AUTO's golden table (plugins/flashnorm/dispatch/write_golden.py)."""
CONFIGURE_LOG = "cmake-configure.log"
"""Where `built_library` keeps what CMake printed when configuring its build."""
ABI = [
    "flashnorm_context_create",
    "flashnorm_context_destroy",
    "flashnorm_workspace_size",
    "flashnorm_resolve_strategy",
    "flashnorm_current_multiprocessors",
    "flashnorm_measured_multiprocessors",
    "flashnorm_matmul",
    "flashnorm_add_matmul",
    "flashnorm_status_string",
    "flashnorm_context_last_error",
    "flashnorm_testing_set_side_delay",
    "flashnorm_testing_set_fused_tuning",
    "flashnorm_testing_set_epilogue_scale_tiles",
    "flashnorm_testing_epilogue_scale_tiles_name",
    "flashnorm_strategy_available",
    "flashnorm_testing_join_dropped",
]


def _run(command: list[str], cwd: Path) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def missing_build_tool(reason: str) -> None:
    """Skip, saying what is missing; in CI, which must build the library, fail instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must build the kernel library)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def built_library(tmp_path_factory) -> Path:
    for tool in ("nvcc", "cmake"):
        if shutil.which(tool) is None:
            missing_build_tool(f"{tool} not found: the kernel library cannot be built")
    build = tmp_path_factory.mktemp("flashnorm-build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configured = _run(["cmake", "-S", str(REPO), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                       f"-DPython3_EXECUTABLE={sys.executable}"], REPO)
    (build / CONFIGURE_LOG).write_text(configured)
    if "FlashNorm kernel library: SKIPPED" in configured:
        missing_build_tool("cuBLASLt not found (pip install nvidia-cublas): CMake skips the kernel library")
    _run(["cmake", "--build", str(build), "--target", "flashnorm", "flashnorm_selftest", "cublaslt_control", "--parallel", "2"], REPO)
    library = build / "plugins" / "flashnorm" / "libflashnorm.so"
    assert library.is_file()
    for program in ("flashnorm_selftest", "cublaslt_control"):
        assert (build / "plugins" / "flashnorm" / "tests" / program).is_file()
    return library


def test_cmake_skips_the_library_with_a_reason_without_cublaslt(tmp_path):
    """cuBLASLt not where FLASHNORM_CUBLAS_ROOT points: configuring still succeeds and says what
    is not built and how to get it, as it does for the plugin without TensorRT headers."""
    for tool in ("nvcc", "cmake"):
        if shutil.which(tool) is None:
            missing_build_tool(f"{tool} not found")
    empty = tmp_path / "no-cublas"
    empty.mkdir()
    configured = _run(["cmake", "-S", str(REPO), "-B", str(tmp_path / "build"), f"-DFLASHNORM_CUBLAS_ROOT={empty}"], REPO)
    assert "FlashNorm kernel library: SKIPPED - cuBLASLt not found" in configured
    assert "pip install nvidia-cublas" in configured


def test_exports_exactly_the_c_abi(built_library):
    symbols = _run(["nm", "-D", "--defined-only", str(built_library)], REPO)
    exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert set(ABI) <= exported
    assert not {name for name in exported if name.startswith("_Z")}, "C++ symbols leak out of the library"


def test_carries_hopper_machine_code_and_ptx(built_library):
    # The fatbinary keeps ptxas's options for each cubin and the PTX's target line.
    contents = built_library.read_bytes()
    assert b"-arch sm_90" in contents, "no sm_90 machine code: CMAKE_CUDA_ARCHITECTURES did not reach nvcc"
    assert b".target sm_90" in contents, "no compute_90 PTX for newer GPUs"


def test_loads_and_answers_without_a_gpu(built_library):
    library = ctypes.CDLL(str(built_library))
    library.flashnorm_testing_join_dropped.restype = ctypes.c_int
    assert library.flashnorm_testing_join_dropped() == 0
    library.flashnorm_status_string.restype = ctypes.c_char_p
    assert library.flashnorm_status_string(3) == b"workspace too small"
    context = ctypes.c_void_p()
    status = library.flashnorm_context_create(ctypes.byref(context))
    if status == 0:  # a GPU is present after all: creation must then work and be undone
        library.flashnorm_context_destroy(context)
    else:
        assert status == 4, f"context creation without a GPU must report a CUDA error, got {status}"
        assert not context.value
        # No device answers: multiprocessors = 0 stands for the count AUTO was measured on.
        assert library.flashnorm_current_multiprocessors() == library.flashnorm_measured_multiprocessors()
    assert library.flashnorm_measured_multiprocessors() == _measured_multiprocessors()


def test_epilogue_scale_tile_names_listed_in_every_build(built_library, monkeypatch):
    """The tuning hook's configurations come from the library (one list, in the C++ enum's order),
    with or without the CUTLASS kernel: distinct names, NULL past the last."""
    from flashnorm import cuda_ops
    from flashnorm.errors import FlashNormError

    monkeypatch.setenv("FLASHNORM_LIBRARY", str(built_library))
    monkeypatch.setattr(cuda_ops.abi, "_library", None)
    names = cuda_ops.epilogue_scale_tile_names()
    assert len(names) == len(set(names)) == 15, names
    listed = {"row_sums_64x32", "one_wave_128x192", "128x192", "clusters_128x256", "one_wave_clusters_128x96"}
    assert listed <= set(names)
    assert all(name for name in names)
    with pytest.raises(FlashNormError, match="'64x48' are unknown"):
        cuda_ops.set_epilogue_scale_tiles("64x48")


def _measured_multiprocessors() -> int:
    """The multiprocessors dispatch.cpp says AUTO's boundaries were measured on."""
    policy = (REPO / "plugins" / "flashnorm" / "dispatch" / "dispatch.cpp").read_text()
    return int(re.search(r"\.measured_multiprocessors = (\d+),", policy).group(1))


def test_auto_matches_the_golden_table_through_the_python_binding(built_library, epilogue_scale_built, monkeypatch):
    """The built library's AUTO, asked through flashnorm.cuda_ops and the C ABI (no GPU needed), is the
    dispatch unit's: its strategy at the first and last row of every run of AUTO's golden table
    (tests/plugins/golden/auto_dispatch.csv) for this build, with or without the CUTLASS kernel, and
    its workspace size at the run's last row, for each multiprocessor count of the table passed as the
    problem's multiprocessors; and with multiprocessors 0 (the default), the rows of the count the
    library says that stands for here (current_multiprocessors: without a GPU, the measured 132). The
    boundaries are in plugins/flashnorm/dispatch/dispatch.cpp; test_dispatch_golden.py checks the
    table against them (and the workspace's cover of every smaller M on every row) without nvcc."""
    import torch

    from flashnorm import cuda_ops

    monkeypatch.setenv("FLASHNORM_LIBRARY", str(built_library))
    monkeypatch.setattr(cuda_ops.abi, "_library", None)
    default = cuda_ops.current_multiprocessors()
    with GOLDEN.open(newline="") as file:
        runs = [row for row in csv.DictReader(file) if row["epilogue_scale_built"] == str(int(epilogue_scale_built))]
    counts = {int(run["multiprocessors"]) for run in runs}
    assert {_measured_multiprocessors(), 114, 78} <= counts
    dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    for run in runs:
        k, splits, dtype = int(run["k"]), [int(size) for size in run["splits"].split("|")], dtypes[run["dtype"]]
        count, last, statistic = int(run["multiprocessors"]), int(run["m_to"]), run["statistic"]
        for multiprocessors in (count, 0) if count == default else (count,):
            label = (run["site"], statistic, run["dtype"], count, multiprocessors)
            for m in (int(run["m_from"]), last):
                picked = cuda_ops.resolve_strategy(m, k, sum(splits), dtype, splits, multiprocessors, statistic)
                assert picked == run["strategy"], (*label, m)
            workspace = cuda_ops.workspace_size(
                last, k, splits, dtype, multiprocessors=multiprocessors, statistic=statistic
            )
            assert workspace == int(run["workspace_bytes_at_m_to"]), (*label, last)
    assert cuda_ops.join_dropped() is False


def test_negative_multiprocessors_make_a_malformed_problem(built_library):
    """The C ABI refuses a negative count as it refuses any malformed problem (workspace size 0),
    and the binding refuses it before asking."""
    import torch

    from flashnorm import cuda_ops
    from flashnorm.cuda_ops.abi import Problem
    from flashnorm.errors import FlashNormError

    library = ctypes.CDLL(str(built_library))
    library.flashnorm_workspace_size.restype = ctypes.c_size_t
    problem = Problem(m=64, k=576, n=960, num_outputs=1, dtype=2, eps=1e-6)
    problem.split_sizes[0] = 960
    for multiprocessors, malformed in ((0, False), (78, False), (-1, True)):
        problem.multiprocessors = multiprocessors
        assert (library.flashnorm_workspace_size(ctypes.byref(problem)) == 0) == malformed, multiprocessors
    with pytest.raises(FlashNormError, match="multiprocessors must be >= 0"):
        cuda_ops.workspace_size(64, 576, [960], torch.bfloat16, multiprocessors=-1)


@pytest.fixture(scope="module")
def epilogue_scale_built(built_library) -> bool:
    """Whether that build has the CUTLASS kernel, as CMake said when configuring it."""
    return "(epilogue-scale strategy built)" in (built_library.parents[2] / CONFIGURE_LOG).read_text()


def test_prenorm_side_workspace_only_for_several_runs(built_library, monkeypatch):
    """Prenorm's side stream (and its own 32 MiB cuBLASLt workspace) serves only a second run of
    equal-width splits: q|k|v has two runs, gate|up and a single output one."""
    import torch

    from flashnorm import cuda_ops

    monkeypatch.setenv("FLASHNORM_LIBRARY", str(built_library))
    monkeypatch.setattr(cuda_ops.abi, "_library", None)
    single = cuda_ops.workspace_size(1024, 576, [3072], torch.bfloat16, "prenorm")
    assert cuda_ops.workspace_size(1024, 576, [1536, 1536], torch.bfloat16, "prenorm") == single
    # q|k|v's N is 960, not 3072: its rounded bias takes less room (n values of 2 bytes, 256-byte rounded).
    bias_room = (2 * 3072 + 255) // 256 * 256 - (2 * 960 + 255) // 256 * 256
    assert cuda_ops.workspace_size(1024, 576, [576, 192, 192], torch.bfloat16, "prenorm") == single + (32 << 20) - bias_room


def _tensorrt_include_dir() -> Path | None:
    candidates = [os.environ.get("TENSORRT_INCLUDE_DIR"), REPO / "third_party" / "TensorRT" / "include"]
    if os.environ.get("TENSORRT_ROOT"):
        candidates.append(Path(os.environ["TENSORRT_ROOT"]) / "include")
    return next((Path(c) for c in candidates if c and (Path(c) / "NvInferRuntime.h").is_file()), None)


def test_each_library_source_is_compiled_once(tmp_path):
    """libflashnorm.so and the TensorRT plugin link one set of objects: every kernel-library source
    has exactly one compile command among both targets' build steps (where TensorRT headers exist
    to configure the plugin; else the library's alone)."""
    for tool in ("nvcc", "cmake"):
        if shutil.which(tool) is None:
            missing_build_tool(f"{tool} not found: the kernel library cannot be configured")
    if shutil.which("ninja") is None:
        pytest.skip("ninja not found: the build's compile commands are listed with `ninja -t commands`")
    include = _tensorrt_include_dir()
    options = [f"-DTENSORRT_INCLUDE_DIR={include}"] if include else []
    configured = _run(["cmake", "-S", str(REPO), "-B", str(tmp_path), "-G", "Ninja",
                       f"-DPython3_EXECUTABLE={sys.executable}", *options], REPO)
    if "FlashNorm kernel library: SKIPPED" in configured:
        missing_build_tool("cuBLASLt not found (pip install nvidia-cublas): CMake skips the kernel library")
    targets = ["flashnorm", "flashnorm_plugin"] if include else ["flashnorm"]
    commands = _run(["ninja", "-C", str(tmp_path), "-t", "commands", *targets], REPO).splitlines()
    sources = ["capi.cpp", "dispatch/dispatch.cpp", "runtime/context.cpp", "kernels/deferred_norm.cu",
               "kernels/normalize.cu", "kernels/fused.cu"]
    for source in sources:
        compiles = [c for c in commands if f"plugins/flashnorm/{source}" in c and " -c " in c]
        assert len(compiles) == 1, f"{source}: {len(compiles)} compile commands for targets {targets}"
    if include:
        assert any("libflashnorm_plugin.so" in c for c in commands), "the plugin's link step is missing"
