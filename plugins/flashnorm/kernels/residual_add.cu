// The residual add on its own, for the strategies whose first kernel cannot take it: sum = x +
// residual, added in fp32 and rounded once (what the add in the I/O dtype computes), 16 bytes per
// thread where all three buffers allow it.
#include <algorithm>

#include "device.cuh"

namespace flashnorm
{
namespace
{

constexpr int kAddThreads = 256;
constexpr int64_t kAddMaxBlocks = int64_t(1) << 16;

template <typename T>
__global__ void __launch_bounds__(kAddThreads)
    residual_add_kernel(T const* __restrict__ x, T const* __restrict__ residual, T* __restrict__ sum, int64_t count,
        bool vectorized)
{
    constexpr int kVec = 16 / sizeof(T);
    int64_t const stride = int64_t(gridDim.x) * blockDim.x;
    int64_t const first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (vectorized)
    {
        for (int64_t i = first; i < count / kVec; i += stride)
        {
            reinterpret_cast<uint4*>(sum)[i] = added<T>(
                __ldg(reinterpret_cast<uint4 const*>(x) + i), __ldg(reinterpret_cast<uint4 const*>(residual) + i));
        }
        return;
    }
    for (int64_t i = first; i < count; i += stride)
    {
        sum[i] = added<T>(x[i], residual[i]);
    }
}

template <typename T>
cudaError_t launch_typed(void const* x, ResidualAdd const& add, int64_t count, cudaStream_t stream)
{
    constexpr int kVec = 16 / sizeof(T);
    bool const vectorized = count % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0
        && reinterpret_cast<uintptr_t>(add.residual) % 16 == 0 && reinterpret_cast<uintptr_t>(add.sum) % 16 == 0;
    int64_t const items = vectorized ? count / kVec : count;
    int64_t const blocks = std::max<int64_t>(1, std::min(kAddMaxBlocks, (items + kAddThreads - 1) / kAddThreads));
    residual_add_kernel<T><<<static_cast<unsigned>(blocks), kAddThreads, 0, stream>>>(static_cast<T const*>(x),
        static_cast<T const*>(add.residual), static_cast<T*>(add.sum), count, vectorized);
    return cudaGetLastError();
}

} // namespace

cudaError_t launch_residual_add(
    flashnorm_dtype dtype, void const* x, ResidualAdd const& add, int64_t count, cudaStream_t stream)
{
    switch (dtype)
    {
    case FLASHNORM_DTYPE_F32: return launch_typed<float>(x, add, count, stream);
    case FLASHNORM_DTYPE_F16: return launch_typed<__half>(x, add, count, stream);
    case FLASHNORM_DTYPE_BF16: return launch_typed<__nv_bfloat16>(x, add, count, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace flashnorm
