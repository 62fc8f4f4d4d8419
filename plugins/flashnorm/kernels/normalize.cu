// The prenorm strategy's first half: x̂ = x ⊙ rsqrt(mean(x²)+eps), fp32 math, stored in x's dtype.
// The library GEMMs that follow read x̂ and write the outputs directly, so nothing passes over the
// N-wide output a second time.
#include "device.cuh"

namespace flashnorm
{
namespace
{

constexpr int kNormalizeItems = 4;        // 16-byte vectors each thread keeps in registers
constexpr int kNormalizeMaxThreads = 256; // one block per row
constexpr int64_t kMaxGrid = int64_t(1) << 30;
static_assert(3 * FLASHNORM_MAX_OUTPUTS <= 32, "the first warp of block 0 writes the whole pointer table");

// One block per row (grid-stride). When the row fits in the block's registers (vectorized and
// K ≤ kNormalizeItems·blockDim·vector width) every load is issued before the reduction and the
// row is scaled from registers: x is read from HBM once and a block never waits on a second pass.
template <typename T>
__global__ void __launch_bounds__(kNormalizeMaxThreads)
    normalize_rows_kernel(T const* __restrict__ x, T* __restrict__ normalized, int64_t m, int64_t k, float eps,
        bool vectorized, PointerTable pointers)
{
    if (blockIdx.x == 0 && threadIdx.x < pointers.count)
    {
        pointers.destination[threadIdx.x] = pointers.values[threadIdx.x];
    }
    constexpr int kVec = 16 / sizeof(T);
    __shared__ float warp_sums[kNormalizeMaxThreads / 32];
    int const warps = blockDim.x / 32;
    int64_t const vectors = k / kVec;
    bool const in_registers = vectorized && vectors <= int64_t(kNormalizeItems) * blockDim.x;
    for (int64_t row = blockIdx.x; row < m; row += gridDim.x)
    {
        T const* x_row = x + row * k;
        T* out_row = normalized + row * k;
        uint4 cached[kNormalizeItems];
        float sum = 0.f;
        if (in_registers)
        {
#pragma unroll
            for (int j = 0; j < kNormalizeItems; ++j)
            {
                int64_t const i = threadIdx.x + int64_t(j) * blockDim.x;
                if (i < vectors)
                {
                    cached[j] = __ldg(reinterpret_cast<uint4 const*>(x_row) + i);
                }
            }
#pragma unroll
            for (int j = 0; j < kNormalizeItems; ++j)
            {
                int64_t const i = threadIdx.x + int64_t(j) * blockDim.x;
                if (i < vectors)
                {
                    sum += square_sum<T>(cached[j]);
                }
            }
        }
        else
        {
            sum = row_square_sum(x_row, k, threadIdx.x, blockDim.x, vectorized);
        }

        sum = warp_sum(sum);
        if ((threadIdx.x & 31) == 0)
        {
            warp_sums[threadIdx.x >> 5] = sum;
        }
        __syncthreads();
        float total = 0.f;
        for (int w = 0; w < warps; ++w)
        {
            total += warp_sums[w];
        }
        // Every thread has read warp_sums: the next row may overwrite it.
        __syncthreads();
        float const scale = rsqrtf(total / float(k) + eps);

        if (in_registers)
        {
#pragma unroll
            for (int j = 0; j < kNormalizeItems; ++j)
            {
                int64_t const i = threadIdx.x + int64_t(j) * blockDim.x;
                if (i < vectors)
                {
                    reinterpret_cast<uint4*>(out_row)[i] = scaled<T>(cached[j], scale);
                }
            }
        }
        else if (vectorized)
        {
            for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x)
            {
                reinterpret_cast<uint4*>(out_row)[i]
                    = scaled<T>(__ldg(reinterpret_cast<uint4 const*>(x_row) + i), scale);
            }
        }
        else
        {
            for (int64_t i = threadIdx.x; i < k; i += blockDim.x)
            {
                out_row[i] = from_float<T>(to_float(x_row[i]) * scale);
            }
        }
    }
}

// Rows that fit one warp's registers (vectorized, at most kNormalizeItems·32 vectors: K ≤ 1024 in
// 16-bit, 512 in fp32): one warp per row, one row per block, the sum in shuffles alone. The kernel
// above runs these rows with one-warp blocks too, but through its block-wide reduction (shared
// memory, two barriers) and a grid-stride loop; on K = 576 it measured 0.3-0.4 µs slower than
// Inductor's norm kernel on the same 1024 × 32 grid (kernels/NOTES.md). Same arithmetic, same order.
template <typename T>
__global__ void __launch_bounds__(32) normalize_rows_warp_kernel(
    uint4 const* __restrict__ x, uint4* __restrict__ normalized, int64_t vectors, float k, float eps, PointerTable pointers)
{
    if (blockIdx.x == 0 && threadIdx.x < pointers.count)
    {
        pointers.destination[threadIdx.x] = pointers.values[threadIdx.x];
    }
    uint4 const* const x_row = x + blockIdx.x * vectors;
    uint4* const out_row = normalized + blockIdx.x * vectors;
    uint4 cached[kNormalizeItems];
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kNormalizeItems; ++j)
    {
        if (threadIdx.x + 32 * j < vectors)
        {
            cached[j] = __ldg(x_row + threadIdx.x + 32 * j);
        }
    }
#pragma unroll
    for (int j = 0; j < kNormalizeItems; ++j)
    {
        if (threadIdx.x + 32 * j < vectors)
        {
            sum += square_sum<T>(cached[j]);
        }
    }
    float const scale = rsqrtf(warp_sum(sum) / k + eps);
#pragma unroll
    for (int j = 0; j < kNormalizeItems; ++j)
    {
        if (threadIdx.x + 32 * j < vectors)
        {
            out_row[threadIdx.x + 32 * j] = scaled<T>(cached[j], scale);
        }
    }
}

template <typename T>
cudaError_t launch_normalize_rows_typed(
    void const* x, void* normalized, int64_t m, int64_t k, float eps, PointerTable const& pointers, cudaStream_t stream)
{
    constexpr int kVec = 16 / sizeof(T);
    bool const vectorized = k % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0
        && reinterpret_cast<uintptr_t>(normalized) % 16 == 0;
    // Just enough warps that each thread holds at most kNormalizeItems vectors of the row.
    int64_t const vectors = (k + kVec - 1) / kVec;
    if (vectorized && vectors <= kNormalizeItems * 32 && m <= kMaxGrid)
    {
        normalize_rows_warp_kernel<T><<<static_cast<unsigned>(m), 32, 0, stream>>>(static_cast<uint4 const*>(x),
            static_cast<uint4*>(normalized), vectors, static_cast<float>(k), eps, pointers);
        return cudaGetLastError();
    }
    int64_t const wanted = (vectors + kNormalizeItems - 1) / kNormalizeItems;
    int const threads
        = static_cast<int>(wanted >= kNormalizeMaxThreads ? kNormalizeMaxThreads : (wanted + 31) / 32 * 32);
    dim3 const grid(static_cast<unsigned>(m < kMaxGrid ? m : kMaxGrid));
    normalize_rows_kernel<T><<<grid, threads, 0, stream>>>(
        static_cast<T const*>(x), static_cast<T*>(normalized), m, k, eps, vectorized, pointers);
    return cudaGetLastError();
}

} // namespace

cudaError_t launch_normalize_rows(flashnorm_dtype dtype, void const* x, void* normalized, int64_t m, int64_t k,
    float eps, PointerTable const& pointers, cudaStream_t stream)
{
    switch (dtype)
    {
    case FLASHNORM_DTYPE_F32: return launch_normalize_rows_typed<float>(x, normalized, m, k, eps, pointers, stream);
    case FLASHNORM_DTYPE_F16: return launch_normalize_rows_typed<__half>(x, normalized, m, k, eps, pointers, stream);
    case FLASHNORM_DTYPE_BF16:
        return launch_normalize_rows_typed<__nv_bfloat16>(x, normalized, m, k, eps, pointers, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace flashnorm
