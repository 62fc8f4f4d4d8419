// The fused strategy: one kernel per call, no side stream, no event, no workspace. Every block
// recomputes sum(x²) of its rows from the x it reads anyway and applies rsqrt(mean + eps) in its
// epilogue.
//
// Two kernels:
//  * fused_mma_kernel (fp16/bf16, N % 8 == 0, K even): tensor cores (mma.sync m16n8k16, fp32
//    accumulators) on 16 rows of x per pass. Each warp streams 16-byte pieces of W* (8 rows × 32
//    columns per copy) and its x fragments through a cp.async pipeline, and movmatrix transposes
//    the 8×8 pieces of W* into the mma's B layout in registers. A 32-column strip is owned by one
//    thread-block cluster (Hopper): its blocks split K, and their partial sums meet in distributed
//    shared memory, so there is still one launch and no global scratch. The cluster size follows
//    the number of strips (pick_cluster_size).
//  * fused_generic_kernel (fp32, and any K or N): CUDA cores, one column per lane, x staged in
//    shared memory; fp32 stays exact fp32 arithmetic (no TF32). A correctness fallback: AUTO
//    never picks it (see capi.cpp).
#include <algorithm>

#include <cooperative_groups.h>

#include "device.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "the fused kernel needs thread-block clusters (sm_90 or newer): set CMAKE_CUDA_ARCHITECTURES (default 90-real 90-virtual)"
#endif

namespace flashnorm
{
namespace
{

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxGridY = 65535;

// ---------------------------------------------------------------- tensor-core kernel (16-bit)

constexpr int kMmaRows = 16;   // rows of x per pass: the mma's M
constexpr int kMmaCols = 32;   // columns of the strip a cluster owns: 4 lanes × 8 columns per W* row
constexpr int kMmaUnroll = 2;  // k-steps of 16 per pipeline stage
constexpr int kMmaStages = 3;  // stages in flight per warp (cp.async groups)
constexpr int kMaxCluster = 8; // the portable cluster-size limit

// One warp's share of one pipeline stage. Lane-major: each lane copies its own slots in and reads
// only those back, so no barrier is needed between the copy and the read.
struct MmaStage
{
    uint4 w[kMmaUnroll][2][32];    // W* rows k0+8·half+group, columns 8·quad .. +7
    uint32_t a[kMmaUnroll][4][32]; // the mma's A fragment of x (pairs of k)
};

// After the main loop the pipeline buffers hold the warps' partial sums instead.
struct MmaPartials
{
    float sum[kWarps][kMmaRows][kMmaCols + 1]; // +1: conflict-free accumulator dump
};

constexpr size_t kMmaSharedBytes = sizeof(MmaStage) * kMmaStages * kWarps > sizeof(MmaPartials)
    ? sizeof(MmaStage) * kMmaStages * kWarps
    : sizeof(MmaPartials);

// Asynchronous global→shared copies; `size` 0 copies nothing and zero-fills (out-of-range data).
__device__ __forceinline__ void copy_async_16(void* shared, void const* global, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                     static_cast<uint32_t>(__cvta_generic_to_shared(shared))),
        "l"(global), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_async_4(void* shared, void const* global, bool valid)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(
                     static_cast<uint32_t>(__cvta_generic_to_shared(shared))),
        "l"(global), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void copy_async_commit()
{
    asm volatile("cp.async.commit_group;");
}

template <int Pending>
__device__ __forceinline__ void copy_async_wait()
{
    asm volatile("cp.async.wait_group %0;" ::"n"(Pending));
}

__device__ __forceinline__ uint32_t transpose_8x8(uint32_t v)
{
    uint32_t out;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(out) : "r"(v));
    return out;
}

template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16x8x16<__nv_bfloat16>(
    float (&d)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
{
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16x8x16<__half>(float (&d)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
{
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Sum of squares of the two 16-bit values packed in `pair`.
template <typename T>
__device__ __forceinline__ float square_sum_pair(uint32_t pair)
{
    T const* values = reinterpret_cast<T const*>(&pair);
    float const a = to_float(values[0]);
    float const b = to_float(values[1]);
    return a * a + b * b;
}

// A cluster owns a strip of kMmaCols columns; all warps of its blocks split K between them in
// k-steps of 16 (warp g of the cluster takes steps g, g + warps, ...). Each warp streams its W*
// and x through a kMmaStages-deep cp.async pipeline: the copies hold no registers, so every warp
// keeps kMmaStages - 1 stages of loads in flight while it computes one.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    fused_mma_kernel(T const* __restrict__ x, T const* __restrict__ w, int64_t m, int64_t k, int64_t n, float eps,
        OutputSplits splits)
{
    extern __shared__ __align__(16) unsigned char shared[];
    __shared__ float partial_ssq[kWarps][kMmaRows];
    __shared__ float block_sum[kMmaRows * kMmaCols]; // this block's share of K, read by the whole cluster
    __shared__ float block_ssq[kMmaRows];
    __shared__ float row_scale[kMmaRows];

    namespace cg = cooperative_groups;
    cg::cluster_group const cluster = cg::this_cluster();
    int const ranks = static_cast<int>(cluster.num_blocks());
    int const rank = static_cast<int>(cluster.block_rank());
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int const group = lane >> 2; // the mma's row (A, D) and column (B) index of this lane
    int const quad = lane & 3;   // the mma's k pair (A, B) and column pair (D) index
    int64_t const row0 = int64_t(blockIdx.y) * kMmaRows;
    int64_t const col0 = int64_t(blockIdx.x / ranks) * kMmaCols;
    int64_t const col = col0 + 8 * quad;
    bool const low_ok = row0 + group < m;
    bool const high_ok = row0 + group + 8 < m;
    T const* x_low = x + (low_ok ? row0 + group : 0) * k;
    T const* x_high = x + (high_ok ? row0 + group + 8 : 0) * k;

    int64_t const steps = (k + 15) / 16;
    int64_t const first = int64_t(rank) * kWarps + warp;
    int64_t const warp_stride = int64_t(ranks) * kWarps;
    int64_t const per_iteration = warp_stride * kMmaUnroll;
    int64_t const iterations = first < steps ? (steps - first + per_iteration - 1) / per_iteration : 0;
    MmaStage* const stages = reinterpret_cast<MmaStage*>(shared) + warp * kMmaStages;

    auto issue = [&](int64_t iteration, MmaStage& stage) {
#pragma unroll
        for (int u = 0; u < kMmaUnroll; ++u)
        {
            int64_t const step = first + (iteration * kMmaUnroll + u) * warp_stride;
            bool const step_ok = step < steps;
            int64_t const k0 = step * 16;
#pragma unroll
            for (int half = 0; half < 2; ++half)
            {
                int64_t const w_row = k0 + 8 * half + group;
                bool const ok = step_ok && w_row < k && col < n;
                copy_async_16(&stage.w[u][half][lane], ok ? w + w_row * n + col : w, ok);
            }
            int64_t const k_low = k0 + 2 * quad;
            int64_t const k_high = k_low + 8;
            bool const low_k_ok = step_ok && k_low < k;
            bool const high_k_ok = step_ok && k_high < k;
            copy_async_4(&stage.a[u][0][lane], low_ok && low_k_ok ? x_low + k_low : x, low_ok && low_k_ok);
            copy_async_4(&stage.a[u][1][lane], high_ok && low_k_ok ? x_high + k_low : x, high_ok && low_k_ok);
            copy_async_4(&stage.a[u][2][lane], low_ok && high_k_ok ? x_low + k_high : x, low_ok && high_k_ok);
            copy_async_4(&stage.a[u][3][lane], high_ok && high_k_ok ? x_high + k_high : x, high_ok && high_k_ok);
        }
    };

    float acc[4][4] = {};
    float ssq_low = 0.f;
    float ssq_high = 0.f;
#pragma unroll
    for (int s = 0; s < kMmaStages - 1; ++s)
    {
        if (s < iterations)
            issue(s, stages[s]);
        copy_async_commit(); // empty groups keep the count uniform
    }
    for (int64_t iteration = 0; iteration < iterations; ++iteration)
    {
        // The stage refilled here was consumed in the previous iteration: its values already fed
        // that iteration's mma instructions, which could not issue before the reads completed.
        int64_t const ahead = iteration + kMmaStages - 1;
        if (ahead < iterations)
            issue(ahead, stages[ahead % kMmaStages]);
        copy_async_commit();
        copy_async_wait<kMmaStages - 1>(); // this iteration's group has landed
        MmaStage const& stage = stages[iteration % kMmaStages];
#pragma unroll
        for (int u = 0; u < kMmaUnroll; ++u)
        {
            uint32_t const a[4] = {stage.a[u][0][lane], stage.a[u][1][lane], stage.a[u][2][lane], stage.a[u][3][lane]};
            // Each element of x's 16×16 A tile sits in exactly one lane: the norm is free here.
            ssq_low += square_sum_pair<T>(a[0]) + square_sum_pair<T>(a[2]);
            ssq_high += square_sum_pair<T>(a[1]) + square_sum_pair<T>(a[3]);
            uint4 const upper = stage.w[u][0][lane];
            uint4 const lower = stage.w[u][1][lane];
            uint32_t const upper_words[4] = {upper.x, upper.y, upper.z, upper.w};
            uint32_t const lower_words[4] = {lower.x, lower.y, lower.z, lower.w};
#pragma unroll
            for (int j = 0; j < 4; ++j)
            {
                // Piece j holds strip columns 8·(c/2) + 2j + c%2: after the transpose it is an n=8
                // B operand, and D's column pair (2·quad, +1) lands on strip columns 8·quad + 2j, +1.
                mma_16x8x16<T>(acc[j], a, transpose_8x8(upper_words[j]), transpose_8x8(lower_words[j]));
            }
        }
    }
    copy_async_wait<0>();

    ssq_low += __shfl_xor_sync(0xffffffffu, ssq_low, 1);
    ssq_low += __shfl_xor_sync(0xffffffffu, ssq_low, 2);
    ssq_high += __shfl_xor_sync(0xffffffffu, ssq_high, 1);
    ssq_high += __shfl_xor_sync(0xffffffffu, ssq_high, 2);
    if (quad == 0)
    {
        partial_ssq[warp][group] = ssq_low;
        partial_ssq[warp][group + 8] = ssq_high;
    }
    __syncthreads(); // every warp is done with its pipeline buffers
    MmaPartials& partials = *reinterpret_cast<MmaPartials*>(shared);
#pragma unroll
    for (int j = 0; j < 4; ++j)
    {
        int const c = 8 * quad + 2 * j;
        partials.sum[warp][group][c] = acc[j][0];
        partials.sum[warp][group][c + 1] = acc[j][1];
        partials.sum[warp][group + 8][c] = acc[j][2];
        partials.sum[warp][group + 8][c + 1] = acc[j][3];
    }
    __syncthreads();
    for (int index = threadIdx.x; index < kMmaRows * kMmaCols; index += kThreads)
    {
        int const r = index / kMmaCols;
        int const c = index % kMmaCols;
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < kWarps; ++v)
        {
            sum += partials.sum[v][r][c];
        }
        block_sum[index] = sum;
    }
    if (threadIdx.x < kMmaRows)
    {
        float ssq = 0.f;
#pragma unroll
        for (int v = 0; v < kWarps; ++v)
        {
            ssq += partial_ssq[v][threadIdx.x];
        }
        block_ssq[threadIdx.x] = ssq;
    }
    cluster.sync(); // every block's sums are written and visible to the cluster
    if (threadIdx.x < kMmaRows)
    {
        float ssq = 0.f;
        for (int q = 0; q < ranks; ++q)
        {
            ssq += cluster.map_shared_rank(block_ssq, q)[threadIdx.x];
        }
        row_scale[threadIdx.x] = rsqrtf(ssq / float(k) + eps);
    }
    __syncthreads();
    // The cluster's blocks share the epilogue: each reads all ranks' sums for its outputs
    // (the remote reads of one output are independent, so they are issued together).
    for (int index = rank * kThreads + threadIdx.x; index < kMmaRows * kMmaCols; index += ranks * kThreads)
    {
        int const r = index / kMmaCols;
        int64_t const row = row0 + r;
        int64_t const out_col = col0 + index % kMmaCols;
        if (row < m && out_col < n)
        {
            float parts[kMaxCluster];
#pragma unroll
            for (int q = 0; q < kMaxCluster; ++q)
            {
                parts[q] = q < ranks ? cluster.map_shared_rank(block_sum, q)[index] : 0.f;
            }
            float sum = 0.f;
#pragma unroll
            for (int q = 0; q < kMaxCluster; ++q)
            {
                sum += parts[q];
            }
            store_split<T>(splits, row, out_col, sum * row_scale[r]);
        }
    }
    cluster.sync(); // no block leaves (and frees its shared memory) while another still reads it
}

// ---------------------------------------------------------------- CUDA-core kernel (any shape)

constexpr int kGenericCols = 32;      // one lane per column: a warp reads one row segment
constexpr int kGenericChunk = kThreads; // rows of K staged in shared memory at a time
constexpr int kGenericUnroll = 4;

// MR: rows of x per pass (1, 2, 4, 8 or 16). Warp v handles rows v, v+8, ... of each K chunk.
template <typename T, int MR>
__global__ void __launch_bounds__(kThreads)
    fused_generic_kernel(T const* __restrict__ x, T const* __restrict__ w, int64_t m, int64_t k, int64_t n,
        float eps, OutputSplits splits)
{
    __shared__ __align__(16) float x_chunk[kGenericChunk][MR];
    __shared__ float partial[kWarps][MR][kGenericCols];
    __shared__ float partial_ssq[kWarps][MR];

    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int64_t const row0 = int64_t(blockIdx.y) * MR;
    int const rows = static_cast<int>(m - row0 < MR ? m - row0 : MR);
    int64_t const col = int64_t(blockIdx.x) * kGenericCols + lane;
    bool const col_ok = col < n;

    float acc[MR] = {};
    float ssq[MR] = {};
    for (int64_t k0 = 0; k0 < k; k0 += kGenericChunk)
    {
        __syncthreads(); // the previous chunk is consumed
        int64_t const kk = k0 + threadIdx.x;
#pragma unroll
        for (int r = 0; r < MR; ++r)
        {
            float const v = (r < rows && kk < k) ? to_float(x[(row0 + r) * k + kk]) : 0.f;
            x_chunk[threadIdx.x][r] = v;
            ssq[r] += v * v;
        }
        __syncthreads();
        int const chunk = static_cast<int>(k - k0 < kGenericChunk ? k - k0 : kGenericChunk);
        for (int i = warp; i < chunk; i += kWarps * kGenericUnroll)
        {
            float w_values[kGenericUnroll];
#pragma unroll
            for (int u = 0; u < kGenericUnroll; ++u)
            {
                int const ki = i + u * kWarps;
                w_values[u] = (col_ok && ki < chunk) ? to_float(__ldg(w + (k0 + ki) * n + col)) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < kGenericUnroll; ++u)
            {
                int const ki = i + u * kWarps;
                if (ki < chunk)
                {
#pragma unroll
                    for (int r = 0; r < MR; ++r)
                    {
                        acc[r] += x_chunk[ki][r] * w_values[u];
                    }
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < MR; ++r)
    {
        float const s = warp_sum(ssq[r]);
        if (lane == 0)
        {
            partial_ssq[warp][r] = s;
        }
        partial[warp][r][lane] = acc[r];
    }
    __syncthreads();
    for (int index = threadIdx.x; index < MR * kGenericCols; index += kThreads)
    {
        int const r = index / kGenericCols;
        int const c = index % kGenericCols;
        int64_t const out_col = int64_t(blockIdx.x) * kGenericCols + c;
        if (r < rows && out_col < n)
        {
            float sum = 0.f;
            float total_ssq = 0.f;
#pragma unroll
            for (int v = 0; v < kWarps; ++v)
            {
                sum += partial[v][r][c];
                total_ssq += partial_ssq[v][r];
            }
            store_split<T>(splits, row0 + r, out_col, sum * rsqrtf(total_ssq / float(k) + eps));
        }
    }
}

// ---------------------------------------------------------------- launch

// The outputs seen from row `row0` on: each output pointer advanced by row0 of its rows.
template <typename T>
OutputSplits shifted(OutputSplits const& splits, int64_t row0)
{
    OutputSplits view = splits;
    for (int i = 0; i < splits.count; ++i)
    {
        int64_t const width = splits.offsets[i + 1] - splits.offsets[i];
        view.outputs[i] = static_cast<T*>(splits.outputs[i]) + row0 * width;
    }
    return view;
}

template <typename Launch>
cudaError_t launch_row_windows(int64_t m, int64_t rows_per_block, Launch const& launch)
{
    // grid.y is at most 65535 blocks: very tall problems are cut into windows of rows.
    int64_t const window = kMaxGridY * rows_per_block;
    for (int64_t row0 = 0; row0 < m; row0 += window)
    {
        int64_t const rows = std::min(window, m - row0);
        launch(row0, rows, static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block));
        cudaError_t const status = cudaGetLastError();
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    return cudaSuccess;
}

template <typename T>
cudaError_t launch_mma(T const* x, T const* w, int64_t m, int64_t k, int64_t n, float eps,
    OutputSplits const& splits, int cluster_size, cudaStream_t stream)
{
    int64_t const strips = (n + kMmaCols - 1) / kMmaCols;
    return launch_row_windows(m, kMmaRows, [&](int64_t row0, int64_t rows, unsigned blocks_y) {
        cudaLaunchAttribute cluster{};
        cluster.id = cudaLaunchAttributeClusterDimension;
        cluster.val.clusterDim.x = static_cast<unsigned>(cluster_size);
        cluster.val.clusterDim.y = 1;
        cluster.val.clusterDim.z = 1;
        cudaLaunchConfig_t config{};
        config.gridDim = dim3(static_cast<unsigned>(strips * cluster_size), blocks_y);
        config.blockDim = dim3(kThreads);
        config.dynamicSmemBytes = kMmaSharedBytes;
        config.stream = stream;
        config.attrs = &cluster;
        config.numAttrs = 1;
        // launch_row_windows reads the launch's error through cudaGetLastError.
        static_cast<void>(cudaLaunchKernelEx(
            &config, fused_mma_kernel<T>, x + row0 * k, w, rows, k, n, eps, shifted<T>(splits, row0)));
    });
}

// Blocks per 32-column strip (the cluster size). Measured on an H200 (bf16, M = 1 and 16, forced
// sizes 1/2/4/8; plugins/flashnorm/kernels/NOTES.md): one block per strip is fastest once there
// are two strips per multiprocessor (2048×16384: 25.7 µs vs 30.5 with 2; 4096×28672: 73 vs 79),
// two blocks below that (4096×6144: 20.2 vs 22.5; 2048×3072: 8.3 vs 8.8), four only for very
// narrow outputs (576×960: 4.3 vs 4.7). Larger clusters were always slower (8: up to 2×).
int pick_cluster_size(int64_t strips, int sm_count)
{
    if (strips >= 2 * int64_t(sm_count))
        return 1;
    if (2 * strips >= int64_t(sm_count))
        return 2;
    return 4;
}

template <typename T, int MR>
cudaError_t launch_generic(T const* x, T const* w, int64_t m, int64_t k, int64_t n, float eps,
    OutputSplits const& splits, cudaStream_t stream)
{
    unsigned const blocks_x = static_cast<unsigned>((n + kGenericCols - 1) / kGenericCols);
    return launch_row_windows(m, MR, [&](int64_t row0, int64_t rows, unsigned blocks_y) {
        fused_generic_kernel<T, MR><<<dim3(blocks_x, blocks_y), kThreads, 0, stream>>>(
            x + row0 * k, w, rows, k, n, eps, shifted<T>(splits, row0));
    });
}

template <typename T>
cudaError_t launch_generic_rows(T const* x, T const* w, int64_t m, int64_t k, int64_t n, float eps,
    OutputSplits const& splits, cudaStream_t stream)
{
    // The fewest rows per pass that cover M (up to 16): no accumulators wasted on absent rows.
    if (m <= 1)
        return launch_generic<T, 1>(x, w, m, k, n, eps, splits, stream);
    if (m <= 2)
        return launch_generic<T, 2>(x, w, m, k, n, eps, splits, stream);
    if (m <= 4)
        return launch_generic<T, 4>(x, w, m, k, n, eps, splits, stream);
    if (m <= 8)
        return launch_generic<T, 8>(x, w, m, k, n, eps, splits, stream);
    return launch_generic<T, 16>(x, w, m, k, n, eps, splits, stream);
}

template <typename T>
cudaError_t launch_fused_16bit(T const* x, T const* w, int64_t m, int64_t k, int64_t n, float eps,
    OutputSplits const& splits, int sm_count, int cluster_size, cudaStream_t stream)
{
    if (!fused_tensor_core_shape(k, n) || reinterpret_cast<uintptr_t>(w) % 16 != 0
        || reinterpret_cast<uintptr_t>(x) % 4 != 0)
    {
        return launch_generic_rows<T>(x, w, m, k, n, eps, splits, stream);
    }
    int64_t const strips = (n + kMmaCols - 1) / kMmaCols;
    int const size = cluster_size > 0 ? cluster_size : pick_cluster_size(strips, sm_count);
    return launch_mma<T>(x, w, m, k, n, eps, splits, size, stream);
}

} // namespace

cudaError_t configure_fused_kernels()
{
    // Above 48 KB a kernel's dynamic shared memory must be allowed explicitly, per device.
    cudaError_t const half = cudaFuncSetAttribute(
        fused_mma_kernel<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kMmaSharedBytes));
    if (half != cudaSuccess)
    {
        return half;
    }
    return cudaFuncSetAttribute(fused_mma_kernel<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(kMmaSharedBytes));
}

cudaError_t launch_fused(flashnorm_dtype dtype, void const* x, void const* w, int64_t m, int64_t k, int64_t n,
    float eps, OutputSplits const& splits, int sm_count, int cluster_size, cudaStream_t stream)
{
    switch (dtype)
    {
    case FLASHNORM_DTYPE_F32:
        return launch_generic_rows<float>(
            static_cast<float const*>(x), static_cast<float const*>(w), m, k, n, eps, splits, stream);
    case FLASHNORM_DTYPE_F16:
        return launch_fused_16bit<__half>(static_cast<__half const*>(x), static_cast<__half const*>(w), m, k, n, eps,
            splits, sm_count, cluster_size, stream);
    case FLASHNORM_DTYPE_BF16:
        return launch_fused_16bit<__nv_bfloat16>(static_cast<__nv_bfloat16 const*>(x),
            static_cast<__nv_bfloat16 const*>(w), m, k, n, eps, splits, sm_count, cluster_size, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace flashnorm
