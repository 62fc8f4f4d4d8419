"""The epilogue-scale strategy (one CUTLASS sm90 GEMM scaling rows and storing splits in its
epilogue; the RMS reduction in the GEMM's main loop on its RowSums tiles, elsewhere a kernel
overlapped through programmatic dependent launch) against a float64 reference: M from 1 to 4096
(every tile configuration), K and N that are multiples of 8 but not of
the tiles, splits that cut through tiles (at multiples of 32 columns, its TMA stores' box), tiny row
norms, outputs poisoned with NaN; and the shapes and pointers it refuses, with the reason, where AUTO
runs another strategy."""

from __future__ import annotations

import pytest
import torch

from kernel_reference import TOLERANCE, cuda_ops_module, generator_from, magnitude_errors, random_inputs, reference, row_errors

DTYPES = [torch.float16, torch.bfloat16]
ROWS = [1, 2, 3, 7, 16, 64, 257, 1024, 4096]
# (K, splits): the SmolLM2 qkv site, one split, K and N not multiples of the 64/128 tiles, splits
# that start inside a tile, and last splits narrower than the 32-column store box (N a multiple of 8).
SHAPES = [
    (576, [576, 192, 192]),
    (96, [64]),
    (200, [32, 64, 96, 8]),
    (1000, [352, 648]),
    (264, [32, 32, 224, 8]),
    (128, [8704, 8704]),  # 136 tiles of 64x128 from one row block: ping-pong 64x128 tiles
    (1032, [8224, 976]),  # K past 1024: to 64 rows one wave of 64x128 tiles, the sums in the main loop; 128x128
    (1032, [8992, 8008]),  # 64x128 tiles beyond one wave too: ping-pong 64x64 tiles with the reduction kernel
    (2056, [1056, 512, 488]),  # one wave of 64x64 tiles with the reduction kernel, a K tail
    (4104, [1056, 1000]),  # K >= 4096 in one wave of 64-row tiles: 128-deep K steps, a K tail
]


def _require_epilogue_scale(cuda_ops) -> None:
    if not cuda_ops.strategy_available("epilogue_scale"):
        pytest.skip("epilogue_scale is not in this library build or not on this device (needs sm_90)")


def _assert_matches(got: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor, eps: float, splits, label: str) -> None:
    for output, wanted in zip(got, torch.split(reference(x, w, eps), splits, dim=-1)):
        worst = row_errors(output, wanted).max().item()
        assert worst <= TOLERANCE[x.dtype], f"{label}: worst row error {worst:.3g}"
    worst = magnitude_errors(torch.cat(got, dim=-1), x, w, eps).max().item()
    assert worst <= TOLERANCE[x.dtype], f"{label}: worst error vs exact math {worst:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_matches_float64_reference(m, dtype, rng):
    cuda_ops = cuda_ops_module()
    _require_epilogue_scale(cuda_ops)
    generator = generator_from(rng)
    for k, splits in SHAPES:
        eps = float(rng.choice([1e-6, 1e-5, 1e-2]))
        x, w = random_inputs(generator, m, k, sum(splits), dtype)
        outputs = [torch.full((m, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
        cuda_ops.flashnorm_matmul(x, w, eps, splits=splits, strategy="epilogue_scale", out=outputs)
        _assert_matches(outputs, x, w, eps, splits, f"m={m} k={k} splits={splits} {dtype} eps={eps}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("m", "k", "splits"),
    [
        (640, 2048, [8224, 4320, 4352]),  # 128x256 clusters: 5 row blocks, the last cluster half out of range
        (1000, 2048, [8224, 4320, 4352]),  # 8 row blocks, a partial last one
        (200, 2056, [4096, 1024, 1024]),  # one wave of 128 128x96 tiles in clusters of two, a partial last row block
        (560, 2056, [2048, 512, 512]),  # one wave of 120 128x128 tiles (91 %), a partial last row block
        (3900, 576, [576, 192, 192]),  # short K: one wave of 124 128x256 tiles, the last cluster half out of range
    ],
)
def test_cooperative_tiles_with_row_and_split_tails(m, k, splits, dtype, rng):
    """The 128-row cooperative tiles where the rows are not a multiple of them: 128x256 tiles in
    clusters of two along M (K = 2048, N = 16896, a split edge inside a tile at 8224, and one wave of
    them on short K), and one wave of 128x96 tiles in clusters of two or of 128x128 tiles filling at
    least 70 % on long K. The one-wave
    choices assume 132 multiprocessors (an H200's, H100 SXM's; dispatch::epilogue_scale_tiles);
    elsewhere other tiles run, still checked."""
    cuda_ops = cuda_ops_module()
    _require_epilogue_scale(cuda_ops)
    x, w = random_inputs(generator_from(rng), m, k, sum(splits), dtype)
    outputs = [torch.full((m, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
    cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy="epilogue_scale", out=outputs)
    _assert_matches(outputs, x, w, 1e-5, splits, f"m={m} k={k} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("m", "k", "splits"),
    [
        (73, 2056, [1056, 512, 488]),  # one wave of 64x64 tiles: 9 rows of the last block, 2 atoms of 8 rows
        (120, 4104, [1056, 1000]),  # 64x64x128 tiles: 56 rows, boxes of 1, 2 and 4 atoms, two per K step, a K tail
        (127, 4104, [1056, 1000]),  # 63 rows: the tile's own box (one row past x)
        (248, 2056, [4096, 1024, 1024]),  # one wave of 128x96 clusters: 120 rows, boxes of 1, 2, 4 and 8 atoms
        (600, 2048, [2048, 512, 512]),  # one wave of 128x128 tiles: 88 rows, boxes of 1, 2 and 8 atoms
        (200, 2048, [2048, 512, 512]),  # one wave of 128x64 tiles: 72 rows, boxes of 1 and 8 atoms
        (65, 1032, [8992, 8008]),  # ping-pong 64x64 tiles (more of them than multiprocessors): 1 row
        (1031, 2048, [8224, 4320, 4352]),  # 128x256 clusters: 7 rows, the cluster's second block wholly past x
    ],
)
def test_partial_last_row_block_loaded_by_atoms(m, k, splits, dtype, rng):
    """The last row block that x fills only in part, whose rows the main loop loads in boxes of 1, 2,
    4, ... swizzle atoms of 8 rows (the binary digits of its atom count; the tile's own box where it
    misses fewer than 8 rows): row counts that end inside an atom and on one, for each tile
    configuration that runs there, and a cluster whose second block lies wholly past x and still
    multicasts its half of W*'s tile. Rows past x hold what the stage held before; outputs past M
    are never written (the NaN poison of the padded buffer stays)."""
    cuda_ops = cuda_ops_module()
    _require_epilogue_scale(cuda_ops)
    x, w = random_inputs(generator_from(rng), m, k, sum(splits), dtype)
    padded = [torch.full((m + 64, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
    outputs = [buffer[:m] for buffer in padded]
    cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy="epilogue_scale", out=outputs)
    _assert_matches(outputs, x, w, 1e-5, splits, f"m={m} k={k} {dtype}")
    assert all(buffer[m:].isnan().all() for buffer in padded), "rows past M were written"


# (M, K, splits) for every forced tile configuration: a row tail inside a swizzle atom and one past
# a whole 128-row block, split edges inside 64-, 96-, 128-, 192- and 256-column tiles, last splits
# narrower than the store box, and K tails on short and long K.
FORCED_TILE_SHAPES = [
    (3, 576, [576, 192, 192]),
    (77, 200, [32, 64, 96, 8]),
    (300, 1000, [352, 648]),
    (133, 2056, [1056, 512, 488]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_forced_tile_configuration_matches_reference(dtype, rng):
    """Each tile configuration, forced (cuda_ops.set_epilogue_scale_tiles), computes every shape:
    the dispatch may pick any of them for any problem the strategy takes, and tuning runs time
    them all. Rows past M stay unwritten (NaN poison of padded buffers)."""
    cuda_ops = cuda_ops_module()
    _require_epilogue_scale(cuda_ops)
    generator = generator_from(rng)
    try:
        for name in cuda_ops.epilogue_scale_tile_names():
            cuda_ops.set_epilogue_scale_tiles(name)
            for m, k, splits in FORCED_TILE_SHAPES:
                x, w = random_inputs(generator, m, k, sum(splits), dtype)
                padded = [torch.full((m + 8, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
                outputs = [buffer[:m] for buffer in padded]
                cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy="epilogue_scale", out=outputs)
                _assert_matches(outputs, x, w, 1e-5, splits, f"{name} m={m} k={k} splits={splits} {dtype}")
                assert all(buffer[m:].isnan().all() for buffer in padded), f"{name}: rows past M were written"
    finally:
        cuda_ops.set_epilogue_scale_tiles(None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [64, 300])
def test_outputs_at_odd_addresses_are_refused_and_auto_writes_nothing_around_them(m, dtype, rng):
    """Outputs 1, 4 and 7 elements into one NaN buffer, rows AUTO gives epilogue-scale: TMA cannot
    store to them, so epilogue_scale refuses with the reason and AUTO runs two_stream, correct and
    writing nothing between the outputs."""
    from flashnorm.errors import FlashNormError

    cuda_ops = cuda_ops_module()
    _require_epilogue_scale(cuda_ops)
    generator = generator_from(rng)
    k, splits = 256, [64, 64, 32]
    assert cuda_ops.resolve_strategy(m, k, sum(splits), dtype, splits) == "epilogue_scale"
    x, w = random_inputs(generator, m, k, sum(splits), dtype)
    storage = torch.full((m * sum(splits) + 32,), float("nan"), dtype=dtype, device="cuda")
    outputs, starts, start = [], [], 1
    for size in splits:
        starts.append(start)
        outputs.append(storage[start : start + m * size].view(m, size))
        start += m * size + 3
    with pytest.raises(FlashNormError, match="16-byte aligned x, W\\* and outputs"):
        cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy="epilogue_scale", out=outputs)
    assert storage.isnan().all(), f"m={m} {dtype}: the refused call wrote"
    cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy="auto", out=outputs)
    _assert_matches(outputs, x, w, 1e-5, splits, f"m={m} {dtype}")
    written = torch.zeros(storage.numel(), dtype=torch.bool, device="cuda")
    for begin, size in zip(starts, splits):
        written[begin : begin + m * size] = True
    assert storage[~written].isnan().all(), f"m={m} {dtype}: wrote outside the outputs"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_auto_region_and_its_fallback_on_unaligned_x(dtype, rng):
    """Where AUTO picks epilogue-scale (one case per rule of its region, rows of
    tests/plugins/golden/auto_dispatch.csv at 132 multiprocessors; the rules: dispatch/dispatch.cpp),
    and where x is not 16-byte aligned it runs two_stream in the workspace AUTO sized, not an error.
    On a GPU of another multiprocessor count the cases AUTO gives another strategy there are skipped."""
    cuda_ops = cuda_ops_module()
    _require_epilogue_scale(cuda_ops)
    generator = generator_from(rng)
    measured = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count == 132
    cases = (
        (512, 576, [576, 192, 192]), (64, 576, [1536, 1536]), (64, 4096, [4096, 1024, 1024]), (64, 2048, [8192, 8192]),
        (64, 2048, [2048, 512, 512]), (300, 576, [1536, 1536]), (3000, 576, [576, 192, 192]),
        (24, 576, [576, 192, 192]), (9, 576, [1536, 1536]), (16, 4096, [4096, 1024, 1024]),
        (200, 2048, [2048, 512, 512]), (250, 4096, [4096, 1024, 1024]), (1000, 2048, [2048, 512, 512]),
        (500, 4096, [4096, 1024, 1024]), (320, 2048, [2048, 512, 512]), (386, 2048, [2048, 512, 512]),
    )
    for m, k, splits in cases:
        picked = cuda_ops.resolve_strategy(m, k, sum(splits), dtype, splits)
        assert picked == "epilogue_scale" or not measured, (m, k, splits, picked)
        if picked != "epilogue_scale":
            continue
        x, w = random_inputs(generator, m, k, sum(splits), dtype)
        shifted = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(m, k)  # 2 bytes past a 16-byte boundary
        for label, operand in (("aligned", x), ("unaligned", shifted)):
            assert (operand.data_ptr() % 16 == 0) == (label == "aligned")
            outputs = [torch.full((m, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
            cuda_ops.flashnorm_matmul(operand, w, 1e-5, splits=splits, strategy="auto", out=outputs)
            _assert_matches(outputs, operand, w, 1e-5, splits, f"m={m} k={k} {label} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "k", "splits", "reason"),
    [
        (torch.float32, 256, [64], "fp16/bf16 only"),
        (torch.bfloat16, 100, [64], "multiples of 8"),
        (torch.bfloat16, 256, [37], "multiples of 8"),
        (torch.bfloat16, 256, [40, 24], "multiple of 32 columns"),
    ],
    ids=["fp32", "k-tail", "n-tail", "split-edge"],
)
def test_refuses_what_it_cannot_run_and_auto_does_not_pick_it(dtype, k, splits, reason, rng):
    from flashnorm.errors import FlashNormError

    cuda_ops = cuda_ops_module()
    _require_epilogue_scale(cuda_ops)
    generator = generator_from(rng)
    m = 64
    x, w = random_inputs(generator, m, k, sum(splits), dtype)
    with pytest.raises(FlashNormError, match=reason):
        cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy="epilogue_scale")
    assert cuda_ops.resolve_strategy(m, k, sum(splits), dtype, splits) != "epilogue_scale"
    outputs = cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy="auto")
    expected = torch.split(reference(x, w, 1e-5), splits, dim=-1)
    for got, wanted in zip(outputs, expected):
        assert row_errors(got, wanted).max().item() <= TOLERANCE[dtype]
