// The C ABI (include/flashnorm/flashnorm.h): argument checks, then the strategy the dispatch unit
// (dispatch/dispatch.h) picks, launched.
#include <new>

#include "dispatch/dispatch.h"
#include "flashnorm/flashnorm.h"
#include "kernels/kernels.h"
#include "runtime/check.h"
#include "runtime/context.h"

namespace
{

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
    if (problem->multiprocessors < 0)
        return "multiprocessors must be >= 0 (0: the device's own)";
    if (problem->statistic != FLASHNORM_STATISTIC_RMS && problem->statistic != FLASHNORM_STATISTIC_VARIANCE)
        return "unknown statistic (0: RMS, 1: variance)";
    return "";
}

static_assert(static_cast<int>(flashnorm::dispatch::Strategy::kTwoStream) == FLASHNORM_STRATEGY_TWO_STREAM
        && static_cast<int>(flashnorm::dispatch::Strategy::kFused) == FLASHNORM_STRATEGY_FUSED
        && static_cast<int>(flashnorm::dispatch::Strategy::kPrenorm) == FLASHNORM_STRATEGY_PRENORM
        && static_cast<int>(flashnorm::dispatch::Strategy::kEpilogueScale) == FLASHNORM_STRATEGY_EPILOGUE_SCALE,
    "dispatch::Strategy mirrors flashnorm_strategy");

// A well-formed problem (problem_error) as the dispatch unit takes it.
flashnorm::dispatch::Problem dispatch_problem(flashnorm_problem const& problem)
{
    flashnorm::dispatch::Problem converted{};
    converted.m = problem.m;
    converted.k = problem.k;
    converted.n = problem.n;
    converted.split_count = problem.num_outputs;
    for (int i = 0; i < problem.num_outputs; ++i)
        converted.split_sizes[i] = problem.split_sizes[i];
    converted.dtype = flashnorm::dispatch_dtype(problem.dtype);
    converted.statistic = static_cast<flashnorm::dispatch::Statistic>(problem.statistic);
    return converted;
}

// The multiprocessors AUTO picks for: the problem's count, else (0) `device_multiprocessors`, the
// device's own (a call's context's, a size's or a resolution's current device's).
int auto_multiprocessors(flashnorm_problem const& problem, int device_multiprocessors)
{
    return problem.multiprocessors > 0 ? problem.multiprocessors : device_multiprocessors;
}

// AUTO's pick and workspace on `multiprocessors` multiprocessors: the dispatch unit's
// (dispatch/dispatch.cpp, where every crossover is).
flashnorm::dispatch::Choice auto_choice(flashnorm_problem const& problem, int multiprocessors)
{
    return flashnorm::dispatch::choose(dispatch_problem(problem), multiprocessors, flashnorm::epilogue_scale_built());
}

flashnorm_strategy resolve(flashnorm_problem const& problem, int multiprocessors)
{
    if (problem.strategy != FLASHNORM_STRATEGY_AUTO)
        return problem.strategy;
    return static_cast<flashnorm_strategy>(auto_choice(problem, multiprocessors).strategy);
}

// Bytes `strategy` (resolved, never AUTO) needs for exactly this problem (under AUTO, epilogue-scale
// with room for its two_stream fallback).
size_t workspace_bytes_for(flashnorm_problem const& problem, flashnorm_strategy strategy)
{
    return flashnorm::dispatch::workspace_bytes(dispatch_problem(problem),
        static_cast<flashnorm::dispatch::Strategy>(strategy), problem.strategy == FLASHNORM_STRATEGY_AUTO);
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
    flashnorm::ResidualAdd const& add, void const* w, float const* bias, void* const* outputs, void* workspace,
    size_t workspace_bytes, cudaStream_t stream, char const* caller)
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

    flashnorm_strategy strategy = resolve(*problem, auto_multiprocessors(*problem, context->sm_count));
    bool const adds = add.residual != nullptr;
    flashnorm::RowNorm const norm = flashnorm::row_norm(*problem, bias);
    if (strategy == FLASHNORM_STRATEGY_FUSED)
    {
        FLASHNORM_CHECK(context,
            flashnorm::launch_fused(problem->dtype, x, add, w, problem->m, problem->k, problem->n, norm, splits,
                context->sm_count, context->fused_tuning, stream));
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
        return flashnorm::run_prenorm(context, *problem, input, w, bias, splits, workspace, stream);
    if (strategy == FLASHNORM_STRATEGY_EPILOGUE_SCALE)
    {
        FLASHNORM_CHECK(context,
            flashnorm::launch_epilogue_scale(problem->dtype, input, w, problem->m, problem->k, problem->n, norm,
                splits, static_cast<float*>(workspace), context->sm_count, context->side_delay_cycles,
                context->epilogue_scale_tiles, stream));
        return FLASHNORM_STATUS_OK;
    }
    return flashnorm::run_two_stream(context, *problem, input, w, bias, splits, workspace, stream);
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
    // Under AUTO the size also covers every smaller M (dispatch::choose) on the same multiprocessors.
    if (problem->strategy == FLASHNORM_STRATEGY_AUTO)
        return auto_choice(*problem, auto_multiprocessors(*problem, flashnorm_current_multiprocessors()))
            .workspace_bytes;
    return workspace_bytes_for(*problem, problem->strategy);
}

flashnorm_strategy flashnorm_resolve_strategy(flashnorm_problem const* problem)
{
    if (*problem_error(problem) != '\0')
        return FLASHNORM_STRATEGY_TWO_STREAM;
    return resolve(*problem, auto_multiprocessors(*problem, flashnorm_current_multiprocessors()));
}

int32_t flashnorm_current_multiprocessors(void)
{
    int device = 0;
    int count = 0;
    if (cudaGetDevice(&device) != cudaSuccess
        || cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count < 1)
    {
        cudaGetLastError(); // no GPU or no driver: leave the caller's next CUDA call no error of ours
        return flashnorm::dispatch::measured_multiprocessors();
    }
    return count;
}

int32_t flashnorm_measured_multiprocessors(void)
{
    return flashnorm::dispatch::measured_multiprocessors();
}

flashnorm_status flashnorm_matmul(flashnorm_context* context, flashnorm_problem const* problem, void const* x,
    void const* w, float const* bias, void* const* outputs, void* workspace, size_t workspace_bytes,
    cudaStream_t stream)
{
    return enqueue(context, problem, x, flashnorm::ResidualAdd{}, w, bias, outputs, workspace, workspace_bytes, stream,
        "flashnorm_matmul");
}

flashnorm_status flashnorm_add_matmul(flashnorm_context* context, flashnorm_problem const* problem, void const* x,
    void const* residual, void* sum, void const* w, float const* bias, void* const* outputs, void* workspace,
    size_t workspace_bytes, cudaStream_t stream)
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
    return enqueue(context, problem, x, flashnorm::ResidualAdd{residual, sum}, w, bias, outputs, workspace,
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
