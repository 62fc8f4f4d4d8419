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

// The bias epilogue's attributes (key.bias), with `bias` as the pointer the heuristic judges the
// alignment of. A bias cuBLASLt does not take is UNSUPPORTED, as a shape without an algorithm is.
flashnorm_status set_bias(flashnorm_context* context, GemmKey const& key, GemmPlan& plan, void const* bias)
{
    uint32_t const epilogue = CUBLASLT_EPILOGUE_BIAS;
    int32_t const type = key.bias.type;
    int64_t const stride = key.n; // a batch's biases are its splits' slices, one width apart
    bool const set = cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                         sizeof(epilogue))
            == CUBLAS_STATUS_SUCCESS
        && cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type, sizeof(type))
            == CUBLAS_STATUS_SUCCESS
        && cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias))
            == CUBLAS_STATUS_SUCCESS
        && (key.batch == 1
            || cublasLtMatmulDescSetAttribute(
                   plan.operation, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &stride, sizeof(stride))
                == CUBLAS_STATUS_SUCCESS);
    return set ? FLASHNORM_STATUS_OK
               : record_error(context, FLASHNORM_STATUS_UNSUPPORTED, "cublasLtMatmulDescSetAttribute",
                   "cuBLASLt takes no bias epilogue of this type here", __FILE__);
}

// Row-major y[m,n] = x[m,k]·W[k,n] is, read column-major, yᵀ[n,m] = Wᵀ[n,k]·xᵀ[k,m]: W is
// cuBLASLt's A (n×k, ld w_ld), x its B (k×m, ld k), the product its D (n×m, ld n); no transposes.
// A column slice of a wider W is the same A with its first column's address and ld = full N. D's
// rows are then y's columns, so the bias epilogue (a vector over D's rows) adds bias[column].
// fp32 uses CUBLAS_COMPUTE_32F, never the TF32 mode, so fp32 stays fp32 arithmetic.
flashnorm_status make_plan(flashnorm_context* context, GemmKey const& key, void const* bias, GemmPlan& plan)
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
    if (key.bias.type != GemmBias::kNoBias)
    {
        flashnorm_status const status = set_bias(context, key, plan, bias);
        if (status != FLASHNORM_STATUS_OK)
            return status;
    }
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
    // cuBLASLt answers a combination it has no kernel for (a bias type beside these outputs, say)
    // with NOT_SUPPORTED or with no result: both are UNSUPPORTED here, which prenorm's bias falls back on.
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t const asked = cublasLtMatmulAlgoGetHeuristic(context->cublas, plan.operation, plan.w_layout,
        plan.x_layout, plan.product_layout, plan.product_layout, plan.preference, 1, &result, &found);
    if (asked != CUBLAS_STATUS_SUCCESS && asked != CUBLAS_STATUS_NOT_SUPPORTED)
        FLASHNORM_CHECK(context, asked);
    if (asked == CUBLAS_STATUS_NOT_SUPPORTED || found == 0)
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

// The plan for `key` (made on first use; `bias` is the pointer a new plan's heuristic judges). A key
// with no algorithm answers UNSUPPORTED on every call, from the cache after the first.
flashnorm_status find_plan(flashnorm_context* context, GemmKey const& key, void const* bias, GemmPlan const** plan)
{
    auto const existing = context->plans.find(key);
    if (existing != context->plans.end())
    {
        *plan = &existing->second;
        return existing->second.usable
            ? FLASHNORM_STATUS_OK
            : record_error(context, FLASHNORM_STATUS_UNSUPPORTED, "cuBLASLt", "no algorithm for this GEMM", __FILE__);
    }
    GemmPlan fresh;
    flashnorm_status const status = make_plan(context, key, bias, fresh);
    if (status != FLASHNORM_STATUS_OK)
    {
        destroy_plan(fresh);
        if (status == FLASHNORM_STATUS_UNSUPPORTED)
        {
            GemmPlan refused;
            refused.usable = false;
            context->plans.emplace(key, refused);
        }
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
        && out_alignment == other.out_alignment && batch == other.batch && bias == other.bias;
}

size_t GemmKeyHash::operator()(GemmKey const& key) const
{
    size_t hash = std::hash<int64_t>()(key.m);
    for (uint64_t part : {uint64_t(key.k), uint64_t(key.n), uint64_t(key.w_ld), uint64_t(key.dtype),
             uint64_t(key.out_dtype), uint64_t(key.x_alignment), uint64_t(key.w_alignment),
             uint64_t(key.out_alignment), uint64_t(key.batch), uint64_t(int64_t(key.bias.type)),
             uint64_t(key.bias.alignment)})
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
    void const* w, float const* bias, OutputSplits const& splits, void* workspace, cudaStream_t stream)
{
    TwoStreamLayout const layout = two_stream_layout(problem.m, problem.n, problem.dtype);
    char* const base = static_cast<char*>(workspace);
    float* const scales = reinterpret_cast<float*>(base);
    void* const product = base + layout.product_offset;
    void* const gemm_workspace = base + layout.gemm_workspace_offset;

    flashnorm_dtype const product_type = product_dtype(problem.dtype);
    GemmKey const key{problem.m, problem.k, problem.n, problem.n, problem.dtype, product_type, alignment_of(x),
        alignment_of(w), alignment_of(product)};
    GemmPlan const* plan = nullptr;
    flashnorm_status status = find_plan(context, key, nullptr, &plan);
    if (status != FLASHNORM_STATUS_OK)
    {
        return status;
    }

    // The side stream starts only after everything the caller enqueued before this call.
    status = fork_side_stream(context, stream);
    if (status != FLASHNORM_STATUS_OK)
        return status;
    FLASHNORM_CHECK(context,
        launch_row_scales(
            problem.dtype, x, problem.m, problem.k, row_norm(problem, bias), scales, context->side_stream));

    float const alpha = 1.f;
    float const beta = 0.f;
    FLASHNORM_CHECK(context,
        cublasLtMatmul(context->cublas, plan->operation, &alpha, w, plan->w_layout, x, plan->x_layout, &beta, product,
            plan->product_layout, product, plan->product_layout, &plan->algorithm, gemm_workspace,
            plan->workspace_bytes, stream));

    // The post-scale reads the scales, so the caller's stream waits for the side stream here.
    status = join_side_stream(context, stream);
    if (status != FLASHNORM_STATUS_OK)
        return status;
    FLASHNORM_CHECK(context,
        launch_post_scale(problem.dtype, product_type, product, scales, bias, problem.m, problem.n, splits, stream));
    return FLASHNORM_STATUS_OK;
}

namespace
{

// One cuBLASLt call of prenorm: a split's GEMM, or a run's pointer-array batch (A, B and D then
// point to arrays in the workspace's pointer table), with its bias (or none).
struct PrenormGemm
{
    GemmPlan const* plan = nullptr;
    void const* a = nullptr;
    void const* b = nullptr;
    void* d = nullptr;
    void const* bias = nullptr;
    int run = 0;
};

// The GEMMs of every run with the bias in `bias_type` (GemmBias::kNoBias: none) read from `biases`
// (the call's fp32 bias, or its rounding in the workspace), planned on the host (nothing enqueued);
// a batch cuBLASLt refuses with that bias runs split by split. UNSUPPORTED where a GEMM has no
// algorithm. `pointers` gets the batches' arrays.
flashnorm_status plan_prenorm_gemms(flashnorm_context* context, flashnorm_problem const& problem, void const* w,
    void const* normalized, void const** table, OutputSplits const& splits, SplitRun const* runs, int run_count,
    int32_t bias_type, char const* biases, PointerTable& pointers, PrenormGemm (&gemms)[FLASHNORM_MAX_OUTPUTS],
    int& gemm_count)
{
    size_t const element = element_bytes(problem.dtype);
    size_t const bias_element = bias_type == CUDA_R_32F ? sizeof(float) : element;
    auto const w_slice = [&](int split) -> void const* {
        return static_cast<char const*>(w) + element * static_cast<size_t>(splits.offsets[split]);
    };
    auto const bias_slice = [&](int split) -> void const* {
        return biases == nullptr ? nullptr : biases + bias_element * static_cast<size_t>(splits.offsets[split]);
    };
    auto const bias_of = [&](void const* first, uint32_t alignment) {
        return bias_type == GemmBias::kNoBias ? GemmBias{} : GemmBias{bias_type, std::min(alignment, alignment_of(first))};
    };
    pointers.count = 0;
    gemm_count = 0;
    for (int r = 0; r < run_count; ++r)
    {
        SplitRun const& run = runs[r];
        if (run.count > 1)
        {
            uint32_t w_alignment = 256;
            uint32_t out_alignment = 256;
            uint32_t bias_alignment = 256;
            void const** const arrays = pointers.values + pointers.count;
            for (int i = 0; i < run.count; ++i)
            {
                arrays[i] = w_slice(run.first + i);
                arrays[run.count + i] = normalized;
                arrays[2 * run.count + i] = splits.outputs[run.first + i];
                w_alignment = std::min(w_alignment, alignment_of(arrays[i]));
                out_alignment = std::min(out_alignment, alignment_of(arrays[2 * run.count + i]));
                bias_alignment = std::min(bias_alignment, alignment_of(bias_slice(run.first + i)));
            }
            GemmKey const key{problem.m, problem.k, run.width, problem.n, problem.dtype, problem.dtype,
                alignment_of(normalized), w_alignment, out_alignment, run.count,
                bias_of(bias_slice(run.first), bias_alignment)};
            GemmPlan const* plan = nullptr;
            flashnorm_status const status = find_plan(context, key, bias_slice(run.first), &plan);
            if (status == FLASHNORM_STATUS_OK)
            {
                gemms[gemm_count++] = {plan, table + pointers.count, table + pointers.count + run.count,
                    const_cast<void**>(table + pointers.count + 2 * run.count), bias_slice(run.first), r};
                pointers.count += 3 * run.count;
                continue;
            }
            if (status != FLASHNORM_STATUS_UNSUPPORTED || bias_type == GemmBias::kNoBias)
                return status;
        }
        for (int split = run.first; split < run.first + run.count; ++split)
        {
            GemmKey const key{problem.m, problem.k, run.width, problem.n, problem.dtype, problem.dtype,
                alignment_of(normalized), alignment_of(w_slice(split)), alignment_of(splits.outputs[split]), 1,
                bias_of(bias_slice(split), 256)};
            GemmPlan const* plan = nullptr;
            flashnorm_status const status = find_plan(context, key, bias_slice(split), &plan);
            if (status != FLASHNORM_STATUS_OK)
                return status;
            gemms[gemm_count++] = {plan, w_slice(split), normalized, splits.outputs[split], bias_slice(split), r};
        }
    }
    return FLASHNORM_STATUS_OK;
}

} // namespace

flashnorm_status run_prenorm(flashnorm_context* context, flashnorm_problem const& problem, void const* x,
    void const* w, float const* bias, OutputSplits const& splits, void* workspace, cudaStream_t stream)
{
    SplitRun runs[FLASHNORM_MAX_OUTPUTS];
    int const run_count = split_runs(problem, runs);
    PrenormLayout const layout = prenorm_layout(problem.m, problem.k, problem.n, problem.dtype, run_count);
    char* const base = static_cast<char*>(workspace);
    void* const normalized = base;
    void const** const table = reinterpret_cast<void const**>(base + layout.pointer_table_offset);
    void* const rounded_bias = base + layout.bias_offset;

    // Every plan first (host only): a failure then leaves nothing enqueued. The bias goes into the
    // GEMMs' epilogue in fp32 where cuBLASLt takes it beside these outputs, else rounded to their type
    // (the normalize kernel rounds it into the workspace).
    PointerTable pointers{};
    pointers.destination = table;
    PrenormGemm gemms[FLASHNORM_MAX_OUTPUTS];
    int gemm_count = 0;
    RoundedBias rounding{};
    flashnorm_status status = FLASHNORM_STATUS_OK;
    if (bias == nullptr)
    {
        status = plan_prenorm_gemms(context, problem, w, normalized, table, splits, runs, run_count,
            GemmBias::kNoBias, nullptr, pointers, gemms, gemm_count);
    }
    else
    {
        status = plan_prenorm_gemms(context, problem, w, normalized, table, splits, runs, run_count, CUDA_R_32F,
            reinterpret_cast<char const*>(bias), pointers, gemms, gemm_count);
        if (status == FLASHNORM_STATUS_UNSUPPORTED && problem.dtype != FLASHNORM_DTYPE_F32)
        {
            rounding = RoundedBias{bias, rounded_bias, problem.n};
            status = plan_prenorm_gemms(context, problem, w, normalized, table, splits, runs, run_count,
                cuda_type(problem.dtype), static_cast<char const*>(rounded_bias), pointers, gemms, gemm_count);
        }
    }
    if (status != FLASHNORM_STATUS_OK)
        return status;
    int widest = 0;
    for (int r = 0; r < run_count; ++r)
        widest = runs[r].columns() > runs[widest].columns() ? r : widest;

    float const alpha = 1.f;
    float const beta = 0.f;
    auto gemm = [&](PrenormGemm const& call, void* gemm_workspace, cudaStream_t on) {
        GemmPlan const* const plan = call.plan;
        if (call.bias != nullptr)
        {
            // Host-side descriptor state, read when the GEMM is enqueued (a capture records it).
            cublasStatus_t const set = cublasLtMatmulDescSetAttribute(
                plan->operation, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &call.bias, sizeof(call.bias));
            if (set != CUBLAS_STATUS_SUCCESS)
                return set;
        }
        return cublasLtMatmul(context->cublas, plan->operation, &alpha, call.a, plan->w_layout, call.b,
            plan->x_layout, &beta, call.d, plan->product_layout, call.d, plan->product_layout, &plan->algorithm,
            gemm_workspace, plan->workspace_bytes, on);
    };

    // The normalize kernel also writes the pointer table and the rounded bias (before any GEMM reads them).
    FLASHNORM_CHECK(context,
        launch_normalize_rows(problem.dtype, x, normalized, problem.m, problem.k, row_norm(problem, bias), pointers,
            rounding, stream));
    bool const forked = run_count > 1;
    if (forked)
    {
        // A narrow run's GEMM alone leaves most of the GPU idle (kernels/DESIGN.md, prenorm): the
        // narrow ones run on the side stream, one after another on its own cuBLASLt workspace,
        // while the widest runs here. Fork after x̂ and the table are written: they all read them.
        status = fork_side_stream(context, stream);
        if (status != FLASHNORM_STATUS_OK)
            return status;
        for (int g = 0; g < gemm_count; ++g)
        {
            if (gemms[g].run != widest)
                FLASHNORM_CHECK(context, gemm(gemms[g], base + layout.side_gemm_workspace_offset, context->side_stream));
        }
    }
    for (int g = 0; g < gemm_count; ++g)
    {
        if (gemms[g].run == widest)
            FLASHNORM_CHECK(context, gemm(gemms[g], base + layout.gemm_workspace_offset, stream));
    }
    // The narrow outputs are written before anything the caller enqueues next.
    return forked ? join_side_stream(context, stream) : FLASHNORM_STATUS_OK;
}

} // namespace flashnorm
