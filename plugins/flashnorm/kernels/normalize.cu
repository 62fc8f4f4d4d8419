// The prenorm strategy's first half: x̂ = x ⊙ rsqrt(mean(x²)+eps), or for the variance statistic
// x̂ = (x − mean) ⊙ rsqrt(mean((x − mean)²)+eps), fp32 math, stored in x's dtype. The library GEMMs
// that follow read x̂ and write the outputs directly, so nothing passes over the N-wide output a second
// time. A row held in registers is centred in two passes over the registers (the exact form); a row
// streamed twice from memory takes the sums shifted by its first element (device.cuh, centred_scale).
#include "device.cuh"

namespace flashnorm
{
namespace
{

constexpr int kNormalizeItems = 4;        // 16-byte vectors each thread keeps in registers
constexpr int kNormalizeMaxThreads = 256; // one block per row
constexpr int64_t kMaxGrid = int64_t(1) << 30;
static_assert(3 * FLASHNORM_MAX_OUTPUTS <= 32, "the first warp of block 0 writes the whole pointer table");

// Block 0's first lanes write the batched GEMM's pointer table (the table the GEMM after this
// kernel reads), in both kernels below. Taken by value, as the kernels take it (a reference
// changes their generated code).
__device__ __forceinline__ void write_pointer_table(PointerTable pointers)
{
    if (blockIdx.x == 0 && threadIdx.x < pointers.count)
    {
        pointers.destination[threadIdx.x] = pointers.values[threadIdx.x];
    }
}

// The GEMMs' bias rounded to T (where cuBLASLt takes no fp32 bias beside T outputs), spread over the
// grid's threads; nothing without one.
template <typename T>
__device__ __forceinline__ void write_rounded_bias(RoundedBias const& bias)
{
    if (bias.bias == nullptr)
    {
        return;
    }
    int64_t const stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < bias.n; i += stride)
    {
        static_cast<T*>(bias.rounded)[i] = from_float<T>(bias.bias[i]);
    }
}

// The sum of this thread's cached vectors (load_row_vectors' order), the first pass of the exact
// centring.
template <typename T, typename Index>
__device__ __forceinline__ float cached_sum(
    int64_t vectors, Index first, Index stride, uint4 const (&cached)[kNormalizeItems])
{
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kNormalizeItems; ++j)
    {
        if (first + Index(j) * stride < vectors)
        {
            T const* elements = reinterpret_cast<T const*>(&cached[j]);
#pragma unroll
            for (int e = 0; e < int(16 / sizeof(T)); ++e)
            {
                sum += to_float(elements[e]);
            }
        }
    }
    return sum;
}

// Σ(v − mean)² over this thread's cached vectors: the second pass.
template <typename T, typename Index>
__device__ __forceinline__ float cached_centred_squares(
    int64_t vectors, Index first, Index stride, uint4 const (&cached)[kNormalizeItems], float mean)
{
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kNormalizeItems; ++j)
    {
        if (first + Index(j) * stride < vectors)
        {
            sum += shifted_sums<T>(cached[j], mean).y;
        }
    }
    return sum;
}

// A row held in registers, shared by both kernels: this thread's 16-byte vectors first + j·stride
// (j < kNormalizeItems, those below `vectors`), every load issued before any arithmetic. Returns
// the sum of their squares.
template <typename T, typename Index>
__device__ __forceinline__ float load_row_vectors(
    uint4 const* row, int64_t vectors, Index first, Index stride, uint4 (&cached)[kNormalizeItems])
{
#pragma unroll
    for (int j = 0; j < kNormalizeItems; ++j)
    {
        if (first + Index(j) * stride < vectors)
        {
            cached[j] = __ldg(row + first + Index(j) * stride);
        }
    }
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kNormalizeItems; ++j)
    {
        if (first + Index(j) * stride < vectors)
        {
            sum += square_sum<T>(cached[j]);
        }
    }
    return sum;
}

// Writes the vectors load_row_vectors read, each scaled by `scale` (Centred: minus `mean` first).
template <typename T, bool Centred, typename Index>
__device__ __forceinline__ void store_row_vectors(uint4* row, int64_t vectors, Index first, Index stride,
    uint4 const (&cached)[kNormalizeItems], float mean, float scale)
{
#pragma unroll
    for (int j = 0; j < kNormalizeItems; ++j)
    {
        if (first + Index(j) * stride < vectors)
        {
            row[first + Index(j) * stride] = Centred ? centred_scaled<T>(cached[j], mean, scale) : scaled<T>(cached[j], scale);
        }
    }
}

// The block's total of one value per thread, in every thread: warp sums, then the warps' in order.
// Its second barrier lets the next call (or row) overwrite `warp_sums`.
__device__ __forceinline__ float block_total(float value, float* warp_sums, int warps)
{
    value = warp_sum(value);
    if ((threadIdx.x & 31) == 0)
    {
        warp_sums[threadIdx.x >> 5] = value;
    }
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < warps; ++w)
    {
        total += warp_sums[w];
    }
    __syncthreads();
    return total;
}

// One block per row (grid-stride). When the row fits in the block's registers (vectorized and
// K ≤ kNormalizeItems·blockDim·vector width) every load is issued before the reduction and the
// row is scaled from registers: x is read from HBM once and a block never waits on a second pass.
// Centred: a row in registers is centred exactly (its mean, then Σ(v − mean)², from the registers);
// a longer row by the sums shifted by its first element.
template <typename T, bool Centred>
__global__ void __launch_bounds__(kNormalizeMaxThreads)
    normalize_rows_kernel(T const* __restrict__ x, T* __restrict__ normalized, int64_t m, int64_t k, float eps,
        bool vectorized, PointerTable pointers, RoundedBias bias)
{
    write_pointer_table(pointers);
    write_rounded_bias<T>(bias);
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
        float mean = 0.f;
        float scale = 0.f;
        if (in_registers)
        {
            [[maybe_unused]] float const squares = load_row_vectors<T>(reinterpret_cast<uint4 const*>(x_row), vectors,
                int64_t(threadIdx.x), int64_t(blockDim.x), cached);
            if constexpr (Centred)
            {
                mean = block_total(cached_sum<T>(vectors, int64_t(threadIdx.x), int64_t(blockDim.x), cached), warp_sums,
                           warps)
                    / float(k);
                float const centred = block_total(
                    cached_centred_squares<T>(vectors, int64_t(threadIdx.x), int64_t(blockDim.x), cached, mean),
                    warp_sums, warps);
                scale = rsqrtf(centred / float(k) + eps);
            }
            else
            {
                scale = rsqrtf(block_total(squares, warp_sums, warps) / float(k) + eps);
            }
        }
        else if constexpr (Centred)
        {
            float const shift = to_float(x_row[0]);
            float2 const part = row_shifted_sums(x_row, k, threadIdx.x, blockDim.x, vectorized, shift);
            float const shifted = block_total(part.x, warp_sums, warps);
            float const squares = block_total(part.y, warp_sums, warps);
            mean = shift + shifted / float(k);
            scale = centred_scale(shifted, squares, float(k), eps);
        }
        else
        {
            scale = rsqrtf(
                block_total(row_square_sum(x_row, k, threadIdx.x, blockDim.x, vectorized), warp_sums, warps) / float(k)
                + eps);
        }

        if (in_registers)
        {
            store_row_vectors<T, Centred>(reinterpret_cast<uint4*>(out_row), vectors, int64_t(threadIdx.x),
                int64_t(blockDim.x), cached, mean, scale);
        }
        else if (vectorized)
        {
            for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x)
            {
                uint4 const in = __ldg(reinterpret_cast<uint4 const*>(x_row) + i);
                reinterpret_cast<uint4*>(out_row)[i] = Centred ? centred_scaled<T>(in, mean, scale) : scaled<T>(in, scale);
            }
        }
        else
        {
            for (int64_t i = threadIdx.x; i < k; i += blockDim.x)
            {
                out_row[i] = from_float<T>((to_float(x_row[i]) - mean) * scale);
            }
        }
    }
}

// Rows that fit one warp's registers (vectorized, at most kNormalizeItems·32 vectors: K ≤ 1024 in
// 16-bit, 512 in fp32): one warp per row, one row per block, the sum in shuffles alone. The kernel
// above runs these rows with one-warp blocks too, but through its block-wide reduction (shared
// memory, two barriers) and a grid-stride loop; on K = 576 it measured 0.3-0.4 µs slower than
// Inductor's norm kernel on the same 1024 × 32 grid (kernels/DESIGN.md). Same arithmetic, same order.
// Centred: the mean, then Σ(v − mean)², both from the registers (exact two-pass centring).
template <typename T, bool Centred>
__global__ void __launch_bounds__(32) normalize_rows_warp_kernel(uint4 const* __restrict__ x,
    uint4* __restrict__ normalized, int64_t vectors, float k, float eps, PointerTable pointers, RoundedBias bias)
{
    write_pointer_table(pointers);
    write_rounded_bias<T>(bias);
    uint4 cached[kNormalizeItems];
    [[maybe_unused]] float const sum = load_row_vectors<T>(x + blockIdx.x * vectors, vectors, threadIdx.x, 32u, cached);
    float mean = 0.f;
    float scale;
    if constexpr (Centred)
    {
        mean = warp_sum(cached_sum<T>(vectors, threadIdx.x, 32u, cached)) / k;
        scale = rsqrtf(warp_sum(cached_centred_squares<T>(vectors, threadIdx.x, 32u, cached, mean)) / k + eps);
    }
    else
    {
        scale = rsqrtf(warp_sum(sum) / k + eps);
    }
    store_row_vectors<T, Centred>(normalized + blockIdx.x * vectors, vectors, threadIdx.x, 32u, cached, mean, scale);
}

template <typename T, bool Centred>
cudaError_t launch_normalize_rows_typed(void const* x, void* normalized, int64_t m, int64_t k, float eps,
    PointerTable const& pointers, RoundedBias const& bias, cudaStream_t stream)
{
    constexpr int kVec = 16 / sizeof(T);
    bool const vectorized = k % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0
        && reinterpret_cast<uintptr_t>(normalized) % 16 == 0;
    // Just enough warps that each thread holds at most kNormalizeItems vectors of the row.
    int64_t const vectors = (k + kVec - 1) / kVec;
    if (vectorized && vectors <= kNormalizeItems * 32 && m <= kMaxGrid)
    {
        normalize_rows_warp_kernel<T, Centred><<<static_cast<unsigned>(m), 32, 0, stream>>>(
            static_cast<uint4 const*>(x), static_cast<uint4*>(normalized), vectors, static_cast<float>(k), eps,
            pointers, bias);
        return cudaGetLastError();
    }
    int64_t const wanted = (vectors + kNormalizeItems - 1) / kNormalizeItems;
    int const threads
        = static_cast<int>(wanted >= kNormalizeMaxThreads ? kNormalizeMaxThreads : (wanted + 31) / 32 * 32);
    dim3 const grid(static_cast<unsigned>(m < kMaxGrid ? m : kMaxGrid));
    normalize_rows_kernel<T, Centred><<<grid, threads, 0, stream>>>(
        static_cast<T const*>(x), static_cast<T*>(normalized), m, k, eps, vectorized, pointers, bias);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_for_statistic(void const* x, void* normalized, int64_t m, int64_t k, RowNorm const& norm,
    PointerTable const& pointers, RoundedBias const& bias, cudaStream_t stream)
{
    return norm.centred ? launch_normalize_rows_typed<T, true>(x, normalized, m, k, norm.eps, pointers, bias, stream)
                        : launch_normalize_rows_typed<T, false>(x, normalized, m, k, norm.eps, pointers, bias, stream);
}

} // namespace

cudaError_t launch_normalize_rows(flashnorm_dtype dtype, void const* x, void* normalized, int64_t m, int64_t k,
    RowNorm const& norm, PointerTable const& pointers, RoundedBias const& bias, cudaStream_t stream)
{
    switch (dtype)
    {
    case FLASHNORM_DTYPE_F32: return launch_for_statistic<float>(x, normalized, m, k, norm, pointers, bias, stream);
    case FLASHNORM_DTYPE_F16: return launch_for_statistic<__half>(x, normalized, m, k, norm, pointers, bias, stream);
    case FLASHNORM_DTYPE_BF16:
        return launch_for_statistic<__nv_bfloat16>(x, normalized, m, k, norm, pointers, bias, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace flashnorm
