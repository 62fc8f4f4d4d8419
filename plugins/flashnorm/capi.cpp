// The C ABI (include/flashnorm/flashnorm.h): argument checks, strategy choice, dispatch.
#include <algorithm>
#include <new>

#include "flashnorm/flashnorm.h"
#include "kernels/kernels.h"
#include "runtime/check.h"
#include "runtime/context.h"

namespace
{

// AUTO's crossovers: the one table of thresholds AUTO picks a strategy by (libflashnorm.so and the
// TensorRT plugin run this same code). Each was measured on an NVIDIA H200 with bf16, W* from HBM
// and CUDA-graph replay; what was measured, where and when is in kernels/NOTES.md ("AUTO's table").
struct AutoTable
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
    // epilogue-scale (builds with the CUTLASS kernel), where K is at most epilogue_scale_max_k:
    // from epilogue_scale_min_rows to epilogue_scale_max_rows rows (below prenorm's region, which
    // for one run of splits starts only past M·N = epilogue_scale_one_wave_elements, about one
    // wave of its 64×128 tiles; elsewhere it measured slower than what AUTO picks) ...
    int64_t epilogue_scale_min_rows;
    int64_t epilogue_scale_max_rows;
    // ... to epilogue_scale_split_runs_max_rows where the splits form several runs (ahead of
    // two_stream and of prenorm, whose region then starts after these rows) ...
    int64_t epilogue_scale_split_runs_max_rows;
    int64_t epilogue_scale_max_k;
    int64_t epilogue_scale_one_wave_elements;
    // ... where K is at least epilogue_scale_long_k: at exactly epilogue_scale_long_k_rows rows
    // where the splits form several runs, or one run with K·N below
    // epilogue_scale_one_run_max_weight (a large-weight prenorm region then starts after it) ...
    int64_t epilogue_scale_long_k_rows;
    int64_t epilogue_scale_long_k;
    int64_t epilogue_scale_one_run_max_weight;
    // ... and for any K from epilogue_scale_one_wave_min_rows rows wherever its tiles run in one
    // wave at least epilogue_scale_one_wave_fill_percent % full, except 64-row tiles that sum the
    // rows in the main loop on K past epilogue_scale_max_k beyond one row block, and 128-row tiles
    // whose last row block is less than epilogue_scale_last_block_sixteenths / 16 full (there
    // two_stream's cuBLAS tiles measured faster); 128×192 tiles at least
    // epilogue_scale_192_column_fill_percent % full with a last row block at least
    // epilogue_scale_192_column_last_block_sixteenths / 16 full; 128×96 tiles in clusters of two
    // with a last row block at least epilogue_scale_96_column_last_block_sixteenths / 16 full, or
    // any last row block from epilogue_scale_96_column_row_blocks row blocks; its tiles as the
    // kernel library picks them on epilogue_scale_multiprocessors, the H200's.
    int64_t epilogue_scale_one_wave_min_rows;
    int64_t epilogue_scale_one_wave_fill_percent;
    int64_t epilogue_scale_last_block_sixteenths;
    int64_t epilogue_scale_192_column_fill_percent;
    int64_t epilogue_scale_192_column_last_block_sixteenths;
    int64_t epilogue_scale_96_column_last_block_sixteenths;
    int64_t epilogue_scale_96_column_row_blocks;
    int epilogue_scale_multiprocessors;
};

constexpr AutoTable kAuto{
    /*fused_max_rows=*/16,
    /*fused_max_rows_one_group=*/8,
    /*fused_max_weight_two_groups=*/int64_t(1) << 25,
    /*prenorm_min_rows=*/256,
    /*prenorm_min_rows_large_weight=*/64,
    /*prenorm_large_weight=*/int64_t(1) << 25,
    /*prenorm_min_narrow_run_elements=*/int64_t(5) << 18,
    /*prenorm_min_rows_f32=*/1024,
    /*epilogue_scale_min_rows=*/17,
    /*epilogue_scale_max_rows=*/1024,
    /*epilogue_scale_split_runs_max_rows=*/4096,
    /*epilogue_scale_max_k=*/1024,
    /*epilogue_scale_one_wave_elements=*/int64_t(1) << 20,
    /*epilogue_scale_long_k_rows=*/64,
    /*epilogue_scale_long_k=*/2048,
    /*epilogue_scale_one_run_max_weight=*/int64_t(1) << 26,
    /*epilogue_scale_one_wave_min_rows=*/9,
    /*epilogue_scale_one_wave_fill_percent=*/70,
    /*epilogue_scale_last_block_sixteenths=*/9,
    /*epilogue_scale_192_column_fill_percent=*/80,
    /*epilogue_scale_192_column_last_block_sixteenths=*/12,
    /*epilogue_scale_96_column_last_block_sixteenths=*/8,
    /*epilogue_scale_96_column_row_blocks=*/4,
    /*epilogue_scale_multiprocessors=*/132,
};

bool valid_dtype(flashnorm_dtype dtype)
{
    return dtype == FLASHNORM_DTYPE_F32 || dtype == FLASHNORM_DTYPE_F16 || dtype == FLASHNORM_DTYPE_BF16;
}

bool valid_strategy(flashnorm_strategy strategy)
{
    return strategy == FLASHNORM_STRATEGY_AUTO || strategy == FLASHNORM_STRATEGY_TWO_STREAM
        || strategy == FLASHNORM_STRATEGY_FUSED || strategy == FLASHNORM_STRATEGY_PRENORM
        || strategy == FLASHNORM_STRATEGY_EPILOGUE_SCALE;
}

// Why the epilogue-scale strategy cannot run this call, or "" when it can.
char const* epilogue_scale_refusal(flashnorm_context const& context, flashnorm_problem const& problem,
    void const* x, void const* w, flashnorm::OutputSplits const& splits)
{
    if (!flashnorm::epilogue_scale_built())
        return "epilogue_scale is not in this build (CUTLASS headers were not found at configure time)";
    if (!context.epilogue_scale_usable)
        return "epilogue_scale needs a compute capability 9.0 device (sm_90a code)";
    if (problem.dtype == FLASHNORM_DTYPE_F32)
        return "epilogue_scale is fp16/bf16 only (the sm90 tensor-core GEMM has no fp32 operands)";
    if (!flashnorm::epilogue_scale_shape_fits(
            problem.dtype, problem.k, problem.n, problem.num_outputs, problem.split_sizes))
        return "epilogue_scale needs K and N multiples of 8 and every split to start at a multiple of 32 columns "
               "(TMA)";
    if (!flashnorm::epilogue_scale_pointers_fit(x, w, splits))
        return "epilogue_scale needs 16-byte aligned x, W* and outputs (TMA)";
    return "";
}

// Empty when the problem is well formed, else what is wrong with it.
char const* problem_error(flashnorm_problem const* problem)
{
    if (problem == nullptr)
        return "problem is null";
    if (problem->m < 0 || problem->k < 1 || problem->n < 1)
        return "need m >= 0, k >= 1, n >= 1";
    if (problem->num_outputs < 1 || problem->num_outputs > FLASHNORM_MAX_OUTPUTS)
        return "num_outputs must be 1..FLASHNORM_MAX_OUTPUTS";
    int64_t total = 0;
    for (int i = 0; i < problem->num_outputs; ++i)
    {
        if (problem->split_sizes[i] < 1)
            return "every split size must be >= 1";
        total += problem->split_sizes[i];
    }
    if (total != problem->n)
        return "split sizes must sum to n";
    if (!valid_dtype(problem->dtype))
        return "unknown dtype";
    if (!valid_strategy(problem->strategy))
        return "unknown strategy";
    if (!(problem->eps >= 0.f))
        return "eps must be >= 0";
    return "";
}

// Whether epilogue-scale can run this problem's dtype and shape in this build (the device and
// the pointers are known only at the call: epilogue_scale_refusal).
bool epilogue_scale_fits(flashnorm_problem const& problem)
{
    return flashnorm::epilogue_scale_built()
        && flashnorm::epilogue_scale_shape_fits(
            problem.dtype, problem.k, problem.n, problem.num_outputs, problem.split_sizes);
}

// Whether AUTO's short-K epilogue-scale rows apply to this K and dtype (any splits, any M).
bool epilogue_scale_short_k(flashnorm_problem const& problem)
{
    return epilogue_scale_fits(problem) && problem.k <= kAuto.epilogue_scale_max_k;
}

// Whether AUTO's one-run long-K epilogue-scale rows apply to this K, N and dtype (all splits one
// run; any M).
bool epilogue_scale_one_run_long_k(flashnorm_problem const& problem)
{
    return epilogue_scale_fits(problem) && problem.k >= kAuto.epilogue_scale_long_k
        && problem.k * problem.n < kAuto.epilogue_scale_one_run_max_weight;
}

// Where all splits form one run of a smaller W*: prenorm from prenorm_min_rows, or on short K
// first past the rows whose epilogue-scale output fits about one wave of its tiles (at most to
// the end of the epilogue-scale region).
int64_t one_run_prenorm_min_rows(flashnorm_problem const& problem)
{
    if (!epilogue_scale_short_k(problem))
        return kAuto.prenorm_min_rows;
    int64_t const past_one_wave = kAuto.epilogue_scale_one_wave_elements / problem.n + 1;
    return std::clamp(past_one_wave, kAuto.prenorm_min_rows, kAuto.epilogue_scale_max_rows + 1);
}

// The fewest rows from which AUTO picks prenorm for this problem's K, splits and dtype. AUTO's
// prenorm region is every M at or above it (the workspace size relies on that).
int64_t prenorm_min_rows(flashnorm_problem const& problem)
{
    if (problem.dtype == FLASHNORM_DTYPE_F32)
        return kAuto.prenorm_min_rows_f32;
    flashnorm::SplitRun runs[FLASHNORM_MAX_OUTPUTS];
    int const run_count = flashnorm::split_runs(problem, runs);
    if (run_count == 1 && problem.k * problem.n >= kAuto.prenorm_large_weight)
        return epilogue_scale_one_run_long_k(problem) ? kAuto.epilogue_scale_long_k_rows + 1
                                                      : kAuto.prenorm_min_rows_large_weight;
    if (run_count == 1)
        return one_run_prenorm_min_rows(problem);
    int64_t narrowest = problem.n;
    for (int r = 0; r < run_count; ++r)
        narrowest = std::min(narrowest, runs[r].columns());
    int64_t const rows = (kAuto.prenorm_min_narrow_run_elements + narrowest - 1) / narrowest;
    if (epilogue_scale_short_k(problem))
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
OneWaveRule one_wave_rule(flashnorm::EpilogueScaleTiles configuration)
{
    switch (configuration)
    {
    case flashnorm::EpilogueScaleTiles::kOneWave128x192:
        return {kAuto.epilogue_scale_192_column_fill_percent, kAuto.epilogue_scale_192_column_last_block_sixteenths, 0};
    case flashnorm::EpilogueScaleTiles::kOneWaveClusters128x96:
        return {kAuto.epilogue_scale_one_wave_fill_percent, kAuto.epilogue_scale_96_column_last_block_sixteenths,
            kAuto.epilogue_scale_96_column_row_blocks};
    default: return {kAuto.epilogue_scale_one_wave_fill_percent, kAuto.epilogue_scale_last_block_sixteenths, 0};
    }
}

// Whether the epilogue-scale GEMM's tiles for this problem (on the H200's multiprocessors) run in
// one wave that AUTO takes (one_wave_rule): full enough, 64-row tiles summing the rows in the main
// loop on long K in one row block only, 128-row tiles with a full enough last row block.
bool epilogue_scale_one_wave_taken(flashnorm_problem const& problem)
{
    int const multiprocessors = kAuto.epilogue_scale_multiprocessors;
    flashnorm::EpilogueScaleTiles const configuration
        = flashnorm::epilogue_scale_tiles(problem.m, problem.k, problem.n, multiprocessors);
    flashnorm::EpilogueScaleTileShape const tile = flashnorm::epilogue_scale_tile_shape(configuration);
    OneWaveRule const rule = one_wave_rule(configuration);
    int64_t const tiles = flashnorm::tile_count(problem.m, problem.n, tile.rows, tile.columns);
    if (!tile.one_wave || 100 * tiles < rule.fill_percent * multiprocessors)
        return false;
    if (tile.row_sums && problem.k > kAuto.epilogue_scale_max_k)
        return problem.m <= tile.rows;
    int64_t const row_blocks = (problem.m + tile.rows - 1) / tile.rows;
    if (rule.any_last_block_row_blocks > 0 && row_blocks >= rule.any_last_block_row_blocks)
        return true;
    int64_t const last_block_rows = (problem.m - 1) % tile.rows + 1;
    return tile.rows < 128 || 16 * last_block_rows >= rule.last_block_sixteenths * tile.rows;
}

// AUTO's epilogue-scale region. Whether the device and the pointers allow it is known only at
// the call (epilogue_scale_refusal); there AUTO falls back to two_stream, whose workspace
// workspace_bytes_for() therefore reserves too.
bool auto_picks_epilogue_scale(flashnorm_problem const& problem)
{
    if (!epilogue_scale_fits(problem))
        return false;
    flashnorm::SplitRun runs[FLASHNORM_MAX_OUTPUTS];
    bool const several_runs = flashnorm::split_runs(problem, runs) > 1;
    if (epilogue_scale_short_k(problem) && problem.m >= kAuto.epilogue_scale_min_rows
        && problem.m <= (several_runs ? kAuto.epilogue_scale_split_runs_max_rows : kAuto.epilogue_scale_max_rows))
        return true;
    if (problem.m == kAuto.epilogue_scale_long_k_rows
        && (several_runs ? problem.k >= kAuto.epilogue_scale_long_k : epilogue_scale_one_run_long_k(problem)))
        return true;
    return problem.m >= kAuto.epilogue_scale_one_wave_min_rows && epilogue_scale_one_wave_taken(problem);
}

flashnorm_strategy resolve(flashnorm_problem const& problem)
{
    if (problem.strategy != FLASHNORM_STRATEGY_AUTO)
        return problem.strategy;
    if (problem.m >= prenorm_min_rows(problem))
        return FLASHNORM_STRATEGY_PRENORM;
    if (auto_picks_epilogue_scale(problem))
        return FLASHNORM_STRATEGY_EPILOGUE_SCALE;
    bool const tensor_cores
        = problem.dtype != FLASHNORM_DTYPE_F32 && flashnorm::fused_tensor_core_shape(problem.k, problem.n);
    int64_t const weight = problem.k * problem.n;
    bool const fused_wins = problem.m <= kAuto.fused_max_rows_one_group
        || (problem.m <= kAuto.fused_max_rows && weight <= kAuto.fused_max_weight_two_groups);
    return tensor_cores && fused_wins ? FLASHNORM_STRATEGY_FUSED : FLASHNORM_STRATEGY_TWO_STREAM;
}


// Bytes `strategy` (resolved, never AUTO) needs for exactly this problem.
size_t workspace_bytes_for(flashnorm_problem const& problem, flashnorm_strategy strategy)
{
    switch (strategy)
    {
    case FLASHNORM_STRATEGY_FUSED: return 0;
    case FLASHNORM_STRATEGY_EPILOGUE_SCALE:
        // Under AUTO the call may fall back to two_stream (above): room for both.
        return problem.strategy == FLASHNORM_STRATEGY_AUTO
            ? std::max(flashnorm::epilogue_scale_workspace_bytes(problem.m),
                flashnorm::two_stream_layout(problem.m, problem.n, problem.dtype).total)
            : flashnorm::epilogue_scale_workspace_bytes(problem.m);
    case FLASHNORM_STRATEGY_PRENORM:
    {
        flashnorm::SplitRun runs[FLASHNORM_MAX_OUTPUTS];
        return flashnorm::prenorm_layout(problem.m, problem.k, problem.dtype, flashnorm::split_runs(problem, runs))
            .total;
    }
    default: return flashnorm::two_stream_layout(problem.m, problem.n, problem.dtype).total;
    }
}

size_t element_bytes(flashnorm_dtype dtype)
{
    return dtype == FLASHNORM_DTYPE_F32 ? 4 : 2;
}

// Whether the `bytes`-long buffers at a and b share a byte.
bool overlaps(void const* a, void const* b, size_t bytes)
{
    auto const first = reinterpret_cast<uintptr_t>(a);
    auto const second = reinterpret_cast<uintptr_t>(b);
    return first < second + bytes && second < first + bytes;
}

// Both entry points: checks, then the strategy's launches; `add` empty for flashnorm_matmul.
flashnorm_status enqueue(flashnorm_context* context, flashnorm_problem const* problem, void const* x,
    flashnorm::ResidualAdd const& add, void const* w, void* const* outputs, void* workspace, size_t workspace_bytes,
    cudaStream_t stream, char const* caller)
{
    if (context == nullptr)
        return FLASHNORM_STATUS_INVALID_ARGUMENT;
    char const* const error = problem_error(problem);
    if (*error != '\0')
        return flashnorm::record_error(context, FLASHNORM_STATUS_INVALID_ARGUMENT, caller, error, "problem");
    if (problem->m == 0)
        return FLASHNORM_STATUS_OK;
    if (x == nullptr || w == nullptr || outputs == nullptr)
        return flashnorm::record_error(
            context, FLASHNORM_STATUS_INVALID_ARGUMENT, caller, "null x, w or outputs", "pointers");
    int device = 0;
    FLASHNORM_CHECK(context, cudaGetDevice(&device));
    if (device != context->device)
        return flashnorm::record_error(context, FLASHNORM_STATUS_INVALID_ARGUMENT, caller,
            "the current CUDA device is not the one the context was created on", "device");

    flashnorm::OutputSplits splits{};
    splits.count = problem->num_outputs;
    splits.offsets[0] = 0;
    for (int i = 0; i < problem->num_outputs; ++i)
    {
        if (outputs[i] == nullptr)
            return flashnorm::record_error(
                context, FLASHNORM_STATUS_INVALID_ARGUMENT, caller, "null output pointer", "outputs");
        splits.outputs[i] = outputs[i];
        splits.offsets[i + 1] = splits.offsets[i] + problem->split_sizes[i];
    }

    flashnorm_strategy strategy = resolve(*problem);
    bool const adds = add.residual != nullptr;
    if (strategy == FLASHNORM_STRATEGY_FUSED)
    {
        FLASHNORM_CHECK(context,
            flashnorm::launch_fused(problem->dtype, x, add, w, problem->m, problem->k, problem->n, problem->eps,
                splits, context->sm_count, context->fused_tuning, stream));
        return FLASHNORM_STATUS_OK;
    }
    // The other strategies' first kernels read x more than once or through TMA: the add runs
    // first on its own, and they read its sum.
    void const* const input = adds ? add.sum : x;
    if (strategy == FLASHNORM_STRATEGY_EPILOGUE_SCALE)
    {
        char const* const refusal = epilogue_scale_refusal(*context, *problem, input, w, splits);
        if (*refusal != '\0' && problem->strategy == FLASHNORM_STRATEGY_AUTO)
            strategy = FLASHNORM_STRATEGY_TWO_STREAM;
        else if (*refusal != '\0')
            return flashnorm::record_error(
                context, FLASHNORM_STATUS_UNSUPPORTED, caller, refusal, "strategy");
    }
    size_t const needed = workspace_bytes_for(*problem, strategy);
    if (workspace == nullptr || workspace_bytes < needed || reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
        return flashnorm::record_error(context, FLASHNORM_STATUS_WORKSPACE_TOO_SMALL, caller,
            "workspace missing, smaller than flashnorm_workspace_size() or not 256-byte aligned", "workspace");
    if (adds)
    {
        FLASHNORM_CHECK(
            context, flashnorm::launch_residual_add(problem->dtype, x, add, problem->m * problem->k, stream));
    }
    if (strategy == FLASHNORM_STRATEGY_PRENORM)
        return flashnorm::run_prenorm(context, *problem, input, w, splits, workspace, stream);
    if (strategy == FLASHNORM_STRATEGY_EPILOGUE_SCALE)
    {
        FLASHNORM_CHECK(context,
            flashnorm::launch_epilogue_scale(problem->dtype, input, w, problem->m, problem->k, problem->n,
                problem->eps, splits, static_cast<float*>(workspace), context->sm_count, context->side_delay_cycles,
                context->epilogue_scale_tiles, stream));
        return FLASHNORM_STATUS_OK;
    }
    return flashnorm::run_two_stream(context, *problem, input, w, splits, workspace, stream);
}

} // namespace

extern "C" {

flashnorm_status flashnorm_context_create(flashnorm_context** context)
{
    if (context == nullptr)
        return FLASHNORM_STATUS_INVALID_ARGUMENT;
    *context = nullptr;
    flashnorm_context* created = new (std::nothrow) flashnorm_context();
    if (created == nullptr)
        return FLASHNORM_STATUS_INVALID_ARGUMENT;
    flashnorm_status const status = flashnorm::create_context(created);
    if (status != FLASHNORM_STATUS_OK)
    {
        flashnorm::destroy_context(created);
        delete created;
        return status;
    }
    *context = created;
    return FLASHNORM_STATUS_OK;
}

void flashnorm_context_destroy(flashnorm_context* context)
{
    if (context == nullptr)
        return;
    flashnorm::destroy_context(context);
    delete context;
}

size_t flashnorm_workspace_size(flashnorm_problem const* problem)
{
    if (*problem_error(problem) != '\0')
        return 0;
    size_t bytes = workspace_bytes_for(*problem, resolve(*problem));
    int64_t const threshold = prenorm_min_rows(*problem);
    if (problem->strategy == FLASHNORM_STRATEGY_AUTO && problem->m >= threshold)
    {
        // AUTO picks another strategy for fewer rows; the size covers every smaller M (the
        // TensorRT plugin sizes its workspace once, for the profile's largest M). Each strategy's
        // own size grows with M, so its largest M below the threshold is the one to cover.
        flashnorm_problem below = *problem;
        below.m = threshold - 1;
        size_t const smaller = workspace_bytes_for(below, resolve(below));
        bytes = smaller > bytes ? smaller : bytes;
    }
    return bytes;
}

flashnorm_strategy flashnorm_resolve_strategy(flashnorm_problem const* problem)
{
    if (*problem_error(problem) != '\0')
        return FLASHNORM_STRATEGY_TWO_STREAM;
    return resolve(*problem);
}

flashnorm_status flashnorm_matmul(flashnorm_context* context, flashnorm_problem const* problem, void const* x,
    void const* w, void* const* outputs, void* workspace, size_t workspace_bytes, cudaStream_t stream)
{
    return enqueue(context, problem, x, flashnorm::ResidualAdd{}, w, outputs, workspace, workspace_bytes, stream,
        "flashnorm_matmul");
}

flashnorm_status flashnorm_add_matmul(flashnorm_context* context, flashnorm_problem const* problem, void const* x,
    void const* residual, void* sum, void const* w, void* const* outputs, void* workspace, size_t workspace_bytes,
    cudaStream_t stream)
{
    char const* const caller = "flashnorm_add_matmul";
    if (context == nullptr)
        return FLASHNORM_STATUS_INVALID_ARGUMENT;
    if (*problem_error(problem) == '\0' && problem->m > 0)
    {
        if (residual == nullptr || sum == nullptr)
            return flashnorm::record_error(
                context, FLASHNORM_STATUS_INVALID_ARGUMENT, caller, "null residual or sum", "pointers");
        // Other blocks still read x and the residual while the first strip writes the sum.
        size_t const bytes = static_cast<size_t>(problem->m) * static_cast<size_t>(problem->k)
            * element_bytes(problem->dtype);
        if (overlaps(sum, x, bytes) || overlaps(sum, residual, bytes))
            return flashnorm::record_error(
                context, FLASHNORM_STATUS_INVALID_ARGUMENT, caller, "sum overlaps x or residual", "pointers");
    }
    return enqueue(context, problem, x, flashnorm::ResidualAdd{residual, sum}, w, outputs, workspace,
        workspace_bytes, stream, caller);
}


char const* flashnorm_status_string(flashnorm_status status)
{
    switch (status)
    {
    case FLASHNORM_STATUS_OK: return "ok";
    case FLASHNORM_STATUS_INVALID_ARGUMENT: return "invalid argument";
    case FLASHNORM_STATUS_UNSUPPORTED: return "unsupported";
    case FLASHNORM_STATUS_WORKSPACE_TOO_SMALL: return "workspace too small";
    case FLASHNORM_STATUS_CUDA_ERROR: return "CUDA error";
    case FLASHNORM_STATUS_CUBLAS_ERROR: return "cuBLAS error";
    }
    return "unknown status";
}

char const* flashnorm_context_last_error(flashnorm_context const* context)
{
    return context == nullptr ? "" : context->last_error.c_str();
}

void flashnorm_testing_set_side_delay(flashnorm_context* context, int64_t cycles)
{
    if (context != nullptr)
        context->side_delay_cycles = cycles < 0 ? 0 : cycles;
}

flashnorm_status flashnorm_testing_set_fused_tuning(
    flashnorm_context* context, int32_t strip_cols, int32_t cluster_size)
{
    if (context == nullptr)
        return FLASHNORM_STATUS_INVALID_ARGUMENT;
    flashnorm::FusedTuning const tuning{strip_cols, cluster_size};
    if (!flashnorm::fused_tuning_supported(tuning))
        return flashnorm::record_error(context, FLASHNORM_STATUS_INVALID_ARGUMENT,
            "flashnorm_testing_set_fused_tuning", "strip_cols must be 0, 32 or 128 and cluster_size 0, 1, 2, 4 or 8",
            "tuning");
    context->fused_tuning = tuning;
    return FLASHNORM_STATUS_OK;
}

flashnorm_status flashnorm_testing_set_epilogue_scale_tiles(flashnorm_context* context, int32_t tiles)
{
    if (context == nullptr)
        return FLASHNORM_STATUS_INVALID_ARGUMENT;
    if (tiles < 0 || tiles > flashnorm::kEpilogueScaleTileConfigurations)
        return flashnorm::record_error(context, FLASHNORM_STATUS_INVALID_ARGUMENT,
            "flashnorm_testing_set_epilogue_scale_tiles",
            "tiles must be 0 (automatic) or 1 + the index of a configuration "
            "(flashnorm_testing_epilogue_scale_tiles_name)",
            "tiles");
    context->epilogue_scale_tiles = tiles == 0
        ? std::nullopt
        : std::optional<flashnorm::EpilogueScaleTiles>(static_cast<flashnorm::EpilogueScaleTiles>(tiles - 1));
    return FLASHNORM_STATUS_OK;
}

char const* flashnorm_testing_epilogue_scale_tiles_name(int32_t index)
{
    if (index < 0 || index >= flashnorm::kEpilogueScaleTileConfigurations)
        return nullptr;
    return flashnorm::epilogue_scale_tiles_name(static_cast<flashnorm::EpilogueScaleTiles>(index));
}

int flashnorm_strategy_available(flashnorm_context const* context, flashnorm_strategy strategy)
{
    if (strategy == FLASHNORM_STRATEGY_EPILOGUE_SCALE)
        return context != nullptr && context->epilogue_scale_usable ? 1 : 0;
    return valid_strategy(strategy) ? 1 : 0;
}

int flashnorm_testing_join_dropped(void)
{
#ifdef FLASHNORM_TESTING_DROP_JOIN
    return 1;
#else
    return 0;
#endif
}

} // extern "C"
