"""The kernel library builds with nvcc on a machine without a GPU (as in CI), exports its C ABI,
and loads: the calls that need no GPU answer, and context creation fails cleanly.

Without nvcc or cuBLASLt (CMake then skips the library and says why) the tests skip with that
reason, except in CI (CI=true), which must build the library: there they fail.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIGURE_LOG = "cmake-configure.log"
"""Where `built_library` keeps what CMake printed when configuring its build."""
ABI = [
    "flashnorm_context_create",
    "flashnorm_context_destroy",
    "flashnorm_workspace_size",
    "flashnorm_resolve_strategy",
    "flashnorm_matmul",
    "flashnorm_add_matmul",
    "flashnorm_status_string",
    "flashnorm_context_last_error",
    "flashnorm_testing_set_side_delay",
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


def test_auto_strategy_through_the_python_binding(built_library, monkeypatch):
    """AUTO's measured thresholds (kAuto in capi.cpp), asked through flashnorm.cuda_ops: no GPU needed."""
    import torch

    from flashnorm import cuda_ops

    monkeypatch.setenv("FLASHNORM_LIBRARY", str(built_library))
    monkeypatch.setattr(cuda_ops, "_library", None)
    assert cuda_ops.resolve_strategy(1, 576, 960, torch.bfloat16) == "fused"
    assert cuda_ops.resolve_strategy(16, 576, 960, torch.float16) == "fused"
    assert cuda_ops.resolve_strategy(17, 576, 960, torch.bfloat16) == "two_stream"
    assert cuda_ops.resolve_strategy(16, 576, 3072, torch.bfloat16) == "fused"
    assert cuda_ops.resolve_strategy(16, 2048, 3072, torch.bfloat16) == "fused"
    assert cuda_ops.resolve_strategy(16, 4096, 6144, torch.bfloat16) == "fused"
    assert cuda_ops.resolve_strategy(16, 2048, 16384, torch.bfloat16) == "fused"
    assert cuda_ops.resolve_strategy(17, 2048, 16384, torch.bfloat16) == "two_stream"
    assert cuda_ops.resolve_strategy(16, 2048, 16392, torch.bfloat16) == "two_stream"
    assert cuda_ops.resolve_strategy(8, 4096, 28672, torch.bfloat16) == "fused"
    assert cuda_ops.resolve_strategy(9, 4096, 28672, torch.bfloat16) == "two_stream"
    assert cuda_ops.resolve_strategy(1, 576, 960, torch.float32) == "two_stream"
    assert cuda_ops.resolve_strategy(1, 576, 962, torch.bfloat16) == "two_stream"
    assert cuda_ops.resolve_strategy(255, 4096, 6144, torch.bfloat16) == "two_stream"
    assert cuda_ops.resolve_strategy(256, 4096, 6144, torch.bfloat16) == "prenorm"
    # Prenorm runs one GEMM per run of equal-width splits: under AUTO (16-bit) M × the narrowest run's
    # columns must be >= 1.25·2^20 (k|v: 2048 columns here), unless all splits are one run.
    qkv = [4096, 1024, 1024]
    assert cuda_ops.resolve_strategy(639, 4096, 6144, torch.bfloat16, qkv) == "two_stream"
    assert cuda_ops.resolve_strategy(640, 4096, 6144, torch.float16, qkv) == "prenorm"
    assert cuda_ops.resolve_strategy(6827, 576, 960, torch.bfloat16, [192, 576, 192]) == "prenorm"
    assert cuda_ops.resolve_strategy(512, 576, 3072, torch.bfloat16, [1536, 1536]) == "prenorm"
    assert cuda_ops.resolve_strategy(63, 576, 3072, torch.bfloat16, [1536, 1536]) == "two_stream"
    assert cuda_ops.resolve_strategy(63, 2048, 16384, torch.bfloat16, [8192, 8192]) == "two_stream"
    assert cuda_ops.resolve_strategy(64, 4096, 28672, torch.float16) == "prenorm"
    assert cuda_ops.resolve_strategy(64, 2048, 32768, torch.bfloat16, [16384, 16384]) == "prenorm"
    assert cuda_ops.resolve_strategy(128, 4096, 6144, torch.bfloat16) == "two_stream"
    assert cuda_ops.resolve_strategy(64, 2048, 16384, torch.float32) == "two_stream"
    assert cuda_ops.resolve_strategy(1023, 4096, 6144, torch.float32, qkv) == "two_stream"
    assert cuda_ops.resolve_strategy(1024, 4096, 6144, torch.float32, qkv) == "prenorm"
    assert cuda_ops.resolve_strategy(4096, 576, 962, torch.float32) == "prenorm"
    assert cuda_ops.join_dropped() is False


@pytest.fixture(scope="module")
def epilogue_scale_built(built_library) -> bool:
    """Whether that build has the CUTLASS kernel, as CMake said when configuring it."""
    return "(epilogue-scale strategy built)" in (built_library.parents[2] / CONFIGURE_LOG).read_text()


def test_auto_epilogue_scale_region(built_library, epilogue_scale_built, monkeypatch):
    """Built with the CUTLASS kernel, AUTO picks epilogue-scale for 64..1024 rows with K <= 1024
    below prenorm's region (which for one run of splits starts past M·N = 2^20 there; for several
    runs, to 4096 rows ahead of prenorm's region, which then starts at 4097 at the earliest), and at
    exactly 64 rows with K >= 2048 where the splits form several runs or one run with K·N < 2^26, a
    large-weight prenorm region then starting at 65 rows (kAuto; measured faster than what AUTO
    picked before on SmolLM2-135M's, Llama-3.2-1B's and Llama-3.1-8B's q|k|v and SmolLM2-135M's and
    Llama-3.2-1B's gate|up, kernels/NOTES.md); built without, two_stream, or prenorm from 64 rows on
    a one-run W* of K·N >= 2^25. Either way AUTO reserves two_stream's workspace there: the call
    falls back to two_stream where the device or the pointers refuse the CUTLASS kernel."""
    import torch

    from flashnorm import cuda_ops

    monkeypatch.setenv("FLASHNORM_LIBRARY", str(built_library))
    monkeypatch.setattr(cuda_ops, "_library", None)
    qkv = [576, 192, 192]
    region = "epilogue_scale" if epilogue_scale_built else "two_stream"
    for m, expected in ((63, "two_stream"), (64, region), (1024, region), (1025, region)):
        assert cuda_ops.resolve_strategy(m, 576, 960, torch.bfloat16, qkv) == expected, m
    # Several runs on short K: epilogue-scale to 4096 rows, prenorm's region after them; without the
    # kernel, two_stream up to prenorm's narrow-run threshold (M × 384 columns >= 1.25·2^20: 3414 rows).
    below_prenorm = region if epilogue_scale_built else "prenorm"
    for m, expected in ((3413, region), (3414, below_prenorm), (4096, below_prenorm), (4097, "prenorm")):
        assert cuda_ops.resolve_strategy(m, 576, 960, torch.bfloat16, qkv) == expected, m
    for m, expected in ((4096, region), (4097, "two_stream"), (6826, "two_stream"), (6827, "prenorm")):
        assert cuda_ops.resolve_strategy(m, 576, 960, torch.bfloat16, [192, 576, 192]) == expected, m
    gate_up = [1536, 1536]
    prenorm_from = 2**20 // 3072 + 1 if epilogue_scale_built else 256
    for m, expected in ((63, "two_stream"), (64, region), (prenorm_from - 1, region), (prenorm_from, "prenorm")):
        assert cuda_ops.resolve_strategy(m, 576, 3072, torch.bfloat16, gate_up) == expected, m
    one_output = "epilogue_scale" if epilogue_scale_built else "prenorm"
    for m, expected in ((255, region), (256, one_output), (1024, one_output), (1025, "prenorm")):
        assert cuda_ops.resolve_strategy(m, 576, 960, torch.bfloat16) == expected, m
    assert cuda_ops.resolve_strategy(512, 576, 960, torch.float16, qkv) == region
    assert cuda_ops.resolve_strategy(512, 576, 960, torch.float32, qkv) == "two_stream"
    assert cuda_ops.resolve_strategy(512, 2048, 3072, torch.bfloat16, [2048, 512, 512]) == "two_stream"
    assert cuda_ops.resolve_strategy(512, 576, 3072, torch.bfloat16, [1536, 1536]) == "prenorm"
    assert cuda_ops.resolve_strategy(512, 576, 964, torch.bfloat16, [576, 192, 196]) == "two_stream"
    # The long-K rows: 64 where K >= 2048 (Llama-3.2-1B's and Llama-3.1-8B's q|k|v); from 65 a partial
    # 64-row block, where the GEMM measured slower than two_stream.
    qkv_8b = [4096, 1024, 1024]
    for m, expected in ((63, "two_stream"), (64, region), (65, "two_stream"), (96, "two_stream"), (128, "two_stream")):
        assert cuda_ops.resolve_strategy(m, 4096, 6144, torch.bfloat16, qkv_8b) == expected, m
        assert cuda_ops.resolve_strategy(m, 2048, 3072, torch.bfloat16, [2048, 512, 512]) == expected, m
    assert cuda_ops.resolve_strategy(64, 2040, 6144, torch.bfloat16, qkv_8b) == "two_stream"
    assert cuda_ops.resolve_strategy(64, 4096, 6144, torch.float32, qkv_8b) == "two_stream"
    assert cuda_ops.resolve_strategy(64, 4096, 28672, torch.bfloat16, [14336, 14336]) == "prenorm"
    # One run on long K: 64 rows where K >= 2048 and 2^25 <= K·N < 2^26 (Llama-3.2-1B's gate|up),
    # ahead of prenorm, which a build without the kernel keeps from 64 rows there.
    gate_up_1b = [8192, 8192]
    one_run = "epilogue_scale" if epilogue_scale_built else "prenorm"
    for m, expected in ((63, "two_stream"), (64, one_run), (65, "prenorm"), (128, "prenorm")):
        assert cuda_ops.resolve_strategy(m, 2048, 16384, torch.bfloat16, gate_up_1b) == expected, m
    assert cuda_ops.resolve_strategy(64, 2048, 16384, torch.float32, gate_up_1b) == "two_stream"
    assert cuda_ops.resolve_strategy(64, 2040, 16384, torch.bfloat16, gate_up_1b) == "two_stream"
    # One run below 2^25, K >= 2048: 64 rows, then two_stream up to prenorm's 256 rows.
    for m, expected in ((64, region), (65, "two_stream"), (128, "two_stream"), (255, "two_stream"), (256, "prenorm")):
        assert cuda_ops.resolve_strategy(m, 2048, 11008, torch.bfloat16, [5504, 5504]) == expected, m
        assert cuda_ops.resolve_strategy(m, 4096, 6144, torch.bfloat16) == expected, m
    reserved = [(64, 576, qkv), (1000, 576, qkv), (1024, 576, qkv), (4096, 576, qkv), (64, 576, gate_up), (64, 4096, qkv_8b),
                (64, 2048, [2048, 512, 512]), (prenorm_from - 1, 576, gate_up)]
    if epilogue_scale_built:  # without the kernel these rows are prenorm's
        reserved += [(64, 2048, gate_up_1b), (1024, 576, [960])]
    for m, k, splits in reserved:
        two_stream = cuda_ops.workspace_size(m, k, splits, torch.bfloat16, "two_stream")
        assert cuda_ops.workspace_size(m, k, splits, torch.bfloat16) >= two_stream, (m, k)


def test_auto_workspace_covers_every_smaller_m(built_library, monkeypatch):
    """The TensorRT plugin sizes one workspace for the profile's largest M: under AUTO that size
    must also hold the strategy picked for any smaller M (two-stream's [M, N] product below the
    prenorm threshold can exceed prenorm's [M, K] at the threshold)."""
    import torch

    from flashnorm import cuda_ops

    monkeypatch.setenv("FLASHNORM_LIBRARY", str(built_library))
    monkeypatch.setattr(cuda_ops, "_library", None)
    sites = [(576, [1536, 1536]), (576, [576, 192, 192]), (2048, [8192, 8192]), (4096, [4096, 1024, 1024]),
             (130, [24, 72]), (130, [5000])]
    for k, splits in sites:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for top in (64, 256, 1024, 4096, 60000):
                largest = cuda_ops.workspace_size(top, k, splits, dtype)
                for m in (m for m in (1, 16, 17, 63, 64, 255, 256, 1000, 1023, 1024, 4096, 54614, 60000) if m <= top):
                    picked = cuda_ops.resolve_strategy(m, k, sum(splits), dtype, splits)
                    needed = cuda_ops.workspace_size(m, k, splits, dtype, picked)
                    assert needed <= largest, (k, splits, dtype, top, m, picked)
                    assert cuda_ops.workspace_size(m, k, splits, dtype) <= largest, (k, splits, dtype, top, m)


def test_prenorm_side_workspace_only_for_several_runs(built_library, monkeypatch):
    """Prenorm's side stream (and its own 32 MiB cuBLASLt workspace) serves only a second run of
    equal-width splits: q|k|v has two runs, gate|up and a single output one."""
    import torch

    from flashnorm import cuda_ops

    monkeypatch.setenv("FLASHNORM_LIBRARY", str(built_library))
    monkeypatch.setattr(cuda_ops, "_library", None)
    single = cuda_ops.workspace_size(1024, 576, [3072], torch.bfloat16, "prenorm")
    assert cuda_ops.workspace_size(1024, 576, [1536, 1536], torch.bfloat16, "prenorm") == single
    assert cuda_ops.workspace_size(1024, 576, [576, 192, 192], torch.bfloat16, "prenorm") == single + (32 << 20)


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
    sources = ["capi.cpp", "runtime/context.cpp", "kernels/deferred_norm.cu", "kernels/normalize.cu", "kernels/fused.cu"]
    for source in sources:
        compiles = [c for c in commands if f"plugins/flashnorm/{source}" in c and " -c " in c]
        assert len(compiles) == 1, f"{source}: {len(compiles)} compile commands for targets {targets}"
    if include:
        assert any("libflashnorm_plugin.so" in c for c in commands), "the plugin's link step is missing"
