// The two halves of the deferred norm around a library GEMM (the two-stream strategy): the row
// scales (side stream) and the post-scale, which adds the bias and fans the product out to the split
// outputs.
#include "device.cuh"

namespace flashnorm
{
namespace
{

constexpr int kPostScaleThreads = 256;
constexpr int kPostScaleVec = 4;   // columns per thread
constexpr int kMaxGridY = 65535;

// Test hook: spins `cycles` GPU clock cycles, so that the side stream's work after it finishes
// late and anything not ordered after it reads whatever its buffers held before.
__global__ void delay_kernel(int64_t cycles)
{
    long long const start = clock64();
    while (clock64() - start < cycles)
    {
    }
}

template <typename T>
__global__ void __launch_bounds__(kRowScaleRowsPerBlock * 32)
    row_scale_kernel(T const* __restrict__ x, int64_t m, int64_t k, float eps, bool centred, float* __restrict__ scales)
{
    store_row_scale(x, m, k, eps, centred, scales);
}

template <typename T, int N>
struct alignas(N * sizeof(T)) Packed
{
    T values[N];
};

// One thread scales kPostScaleVec consecutive columns of one row and adds their bias (where there
// is one). `vectorized` (all split widths and N multiples of kPostScaleVec, every pointer aligned)
// lets those columns move as one access and never straddle two outputs.
//
// Launched with programmatic stream serialization after the library GEMM, so that its launch
// overlaps the GEMM's end. griddepcontrol.wait, before any memory access, returns once every
// grid this launch depends on (the GEMM, and the reduction joined from the side stream) has
// completed and its writes are visible; launched without PDL it returns at once.
template <typename T, typename P>
__global__ void __launch_bounds__(kPostScaleThreads)
    post_scale_kernel(P const* __restrict__ product, float const* __restrict__ scales, float const* __restrict__ bias,
        int64_t m, int64_t n, OutputSplits splits, bool vectorized)
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
    int64_t const col = (int64_t(blockIdx.x) * kPostScaleThreads + threadIdx.x) * kPostScaleVec;
    if (col >= n)
    {
        return;
    }
    // This thread's columns' bias, read once for all its rows (zeros without one).
    Packed<float, kPostScaleVec> added{};
    if (bias != nullptr)
    {
        if (vectorized)
        {
            added = *reinterpret_cast<Packed<float, kPostScaleVec> const*>(bias + col);
        }
        else
        {
            for (int j = 0; j < kPostScaleVec && col + j < n; ++j)
            {
                added.values[j] = bias[col + j];
            }
        }
    }
    for (int64_t row = blockIdx.y; row < m; row += gridDim.y)
    {
        float const scale = scales[row];
        P const* product_row = product + row * n;
        if (vectorized)
        {
            auto const in = *reinterpret_cast<Packed<P, kPostScaleVec> const*>(product_row + col);
            int const index = split_of(splits, col);
            int64_t const width = splits.offsets[index + 1] - splits.offsets[index];
            Packed<T, kPostScaleVec> out;
#pragma unroll
            for (int j = 0; j < kPostScaleVec; ++j)
            {
                out.values[j] = from_float<T>(to_float(in.values[j]) * scale + added.values[j]);
            }
            *reinterpret_cast<Packed<T, kPostScaleVec>*>(
                static_cast<T*>(splits.outputs[index]) + row * width + (col - splits.offsets[index]))
                = out;
        }
        else
        {
            for (int64_t c = col; c < col + kPostScaleVec && c < n; ++c)
            {
                store_split<T>(splits, row, c, to_float(product_row[c]) * scale + added.values[c - col]);
            }
        }
    }
}

template <typename T>
cudaError_t launch_row_scales_typed(
    void const* x, int64_t m, int64_t k, RowNorm const& norm, float* scales, cudaStream_t stream)
{
    dim3 const grid(static_cast<unsigned>((m + kRowScaleRowsPerBlock - 1) / kRowScaleRowsPerBlock));
    row_scale_kernel<T><<<grid, kRowScaleRowsPerBlock * 32, 0, stream>>>(
        static_cast<T const*>(x), m, k, norm.eps, norm.centred, scales);
    return cudaGetLastError();
}

bool aligned(void const* pointer, size_t bytes)
{
    return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

template <typename T, typename P>
cudaError_t launch_post_scale_typed(void const* product, float const* scales, float const* bias, int64_t m, int64_t n,
    OutputSplits const& splits, cudaStream_t stream)
{
    bool vectorized = n % kPostScaleVec == 0 && aligned(product, kPostScaleVec * sizeof(P))
        && (bias == nullptr || aligned(bias, kPostScaleVec * sizeof(float)));
    for (int i = 0; i < splits.count; ++i)
    {
        int64_t const width = splits.offsets[i + 1] - splits.offsets[i];
        vectorized = vectorized && width % kPostScaleVec == 0 && aligned(splits.outputs[i], kPostScaleVec * sizeof(T));
    }
    int64_t const columns_per_block = int64_t(kPostScaleThreads) * kPostScaleVec;
    dim3 const grid(static_cast<unsigned>((n + columns_per_block - 1) / columns_per_block),
        static_cast<unsigned>(m < kMaxGridY ? m : kMaxGridY));
    // On the H200: 0.2 µs off two_stream on SmolLM2-135M's and Llama-3.2-1B's q|k|v and SmolLM2's
    // gate|up, within ±0.3 µs on the larger problems (docs/history/2026-12-03-kernel-notes.md,
    // "Launch-level variants").
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = dim3(kPostScaleThreads);
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(
        &config, post_scale_kernel<T, P>, static_cast<P const*>(product), scales, bias, m, n, splits, vectorized);
}

} // namespace

cudaError_t launch_row_scales(flashnorm_dtype dtype, void const* x, int64_t m, int64_t k, RowNorm const& norm,
    float* scales, cudaStream_t stream)
{
    switch (dtype)
    {
    case FLASHNORM_DTYPE_F32: return launch_row_scales_typed<float>(x, m, k, norm, scales, stream);
    case FLASHNORM_DTYPE_F16: return launch_row_scales_typed<__half>(x, m, k, norm, scales, stream);
    case FLASHNORM_DTYPE_BF16: return launch_row_scales_typed<__nv_bfloat16>(x, m, k, norm, scales, stream);
    }
    return cudaErrorInvalidValue;
}

cudaError_t launch_delay(int64_t cycles, cudaStream_t stream)
{
    delay_kernel<<<1, 1, 0, stream>>>(cycles);
    return cudaGetLastError();
}

cudaError_t launch_post_scale(flashnorm_dtype dtype, flashnorm_dtype product_type, void const* product,
    float const* scales, float const* bias, int64_t m, int64_t n, OutputSplits const& splits, cudaStream_t stream)
{
    if (product_type == FLASHNORM_DTYPE_F32)
    {
        switch (dtype)
        {
        case FLASHNORM_DTYPE_F32: return launch_post_scale_typed<float, float>(product, scales, bias, m, n, splits, stream);
        case FLASHNORM_DTYPE_F16: return launch_post_scale_typed<__half, float>(product, scales, bias, m, n, splits, stream);
        case FLASHNORM_DTYPE_BF16:
            return launch_post_scale_typed<__nv_bfloat16, float>(product, scales, bias, m, n, splits, stream);
        }
    }
    if (product_type == FLASHNORM_DTYPE_BF16 && dtype == FLASHNORM_DTYPE_BF16)
    {
        return launch_post_scale_typed<__nv_bfloat16, __nv_bfloat16>(product, scales, bias, m, n, splits, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace flashnorm
