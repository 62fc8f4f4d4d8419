// cublaslt_control: the control for compute-sanitizer racecheck on the self-test. It calls
// cublasLtMatmul alone, no FlashNorm code, for the GEMMs the library's strategies ask for: the
// norm→projection sites of benchmarks/shapes.py (whole N and each split width, W* sliced with
// ld = N, bf16, the library's workspace limit) at decode sizes, and the self-test's prenorm case
// k = 8200. Hazards racecheck reports here are cuBLAS's own, whatever FlashNorm does around them.
// Prints the algorithm cuBLASLt picked per GEMM; exits non-zero on any CUDA or cuBLASLt error.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CONTROL_CHECK(call)                                                                                            \
    do                                                                                                                 \
    {                                                                                                                  \
        long const code_ = static_cast<long>(call);                                                                    \
        if (code_ != 0)                                                                                                \
        {                                                                                                              \
            std::fprintf(stderr, "%s:%d %s failed with %ld\n", __FILE__, __LINE__, #call, code_);                   \
            std::exit(1);                                                                                              \
        }                                                                                                              \
    } while (0)

namespace
{

constexpr size_t kWorkspaceBytes = size_t(32) << 20; // the library's cuBLASLt workspace limit

struct Gemm
{
    int64_t m, k, n, ld; // x [m, k] · W*[:, n of ld columns]
};

// y[m, n] = x[m, k] · W[k, n], row-major, computed as the column-major yᵀ = Wᵀ·xᵀ (as the library does).
void run(cublasLtHandle_t handle, Gemm const& g, void const* x, void const* w, void* y, void* workspace)
{
    cublasLtMatmulDesc_t operation = nullptr;
    cublasLtMatrixLayout_t w_layout = nullptr, x_layout = nullptr, y_layout = nullptr;
    cublasLtMatmulPreference_t preference = nullptr;
    CONTROL_CHECK(cublasLtMatmulDescCreate(&operation, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CONTROL_CHECK(cublasLtMatrixLayoutCreate(&w_layout, CUDA_R_16BF, g.n, g.k, g.ld));
    CONTROL_CHECK(cublasLtMatrixLayoutCreate(&x_layout, CUDA_R_16BF, g.k, g.m, g.k));
    CONTROL_CHECK(cublasLtMatrixLayoutCreate(&y_layout, CUDA_R_16BF, g.n, g.m, g.n));
    CONTROL_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    CONTROL_CHECK(cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspaceBytes, sizeof(kWorkspaceBytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    CONTROL_CHECK(cublasLtMatmulAlgoGetHeuristic(
        handle, operation, w_layout, x_layout, y_layout, y_layout, preference, 1, &result, &found));
    if (found == 0)
    {
        std::fprintf(stderr, "no cuBLASLt algorithm for m=%ld k=%ld n=%ld\n", long(g.m), long(g.k), long(g.n));
        std::exit(1);
    }
    int algo = 0, split_k = 0;
    size_t written = 0;
    CONTROL_CHECK(cublasLtMatmulAlgoConfigGetAttribute(
        &result.algo, CUBLASLT_ALGO_CONFIG_ID, &algo, sizeof(algo), &written));
    CONTROL_CHECK(cublasLtMatmulAlgoConfigGetAttribute(
        &result.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k, sizeof(split_k), &written));
    float const alpha = 1.f, beta = 0.f;
    CONTROL_CHECK(cublasLtMatmul(handle, operation, &alpha, w, w_layout, x, x_layout, &beta, y, y_layout, y, y_layout,
        &result.algo, workspace, kWorkspaceBytes, nullptr));
    CONTROL_CHECK(cudaDeviceSynchronize());
    std::printf("m=%-3ld k=%-5ld n=%-6ld algo=%d split_k=%d\n", long(g.m), long(g.k), long(g.n), algo, split_k);
    cublasLtMatmulPreferenceDestroy(preference);
    cublasLtMatrixLayoutDestroy(y_layout);
    cublasLtMatrixLayoutDestroy(x_layout);
    cublasLtMatrixLayoutDestroy(w_layout);
    cublasLtMatmulDescDestroy(operation);
}

} // namespace

int main()
{
    // K, then N and its distinct split widths (benchmarks/shapes.py).
    int64_t const sites[][4] = {{576, 960, 576, 192}, {576, 3072, 1536, 0}, {2048, 3072, 2048, 512},
        {2048, 16384, 8192, 0}, {4096, 6144, 4096, 1024}, {4096, 28672, 14336, 0}};
    size_t const bytes = size_t(4096) * 28672 * 2;
    void *x = nullptr, *w = nullptr, *y = nullptr, *workspace = nullptr;
    CONTROL_CHECK(cudaMalloc(&x, bytes));
    CONTROL_CHECK(cudaMalloc(&w, bytes));
    CONTROL_CHECK(cudaMalloc(&y, bytes));
    CONTROL_CHECK(cudaMalloc(&workspace, kWorkspaceBytes));
    CONTROL_CHECK(cudaMemset(x, 0x3c, bytes)); // bf16 0x3c3c ≈ 0.0115: finite, never zero
    CONTROL_CHECK(cudaMemset(w, 0x3c, bytes));
    cublasLtHandle_t handle = nullptr;
    CONTROL_CHECK(cublasLtCreate(&handle));
    std::printf("cuBLASLt %zu\n", cublasLtGetVersion());
    for (auto const& site : sites)
    {
        for (int64_t const m : {1, 4, 16, 64})
        {
            for (int column = 1; column < 4; ++column)
            {
                if (site[column] > 0)
                    run(handle, {m, site[0], site[column], site[1]}, x, w, y, workspace);
            }
        }
    }
    run(handle, {3, 8200, 24, 32}, x, w, y, workspace); // flashnorm_selftest's prenorm case, splits 24 + 8
    run(handle, {3, 8200, 8, 32}, x, w, y, workspace);
    CONTROL_CHECK(cublasLtDestroy(handle));
    CONTROL_CHECK(cudaFree(workspace));
    CONTROL_CHECK(cudaFree(y));
    CONTROL_CHECK(cudaFree(w));
    CONTROL_CHECK(cudaFree(x));
    return 0;
}
