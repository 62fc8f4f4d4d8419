// Runs every strategy of the C ABI on small problems (all dtypes, several splits, tails in K
// and N, M above one row pass, a delayed side stream, a CUDA-graph capture, AUTO on a given
// multiprocessor count in the workspace sized for that count, both statistics with and without a
// bias, rows whose mean is a thousand times their spread) and compares each output element with a
// float64 host reference. Small on purpose: it runs under compute-sanitizer.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "flashnorm/flashnorm.h"

namespace
{

int g_failures = 0;

#define SELFTEST_CUDA(call)                                                                                     \
    do                                                                                                          \
    {                                                                                                           \
        cudaError_t const selftest_error_ = (call);                                                             \
        if (selftest_error_ != cudaSuccess)                                                                     \
        {                                                                                                       \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(selftest_error_)); \
            std::exit(2);                                                                                       \
        }                                                                                                       \
    } while (0)

size_t element_bytes(flashnorm_dtype dtype)
{
    return dtype == FLASHNORM_DTYPE_F32 ? 4 : 2;
}

// Host-side encode/decode of one element of `dtype`, stored in a byte vector.
void encode(flashnorm_dtype dtype, std::vector<uint8_t>& bytes, size_t index, float value)
{
    if (dtype == FLASHNORM_DTYPE_F32)
        reinterpret_cast<float*>(bytes.data())[index] = value;
    else if (dtype == FLASHNORM_DTYPE_F16)
        reinterpret_cast<__half*>(bytes.data())[index] = __float2half_rn(value);
    else
        reinterpret_cast<__nv_bfloat16*>(bytes.data())[index] = __float2bfloat16_rn(value);
}

double decode(flashnorm_dtype dtype, std::vector<uint8_t> const& bytes, size_t index)
{
    if (dtype == FLASHNORM_DTYPE_F32)
        return reinterpret_cast<float const*>(bytes.data())[index];
    if (dtype == FLASHNORM_DTYPE_F16)
        return __half2float(reinterpret_cast<__half const*>(bytes.data())[index]);
    return __bfloat162float(reinterpret_cast<__nv_bfloat16 const*>(bytes.data())[index]);
}

double tolerance(flashnorm_dtype dtype)
{
    return dtype == FLASHNORM_DTYPE_F32 ? 1e-4 : (dtype == FLASHNORM_DTYPE_F16 ? 4e-3 : 2e-2);
}

char const* name(flashnorm_dtype dtype)
{
    return dtype == FLASHNORM_DTYPE_F32 ? "f32" : (dtype == FLASHNORM_DTYPE_F16 ? "f16" : "bf16");
}

char const* strategy_name(flashnorm_strategy strategy)
{
    switch (strategy)
    {
    case FLASHNORM_STRATEGY_FUSED: return "fused";
    case FLASHNORM_STRATEGY_TWO_STREAM: return "two_stream";
    case FLASHNORM_STRATEGY_PRENORM: return "prenorm";
    case FLASHNORM_STRATEGY_EPILOGUE_SCALE: return "epilogue_scale";
    case FLASHNORM_STRATEGY_AUTO: break;
    }
    return "auto";
}

struct Case
{
    flashnorm_dtype dtype;
    flashnorm_strategy strategy;
    int64_t m, k;
    std::vector<int64_t> splits;
    int64_t side_delay;
    bool captured;
    int32_t strip_cols = 0; // the fused kernel's layout, forced where non-zero
    int32_t cluster_size = 0;
    int32_t multiprocessors = 0; // AUTO's count (flashnorm_problem.multiprocessors; 0: the device's)
    flashnorm_statistic statistic = FLASHNORM_STATISTIC_RMS;
    bool bias = false;
    float mean = 0.f; // each row's mean, in units of its spread (variance cases: 1000 tests the shifted sums)
};

char const* statistic_name(flashnorm_statistic statistic)
{
    return statistic == FLASHNORM_STATISTIC_VARIANCE ? "variance" : "rms";
}

void run_case(flashnorm_context* context, std::mt19937& rng, Case const& c)
{
    flashnorm_problem problem{};
    problem.m = c.m;
    problem.k = c.k;
    problem.num_outputs = static_cast<int32_t>(c.splits.size());
    for (size_t i = 0; i < c.splits.size(); ++i)
    {
        problem.split_sizes[i] = c.splits[i];
        problem.n += c.splits[i];
    }
    problem.dtype = c.dtype;
    problem.eps = 1e-5f;
    problem.strategy = c.strategy;
    problem.multiprocessors = c.multiprocessors;
    problem.statistic = c.statistic;
    int64_t const m = c.m, k = c.k, n = problem.n;
    size_t const bytes = element_bytes(c.dtype);

    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<uint8_t> x(m * k * bytes), w(k * n * bytes);
    for (int64_t r = 0; r < m; ++r)
    {
        float const row_scale = std::pow(10.f, std::uniform_real_distribution<float>(-2.f, 1.f)(rng));
        float const row_mean = (r % 2 ? -c.mean : c.mean) * row_scale;
        for (int64_t i = 0; i < k; ++i)
            encode(c.dtype, x, r * k + i, row_mean + normal(rng) * row_scale);
    }
    for (int64_t i = 0; i < k * n; ++i)
        encode(c.dtype, w, i, normal(rng) / std::sqrt(float(k)));
    std::vector<float> bias(c.bias ? n : 0);
    for (float& value : bias)
        value = normal(rng);

    void *x_device = nullptr, *w_device = nullptr, *workspace = nullptr;
    float* bias_device = nullptr;
    std::vector<void*> outputs(c.splits.size());
    SELFTEST_CUDA(cudaMalloc(&x_device, x.size()));
    SELFTEST_CUDA(cudaMalloc(&w_device, w.size()));
    SELFTEST_CUDA(cudaMemcpy(x_device, x.data(), x.size(), cudaMemcpyHostToDevice));
    SELFTEST_CUDA(cudaMemcpy(w_device, w.data(), w.size(), cudaMemcpyHostToDevice));
    if (c.bias)
    {
        SELFTEST_CUDA(cudaMalloc(&bias_device, n * sizeof(float)));
        SELFTEST_CUDA(cudaMemcpy(bias_device, bias.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    }
    for (size_t i = 0; i < c.splits.size(); ++i)
    {
        SELFTEST_CUDA(cudaMalloc(&outputs[i], m * c.splits[i] * bytes));
        SELFTEST_CUDA(cudaMemset(outputs[i], 0xff, m * c.splits[i] * bytes)); // NaN in every dtype
    }
    size_t const workspace_bytes = flashnorm_workspace_size(&problem);
    if (workspace_bytes > 0)
        SELFTEST_CUDA(cudaMalloc(&workspace, workspace_bytes));

    cudaStream_t stream = nullptr;
    SELFTEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    flashnorm_testing_set_side_delay(context, c.side_delay);
    flashnorm_status status = flashnorm_testing_set_fused_tuning(context, c.strip_cols, c.cluster_size);
    if (c.captured)
    {
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        SELFTEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        if (status == FLASHNORM_STATUS_OK)
            status = flashnorm_matmul(context, &problem, x_device, w_device, bias_device, outputs.data(), workspace,
                workspace_bytes, stream);
        SELFTEST_CUDA(cudaStreamEndCapture(stream, &graph));
        SELFTEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
        for (int replay = 0; replay < 3; ++replay)
            SELFTEST_CUDA(cudaGraphLaunch(exec, stream));
        SELFTEST_CUDA(cudaGraphExecDestroy(exec));
        SELFTEST_CUDA(cudaGraphDestroy(graph));
    }
    else if (status == FLASHNORM_STATUS_OK)
    {
        status = flashnorm_matmul(context, &problem, x_device, w_device, bias_device, outputs.data(), workspace,
            workspace_bytes, stream);
    }
    SELFTEST_CUDA(cudaStreamSynchronize(stream));
    flashnorm_testing_set_side_delay(context, 0);
    flashnorm_testing_set_fused_tuning(context, 0, 0);
    if (status != FLASHNORM_STATUS_OK)
    {
        std::fprintf(stderr, "FAIL flashnorm_matmul: %s (%s)\n", flashnorm_status_string(status),
            flashnorm_context_last_error(context));
        ++g_failures;
    }

    double worst = 0.0;
    int64_t column0 = 0;
    for (size_t i = 0; i < c.splits.size(); ++i)
    {
        std::vector<uint8_t> y(m * c.splits[i] * bytes);
        SELFTEST_CUDA(cudaMemcpy(y.data(), outputs[i], y.size(), cudaMemcpyDeviceToHost));
        for (int64_t r = 0; r < m; ++r)
        {
            double mean = 0.0;
            if (c.statistic == FLASHNORM_STATISTIC_VARIANCE)
            {
                for (int64_t j = 0; j < k; ++j)
                    mean += decode(c.dtype, x, r * k + j);
                mean /= double(k);
            }
            double ssq = 0.0;
            for (int64_t j = 0; j < k; ++j)
                ssq += (decode(c.dtype, x, r * k + j) - mean) * (decode(c.dtype, x, r * k + j) - mean);
            double const scale = 1.0 / std::sqrt(ssq / double(k) + 1e-5);
            for (int64_t col = 0; col < c.splits[i]; ++col)
            {
                double dot = 0.0, magnitude = 0.0;
                for (int64_t j = 0; j < k; ++j)
                {
                    double const term = decode(c.dtype, x, r * k + j) * decode(c.dtype, w, j * n + column0 + col);
                    dot += term;
                    magnitude += std::fabs(term);
                }
                double const added = c.bias ? bias[column0 + col] : 0.0;
                double const got = decode(c.dtype, y, r * c.splits[i] + col);
                double const error
                    = std::fabs(got - (dot * scale + added)) / ((magnitude + 1e-30) * scale + std::fabs(added));
                worst = std::isnan(got) ? INFINITY : std::fmax(worst, error);
            }
        }
        column0 += c.splits[i];
        SELFTEST_CUDA(cudaFree(outputs[i]));
    }
    bool const ok = worst <= tolerance(c.dtype);
    g_failures += ok ? 0 : 1;
    std::printf("%s %-4s %-14s %-8s bias=%d mean=%g m=%-3lld k=%-4lld n=%-4lld outputs=%zu delay=%lld graph=%d "
                "strip=%d cluster=%d multiprocessors=%d workspace=%zu worst=%.3g\n",
        ok ? "ok  " : "FAIL", name(c.dtype), strategy_name(c.strategy), statistic_name(c.statistic), int(c.bias),
        c.mean, (long long)m, (long long)k, (long long)n, c.splits.size(), (long long)c.side_delay, int(c.captured),
        c.strip_cols, c.cluster_size, c.multiprocessors, workspace_bytes, worst);

    SELFTEST_CUDA(cudaStreamDestroy(stream));
    SELFTEST_CUDA(cudaFree(x_device));
    SELFTEST_CUDA(cudaFree(w_device));
    if (bias_device)
        SELFTEST_CUDA(cudaFree(bias_device));
    if (workspace)
        SELFTEST_CUDA(cudaFree(workspace));
}

} // namespace

int main()
{
    // Line-buffered: under compute-sanitizer each case's line lands next to any report it causes.
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    flashnorm_context* context = nullptr;
    flashnorm_status const created = flashnorm_context_create(&context);
    if (created != FLASHNORM_STATUS_OK)
    {
        std::fprintf(stderr, "flashnorm_context_create: %s\n", flashnorm_status_string(created));
        return 2;
    }
    std::mt19937 rng(std::random_device{}());
    auto const fused = FLASHNORM_STRATEGY_FUSED;
    auto const two = FLASHNORM_STRATEGY_TWO_STREAM;
    auto const prenorm = FLASHNORM_STRATEGY_PRENORM;
    auto const epilogue = FLASHNORM_STRATEGY_EPILOGUE_SCALE;
    auto const automatic = FLASHNORM_STRATEGY_AUTO;
    std::vector<Case> cases = {
        {FLASHNORM_DTYPE_F32, fused, 3, 100, {30, 41}, 0, false},
        {FLASHNORM_DTYPE_F32, two, 3, 100, {30, 41}, 0, false},
        {FLASHNORM_DTYPE_BF16, fused, 5, 96, {32, 16, 16}, 0, false},    // tensor-core kernel
        {FLASHNORM_DTYPE_BF16, fused, 3, 520, {128, 128}, 0, false},     // a cluster of blocks splits K
        {FLASHNORM_DTYPE_BF16, fused, 2, 2050, {4096, 8}, 0, false},     // the cp.async ring wraps, K tail
        {FLASHNORM_DTYPE_BF16, two, 5, 96, {32, 16, 16}, 0, false},
        {FLASHNORM_DTYPE_F16, fused, 19, 130, {24, 72}, 0, false},       // two row passes, K tail
        {FLASHNORM_DTYPE_F16, fused, 9, 33, {7, 13}, 0, false},          // CUDA-core kernel, odd K and N
        {FLASHNORM_DTYPE_BF16, two, 7, 64, {40, 24}, 200000, false},     // delayed side stream
        {FLASHNORM_DTYPE_BF16, two, 4, 64, {48, 16}, 100000, true},      // captured two-stream
        {FLASHNORM_DTYPE_F16, fused, 4, 64, {64}, 0, true},              // captured fused
        {FLASHNORM_DTYPE_F32, prenorm, 3, 100, {30, 41}, 0, false},      // scalar normalize, unaligned W slice
        {FLASHNORM_DTYPE_BF16, prenorm, 5, 96, {32, 16, 16}, 0, false},  // row held in registers
        {FLASHNORM_DTYPE_BF16, prenorm, 3, 1024, {64, 32}, 0, false},    // the one-warp row's limit
        {FLASHNORM_DTYPE_F16, prenorm, 3, 1032, {64, 32}, 0, false},     // ... one vector over: block kernel
        {FLASHNORM_DTYPE_BF16, prenorm, 3, 8200, {24, 8}, 0, false},     // row longer than the registers hold
        {FLASHNORM_DTYPE_F16, prenorm, 19, 130, {24, 72}, 0, true},      // captured prenorm, K tail
        {FLASHNORM_DTYPE_BF16, prenorm, 70, 256, {64, 64, 64}, 0, true},   // captured, equal splits
        {FLASHNORM_DTYPE_BF16, fused, 3, 520, {40, 8}, 0, false, 32, 1},   // narrow strips, the ring wraps
        {FLASHNORM_DTYPE_BF16, fused, 11, 264, {88}, 0, false, 32, 4},     // ... two token groups, a cluster
        {FLASHNORM_DTYPE_F16, fused, 2, 1030, {96, 40}, 0, false, 32, 8},  // ... N tail, K tail
        {FLASHNORM_DTYPE_F16, fused, 16, 130, {72}, 0, true, 32, 2},       // ... captured
        // AUTO for a device of 78 multiprocessors, whatever this one has: the fused kernel in no
        // workspace (the size asked for 78); on 132 it would take the epilogue-scale GEMM, which
        // needs one. Then the same on 132 and on this device's own count.
        {FLASHNORM_DTYPE_F16, automatic, 16, 576, {1536, 1536}, 0, false, 0, 0, 78},
        {FLASHNORM_DTYPE_F16, automatic, 16, 576, {1536, 1536}, 0, false, 0, 0, 132},
        {FLASHNORM_DTYPE_F16, automatic, 16, 576, {1536, 1536}, 0, false, 0, 0, 0},
    };
    // LayerNorm: every strategy with the variance statistic and a bias, rows whose mean is a
    // thousand times their spread; K tails, two row passes, a delayed side stream, captures.
    auto const variance = FLASHNORM_STATISTIC_VARIANCE;
    std::vector<Case> layer_norm = {
        {FLASHNORM_DTYPE_F32, fused, 3, 100, {30, 41}, 0, false, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_BF16, fused, 5, 96, {32, 16, 16}, 0, false, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_F16, fused, 19, 130, {24, 72}, 0, true, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_BF16, fused, 2, 2050, {4096, 8}, 0, false, 0, 0, 0, variance, false, 10.f},
        {FLASHNORM_DTYPE_BF16, fused, 11, 264, {88}, 0, false, 32, 4, 0, variance, true, 100.f},
        {FLASHNORM_DTYPE_F16, fused, 9, 33, {7, 13}, 0, false, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_F32, two, 3, 100, {30, 41}, 0, false, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_BF16, two, 7, 64, {40, 24}, 200000, false, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_F16, two, 4, 130, {48, 16}, 100000, true, 0, 0, 0, variance, true, 100.f},
        {FLASHNORM_DTYPE_F32, prenorm, 3, 100, {30, 41}, 0, false, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_BF16, prenorm, 5, 96, {32, 16, 16}, 0, false, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_F16, prenorm, 3, 1032, {64, 32}, 0, false, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_BF16, prenorm, 3, 8200, {24, 8}, 0, false, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_BF16, prenorm, 70, 256, {64, 64, 64}, 0, true, 0, 0, 0, variance, true, 1000.f},
        {FLASHNORM_DTYPE_F16, prenorm, 19, 130, {24, 72}, 0, false, 0, 0, 0, FLASHNORM_STATISTIC_RMS, true, 0.f},
        {FLASHNORM_DTYPE_BF16, automatic, 300, 768, {768, 768, 768}, 0, false, 0, 0, 0, variance, true, 100.f},
    };
    cases.insert(cases.end(), layer_norm.begin(), layer_norm.end());
    if (flashnorm_strategy_available(context, epilogue))
    {
        cases.insert(cases.end(), {
            {FLASHNORM_DTYPE_BF16, epilogue, 5, 96, {32, 32, 16}, 0, false},      // 64-row tiles, row tail
            {FLASHNORM_DTYPE_F16, epilogue, 300, 264, {32, 32, 32, 8}, 0, false}, // sums in the main loop, K tail
            {FLASHNORM_DTYPE_BF16, epilogue, 200, 2056, {4096, 1024, 1024}, 0, false}, // 128x96 clusters, last block in atoms
            {FLASHNORM_DTYPE_F16, epilogue, 560, 2056, {2048, 512, 512}, 0, false},    // 128x128, last block in atoms
            {FLASHNORM_DTYPE_F16, epilogue, 3900, 576, {576, 192, 192}, 0, false},   // a cluster's 2nd block past x
            {FLASHNORM_DTYPE_BF16, epilogue, 7, 64, {32, 24}, 200000, false},     // delayed reduction
            {FLASHNORM_DTYPE_BF16, epilogue, 70, 256, {64, 64, 64}, 100000, true}, // captured, delayed
            // LayerNorm: sums in the main loop (K tail), the reduction kernel, a cluster, captured
            {FLASHNORM_DTYPE_F16, epilogue, 300, 264, {32, 32, 32, 8}, 0, false, 0, 0, 0, variance, true, 1000.f},
            {FLASHNORM_DTYPE_BF16, epilogue, 5, 96, {32, 32, 16}, 0, false, 0, 0, 0, variance, true, 1000.f},
            {FLASHNORM_DTYPE_BF16, epilogue, 200, 2056, {4096, 1024, 1024}, 0, false, 0, 0, 0, variance, true, 100.f},
            {FLASHNORM_DTYPE_BF16, epilogue, 7, 64, {32, 24}, 200000, false, 0, 0, 0, variance, true, 1000.f},
            {FLASHNORM_DTYPE_BF16, epilogue, 70, 256, {64, 64, 64}, 100000, true, 0, 0, 0, variance, true, 10.f},
            {FLASHNORM_DTYPE_F16, epilogue, 3900, 576, {576, 192, 192}, 0, false, 0, 0, 0, FLASHNORM_STATISTIC_RMS, true, 0.f},
        });
    }
    else
    {
        std::printf("epilogue_scale: not available in this build or on this device, its cases skipped\n");
    }
    for (Case const& c : cases)
        run_case(context, rng, c);
    flashnorm_context_destroy(context);
    std::printf("%d passed, %d failed\n", int(cases.size()) - g_failures, g_failures);
    return g_failures == 0 ? 0 : 1;
}
