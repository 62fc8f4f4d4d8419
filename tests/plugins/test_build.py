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


def test_epilogue_scale_tile_names_listed_in_every_build(built_library, monkeypatch):
    """The tuning hook's configurations come from the library (one list, in the C++ enum's order),
    with or without the CUTLASS kernel: distinct names, NULL past the last."""
    from flashnorm import cuda_ops
    from flashnorm.errors import FlashNormError

    monkeypatch.setenv("FLASHNORM_LIBRARY", str(built_library))
    monkeypatch.setattr(cuda_ops, "_library", None)
    names = cuda_ops.epilogue_scale_tile_names()
    assert len(names) == len(set(names)) == 15, names
    listed = {"row_sums_64x32", "one_wave_128x192", "128x192", "clusters_128x256", "one_wave_clusters_128x96"}
    assert listed <= set(names)
    assert all(name for name in names)
    with pytest.raises(FlashNormError, match="'64x48' are unknown"):
        cuda_ops.set_epilogue_scale_tiles("64x48")


def test_auto_strategy_through_the_python_binding(built_library, epilogue_scale_built, monkeypatch):
    """AUTO's measured thresholds (kAuto in capi.cpp), asked through flashnorm.cuda_ops: no GPU needed.
    Where a build with the CUTLASS kernel runs epilogue-scale instead (its rows are
    test_auto_epilogue_scale_region's), `or_es` names what a build without it runs."""
    import torch

    from flashnorm import cuda_ops

    monkeypatch.setenv("FLASHNORM_LIBRARY", str(built_library))
    monkeypatch.setattr(cuda_ops, "_library", None)

    def or_es(strategy: str) -> str:
        return "epilogue_scale" if epilogue_scale_built else strategy

    assert cuda_ops.resolve_strategy(1, 576, 960, torch.bfloat16) == "fused"
    assert cuda_ops.resolve_strategy(16, 576, 960, torch.float16) == "fused"
    assert cuda_ops.resolve_strategy(17, 576, 960, torch.bfloat16) == or_es("two_stream")
    assert cuda_ops.resolve_strategy(16, 576, 3072, torch.bfloat16) == or_es("fused")
    assert cuda_ops.resolve_strategy(16, 2048, 3072, torch.bfloat16) == "fused"
    assert cuda_ops.resolve_strategy(16, 4096, 6144, torch.bfloat16) == or_es("fused")
    assert cuda_ops.resolve_strategy(16, 2048, 16384, torch.bfloat16) == or_es("fused")
    assert cuda_ops.resolve_strategy(17, 2048, 16384, torch.bfloat16) == or_es("two_stream")
    assert cuda_ops.resolve_strategy(16, 2048, 16392, torch.bfloat16) == or_es("two_stream")
    # The same two thresholds where a split edge off the 32-column grid keeps epilogue-scale out.
    assert cuda_ops.resolve_strategy(16, 2048, 16384, torch.bfloat16, [8184, 8200]) == "fused"
    assert cuda_ops.resolve_strategy(16, 2048, 16392, torch.float16, [16376, 16]) == "two_stream"
    assert cuda_ops.resolve_strategy(8, 4096, 28672, torch.bfloat16) == "fused"
    assert cuda_ops.resolve_strategy(9, 4096, 28672, torch.bfloat16) == "two_stream"
    assert cuda_ops.resolve_strategy(1, 576, 960, torch.float32) == "two_stream"
    assert cuda_ops.resolve_strategy(1, 576, 962, torch.bfloat16) == "two_stream"
    assert cuda_ops.resolve_strategy(255, 4096, 6144, torch.bfloat16) == or_es("two_stream")
    assert cuda_ops.resolve_strategy(256, 4096, 6144, torch.bfloat16) == "prenorm"
    # Prenorm runs one GEMM per run of equal-width splits: under AUTO (16-bit) M × the narrowest run's
    # columns must be >= 1.25·2^20 (k|v: 2048 columns here), unless all splits are one run.
    qkv = [4096, 1024, 1024]
    assert cuda_ops.resolve_strategy(639, 4096, 6144, torch.bfloat16, qkv) == "two_stream"
    assert cuda_ops.resolve_strategy(640, 4096, 6144, torch.float16, qkv) == "prenorm"
    assert cuda_ops.resolve_strategy(6827, 576, 960, torch.bfloat16, [192, 576, 192]) == "prenorm"
    assert cuda_ops.resolve_strategy(512, 576, 3072, torch.bfloat16, [1536, 1536]) == "prenorm"
    assert cuda_ops.resolve_strategy(63, 576, 3072, torch.bfloat16, [1536, 1536]) == or_es("two_stream")
    assert cuda_ops.resolve_strategy(63, 2048, 16384, torch.bfloat16, [8192, 8192]) == or_es("two_stream")
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
    """Built with the CUTLASS kernel, AUTO picks epilogue-scale (kAuto; each region measured faster
    than what AUTO picked before, kernels/NOTES.md): with K <= 1024 from 17 rows to 1024 below
    prenorm's region (which for one run of splits starts past M·N = 2^20 there; for several runs, to
    4096 rows ahead of prenorm's region, which then starts at 4097 at the earliest); with K >= 2048
    at exactly 64 rows where the splits form several runs or one run with K·N < 2^26, a large-weight
    prenorm region then starting at 65 rows; and from 9 rows wherever its tiles run in one wave at
    least 70 % full of the H200's 132 multiprocessors, except 64-row tiles summing the rows in the
    main loop on long K beyond one row block and 128-row tiles whose last row block is less than
    9/16 full (128×192 tiles: 80 % and 12/16; 128×96 tiles in clusters of two: 8/16 over two or
    three row blocks, any over four). Built without, fused, two_stream, or prenorm from 64 rows on a one-run W* of
    K·N >= 2^25. Either way AUTO reserves two_stream's workspace there: the call falls back to
    two_stream where the device or the pointers refuse the CUTLASS kernel."""
    import torch

    from flashnorm import cuda_ops

    monkeypatch.setenv("FLASHNORM_LIBRARY", str(built_library))
    monkeypatch.setattr(cuda_ops, "_library", None)
    es = "epilogue_scale" if epilogue_scale_built else None

    def check(k: int, splits: list[int], expected_by_rows) -> None:
        for m, expected in expected_by_rows:
            assert cuda_ops.resolve_strategy(m, k, sum(splits), torch.bfloat16, splits) == expected, (m, k, splits)

    qkv = [576, 192, 192]
    region = es or "two_stream"
    check(576, qkv, ((16, "fused"), (17, region), (63, region), (64, region), (1024, region), (1025, region)))
    # Several runs on short K: epilogue-scale to 4096 rows, prenorm's region after them; without the
    # kernel, two_stream up to prenorm's narrow-run threshold (M × 384 columns >= 1.25·2^20: 3414 rows).
    below_prenorm = es or "prenorm"
    check(576, qkv, ((3413, region), (3414, below_prenorm), (4096, below_prenorm), (4097, "prenorm")))
    check(576, [192, 576, 192], ((4096, region), (4097, "two_stream"), (6826, "two_stream"), (6827, "prenorm")))
    # One run on short K (SmolLM2-135M's gate|up): from 9 rows its 96 tiles of 64×32 fill one wave.
    gate_up = [1536, 1536]
    prenorm_from = 2**20 // 3072 + 1 if epilogue_scale_built else 256
    check(576, gate_up, ((8, "fused"), (9, es or "fused"), (16, es or "fused"), (17, region), (63, region),
                         (64, region), (prenorm_from - 1, region), (prenorm_from, "prenorm")))
    check(576, [960], ((255, region), (256, es or "prenorm"), (1024, es or "prenorm"), (1025, "prenorm")))
    assert cuda_ops.resolve_strategy(512, 576, 960, torch.float16, qkv) == region
    assert cuda_ops.resolve_strategy(512, 576, 960, torch.float32, qkv) == "two_stream"
    assert cuda_ops.resolve_strategy(512, 576, 3072, torch.bfloat16, [1536, 1536]) == "prenorm"
    assert cuda_ops.resolve_strategy(512, 576, 964, torch.bfloat16, [576, 192, 196]) == "two_stream"
    # Llama-3.1-8B's q|k|v: one wave of 96 tiles of 64×64 from 9 to 64 rows; 64×128 tiles with the
    # sums in the main loop over two row blocks from 65 (not taken); one wave of 128 128×96 tiles in
    # clusters of two from 129 rows, taken from 192 (a last row block of 64 rows); one wave of 96
    # 128×192 tiles from 257 (73 %: not taken) and of 128 from 385, taken from 480 (a last row block
    # of 96 rows); past one wave from 513.
    qkv_8b = [4096, 1024, 1024]
    check(4096, qkv_8b, ((8, "fused"), (9, es or "fused"), (16, es or "fused"), (17, region), (64, region),
                         (65, "two_stream"), (128, "two_stream"), (191, "two_stream"), (192, region), (256, region),
                         (257, "two_stream"), (384, "two_stream"), (479, "two_stream"), (480, region), (512, region),
                         (513, "two_stream"), (639, "two_stream"), (640, "prenorm")))
    # Llama-3.2-1B's q|k|v: 48 tiles of 64×64 up to 64 rows (exactly 64 taken), 96 from 65 to 128;
    # one wave of 96 128×64 tiles from 129 to 256 rows, taken from a last row block of 72 rows; of 96
    # and 128 128×96 tiles in clusters of two from 257 to 512, taken from a last row block of 64 rows
    # over three row blocks and from 385 over four;
    # of 120 128×128 tiles from 513 to 640, taken from 72 rows; and of 96, 112 and 128 128×192 tiles
    # from 641 to 1024 (the 96, 73 % of the multiprocessors, not taken), from a last row block of 96
    # rows.
    qkv_1b = [2048, 512, 512]
    check(2048, qkv_1b, ((16, "fused"), (17, "two_stream"), (63, "two_stream"), (64, region), (65, region),
                         (128, region), (129, "two_stream"), (199, "two_stream"), (200, region), (256, region),
                         (257, "two_stream"), (319, "two_stream"), (320, region), (384, region), (385, region),
                         (447, region), (512, region), (513, "two_stream"),
                         (583, "two_stream"), (584, region), (640, region), (641, "two_stream"), (768, "two_stream"),
                         (863, "two_stream"), (864, region), (896, region), (897, "two_stream"), (991, "two_stream"),
                         (992, region), (1024, region), (1025, "two_stream"), (1280, "prenorm")))
    # 38 columns of 128×96 tiles over three row blocks: 114 tiles, but clusters pair the row blocks
    # and run 152 blocks, more than one wave.
    check(2048, [2048, 1024, 512], ((320, "two_stream"), (384, "two_stream")))
    assert cuda_ops.resolve_strategy(64, 2040, 3072, torch.bfloat16, qkv_1b) == "two_stream"
    assert cuda_ops.resolve_strategy(64, 4096, 6144, torch.float32, qkv_8b) == "two_stream"
    assert cuda_ops.resolve_strategy(64, 4096, 28672, torch.bfloat16, [14336, 14336]) == "prenorm"
    # One run on long K, K·N from 2^25 below 2^26 (Llama-3.2-1B's gate|up): one wave of 128 tiles
    # of 64×128 from 9 to 64 rows, ahead of fused, two_stream and prenorm, which a build without the
    # kernel keeps from 64 rows there.
    gate_up_1b = [8192, 8192]
    check(2048, gate_up_1b, ((8, "fused"), (9, es or "fused"), (17, es or "two_stream"), (63, es or "two_stream"),
                             (64, es or "prenorm"), (65, "prenorm"), (128, "prenorm")))
    assert cuda_ops.resolve_strategy(64, 2048, 16384, torch.float32, gate_up_1b) == "two_stream"
    assert cuda_ops.resolve_strategy(64, 2040, 16384, torch.bfloat16, gate_up_1b) == region
    # One run below 2^25, K >= 2048: 64 rows, then two_stream up to prenorm's 256 rows (from 224 one
    # wave of 116 128×192 tiles, 88 %, a last row block of 96 rows); Llama-3.1-8B's q|k|v as one
    # output also in one wave of 64×64 tiles from 9 rows and of 128×96 clusters from 192.
    check(2048, [5504, 5504], ((17, "two_stream"), (64, region), (65, "two_stream"), (223, "two_stream"),
                               (224, region), (255, region), (256, "prenorm")))
    check(4096, [6144], ((9, es or "fused"), (64, region), (65, "two_stream"), (191, "two_stream"), (192, region),
                         (255, region), (256, "prenorm")))
    reserved = [(64, 576, qkv), (1000, 576, qkv), (1024, 576, qkv), (4096, 576, qkv), (64, 576, gate_up), (64, 4096, qkv_8b),
                (64, 2048, qkv_1b), (prenorm_from - 1, 576, gate_up)]
    if epilogue_scale_built:  # without the kernel these rows are fused's or prenorm's
        reserved += [(64, 2048, gate_up_1b), (1024, 576, [960]), (9, 576, gate_up), (16, 4096, qkv_8b),
                     (200, 2048, qkv_1b), (640, 2048, qkv_1b), (1024, 2048, qkv_1b), (512, 4096, qkv_8b)]
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
    sources = ["capi.cpp", "dispatch/dispatch.cpp", "runtime/context.cpp", "kernels/deferred_norm.cu",
               "kernels/normalize.cu", "kernels/fused.cu"]
    for source in sources:
        compiles = [c for c in commands if f"plugins/flashnorm/{source}" in c and " -c " in c]
        assert len(compiles) == 1, f"{source}: {len(compiles)} compile commands for targets {targets}"
    if include:
        assert any("libflashnorm_plugin.so" in c for c in commands), "the plugin's link step is missing"
