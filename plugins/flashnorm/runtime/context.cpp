#include "runtime/context.h"

#include <algorithm>
#include <functional>

#include "runtime/check.h"

namespace flashnorm
{
namespace
{

size_t element_bytes(flashnorm_dtype dtype)
{
    return dtype == FLASHNORM_DTYPE_F32 ? 4 : 2;
}

cudaDataType_t cuda_type(flashnorm_dtype dtype)
{
    switch (dtype)
    {
    case FLASHNORM_DTYPE_F16: return CUDA_R_16F;
    case FLASHNORM_DTYPE_BF16: return CUDA_R_16BF;
    case FLASHNORM_DTYPE_F32: break;
    }
    return CUDA_R_32F;
}

// Largest power of two (at most 256) dividing the address: what cuBLASLt may assume.
uint32_t alignment_of(void const* pointer)
{
    uintptr_t const address = reinterpret_cast<uintptr_t>(pointer);
    uint32_t alignment = 256;
    while (alignment > 1 && address % alignment != 0)
    {
        alignment >>= 1;
    }
    return alignment;
}

void destroy_plan(GemmPlan& plan)
{
    // Destruction cannot usefully fail; the status is not actionable here.
    if (plan.preference)
        cublasLtMatmulPreferenceDestroy(plan.preference);
    if (plan.product_layout)
        cublasLtMatrixLayoutDestroy(plan.product_layout);
    if (plan.x_layout)
        cublasLtMatrixLayoutDestroy(plan.x_layout);
    if (plan.w_layout)
        cublasLtMatrixLayoutDestroy(plan.w_layout);
    if (plan.operation)
        cublasLtMatmulDescDestroy(plan.operation);
    plan = GemmPlan{};
}

// Row-major y[m,n] = x[m,k]·W[k,n] is, read column-major, yᵀ[n,m] = Wᵀ[n,k]·xᵀ[k,m]: W is
// cuBLASLt's A (n×k, ld w_ld), x its B (k×m, ld k), the product its D (n×m, ld n); no transposes.
// A column slice of a wider W is the same A with its first column's address and ld = full N.
// fp32 uses CUBLAS_COMPUTE_32F, never the TF32 mode, so fp32 stays fp32 arithmetic.
flashnorm_status make_plan(flashnorm_context* context, GemmKey const& key, GemmPlan& plan)
{
    cudaDataType_t const io_type = cuda_type(key.dtype);
    cudaDataType_t const out_type = cuda_type(key.out_dtype);
    uint64_t const m = static_cast<uint64_t>(key.m);
    uint64_t const k = static_cast<uint64_t>(key.k);
    uint64_t const n = static_cast<uint64_t>(key.n);
    FLASHNORM_CHECK(context, cublasLtMatmulDescCreate(&plan.operation, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    FLASHNORM_CHECK(context, cublasLtMatrixLayoutCreate(&plan.w_layout, io_type, n, k, key.w_ld));
    FLASHNORM_CHECK(context, cublasLtMatrixLayoutCreate(&plan.x_layout, io_type, k, m, static_cast<int64_t>(k)));
    FLASHNORM_CHECK(
        context, cublasLtMatrixLayoutCreate(&plan.product_layout, out_type, n, m, static_cast<int64_t>(n)));
    if (key.batch > 1)
    {
        uint32_t const mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
        for (cublasLtMatrixLayout_t const layout : {plan.w_layout, plan.x_layout, plan.product_layout})
        {
            FLASHNORM_CHECK(context,
                cublasLtMatrixLayoutSetAttribute(
                    layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &key.batch, sizeof(key.batch)));
            FLASHNORM_CHECK(context,
                cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof(mode)));
        }
    }
    FLASHNORM_CHECK(context, cublasLtMatmulPreferenceCreate(&plan.preference));
    size_t const workspace_limit = kGemmWorkspaceBytes;
    FLASHNORM_CHECK(context,
        cublasLtMatmulPreferenceSetAttribute(plan.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &workspace_limit, sizeof(workspace_limit)));
    uint32_t const product_alignment = key.out_alignment;
    FLASHNORM_CHECK(context,
        cublasLtMatmulPreferenceSetAttribute(plan.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            &key.w_alignment, sizeof(key.w_alignment)));
    FLASHNORM_CHECK(context,
        cublasLtMatmulPreferenceSetAttribute(plan.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            &key.x_alignment, sizeof(key.x_alignment)));
    FLASHNORM_CHECK(context,
        cublasLtMatmulPreferenceSetAttribute(plan.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            &product_alignment, sizeof(product_alignment)));
    FLASHNORM_CHECK(context,
        cublasLtMatmulPreferenceSetAttribute(plan.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            &product_alignment, sizeof(product_alignment)));
    // Host-only query (no stream work), so a first call of a new shape inside a capture is fine.
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    FLASHNORM_CHECK(context,
        cublasLtMatmulAlgoGetHeuristic(context->cublas, plan.operation, plan.w_layout, plan.x_layout,
            plan.product_layout, plan.product_layout, plan.preference, 1, &result, &found));
    if (found == 0)
    {
        return record_error(context, FLASHNORM_STATUS_UNSUPPORTED, "cublasLtMatmulAlgoGetHeuristic",
            "no cuBLASLt algorithm for this shape and alignment", __FILE__);
    }
    plan.algorithm = result.algo;
    plan.workspace_bytes = result.workspaceSize;
    return FLASHNORM_STATUS_OK;
}

// Fork: the side stream's work enqueued after this starts only after everything enqueued on
// `stream` so far, and after the test hook's delay (flashnorm_testing_set_side_delay) if set.
flashnorm_status fork_side_stream(flashnorm_context* context, cudaStream_t stream)
{
    FLASHNORM_CHECK(context, cudaEventRecord(context->fork, stream));
    FLASHNORM_CHECK(context, cudaStreamWaitEvent(context->side_stream, context->fork, 0));
    if (context->side_delay_cycles > 0)
        FLASHNORM_CHECK(context, launch_delay(context->side_delay_cycles, context->side_stream));
    return FLASHNORM_STATUS_OK;
}

// Join: what `stream` gets enqueued after this starts only after the side stream's work so far.
// The race-test mutant (FLASHNORM_TESTING_DROP_JOIN) records the event but drops the wait.
flashnorm_status join_side_stream(flashnorm_context* context, cudaStream_t stream)
{
    FLASHNORM_CHECK(context, cudaEventRecord(context->join, context->side_stream));
#ifndef FLASHNORM_TESTING_DROP_JOIN
    FLASHNORM_CHECK(context, cudaStreamWaitEvent(stream, context->join, 0));
#endif
    return FLASHNORM_STATUS_OK;
}

flashnorm_status find_plan(flashnorm_context* context, GemmKey const& key, GemmPlan const** plan)
{
    auto const existing = context->plans.find(key);
    if (existing != context->plans.end())
    {
        *plan = &existing->second;
        return FLASHNORM_STATUS_OK;
    }
    GemmPlan fresh;
    flashnorm_status const status = make_plan(context, key, fresh);
    if (status != FLASHNORM_STATUS_OK)
    {
        destroy_plan(fresh);
        return status;
    }
    *plan = &context->plans.emplace(key, fresh).first->second;
    return FLASHNORM_STATUS_OK;
}

} // namespace

flashnorm_status record_error(
    flashnorm_context* context, flashnorm_status status, char const* what, char const* detail, char const* where)
{
    if (context != nullptr)
    {
        context->last_error = std::string(what) + ": " + detail + " (" + where + ")";
    }
    return status;
}

bool GemmKey::operator==(GemmKey const& other) const
{
    return m == other.m && k == other.k && n == other.n && w_ld == other.w_ld && dtype == other.dtype
        && out_dtype == other.out_dtype && x_alignment == other.x_alignment && w_alignment == other.w_alignment
        && out_alignment == other.out_alignment && batch == other.batch;
}

size_t GemmKeyHash::operator()(GemmKey const& key) const
{
    size_t hash = std::hash<int64_t>()(key.m);
    for (uint64_t part : {uint64_t(key.k), uint64_t(key.n), uint64_t(key.w_ld), uint64_t(key.dtype),
             uint64_t(key.out_dtype), uint64_t(key.x_alignment), uint64_t(key.w_alignment),
             uint64_t(key.out_alignment), uint64_t(key.batch)})
    {
        hash = hash * 1000003u ^ std::hash<uint64_t>()(part);
    }
    return hash;
}

flashnorm_status create_context(flashnorm_context* context)
{
    FLASHNORM_CHECK(context, cudaGetDevice(&context->device));
    FLASHNORM_CHECK(
        context, cudaDeviceGetAttribute(&context->sm_count, cudaDevAttrMultiProcessorCount, context->device));
    // Non-blocking: the side stream must not serialize with the legacy default stream.
    FLASHNORM_CHECK(context, cudaStreamCreateWithFlags(&context->side_stream, cudaStreamNonBlocking));
    FLASHNORM_CHECK(context, cudaEventCreateWithFlags(&context->fork, cudaEventDisableTiming));
    FLASHNORM_CHECK(context, cudaEventCreateWithFlags(&context->join, cudaEventDisableTiming));
    FLASHNORM_CHECK(context, cublasLtCreate(&context->cublas));
    FLASHNORM_CHECK(context, configure_fused_kernels());
    int major = 0;
    int minor = 0;
    FLASHNORM_CHECK(context, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, context->device));
    FLASHNORM_CHECK(context, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, context->device));
    context->epilogue_scale_usable = epilogue_scale_built() && major == 9 && minor == 0;
    if (context->epilogue_scale_usable)
        FLASHNORM_CHECK(context, configure_epilogue_scale_kernels());
    return FLASHNORM_STATUS_OK;
}

void destroy_context(flashnorm_context* context)
{
    for (auto& entry : context->plans)
    {
        destroy_plan(entry.second);
    }
    context->plans.clear();
    // Teardown: statuses are not actionable; pending side-stream work completes on its own.
    if (context->cublas)
        cublasLtDestroy(context->cublas);
    if (context->join)
        cudaEventDestroy(context->join);
    if (context->fork)
        cudaEventDestroy(context->fork);
    if (context->side_stream)
        cudaStreamDestroy(context->side_stream);
}

flashnorm_status run_two_stream(flashnorm_context* context, flashnorm_problem const& problem, void const* x,
    void const* w, OutputSplits const& splits, void* workspace, cudaStream_t stream)
{
    TwoStreamLayout const layout = two_stream_layout(problem.m, problem.n, problem.dtype);
    char* const base = static_cast<char*>(workspace);
    float* const inv_rms = reinterpret_cast<float*>(base);
    void* const product = base + layout.product_offset;
    void* const gemm_workspace = base + layout.gemm_workspace_offset;

    flashnorm_dtype const product_type = product_dtype(problem.dtype);
    GemmKey const key{problem.m, problem.k, problem.n, problem.n, problem.dtype, product_type, alignment_of(x),
        alignment_of(w), alignment_of(product)};
    GemmPlan const* plan = nullptr;
    flashnorm_status status = find_plan(context, key, &plan);
    if (status != FLASHNORM_STATUS_OK)
    {
        return status;
    }

    // The side stream starts only after everything the caller enqueued before this call.
    status = fork_side_stream(context, stream);
    if (status != FLASHNORM_STATUS_OK)
        return status;
    FLASHNORM_CHECK(
        context, launch_inv_rms(problem.dtype, x, problem.m, problem.k, problem.eps, inv_rms, context->side_stream));

    float const alpha = 1.f;
    float const beta = 0.f;
    FLASHNORM_CHECK(context,
        cublasLtMatmul(context->cublas, plan->operation, &alpha, w, plan->w_layout, x, plan->x_layout, &beta, product,
            plan->product_layout, product, plan->product_layout, &plan->algorithm, gemm_workspace,
            plan->workspace_bytes, stream));

    // The post-scale reads inv_rms, so the caller's stream waits for the side stream here.
    status = join_side_stream(context, stream);
    if (status != FLASHNORM_STATUS_OK)
        return status;
    FLASHNORM_CHECK(context,
        launch_post_scale(problem.dtype, product_type, product, inv_rms, problem.m, problem.n, splits, stream));
    return FLASHNORM_STATUS_OK;
}

flashnorm_status run_prenorm(flashnorm_context* context, flashnorm_problem const& problem, void const* x,
    void const* w, OutputSplits const& splits, void* workspace, cudaStream_t stream)
{
    SplitRun runs[FLASHNORM_MAX_OUTPUTS];
    int const run_count = split_runs(problem, runs);
    PrenormLayout const layout = prenorm_layout(problem.m, problem.k, problem.dtype, run_count);
    char* const base = static_cast<char*>(workspace);
    void* const normalized = base;
    void const** const table = reinterpret_cast<void const**>(base + layout.pointer_table_offset);
    size_t const element = element_bytes(problem.dtype);
    auto const w_slice = [&](int split) -> void const* {
        return static_cast<char const*>(w) + element * static_cast<size_t>(splits.offsets[split]);
    };

    // Every plan first (host only): a failure then leaves nothing enqueued. A run of several
    // splits reads its W slices, x̂ and outputs from three arrays of the pointer table.
    GemmPlan const* plans[FLASHNORM_MAX_OUTPUTS] = {};
    void const* a_operands[FLASHNORM_MAX_OUTPUTS] = {};
    void const* b_operands[FLASHNORM_MAX_OUTPUTS] = {};
    void* d_operands[FLASHNORM_MAX_OUTPUTS] = {};
    PointerTable pointers{};
    pointers.destination = table;
    int widest = 0;
    for (int r = 0; r < run_count; ++r)
    {
        SplitRun const& run = runs[r];
        uint32_t w_alignment = alignment_of(w_slice(run.first));
        uint32_t out_alignment = alignment_of(splits.outputs[run.first]);
        if (run.count == 1)
        {
            a_operands[r] = w_slice(run.first);
            b_operands[r] = normalized;
            d_operands[r] = splits.outputs[run.first];
        }
        else
        {
            void const** const arrays = pointers.values + pointers.count;
            for (int i = 0; i < run.count; ++i)
            {
                arrays[i] = w_slice(run.first + i);
                arrays[run.count + i] = normalized;
                arrays[2 * run.count + i] = splits.outputs[run.first + i];
                w_alignment = std::min(w_alignment, alignment_of(arrays[i]));
                out_alignment = std::min(out_alignment, alignment_of(arrays[2 * run.count + i]));
            }
            a_operands[r] = table + pointers.count;
            b_operands[r] = table + pointers.count + run.count;
            d_operands[r] = table + pointers.count + 2 * run.count;
            pointers.count += 3 * run.count;
        }
        GemmKey const key{problem.m, problem.k, run.width, problem.n, problem.dtype, problem.dtype,
            alignment_of(normalized), w_alignment, out_alignment, run.count};
        flashnorm_status const status = find_plan(context, key, &plans[r]);
        if (status != FLASHNORM_STATUS_OK)
        {
            return status;
        }
        widest = run.columns() > runs[widest].columns() ? r : widest;
    }

    float const alpha = 1.f;
    float const beta = 0.f;
    auto gemm = [&](int r, void* gemm_workspace, cudaStream_t on) {
        GemmPlan const* const plan = plans[r];
        return cublasLtMatmul(context->cublas, plan->operation, &alpha, a_operands[r], plan->w_layout, b_operands[r],
            plan->x_layout, &beta, d_operands[r], plan->product_layout, d_operands[r], plan->product_layout,
            &plan->algorithm, gemm_workspace, plan->workspace_bytes, on);
    };

    // The normalize kernel also writes the pointer table (before any GEMM reads it).
    FLASHNORM_CHECK(context,
        launch_normalize_rows(problem.dtype, x, normalized, problem.m, problem.k, problem.eps, pointers, stream));
    bool const forked = run_count > 1;
    if (forked)
    {
        // A narrow run's GEMM alone leaves most of the GPU idle (kernels/DESIGN.md, prenorm): the
        // narrow ones run on the side stream, one after another on its own cuBLASLt workspace,
        // while the widest runs here. Fork after x̂ and the table are written: they all read them.
        flashnorm_status const status = fork_side_stream(context, stream);
        if (status != FLASHNORM_STATUS_OK)
            return status;
        for (int r = 0; r < run_count; ++r)
        {
            if (r != widest)
                FLASHNORM_CHECK(context, gemm(r, base + layout.side_gemm_workspace_offset, context->side_stream));
        }
    }
    FLASHNORM_CHECK(context, gemm(widest, base + layout.gemm_workspace_offset, stream));
    // The narrow outputs are written before anything the caller enqueues next.
    return forked ? join_side_stream(context, stream) : FLASHNORM_STATUS_OK;
}

} // namespace flashnorm
