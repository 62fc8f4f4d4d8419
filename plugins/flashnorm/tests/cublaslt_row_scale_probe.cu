// cublaslt_row_scale_probe: does cuBLASLt take FlashNorm's per-token scale inside a bf16 GEMM?
// For the site shapes, asks cublasLtMatmulAlgoGetHeuristic (bf16 A, B, D; fp32 compute and scale)
// for three ways of passing a vector of scales along the token dimension:
//   alpha-vector  CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_ZERO, tokens as the GEMM's M
//                 (x·W with CUBLASLT_ORDER_ROW layouts: D's rows are the tokens);
//   b-outer-vec   CUBLASLT_MATMUL_DESC_B_SCALE_MODE = OUTER_VEC_32F in the library's own form
//                 yᵀ = W*ᵀ·xᵀ (column-major; B = xᵀ, one scale per column of B = per token);
//   a-outer-vec   CUBLASLT_MATMUL_DESC_A_SCALE_MODE = OUTER_VEC_32F with A = x (ORDER_ROW).
// and, as the control, the same layouts with a host scalar alpha. Prints the status and the number
// of algorithms for each; exits 0 whatever cuBLASLt answers (it reports, it does not assert).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace
{

struct Shape
{
    int64_t m, k, n;
};

enum class Mode
{
    HostScalar,
    AlphaVector,
    BOuterVector,
    AOuterVector
};

char const* name(Mode mode)
{
    switch (mode)
    {
    case Mode::HostScalar: return "host-scalar";
    case Mode::AlphaVector: return "alpha-vector";
    case Mode::BOuterVector: return "b-outer-vec";
    case Mode::AOuterVector: return "a-outer-vec";
    }
    return "?";
}

// One heuristic query; returns the algorithm count, or -status when a call refused.
int query(cublasLtHandle_t handle, Shape const& s, Mode mode, bool tokens_first)
{
    cublasLtMatmulDesc_t operation = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulPreference_t preference = nullptr;
    int result = 0;
    auto refuse = [&](cublasStatus_t status) { result = status == CUBLAS_STATUS_SUCCESS ? result : -int(status); };
    refuse(cublasLtMatmulDescCreate(&operation, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasLtOrder_t const row = CUBLASLT_ORDER_ROW;
    if (tokens_first) // D[m, n] = x[m, k] · W[k, n], all row-major
    {
        refuse(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, s.m, s.k, s.k));
        refuse(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, s.k, s.n, s.n));
        refuse(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, s.m, s.n, s.n));
        for (auto layout : {a, b, d})
            refuse(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_ORDER, &row, sizeof(row)));
    }
    else // column-major yᵀ[n, m] = W*ᵀ[n, k] · xᵀ[k, m] (the library's form)
    {
        refuse(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, s.n, s.k, s.n));
        refuse(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, s.k, s.m, s.k));
        refuse(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, s.n, s.m, s.n));
    }
    if (mode == Mode::AlphaVector)
    {
        cublasLtPointerMode_t const pointer = CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_ZERO;
        refuse(cublasLtMatmulDescSetAttribute(operation, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer, sizeof(pointer)));
    }
    else if (mode == Mode::BOuterVector || mode == Mode::AOuterVector)
    {
        int32_t const scale = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        auto const attribute
            = mode == Mode::BOuterVector ? CUBLASLT_MATMUL_DESC_B_SCALE_MODE : CUBLASLT_MATMUL_DESC_A_SCALE_MODE;
        refuse(cublasLtMatmulDescSetAttribute(operation, attribute, &scale, sizeof(scale)));
    }
    refuse(cublasLtMatmulPreferenceCreate(&preference));
    size_t const workspace = size_t(32) << 20;
    refuse(cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace)));
    if (result == 0)
    {
        cublasLtMatmulHeuristicResult_t found[8];
        int count = 0;
        cublasStatus_t const status
            = cublasLtMatmulAlgoGetHeuristic(handle, operation, a, b, d, d, preference, 8, found, &count);
        result = status == CUBLAS_STATUS_SUCCESS ? count : -int(status);
    }
    cublasLtMatmulPreferenceDestroy(preference);
    for (auto layout : {a, b, d})
        cublasLtMatrixLayoutDestroy(layout);
    cublasLtMatmulDescDestroy(operation);
    return result;
}

} // namespace

int main()
{
    cublasLtHandle_t handle = nullptr;
    if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS)
    {
        std::fprintf(stderr, "cublasLtCreate failed\n");
        return 1;
    }
    std::printf("cuBLASLt %zu; bf16 A/B/D, fp32 compute and scale; value: algorithms found, or -status\n",
        cublasLtGetVersion());
    Shape const shapes[] = {{1, 576, 960}, {16, 576, 3072}, {256, 2048, 3072}, {1024, 4096, 6144}};
    for (Shape const& s : shapes)
    {
        std::printf("m=%-5ld k=%-5ld n=%-5ld", long(s.m), long(s.k), long(s.n));
        std::printf("  tokens-first: %s %d, %s %d, %s %d", name(Mode::HostScalar), query(handle, s, Mode::HostScalar, true),
            name(Mode::AlphaVector), query(handle, s, Mode::AlphaVector, true), name(Mode::AOuterVector),
            query(handle, s, Mode::AOuterVector, true));
        std::printf("  | library form: %s %d, %s %d\n", name(Mode::HostScalar), query(handle, s, Mode::HostScalar, false),
            name(Mode::BOuterVector), query(handle, s, Mode::BOuterVector, false));
    }
    cublasLtDestroy(handle);
    return 0;
}
