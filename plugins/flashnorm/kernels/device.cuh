// Device-side helpers shared by the kernels: element conversion, warp sums, the row statistics, output
// routing.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels.h"

namespace flashnorm
{

__device__ __forceinline__ float to_float(float v)
{
    return v;
}
__device__ __forceinline__ float to_float(__half v)
{
    return __half2float(v);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v)
{
    return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v)
{
    return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
    {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// The elementwise sum a + b of the T values packed in `a` and `b` (one T, a pair in 32 bits, eight
// in a 16-byte vector), each added in fp32 and rounded once to T: what the add in T computes (the
// residual add of flashnorm_add_matmul).
template <typename T, typename Packed>
__device__ __forceinline__ Packed added(Packed a, Packed b)
{
    static_assert(sizeof(Packed) % sizeof(T) == 0, "whole elements of T");
    T const* left = reinterpret_cast<T const*>(&a);
    T const* right = reinterpret_cast<T const*>(&b);
    Packed sum;
    T* values = reinterpret_cast<T*>(&sum);
#pragma unroll
    for (int e = 0; e < int(sizeof(Packed) / sizeof(T)); ++e)
    {
        values[e] = from_float<T>(to_float(left[e]) + to_float(right[e]));
    }
    return sum;
}

// Sum of squares (fp32) of the 16 / sizeof(T) elements packed in one 16-byte vector.
template <typename T>
__device__ __forceinline__ float square_sum(uint4 const& packed)
{
    T const* elements = reinterpret_cast<T const*>(&packed);
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < int(16 / sizeof(T)); ++e)
    {
        float const v = to_float(elements[e]);
        sum += v * v;
    }
    return sum;
}

// One 16-byte vector of T, each element times `scale` in fp32 and rounded once.
template <typename T>
__device__ __forceinline__ uint4 scaled(uint4 const& packed, float scale)
{
    T const* elements = reinterpret_cast<T const*>(&packed);
    uint4 out;
    T* values = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int e = 0; e < int(16 / sizeof(T)); ++e)
    {
        values[e] = from_float<T>(to_float(elements[e]) * scale);
    }
    return out;
}

// (Σ(v − shift), Σ(v − shift)²) in fp32 over the 16 / sizeof(T) elements packed in one 16-byte vector.
template <typename T>
__device__ __forceinline__ float2 shifted_sums(uint4 const& packed, float shift)
{
    T const* elements = reinterpret_cast<T const*>(&packed);
    float2 sums = make_float2(0.f, 0.f);
#pragma unroll
    for (int e = 0; e < int(16 / sizeof(T)); ++e)
    {
        float const d = to_float(elements[e]) - shift;
        sums.x += d;
        sums.y += d * d;
    }
    return sums;
}

// The variance statistic's row scale, rsqrt(mean((x − mean x)²) + eps), from sums shifted by one
// element c of the row (its first): shifted = Σ(x − c), squares = Σ(x − c)². Then
// var = squares/K − (shifted/K)² cancels only as much as (mean − c)² exceeds var, which for any
// element c of the row is at most K − 1 times (and about once for typical rows), where
// mean(x²) − mean² cancels as (mean/σ)² does (kernels/DESIGN.md, "The statistic's numerics").
__device__ __forceinline__ float centred_scale(float shifted, float squares, float k, float eps)
{
    float const mean = shifted / k;
    return rsqrtf(fmaxf(squares / k - mean * mean, 0.f) + eps);
}

// One 16-byte vector of T, each element minus `mean`, times `scale` in fp32, rounded once.
template <typename T>
__device__ __forceinline__ uint4 centred_scaled(uint4 const& packed, float mean, float scale)
{
    T const* elements = reinterpret_cast<T const*>(&packed);
    uint4 out;
    T* values = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int e = 0; e < int(16 / sizeof(T)); ++e)
    {
        values[e] = from_float<T>((to_float(elements[e]) - mean) * scale);
    }
    return out;
}

// This thread's share of sum(row²): elements first, first + stride, ... of a K-long row, read as
// 16-byte vectors where `vectorized` (K a multiple of the vector, the row 16-byte aligned).
template <typename T>
__device__ __forceinline__ float row_square_sum(T const* row, int64_t k, int64_t first, int64_t stride, bool vectorized)
{
    float sum = 0.f;
    if (vectorized)
    {
        for (int64_t i = first; i < k / int64_t(16 / sizeof(T)); i += stride)
        {
            sum += square_sum<T>(__ldg(reinterpret_cast<uint4 const*>(row) + i));
        }
    }
    else
    {
        for (int64_t i = first; i < k; i += stride)
        {
            float const v = to_float(row[i]);
            sum += v * v;
        }
    }
    return sum;
}

// This thread's share of (Σ(v − shift), Σ(v − shift)²) over the same elements as row_square_sum's.
template <typename T>
__device__ __forceinline__ float2 row_shifted_sums(
    T const* row, int64_t k, int64_t first, int64_t stride, bool vectorized, float shift)
{
    float2 sums = make_float2(0.f, 0.f);
    if (vectorized)
    {
        for (int64_t i = first; i < k / int64_t(16 / sizeof(T)); i += stride)
        {
            float2 const part = shifted_sums<T>(__ldg(reinterpret_cast<uint4 const*>(row) + i), shift);
            sums.x += part.x;
            sums.y += part.y;
        }
    }
    else
    {
        for (int64_t i = first; i < k; i += stride)
        {
            float const d = to_float(row[i]) - shift;
            sums.x += d;
            sums.y += d * d;
        }
    }
    return sums;
}

// The deferred norm's reduction, one warp per row, kRowScaleRowsPerBlock rows a block: scales[row] =
// the row's statistic, rsqrt(mean(row²) + eps) or (`centred`) rsqrt(mean((row − mean)²) + eps). The
// body of both reduction kernels (two_stream's side-stream one and epilogue_scale's, which releases
// the dependent GEMM first).
constexpr int kRowScaleRowsPerBlock = 8;

template <typename T>
__device__ __forceinline__ void store_row_scale(T const* x, int64_t m, int64_t k, float eps, bool centred, float* scales)
{
    int const lane = threadIdx.x & 31;
    int64_t const row = int64_t(blockIdx.x) * kRowScaleRowsPerBlock + (threadIdx.x >> 5);
    bool const vectorized = (k % int64_t(16 / sizeof(T)) == 0) && (reinterpret_cast<uintptr_t>(x) % 16 == 0);
    if (centred)
    {
        // Every lane shifts by the row's first element (one cached load), so the partial sums add.
        float const shift = row < m ? to_float(x[row * k]) : 0.f;
        float2 const part = row < m ? row_shifted_sums(x + row * k, k, lane, 32, vectorized, shift) : make_float2(0.f, 0.f);
        float const shifted = warp_sum(part.x);
        float const squares = warp_sum(part.y);
        if (row < m && lane == 0)
        {
            scales[row] = centred_scale(shifted, squares, float(k), eps);
        }
        return;
    }
    float const sum = warp_sum(row < m ? row_square_sum(x + row * k, k, lane, 32, vectorized) : 0.f);
    if (row < m && lane == 0)
    {
        scales[row] = rsqrtf(sum / float(k) + eps);
    }
}

// Index of the output that receives global column `col` (splits are few: a linear scan).
__device__ __forceinline__ int split_of(OutputSplits const& splits, int64_t col)
{
    int index = 0;
    while (index + 1 < splits.count && col >= splits.offsets[index + 1])
    {
        ++index;
    }
    return index;
}

// Writes one finished element (scaled, the bias added) of row `row`, global column `col` to the output
// that owns it.
template <typename T>
__device__ __forceinline__ void store_split(OutputSplits const& splits, int64_t row, int64_t col, float value)
{
    int const index = split_of(splits, col);
    int64_t const width = splits.offsets[index + 1] - splits.offsets[index];
    static_cast<T*>(splits.outputs[index])[row * width + (col - splits.offsets[index])] = from_float<T>(value);
}

} // namespace flashnorm
