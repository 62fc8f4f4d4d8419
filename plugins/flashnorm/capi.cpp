// The C ABI (include/flashnorm/flashnorm.h): argument checks, strategy choice, dispatch.
#include <new>

#include "flashnorm/flashnorm.h"
#include "kernels/kernels.h"
#include "runtime/check.h"
#include "runtime/context.h"

namespace
{

// AUTO, measured on an NVIDIA H200 (bf16/fp16, CUDA-graph replay; plugins/flashnorm/kernels/NOTES.md
// and docs/BENCHMARKS.md): the fused kernel only where it beat two-stream, i.e. few rows (M <= 16)
// and a small W* (K·N <= 2^20 elements, e.g. 576×960: fused 4.4-4.5 µs, two-stream 4.9-5.0).
// Everywhere else two-stream was faster (4096×6144, M=1: 16.3 vs 20.2 µs; 4096×28672: 58.5 vs
// 73.0) and is picked. The CUDA-core fallback (fp32, N % 8 != 0, odd K) is never picked
// (fp32 1×2048×3072: 46.7 µs fused, 8.0 µs two-stream).
constexpr int64_t kFusedMaxRows = 16;
constexpr int64_t kFusedMaxWeightElements = int64_t(1) << 20;

bool valid_dtype(flashnorm_dtype dtype)
{
    return dtype == FLASHNORM_DTYPE_F32 || dtype == FLASHNORM_DTYPE_F16 || dtype == FLASHNORM_DTYPE_BF16;
}

bool valid_strategy(flashnorm_strategy strategy)
{
    return strategy == FLASHNORM_STRATEGY_AUTO || strategy == FLASHNORM_STRATEGY_TWO_STREAM
        || strategy == FLASHNORM_STRATEGY_FUSED;
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

flashnorm_strategy resolve(flashnorm_problem const& problem)
{
    if (problem.strategy != FLASHNORM_STRATEGY_AUTO)
        return problem.strategy;
    bool const tensor_cores
        = problem.dtype != FLASHNORM_DTYPE_F32 && flashnorm::fused_tensor_core_shape(problem.k, problem.n);
    bool const small = problem.m <= kFusedMaxRows && problem.k * problem.n <= kFusedMaxWeightElements;
    return tensor_cores && small ? FLASHNORM_STRATEGY_FUSED : FLASHNORM_STRATEGY_TWO_STREAM;
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
    if (resolve(*problem) == FLASHNORM_STRATEGY_FUSED)
        return 0;
    return flashnorm::two_stream_layout(problem->m, problem->n, problem->dtype).total;
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

    if (resolve(*problem) == FLASHNORM_STRATEGY_FUSED)
    {
        FLASHNORM_CHECK(context,
            flashnorm::launch_fused(problem->dtype, x, w, problem->m, problem->k, problem->n, problem->eps, splits,
                context->sm_count, context->fused_cluster_size, stream));
        return FLASHNORM_STATUS_OK;
    }
    size_t const needed = flashnorm::two_stream_layout(problem->m, problem->n, problem->dtype).total;
    if (workspace == nullptr || workspace_bytes < needed || reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
        return flashnorm::record_error(context, FLASHNORM_STATUS_WORKSPACE_TOO_SMALL, "flashnorm_matmul",
            "workspace missing, smaller than flashnorm_workspace_size() or not 256-byte aligned", "workspace");
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

int flashnorm_testing_join_dropped(void)
{
#ifdef FLASHNORM_TESTING_DROP_JOIN
    return 1;
#else
    return 0;
#endif
}

} // extern "C"
