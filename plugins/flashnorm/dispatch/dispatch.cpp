// AUTO's policy and the epilogue-scale GEMM's tile rules: the two tables a maintainer edits (kAuto,
// kTiles), each boundary written once, and the functions that read them. Each boundary was measured
// on an NVIDIA H200 with bf16, W* from HBM and CUDA-graph replay; what was measured, where and when is
// in kernels/DESIGN.md and, as measured, docs/history/2026-12-04-kernel-notes.md ("AUTO's table").
// The effect of an edit over a grid of shapes: `python plugins/flashnorm/dispatch/write_golden.py`, then `git diff tests/plugins/golden/`.
//
// C++20 (designated initializers) and no CUDA header: CMake builds this file alone in that standard.
#include "dispatch/dispatch.h"

#include <algorithm>

namespace flashnorm::dispatch
{
namespace
{

// ---- The epilogue-scale GEMM's tile rules (epilogue_scale_tiles) ----

struct TileRules
{
    // Short K, to row_sums_max_k: 64-row tiles whose main loop sums the rows, to row_sums_max_rows
    // rows (AUTO's short-K region is this K too).
    int64_t row_sums_max_k;
    int64_t row_sums_max_rows;
    // 64-row tiles with the reduction kernel in front up to these rows ...
    int64_t small_tile_max_rows;
    // ... in 128-deep K steps from this K.
    int64_t deep_k_min_k;
    // 128×256 tiles in clusters of two from this K in waves at least wide_tile_fill_percent % full
    // (on shorter K in one wave only).
    int64_t wide_tile_min_k;
    int64_t wide_tile_fill_percent;
    // On long K, one wave of 128-row tiles that fills at least this share of the multiprocessors.
    int64_t long_k_one_wave_fill_percent;
};

// Measured on the H200 (kernels/DESIGN.md):
// - Short K, to 1024 rows: one wave of the narrowest of 64×32, 64×64 and 64×128 tiles that number
//   at most the multiprocessors (the non-persistent kernel, one tile per block, no tile
//   scheduler), else ping-pong 64×128 tiles. 2026-12-03 ("Short K beyond 256 rows, long K back to
//   the reduction kernel"): SmolLM2-135M q|k|v at M = 256 5.55 µs on 120 tiles of 64×32 against
//   5.88 on 60 of 64×64, at 512 6.1 against 7.9 on 128-row tiles; gate|up at 256 7.4 on 64×128
//   tiles against 8.8 on ping-pong 64×64 ones, at 1024 14.1 against 17.7 on 128×128.
// - Longer K to 256 rows: 64-row tiles with the reduction kernel, where the sums' loads and
//   squares in each K step cost more than they save (Llama-3.1-8B q|k|v at M = 128 26.5 µs against
//   32.2, gate|up at 64 65.2 against 70.3): one wave of 64×64 tiles (128-deep K steps on K ≥ 4096),
//   else one wave of 64×128 tiles with the sums in the main loop (twice the wgmma work per K step
//   hides them: 2026-12-03, Llama-3.2-1B gate|up at M = 64 22.0 µs against 23.3 on ping-pong 64×64
//   tiles, q|k|v at 256 13.3 against 16.1, Llama-3.1-8B q|k|v at 128 23.0 against 26.2), else
//   ping-pong 64×64 tiles.
// - Otherwise 128-row cooperative tiles: 128×128, or 128×64 where 128×128 ones would leave
//   multiprocessors idle; 128×256 clusters where wide_tiles_fit. Ping-pong 64×128 / 64×256 tiles
//   measured slower there, on long K or at 4096 rows.
// - On long K, one wave of 128×96 tiles in clusters of two along M (each pair shares its W* tile
//   through TMA multicast) at least 70 % full, counting a pair's blocks for an odd last row block:
//   2026-12-04 (benchmarks/epilogue_scale_tiles.py; the tile and cluster shape cuBLAS runs there),
//   Llama-3.2-1B q|k|v at 384 rows 14.1 µs on 96 tiles against 15.6 on 72 of 128×128, at 448 and
//   512 rows 14.2 and 14.6 on 128 tiles against 16.2 and 16.5 on 96 of 128×128 (16.1 and 16.7 on
//   128×96 tiles without clusters); Llama-3.1-8B q|k|v at 192 and 256 rows 23.6 and 25.4 against
//   26.2 and 26.1 on 96 of 128×128 (28.3 and 29.4 without clusters).
// - Else on long K, one wave of 128×128 tiles at least 70 % full ahead of the 64-row tiles, and then
//   one of 128×64 tiles: 2026-12-03, Llama-3.1-8B q|k|v at 256 rows 25.9 µs on 96 tiles against 45 on
//   ping-pong 64×64 ones, at 160 rows 25.8 (a partial last row block: PartialRowBlockMainloop)
//   against 46.7; Llama-3.2-1B q|k|v at 512 rows 17.0 against 20.0 on 128×64 tiles, at 256 rows
//   11.5 on 96 tiles of 128×64 against 12.1 on 64×128 tiles with the sums in the main loop.
// - On long K where 128×128 tiles do not fill one wave that way, 128×192 tiles wherever their waves
//   are at least as full: 2026-12-04 (benchmarks/epilogue_scale_tiles.py), Llama-3.2-1B q|k|v at
//   1024 rows 22.9 µs on 128 tiles against 29.0 on two waves of 128×128 ones (the second 45 % full),
//   at 768 21.8 against 28.6, at 2048 41.0 against 45.1; Llama-3.1-8B q|k|v at 1024 74.2 against
//   93.2. Not on short K: SmolLM2-135M gate|up at 1024 rows 12.6 against 12.3 on ping-pong 64×128
//   tiles that sum the rows in the main loop.
// - 128×256 tiles (wide_tiles_fit) pay off where each tile's main loop is long and the last wave is
//   not mostly idle: on the H200 (2026-12-01 23:55 UTC, Nsight Compute) Llama-3.1-8B gate/up at
//   M = 256, 1024, 4096 took 108.5 / 334.7 / 1312.9 µs against 115.5 / 413.1 / 1583.6 with 128×128
//   tiles, while Llama-3.1-8B qkv at M = 1024 (192 wide tiles: the second wave 45 % full) took 105.2
//   against 91.8 and SmolLM2 gate/up at M = 4096 (K = 576, three waves) 46.2 against 44.4. On short K
//   in one wave they do pay off (2026-12-03 12:56 UTC): SmolLM2 q|k|v at M = 4096, 128 tiles, 15.0 µs
//   against 16.6 on 128×128 tiles.
constexpr TileRules kTiles{
    .row_sums_max_k = 1024,
    .row_sums_max_rows = 1024,
    .small_tile_max_rows = 256,
    .deep_k_min_k = 4096,
    .wide_tile_min_k = 2048,
    .wide_tile_fill_percent = 80,
    .long_k_one_wave_fill_percent = 70,
};

// ---- AUTO's boundaries (choose) ----

struct AutoBoundaries
{
    // fused: at most this many rows (two 8-token B operands) ...
    int64_t fused_max_rows;
    // ... always up to this many rows (one B operand) ...
    int64_t fused_max_rows_one_group;
    // ... and beyond it only while K·N is at most this (fused's re-read of W* per 8 rows).
    int64_t fused_max_weight_two_groups;
    // prenorm, where all splits form one run: from this many rows (further up where the
    // epilogue-scale GEMM's output fits epilogue_scale_one_wave_elements, below) ...
    int64_t prenorm_min_rows;
    // ... or from this many where K·N is at least prenorm_large_weight;
    int64_t prenorm_min_rows_large_weight;
    int64_t prenorm_large_weight;
    // with a narrower run: also M × (narrowest run width) at least this;
    int64_t prenorm_min_narrow_run_elements;
    // fp32 (CUDA-core GEMMs): from this many rows, whatever the splits.
    int64_t prenorm_min_rows_f32;
    // epilogue-scale (builds with the CUTLASS kernel), on short K (kTiles.row_sums_max_k): from
    // epilogue_scale_min_rows to epilogue_scale_max_rows rows (below prenorm's region, which for one
    // run of splits starts only past M·N = epilogue_scale_one_wave_elements, about one wave of its
    // 64×128 tiles; elsewhere it measured slower than what AUTO picks) ...
    int64_t epilogue_scale_min_rows;
    int64_t epilogue_scale_max_rows;
    // ... to epilogue_scale_split_runs_max_rows where the splits form several runs (ahead of
    // two_stream and of prenorm, whose region then starts after these rows) ...
    int64_t epilogue_scale_split_runs_max_rows;
    int64_t epilogue_scale_one_wave_elements;
    // ... where K is at least epilogue_scale_long_k: at exactly epilogue_scale_long_k_rows rows
    // where the splits form several runs, or one run with K·N below
    // epilogue_scale_one_run_max_weight (a large-weight prenorm region then starts after it) ...
    int64_t epilogue_scale_long_k_rows;
    int64_t epilogue_scale_long_k;
    int64_t epilogue_scale_one_run_max_weight;
    // ... and for any K from epilogue_scale_one_wave_min_rows rows wherever its tiles (as
    // epilogue_scale_tiles picks them on the device's multiprocessors) run in one wave that
    // one_wave_rule takes: at least epilogue_scale_one_wave_fill_percent % full, except 64-row tiles
    // that sum the rows in the main loop on long K beyond one row block, and 128-row tiles whose last
    // row block is less than epilogue_scale_last_block_sixteenths / 16 full (there two_stream's
    // cuBLAS tiles measured faster); 128×192 tiles at least epilogue_scale_192_column_fill_percent %
    // full with a last row block at least epilogue_scale_192_column_last_block_sixteenths / 16 full;
    // 128×96 tiles in clusters of two with a last row block at least
    // epilogue_scale_96_column_last_block_sixteenths / 16 full, or any last row block from
    // epilogue_scale_96_column_row_blocks row blocks.
    int64_t epilogue_scale_one_wave_min_rows;
    int64_t epilogue_scale_one_wave_fill_percent;
    int64_t epilogue_scale_last_block_sixteenths;
    int64_t epilogue_scale_192_column_fill_percent;
    int64_t epilogue_scale_192_column_last_block_sixteenths;
    int64_t epilogue_scale_96_column_last_block_sixteenths;
    int64_t epilogue_scale_96_column_row_blocks;
    // The multiprocessors of the H200, where these boundaries were measured (the one-wave rule
    // counts the device's): measured_multiprocessors().
    int measured_multiprocessors;
};

constexpr AutoBoundaries kAuto{
    .fused_max_rows = 16,
    .fused_max_rows_one_group = 8,
    .fused_max_weight_two_groups = int64_t(1) << 25,
    .prenorm_min_rows = 256,
    .prenorm_min_rows_large_weight = 64,
    .prenorm_large_weight = int64_t(1) << 25,
    .prenorm_min_narrow_run_elements = int64_t(5) << 18,
    .prenorm_min_rows_f32 = 1024,
    .epilogue_scale_min_rows = 17,
    .epilogue_scale_max_rows = 1024,
    .epilogue_scale_split_runs_max_rows = 4096,
    .epilogue_scale_one_wave_elements = int64_t(1) << 20,
    .epilogue_scale_long_k_rows = 64,
    .epilogue_scale_long_k = 2048,
    .epilogue_scale_one_run_max_weight = int64_t(1) << 26,
    .epilogue_scale_one_wave_min_rows = 9,
    .epilogue_scale_one_wave_fill_percent = 70,
    .epilogue_scale_last_block_sixteenths = 9,
    .epilogue_scale_192_column_fill_percent = 80,
    .epilogue_scale_192_column_last_block_sixteenths = 12,
    .epilogue_scale_96_column_last_block_sixteenths = 8,
    .epilogue_scale_96_column_row_blocks = 4,
    .measured_multiprocessors = 132,
};

// ---- Tiles ----

// Whether `tiles` run in one wave that keeps at least kTiles.long_k_one_wave_fill_percent % of the
// multiprocessors busy.
bool fills_one_wave(int64_t tiles, int multiprocessors)
{
    return tiles <= multiprocessors && 100 * tiles >= kTiles.long_k_one_wave_fill_percent * multiprocessors;
}

// Whether `tiles` leave the multiprocessors of their waves at least as busy as `other_tiles` do
// theirs (tiles / (waves · multiprocessors), compared without division).
bool fills_waves_as_well(int64_t tiles, int64_t other_tiles, int multiprocessors)
{
    int64_t const waves = (tiles + multiprocessors - 1) / multiprocessors;
    int64_t const other_waves = (other_tiles + multiprocessors - 1) / multiprocessors;
    return tiles * other_waves >= other_tiles * waves;
}

constexpr EpilogueScaleTileShape kWide = epilogue_scale_tile_shape(EpilogueScaleTiles::kClusters128x256);
constexpr EpilogueScaleTileShape kLarge = epilogue_scale_tile_shape(EpilogueScaleTiles::k128x128);
constexpr EpilogueScaleTileShape kTallWide = epilogue_scale_tile_shape(EpilogueScaleTiles::k128x192);
constexpr EpilogueScaleTileShape kNarrow = epilogue_scale_tile_shape(EpilogueScaleTiles::k128x64);
constexpr EpilogueScaleTileShape kPaired = epilogue_scale_tile_shape(EpilogueScaleTiles::kOneWaveClusters128x96);
constexpr EpilogueScaleTileShape kRowSums32 = epilogue_scale_tile_shape(EpilogueScaleTiles::kRowSums64x32);
constexpr EpilogueScaleTileShape kRowSums64 = epilogue_scale_tile_shape(EpilogueScaleTiles::kRowSums64x64);
constexpr EpilogueScaleTileShape kRowSums128 = epilogue_scale_tile_shape(EpilogueScaleTiles::kRowSums64x128);
constexpr EpilogueScaleTileShape kSmall = epilogue_scale_tile_shape(EpilogueScaleTiles::kOneWave64x64);
// The 128-row tiles run where x has more rows than one of them.
constexpr int64_t kTallRows = kLarge.rows;
static_assert(kWide.rows == kTallRows && kTallWide.rows == kTallRows && kNarrow.rows == kTallRows
        && kPaired.rows == kTallRows,
    "the cooperative tiles are all 128 rows tall");

// 128×256 tiles in clusters of two: in waves at least kTiles.wide_tile_fill_percent % full, on long
// K (kTiles.wide_tile_min_k) at least one wave of them, on shorter K exactly one.
bool wide_tiles_fit(int64_t m, int64_t k, int64_t n, int multiprocessors)
{
    int64_t const tiles = tile_count(m, n, kWide.rows, kWide.columns);
    int64_t const waves = (tiles + multiprocessors - 1) / multiprocessors;
    if (m <= kTallRows || 100 * tiles < kTiles.wide_tile_fill_percent * waves * multiprocessors)
        return false;
    return k >= kTiles.wide_tile_min_k ? tiles >= multiprocessors : waves == 1;
}

// ---- AUTO ----

bool short_k(int64_t k)
{
    return k <= kTiles.row_sums_max_k;
}

// Whether epilogue-scale can run this problem's dtype and shape in this build (the device and
// the pointers are known only at the call).
bool epilogue_scale_fits(Problem const& problem, bool built)
{
    return built
        && epilogue_scale_shape_fits(problem.dtype, problem.k, problem.n, problem.split_count, problem.split_sizes);
}

// Whether AUTO's short-K epilogue-scale rows apply to this K and dtype (any splits, any M).
bool epilogue_scale_short_k(Problem const& problem, bool built)
{
    return epilogue_scale_fits(problem, built) && short_k(problem.k);
}

// Whether AUTO's one-run long-K epilogue-scale rows apply to this K, N and dtype (all splits one
// run; any M).
bool epilogue_scale_one_run_long_k(Problem const& problem, bool built)
{
    return epilogue_scale_fits(problem, built) && problem.k >= kAuto.epilogue_scale_long_k
        && problem.k * problem.n < kAuto.epilogue_scale_one_run_max_weight;
}

// Where all splits form one run of a smaller W*: prenorm from prenorm_min_rows, or on short K
// first past the rows whose epilogue-scale output fits about one wave of its tiles (at most to
// the end of the epilogue-scale region).
int64_t one_run_prenorm_min_rows(Problem const& problem, bool built)
{
    if (!epilogue_scale_short_k(problem, built))
        return kAuto.prenorm_min_rows;
    int64_t const past_one_wave = kAuto.epilogue_scale_one_wave_elements / problem.n + 1;
    return std::clamp(past_one_wave, kAuto.prenorm_min_rows, kAuto.epilogue_scale_max_rows + 1);
}

// The fewest rows from which AUTO picks prenorm for this problem's K, splits and dtype. AUTO's
// prenorm region is every M at or above it (the workspace size relies on that).
int64_t prenorm_min_rows(Problem const& problem, bool built)
{
    if (problem.dtype == DType::kF32)
        return kAuto.prenorm_min_rows_f32;
    SplitRun runs[kMaxOutputs];
    int const run_count = split_runs(problem.split_count, problem.split_sizes, runs);
    if (run_count == 1 && problem.k * problem.n >= kAuto.prenorm_large_weight)
        return epilogue_scale_one_run_long_k(problem, built) ? kAuto.epilogue_scale_long_k_rows + 1
                                                             : kAuto.prenorm_min_rows_large_weight;
    if (run_count == 1)
        return one_run_prenorm_min_rows(problem, built);
    int64_t narrowest = problem.n;
    for (int r = 0; r < run_count; ++r)
        narrowest = std::min(narrowest, runs[r].columns());
    int64_t const rows = (kAuto.prenorm_min_narrow_run_elements + narrowest - 1) / narrowest;
    if (epilogue_scale_short_k(problem, built))
        return std::max(rows, kAuto.epilogue_scale_split_runs_max_rows + 1);
    return std::max(rows, kAuto.prenorm_min_rows);
}

// AUTO's one-wave rule for a tile configuration: how full the wave must be, how full its last
// row block (sixteenths of a 128-row tile), and from how many row blocks any last block will do
// (0: never).
struct OneWaveRule
{
    int64_t fill_percent;
    int64_t last_block_sixteenths;
    int64_t any_last_block_row_blocks;
};

// 128×192 tiles by their own two entries (their one wave at 73 % and a last row block of 72 rows
// measured slower than two_stream on K = 4096), 128×96 clusters by theirs (over two or three row
// blocks a last one of 64 rows measured faster than two_stream, of 1 to 48 rows slower; over four,
// any), every other configuration by the common two.
OneWaveRule one_wave_rule(EpilogueScaleTiles configuration)
{
    switch (configuration)
    {
    case EpilogueScaleTiles::kOneWave128x192:
        return {kAuto.epilogue_scale_192_column_fill_percent, kAuto.epilogue_scale_192_column_last_block_sixteenths, 0};
    case EpilogueScaleTiles::kOneWaveClusters128x96:
        return {kAuto.epilogue_scale_one_wave_fill_percent, kAuto.epilogue_scale_96_column_last_block_sixteenths,
            kAuto.epilogue_scale_96_column_row_blocks};
    default: return {kAuto.epilogue_scale_one_wave_fill_percent, kAuto.epilogue_scale_last_block_sixteenths, 0};
    }
}

// Whether the epilogue-scale GEMM's tiles for this problem run in one wave that AUTO takes
// (one_wave_rule): full enough, 64-row tiles summing the rows in the main loop on long K in one row
// block only, 128-row tiles with a full enough last row block.
bool epilogue_scale_one_wave_taken(Problem const& problem, int multiprocessors)
{
    EpilogueScaleTiles const configuration = epilogue_scale_tiles(problem.m, problem.k, problem.n, multiprocessors);
    EpilogueScaleTileShape const tile = epilogue_scale_tile_shape(configuration);
    OneWaveRule const rule = one_wave_rule(configuration);
    int64_t const tiles = tile_count(problem.m, problem.n, tile.rows, tile.columns);
    if (!tile.one_wave || 100 * tiles < rule.fill_percent * multiprocessors)
        return false;
    if (tile.row_sums && !short_k(problem.k))
        return problem.m <= tile.rows;
    int64_t const row_blocks = (problem.m + tile.rows - 1) / tile.rows;
    if (rule.any_last_block_row_blocks > 0 && row_blocks >= rule.any_last_block_row_blocks)
        return true;
    int64_t const last_block_rows = (problem.m - 1) % tile.rows + 1;
    return tile.rows < kTallRows || 16 * last_block_rows >= rule.last_block_sixteenths * tile.rows;
}

// AUTO's epilogue-scale region on a device of `multiprocessors` multiprocessors.
bool picks_epilogue_scale(Problem const& problem, int multiprocessors, bool built)
{
    if (!epilogue_scale_fits(problem, built))
        return false;
    SplitRun runs[kMaxOutputs];
    bool const several_runs = split_runs(problem.split_count, problem.split_sizes, runs) > 1;
    if (epilogue_scale_short_k(problem, built) && problem.m >= kAuto.epilogue_scale_min_rows
        && problem.m <= (several_runs ? kAuto.epilogue_scale_split_runs_max_rows : kAuto.epilogue_scale_max_rows))
        return true;
    if (problem.m == kAuto.epilogue_scale_long_k_rows
        && (several_runs ? problem.k >= kAuto.epilogue_scale_long_k : epilogue_scale_one_run_long_k(problem, built)))
        return true;
    return problem.m >= kAuto.epilogue_scale_one_wave_min_rows
        && epilogue_scale_one_wave_taken(problem, multiprocessors);
}

Strategy resolve(Problem const& problem, int multiprocessors, bool built)
{
    if (problem.m >= prenorm_min_rows(problem, built))
        return Strategy::kPrenorm;
    if (picks_epilogue_scale(problem, multiprocessors, built))
        return Strategy::kEpilogueScale;
    bool const tensor_cores = problem.dtype != DType::kF32 && fused_tensor_core_shape(problem.k, problem.n);
    int64_t const weight = problem.k * problem.n;
    bool const fused_wins = problem.m <= kAuto.fused_max_rows_one_group
        || (problem.m <= kAuto.fused_max_rows && weight <= kAuto.fused_max_weight_two_groups);
    return tensor_cores && fused_wins ? Strategy::kFused : Strategy::kTwoStream;
}

size_t round_up(size_t bytes)
{
    return (bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
}

} // namespace

Choice choose(Problem const& problem, int multiprocessors, bool epilogue_scale_built)
{
    Strategy const strategy = resolve(problem, multiprocessors, epilogue_scale_built);
    size_t bytes = workspace_bytes(problem, strategy, true);
    int64_t const threshold = prenorm_min_rows(problem, epilogue_scale_built);
    if (problem.m >= threshold)
    {
        // AUTO picks another strategy for fewer rows; the size covers every smaller M. Each
        // strategy's own size grows with M, so its largest M below the threshold is the one to cover.
        Problem below = problem;
        below.m = threshold - 1;
        bytes = std::max(bytes, workspace_bytes(below, resolve(below, multiprocessors, epilogue_scale_built), true));
    }
    return {strategy, bytes};
}

size_t workspace_bytes(Problem const& problem, Strategy strategy, bool under_auto)
{
    switch (strategy)
    {
    case Strategy::kFused: return 0;
    case Strategy::kEpilogueScale:
        // Under AUTO the call may fall back to two_stream (choose): room for both.
        return under_auto ? std::max(epilogue_scale_workspace_bytes(problem.m),
                                two_stream_layout(problem.m, problem.n, problem.dtype).total)
                          : epilogue_scale_workspace_bytes(problem.m);
    case Strategy::kPrenorm:
    {
        SplitRun runs[kMaxOutputs];
        return prenorm_layout(problem.m, problem.k, problem.n, problem.dtype,
            split_runs(problem.split_count, problem.split_sizes, runs))
            .total;
    }
    case Strategy::kTwoStream: break;
    }
    return two_stream_layout(problem.m, problem.n, problem.dtype).total;
}

int measured_multiprocessors()
{
    return kAuto.measured_multiprocessors;
}

int split_runs(int32_t split_count, int64_t const* split_sizes, SplitRun (&runs)[kMaxOutputs])
{
    int count = 0;
    for (int i = 0; i < split_count;)
    {
        int j = i + 1;
        while (j < split_count && split_sizes[j] == split_sizes[i])
            ++j;
        runs[count++] = SplitRun{i, j - i, split_sizes[i]};
        i = j;
    }
    return count;
}

TwoStreamLayout two_stream_layout(int64_t m, int64_t n, DType dtype)
{
    TwoStreamLayout layout{};
    layout.product_offset = round_up(sizeof(float) * static_cast<size_t>(m));
    layout.gemm_workspace_offset
        = layout.product_offset + round_up(element_bytes(product_dtype(dtype)) * static_cast<size_t>(m * n));
    layout.total = layout.gemm_workspace_offset + kGemmWorkspaceBytes;
    return layout;
}

PrenormLayout prenorm_layout(int64_t m, int64_t k, int64_t n, DType dtype, int runs)
{
    PrenormLayout layout{};
    layout.pointer_table_offset = round_up(element_bytes(dtype) * static_cast<size_t>(m * k));
    layout.bias_offset = layout.pointer_table_offset + round_up(kPointerTableBytes);
    layout.gemm_workspace_offset = layout.bias_offset + round_up(element_bytes(dtype) * static_cast<size_t>(n));
    layout.side_gemm_workspace_offset = layout.gemm_workspace_offset + kGemmWorkspaceBytes;
    layout.total = layout.side_gemm_workspace_offset + (runs > 1 ? kGemmWorkspaceBytes : 0);
    return layout;
}

size_t epilogue_scale_workspace_bytes(int64_t m)
{
    return round_up(sizeof(float) * static_cast<size_t>(m));
}

bool epilogue_scale_shape_fits(DType dtype, int64_t k, int64_t n, int32_t split_count, int64_t const* split_sizes)
{
    int64_t begin = 0;
    for (int32_t split = 0; split + 1 < split_count; ++split)
    {
        begin += split_sizes[split];
        if (begin % kEpilogueScaleSubtileColumns != 0)
            return false;
    }
    return dtype != DType::kF32 && k % 8 == 0 && n % 8 == 0;
}

EpilogueScaleTiles epilogue_scale_tiles(int64_t m, int64_t k, int64_t n, int multiprocessors)
{
    if (short_k(k) && m <= kTiles.row_sums_max_rows)
    {
        if (tile_count(m, n, kRowSums32.rows, kRowSums32.columns) <= multiprocessors)
            return EpilogueScaleTiles::kRowSums64x32;
        if (tile_count(m, n, kRowSums64.rows, kRowSums64.columns) <= multiprocessors)
            return EpilogueScaleTiles::kRowSums64x64;
        if (tile_count(m, n, kRowSums128.rows, kRowSums128.columns) <= multiprocessors)
            return EpilogueScaleTiles::kRowSums64x128;
        return EpilogueScaleTiles::kRowSumsPingPong64x128;
    }
    if (wide_tiles_fit(m, k, n, multiprocessors))
        return EpilogueScaleTiles::kClusters128x256;
    if (m > kTallRows)
    {
        bool const long_k = !short_k(k);
        // Blocks run in pairs of row blocks, so an odd last row block still takes a pair's blocks.
        int64_t const paired_blocks = 2 * tile_count(m, n, 2 * kPaired.rows, kPaired.columns);
        if (long_k && paired_blocks <= multiprocessors
            && fills_one_wave(tile_count(m, n, kPaired.rows, kPaired.columns), multiprocessors))
            return EpilogueScaleTiles::kOneWaveClusters128x96;
        int64_t const large_tiles = tile_count(m, n, kLarge.rows, kLarge.columns);
        if (long_k && fills_one_wave(large_tiles, multiprocessors))
            return EpilogueScaleTiles::kOneWave128x128;
        int64_t const tall_wide_tiles = tile_count(m, n, kTallWide.rows, kTallWide.columns);
        if (long_k && fills_waves_as_well(tall_wide_tiles, large_tiles, multiprocessors))
            return tall_wide_tiles <= multiprocessors ? EpilogueScaleTiles::kOneWave128x192
                                                      : EpilogueScaleTiles::k128x192;
        if (large_tiles >= multiprocessors)
            return EpilogueScaleTiles::k128x128;
        if (long_k && fills_one_wave(tile_count(m, n, kNarrow.rows, kNarrow.columns), multiprocessors))
            return EpilogueScaleTiles::kOneWave128x64;
    }
    if (m <= kTiles.small_tile_max_rows)
    {
        if (tile_count(m, n, kSmall.rows, kSmall.columns) <= multiprocessors)
            return k >= kTiles.deep_k_min_k ? EpilogueScaleTiles::kOneWave64x64DeepK
                                            : EpilogueScaleTiles::kOneWave64x64;
        return tile_count(m, n, kRowSums128.rows, kRowSums128.columns) <= multiprocessors
            ? EpilogueScaleTiles::kRowSums64x128
            : EpilogueScaleTiles::kPingPong64x64;
    }
    return EpilogueScaleTiles::k128x64;
}

char const* epilogue_scale_tiles_name(EpilogueScaleTiles tiles)
{
    switch (tiles)
    {
    case EpilogueScaleTiles::kRowSums64x32: return "row_sums_64x32";
    case EpilogueScaleTiles::kRowSums64x64: return "row_sums_64x64";
    case EpilogueScaleTiles::kRowSums64x128: return "row_sums_64x128";
    case EpilogueScaleTiles::kRowSumsPingPong64x128: return "row_sums_ping_pong_64x128";
    case EpilogueScaleTiles::kOneWave64x64: return "one_wave_64x64";
    case EpilogueScaleTiles::kOneWave64x64DeepK: return "one_wave_64x64_deep_k";
    case EpilogueScaleTiles::kPingPong64x64: return "ping_pong_64x64";
    case EpilogueScaleTiles::kOneWave128x64: return "one_wave_128x64";
    case EpilogueScaleTiles::k128x64: return "128x64";
    case EpilogueScaleTiles::kOneWave128x128: return "one_wave_128x128";
    case EpilogueScaleTiles::k128x128: return "128x128";
    case EpilogueScaleTiles::kOneWave128x192: return "one_wave_128x192";
    case EpilogueScaleTiles::k128x192: return "128x192";
    case EpilogueScaleTiles::kClusters128x256: return "clusters_128x256";
    case EpilogueScaleTiles::kOneWaveClusters128x96: return "one_wave_clusters_128x96";
    }
    return "";
}

} // namespace flashnorm::dispatch
