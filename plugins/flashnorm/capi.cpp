// The C ABI (include/flashnorm/flashnorm.h): argument checks, strategy choice, dispatch.
#include <algorithm>
#include <new>

#include "flashnorm/flashnorm.h"
#include "kernels/kernels.h"
#include "runtime/check.h"
#include "runtime/context.h"

namespace
{

// AUTO, measured on an NVIDIA H200 (bf16, W* from HBM, CUDA-graph replay; plugins/flashnorm/kernels/NOTES.md
// and docs/BENCHMARKS.md): the fused kernel where it beat two-stream. With one B operand of 8 tokens
// (M <= 8) it did on every W* measured (2048×16384, M=4: 20.5 vs 22.1 µs; 4096×6144: 16.8 vs 18.8;
// 4096×28672, the largest: 58.8 vs 60.1 at M=1 and 60.5 vs 61.8 at M=4 on 2026-11-29 20:46 UTC,
// faster or tied in 5 of 6 runs that day, 66.4 vs 60.2 in one). With two (9..16 rows), since its
// epilogue exchanges whole accumulator fragments (2026-11-29 ≈ 22:50 UTC, M=16): on every W* up to
// 2048×16384 (576×960: 4.6 vs 5.6; 2048×3072: 8.1 vs 8.8; 4096×6144: 18.2 vs 19.1; 2048×16384:
// 22.1 vs 22.6), not on 4096×28672 (65.1 vs 63.3). The CUDA-core fallback (fp32, N % 8 != 0, odd K)
// is never picked (fp32 1×2048×3072: 46.7 µs fused, 8.0 µs two-stream).
constexpr int64_t kFusedMaxRows = 16;
constexpr int64_t kFusedMaxRowsOneGroup = 8;
constexpr int64_t kFusedMaxWeightElementsTwoGroups = int64_t(1) << 25;
// Prenorm (kernels/NOTES.md, "prenorm"): two-stream's post-scale reads and writes the N-wide output
// once more, prenorm's extra pass is over the K-wide input; but prenorm runs one GEMM per run of
// consecutive equal-width splits (a pointer-array batched GEMM for a run of several), and a narrow
// run (k|v: 384-2048 columns) is a GEMM too small to fill the GPU. Measured (bf16, H200,
// W* from HBM, 2026-11-29): where all splits form one run (gate|up, a single output) prenorm beat
// two-stream from M = 256 on every site (576×3072: 7.3 vs 9.6 µs; 4096×28672: 96.6 vs 107.8);
// with a narrow run it won where M × (narrowest run) >= 1.5·2^20 (4096 × 384: 18.4 vs 19.7
// µs; 4096 × 1024: 79.1 vs 94.9), tied around 2^20 (1024 × 1024: 27.1 vs 27.3; 1024 × 2048: 82.2
// vs 82.1) and lost below (256 × 2048: 33.7 vs 31.3; 1024 × 384: 10.5 vs 10.7). fp32 GEMMs run on
// CUDA cores, where the narrow splits cost little: prenorm won at M = 1024 on both sites measured
// (292.7 vs 306.9, 1030 vs 1086 µs) and lost at M = 256 on one (101.4 vs 83.8).
// On a large W* in one run prenorm already won at M = 64 (docs/BENCHMARKS.md, 2026-11-29 22:25 and
// 2026-11-30 00:07 UTC: 2048×16384 23.2 vs 25.2 and 25.1 µs; 4096×28672 61.8 vs 66.9 and 67.0)
// but not on 576×3072 (7.05 vs 6.47); 2^25 is the smallest such W* measured.
constexpr int64_t kPrenormMinRows = 256;
constexpr int64_t kPrenormMinRowsLargeWeight = 64;
constexpr int64_t kPrenormLargeWeightElements = int64_t(1) << 25;
constexpr int64_t kPrenormMinNarrowRunElements = int64_t(5) << 18; // 1.25·2^20
constexpr int64_t kPrenormMinRowsF32 = 1024;

bool valid_dtype(flashnorm_dtype dtype)
{
    return dtype == FLASHNORM_DTYPE_F32 || dtype == FLASHNORM_DTYPE_F16 || dtype == FLASHNORM_DTYPE_BF16;
}

bool valid_strategy(flashnorm_strategy strategy)
{
    return strategy == FLASHNORM_STRATEGY_AUTO || strategy == FLASHNORM_STRATEGY_TWO_STREAM
        || strategy == FLASHNORM_STRATEGY_FUSED || strategy == FLASHNORM_STRATEGY_PRENORM;
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

// The fewest rows from which AUTO picks prenorm for this problem's K, splits and dtype. AUTO's
// prenorm region is every M at or above it (the workspace size relies on that).
int64_t prenorm_min_rows(flashnorm_problem const& problem)
{
    if (problem.dtype == FLASHNORM_DTYPE_F32)
        return kPrenormMinRowsF32;
    flashnorm::SplitRun runs[FLASHNORM_MAX_OUTPUTS];
    int const run_count = flashnorm::split_runs(problem, runs);
    if (run_count == 1)
        return problem.k * problem.n >= kPrenormLargeWeightElements ? kPrenormMinRowsLargeWeight : kPrenormMinRows;
    int64_t narrowest = problem.n;
    for (int r = 0; r < run_count; ++r)
        narrowest = std::min(narrowest, runs[r].columns());
    int64_t const rows = (kPrenormMinNarrowRunElements + narrowest - 1) / narrowest;
    return rows > kPrenormMinRows ? rows : kPrenormMinRows;
}

flashnorm_strategy resolve(flashnorm_problem const& problem)
{
    if (problem.strategy != FLASHNORM_STRATEGY_AUTO)
        return problem.strategy;
    if (problem.m >= prenorm_min_rows(problem))
        return FLASHNORM_STRATEGY_PRENORM;
    bool const tensor_cores
        = problem.dtype != FLASHNORM_DTYPE_F32 && flashnorm::fused_tensor_core_shape(problem.k, problem.n);
    int64_t const weight = problem.k * problem.n;
    bool const fused_wins = problem.m <= kFusedMaxRowsOneGroup
        || (problem.m <= kFusedMaxRows && weight <= kFusedMaxWeightElementsTwoGroups);
    return tensor_cores && fused_wins ? FLASHNORM_STRATEGY_FUSED : FLASHNORM_STRATEGY_TWO_STREAM;
}

// Bytes `strategy` (resolved, never AUTO) needs for exactly this problem.
size_t workspace_bytes_for(flashnorm_problem const& problem, flashnorm_strategy strategy)
{
    switch (strategy)
    {
    case FLASHNORM_STRATEGY_FUSED: return 0;
    case FLASHNORM_STRATEGY_PRENORM:
    {
        flashnorm::SplitRun runs[FLASHNORM_MAX_OUTPUTS];
        return flashnorm::prenorm_layout(problem.m, problem.k, problem.dtype, flashnorm::split_runs(problem, runs))
            .total;
    }
    default: return flashnorm::two_stream_layout(problem.m, problem.n, problem.dtype).total;
    }
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
    if (context == nullptr)
        return FLASHNORM_STATUS_INVALID_ARGUMENT;
    char const* const error = problem_error(problem);
    if (*error != '\0')
        return flashnorm::record_error(context, FLASHNORM_STATUS_INVALID_ARGUMENT, "flashnorm_matmul", error, "problem");
    if (problem->m == 0)
        return FLASHNORM_STATUS_OK;
    if (x == nullptr || w == nullptr || outputs == nullptr)
        return flashnorm::record_error(
            context, FLASHNORM_STATUS_INVALID_ARGUMENT, "flashnorm_matmul", "null x, w or outputs", "pointers");
    int device = 0;
    FLASHNORM_CHECK(context, cudaGetDevice(&device));
    if (device != context->device)
        return flashnorm::record_error(context, FLASHNORM_STATUS_INVALID_ARGUMENT, "flashnorm_matmul",
            "the current CUDA device is not the one the context was created on", "device");

    flashnorm::OutputSplits splits{};
    splits.count = problem->num_outputs;
    splits.offsets[0] = 0;
    for (int i = 0; i < problem->num_outputs; ++i)
    {
        if (outputs[i] == nullptr)
            return flashnorm::record_error(
                context, FLASHNORM_STATUS_INVALID_ARGUMENT, "flashnorm_matmul", "null output pointer", "outputs");
        splits.outputs[i] = outputs[i];
        splits.offsets[i + 1] = splits.offsets[i] + problem->split_sizes[i];
    }

    flashnorm_strategy const strategy = resolve(*problem);
    if (strategy == FLASHNORM_STRATEGY_FUSED)
    {
        FLASHNORM_CHECK(context,
            flashnorm::launch_fused(problem->dtype, x, w, problem->m, problem->k, problem->n, problem->eps, splits,
                context->sm_count, context->fused_tuning, stream));
        return FLASHNORM_STATUS_OK;
    }
    size_t const needed = workspace_bytes_for(*problem, strategy);
    if (workspace == nullptr || workspace_bytes < needed || reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
        return flashnorm::record_error(context, FLASHNORM_STATUS_WORKSPACE_TOO_SMALL, "flashnorm_matmul",
            "workspace missing, smaller than flashnorm_workspace_size() or not 256-byte aligned", "workspace");
    if (strategy == FLASHNORM_STRATEGY_PRENORM)
        return flashnorm::run_prenorm(context, *problem, x, w, splits, workspace, stream);
    return flashnorm::run_two_stream(context, *problem, x, w, splits, workspace, stream);
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

int flashnorm_testing_join_dropped(void)
{
#ifdef FLASHNORM_TESTING_DROP_JOIN
    return 1;
#else
    return 0;
#endif
}

} // extern "C"
