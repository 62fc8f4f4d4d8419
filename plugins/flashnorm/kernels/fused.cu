// The fused strategy: one kernel per call, no side stream, no event, no workspace. Every block
// recomputes its rows' sums from the x it reads anyway (Σx², or for the variance Σ(x − c) and
// Σ(x − c)² shifted by each row's first element c, which add across lanes, warps and blocks like
// the squares) and applies the row scale and the bias in its epilogue.
//
// Two kernels:
//  * fused_mma_kernel (fp16/bf16, N % 8 == 0, K even): tensor cores (mma.sync m16n8k16, fp32
//    accumulators) on the transposed product, W*ᵀ as the mma's 16-row side and up to 16 tokens as
//    its 8-wide side, so decode wastes no mma rows. Each warp streams whole row pieces of W* (256
//    or 64 bytes, as a GEMV reads) and its x fragments through a cp.async ring into swizzled shared
//    memory, and ldmatrix.trans hands W* to the mma in its A layout. A strip of 128 columns (32 on
//    a small W*: pick_strip_cols) is owned by one thread-block cluster (Hopper): its blocks split
//    K, and their partial sums meet in distributed shared memory, so there is still one launch and
//    no global scratch. The cluster size follows the number of strips (pick_cluster_size).
//  * fused_generic_kernel (fp32, and any K or N): CUDA cores, one column per lane, x staged in
//    shared memory; fp32 stays exact fp32 arithmetic (no TF32). A correctness fallback: AUTO
//    never picks it (see capi.cpp).
// Both can take the residual add in front of the norm (ResidualAdd): x + residual is formed as x
// is read, rounded to T as the separate add would round it, and the blocks of the first strip
// (each K step is read by exactly one of them) write it out as the sum. A decode step then has no
// kernel of its own left for the add: it runs in the projection that the norm already runs in.
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

constexpr int64_t kMaxGridY = 65535;

// ---------------------------------------------------------------- tensor-core kernel (16-bit)

// The mma computes the transposed product, yᵀ[n, token] = W*ᵀ[n, k]·xᵀ[k, token]: W* is its A
// operand (16 columns of W* per tile), x its B operand (8 tokens), so decode's few tokens fill the
// mma's narrow side and W* needs no padding.
constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaMaxBlocksPerSm = 3;   // resident blocks per multiprocessor (shared memory bound)
constexpr int kStepRows = 16;           // rows of W* (k) per mma step
constexpr int kTokenGroupRows = 8;      // the mma's N: tokens per B operand
constexpr int kMaxTokenGroups = 2;      // 16 rows of x per pass
constexpr int kMaxCluster = 8;          // the portable cluster-size limit

// A strip is the columns one cluster owns. Wide strips (128 columns: 256 contiguous bytes of each
// W* row) read W* as a GEMV does; narrow ones (32 columns) give a small W* four times the strips,
// so its few steps of K spread over more multiprocessors, with a deeper ring per warp. With the
// residual add each stage also holds the residual's fragments (Sources = 2).
template <int StripCols, int Stages, int Sources = 1>
struct MmaLayout
{
    static_assert(StripCols % 16 == 0 && StripCols <= 128, "a strip is whole 16-column mma tiles");
    static_assert(Sources == 1 || Sources == 2, "x, or x and the residual");
    static constexpr int kStripCols = StripCols;
    static constexpr int kStages = Stages;                   // mma steps in flight per warp
    static constexpr bool kResidual = Sources == 2;
    static constexpr int kStripTiles = StripCols / 16;
    static constexpr int kRowChunks = StripCols * 2 / 16;    // 16-byte pieces of one strip row
    static constexpr int kCopyRowStride = 32 / kRowChunks;  // rows one copy instruction of a warp covers

    // Piece c of row r sits at c ^ swizzle(r): the 8 rows one ldmatrix phase reads then fall in
    // 8 different 16-byte bank groups whatever the row length.
    static __device__ __forceinline__ int piece_slot(int r, int c)
    {
        constexpr int rows_per_cycle = kRowChunks >= 8 ? 1 : 8 / kRowChunks;
        constexpr int pieces = kRowChunks >= 8 ? 8 : kRowChunks;
        return c ^ ((r / rows_per_cycle) % pieces);
    }

    // One warp's share of one pipeline stage: 16 rows of the strip of W* and the B fragments of x
    // (source 0) and of the residual (source 1).
    struct Stage
    {
        uint4 w[kStepRows][kRowChunks];
        uint32_t x[Sources][kMaxTokenGroups][2][32]; // per lane: the pair of k for b0 and for b1
    };

    // Accumulators in the mma's fragment order: lane l's four values of tile t and token group g
    // are one float4 (at (t · token groups + g) · 32 + l), so dumping, summing and exchanging them
    // are whole 16-byte accesses.
    struct Fragments
    {
        float4 value[kStripTiles * kMaxTokenGroups * 32];
    };

    // After the main loop each warp's own ring holds its Fragments (written without waiting for
    // the other warps); warp 0's ring also holds the block's sum over its warps, which the whole
    // cluster reads.
    static constexpr size_t kRingBytes = sizeof(Stage) * Stages;
    static constexpr size_t kSharedBytes = kRingBytes * kMmaWarps;
    static_assert(2 * sizeof(Fragments) <= kRingBytes, "a warp's ring holds its fragments and the block's sums");
    // Per block: 1 KB reserved by the hardware and under 2 KB of static shared memory (1.3–1.4 KB
    // by ptxas: the sums of squares, cooperative groups); 227 KB is an sm_90 multiprocessor's.
    static constexpr int kBlocksFit = static_cast<int>((227 * 1024) / (kSharedBytes + 1024 + 2048));
    static constexpr int kBlocksPerSm = kBlocksFit < kMmaMaxBlocksPerSm ? kBlocksFit : kMmaMaxBlocksPerSm;
    static_assert(kBlocksPerSm >= 2, "the fused kernel's shared memory must leave room for two blocks per multiprocessor");
};

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

// Four 8×8 16-bit matrices from shared memory, transposed: with rows of W* (k) stored as rows,
// each lane receives pairs along k, the layout of the mma's A operand for W*ᵀ.
__device__ __forceinline__ void load_matrix_x4_trans(uint32_t (&a)[4], void const* row)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(row))));
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

// A cluster owns a strip of Layout::kStripCols columns; the warps of its blocks split K between
// them in mma steps of 16 rows (warp g of the cluster takes steps g, g + warps, ...). Each warp
// streams its 16 rows of the strip per step (whole row pieces of up to 256 bytes, as a GEMV reads)
// and its x fragments through a Layout::kStages-deep cp.async ring: the copies hold no registers,
// so kStages - 1 steps stay in flight while one is computed. TokenGroups (1 or 2) B operands of
// 8 tokens cover up to 16 rows of x. With Layout::kResidual the input is x + residual, which the
// first strip's blocks store to `sum` (both [m, k]; ignored otherwise). Centred: the variance
// statistic (the sums shifted by each row's first element); `bias`: n values added after the scale,
// or null.
template <typename T, int TokenGroups, typename Layout, bool Centred>
__global__ void __launch_bounds__(kMmaThreads, Layout::kBlocksPerSm)
    fused_mma_kernel(T const* __restrict__ x, T const* __restrict__ residual, T* __restrict__ sum, T const* __restrict__ w,
        int64_t m, int64_t k, int64_t n, float eps, float const* __restrict__ bias, OutputSplits splits)
{
    constexpr int kPassRows = kTokenGroupRows * TokenGroups;
    constexpr int kStripCols = Layout::kStripCols;
    constexpr int kStripTiles = Layout::kStripTiles;
    constexpr int kRowChunks = Layout::kRowChunks;
    constexpr int kStages = Layout::kStages;
    using Stage = typename Layout::Stage;
    extern __shared__ __align__(128) unsigned char shared[];
    __shared__ float partial_ssq[kMmaWarps][kPassRows];
    __shared__ __align__(8) float block_ssq[kPassRows]; // read by the cluster as float2 pairs of rows
    // Centred: the shifted sums beside the squares (one unused element otherwise).
    __shared__ float partial_shifted[kMmaWarps][Centred ? kPassRows : 1];
    __shared__ __align__(8) float block_shifted[Centred ? kPassRows : 2];

    namespace cg = cooperative_groups;
    cg::cluster_group const cluster = cg::this_cluster();
    int const ranks = static_cast<int>(cluster.num_blocks());
    int const rank = static_cast<int>(cluster.block_rank());
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int const group = lane >> 2; // the mma's A row / B column (token) / D row index of this lane
    int const quad = lane & 3;   // the mma's k pair (A, B) and D column pair index
    int64_t const row0 = int64_t(blockIdx.y) * kPassRows;
    int64_t const col0 = int64_t(blockIdx.x / ranks) * kStripCols;

    // This lane's copies: W* piece `chunk` of rows copy_row, copy_row + 2, ...; x pairs of token
    // `group` of each token group.
    int const chunk = lane % kRowChunks;
    int const copy_row = lane / kRowChunks;
    bool const chunk_ok = col0 + 8 * chunk < n;
    T const* x_rows[TokenGroups];
    int64_t row_offsets[TokenGroups]; // of this lane's token in x, the residual and the sum
    bool x_ok[TokenGroups];
#pragma unroll
    for (int g = 0; g < TokenGroups; ++g)
    {
        int64_t const token = row0 + g * kTokenGroupRows + group;
        x_ok[g] = token < m;
        row_offsets[g] = (x_ok[g] ? token : 0) * k;
        x_rows[g] = x + row_offsets[g];
    }
    // Every strip reads all of x; the first one alone writes the sum, each element once.
    bool const writes_sum = Layout::kResidual && blockIdx.x < unsigned(ranks);
    // Centred: each token's sums are shifted by its first input element (x + residual where the add
    // is here), the same value in every lane, warp and block, so their partial sums add.
    float shift[TokenGroups] = {};
    if constexpr (Centred)
    {
#pragma unroll
        for (int g = 0; g < TokenGroups; ++g)
        {
            if (x_ok[g])
            {
                T first_value = x_rows[g][0];
                if constexpr (Layout::kResidual)
                {
                    first_value = added<T>(first_value, residual[row_offsets[g]]);
                }
                shift[g] = to_float(first_value);
            }
        }
    }

    int64_t const steps = (k + kStepRows - 1) / kStepRows;
    int64_t const first = int64_t(rank) * kMmaWarps + warp;
    int64_t const warp_stride = int64_t(ranks) * kMmaWarps;
    int64_t const my_steps = first < steps ? (steps - 1 - first) / warp_stride + 1 : 0;
    Stage* const stages = reinterpret_cast<Stage*>(shared) + warp * kStages;

    auto issue = [&](int64_t index, Stage& stage) {
        int64_t const k0 = (first + index * warp_stride) * kStepRows;
#pragma unroll
        for (int r = copy_row; r < kStepRows; r += Layout::kCopyRowStride)
        {
            int64_t const w_row = k0 + r;
            bool const ok = chunk_ok && w_row < k;
            copy_async_16(&stage.w[r][Layout::piece_slot(r, chunk)], ok ? w + w_row * n + col0 + 8 * chunk : w, ok);
        }
#pragma unroll
        for (int g = 0; g < TokenGroups; ++g)
        {
#pragma unroll
            for (int half = 0; half < 2; ++half)
            {
                int64_t const pair = k0 + 8 * half + 2 * quad; // k is even: a pair never straddles K
                bool const ok = x_ok[g] && pair < k;
                copy_async_4(&stage.x[0][g][half][lane], ok ? x_rows[g] + pair : x, ok);
                if constexpr (Layout::kResidual)
                {
                    copy_async_4(&stage.x[1][g][half][lane], ok ? residual + row_offsets[g] + pair : residual, ok);
                }
            }
        }
    };

    float acc[kStripTiles][TokenGroups][4] = {};
    float ssq[TokenGroups] = {};
    float shifted[TokenGroups] = {};
    // ldmatrix: lanes 8i..8i+7 address the rows of matrix i = (k rows 0-7 | 8-15) × (columns 0-7 | 8-15).
    int const matrix_row = (lane >> 4) * 8 + (lane & 7);
    int const matrix_chunk = (lane >> 3) & 1;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s)
    {
        if (s < my_steps)
            issue(s, stages[s]);
        copy_async_commit(); // empty groups keep the count uniform
    }
    for (int64_t index = 0; index < my_steps; ++index)
    {
        __syncwarp(); // every lane has read the stage refilled next (consumed in the previous step)
        int64_t const ahead = index + kStages - 1;
        if (ahead < my_steps)
            issue(ahead, stages[ahead % kStages]);
        copy_async_commit();
        copy_async_wait<kStages - 1>(); // this lane's copies of this step have landed
        __syncwarp();                   // ... and the other lanes' too, visible to this lane
        Stage const& stage = stages[index % kStages];
        int64_t const step_k0 = (first + index * warp_stride) * kStepRows;
        uint32_t b[TokenGroups][2];
#pragma unroll
        for (int g = 0; g < TokenGroups; ++g)
        {
#pragma unroll
            for (int half = 0; half < 2; ++half)
            {
                b[g][half] = stage.x[0][g][half][lane];
                if constexpr (Layout::kResidual)
                {
                    // Out-of-range pairs were zero-filled in both sources: their sum stays zero.
                    b[g][half] = added<T>(b[g][half], stage.x[1][g][half][lane]);
                    int64_t const pair = step_k0 + 8 * half + 2 * quad;
                    if (writes_sum && x_ok[g] && pair < k)
                    {
                        *reinterpret_cast<uint32_t*>(sum + row_offsets[g] + pair) = b[g][half];
                    }
                }
            }
            // Each element of x's 16×8 B tile sits in exactly one lane: the norm is free here.
            if constexpr (Centred)
            {
                // Pairs past K were zero-filled: shifted, they would count, so they are skipped.
#pragma unroll
                for (int half = 0; half < 2; ++half)
                {
                    if (step_k0 + 8 * half + 2 * quad < k)
                    {
                        T const* values = reinterpret_cast<T const*>(&b[g][half]);
                        float const d0 = to_float(values[0]) - shift[g];
                        float const d1 = to_float(values[1]) - shift[g];
                        shifted[g] += d0 + d1;
                        ssq[g] += d0 * d0 + d1 * d1;
                    }
                }
            }
            else
            {
                ssq[g] += square_sum_pair<T>(b[g][0]) + square_sum_pair<T>(b[g][1]);
            }
        }
#pragma unroll
        for (int tile = 0; tile < kStripTiles; ++tile)
        {
            int const piece = 2 * tile + matrix_chunk;
            uint32_t a[4];
            load_matrix_x4_trans(a, &stage.w[matrix_row][Layout::piece_slot(matrix_row, piece)]);
#pragma unroll
            for (int g = 0; g < TokenGroups; ++g)
            {
                mma_16x8x16<T>(acc[tile][g], a, b[g][0], b[g][1]);
            }
        }
    }
    copy_async_wait<0>();
    __syncwarp(); // every lane's copies have landed and its last reads of the ring are done

    // Epilogue: the warps' partial products meet in shared memory, the cluster's blocks in
    // distributed shared memory; one block barrier and two cluster barriers in all.
    using Fragments = typename Layout::Fragments;
    auto const ring_of = [&](int v) { return reinterpret_cast<Fragments*>(shared + v * Layout::kRingBytes); };
    Fragments& mine = *ring_of(warp);
#pragma unroll
    for (int tile = 0; tile < kStripTiles; ++tile)
    {
#pragma unroll
        for (int g = 0; g < TokenGroups; ++g)
        {
            mine.value[(tile * TokenGroups + g) * 32 + lane]
                = make_float4(acc[tile][g][0], acc[tile][g][1], acc[tile][g][2], acc[tile][g][3]);
        }
    }
#pragma unroll
    for (int g = 0; g < TokenGroups; ++g)
    {
        ssq[g] += __shfl_xor_sync(0xffffffffu, ssq[g], 1);
        ssq[g] += __shfl_xor_sync(0xffffffffu, ssq[g], 2);
        if (quad == 0)
            partial_ssq[warp][g * kTokenGroupRows + group] = ssq[g];
        if constexpr (Centred)
        {
            shifted[g] += __shfl_xor_sync(0xffffffffu, shifted[g], 1);
            shifted[g] += __shfl_xor_sync(0xffffffffu, shifted[g], 2);
            if (quad == 0)
                partial_shifted[warp][g * kTokenGroupRows + group] = shifted[g];
        }
    }
    __syncthreads();

    // Fragment e = (tile, token group, lane) holds D[column, token], D[column, token + 1],
    // D[column + 8, token], D[column + 8, token + 1] of the strip's 16-column tile.
    constexpr int kFragments = kStripTiles * TokenGroups * 32;
    int const valid_rows = static_cast<int>(m - row0 < kPassRows ? m - row0 : kPassRows);
    auto const first_token = [](int e) { return ((e / 32) % TokenGroups) * kTokenGroupRows + 2 * ((e % 32) & 3); };
    float4* const block_values = (ring_of(0) + 1)->value;
    for (int e = threadIdx.x; e < kFragments; e += kMmaThreads)
    {
        if (first_token(e) < valid_rows)
        {
            float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int v = 0; v < kMmaWarps; ++v)
            {
                float4 const part = ring_of(v)->value[e];
                sum = make_float4(sum.x + part.x, sum.y + part.y, sum.z + part.z, sum.w + part.w);
            }
            block_values[e] = sum;
        }
    }
    if (threadIdx.x < kPassRows)
    {
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < kMmaWarps; ++v)
        {
            sum += partial_ssq[v][threadIdx.x];
        }
        block_ssq[threadIdx.x] = sum;
        if constexpr (Centred)
        {
            float shifted_sum = 0.f;
#pragma unroll
            for (int v = 0; v < kMmaWarps; ++v)
            {
                shifted_sum += partial_shifted[v][threadIdx.x];
            }
            block_shifted[threadIdx.x] = shifted_sum;
        }
    }
    cluster.sync(); // every block's sums are written and visible to the cluster

    // The cluster's blocks share the outputs: each gathers all ranks' sums of a fragment and of
    // its two tokens' squares at once (independent remote reads), scales and stores.
    for (int e = rank * kMmaThreads + threadIdx.x; e < kFragments; e += ranks * kMmaThreads)
    {
        int const token = first_token(e);
        if (token >= valid_rows)
            continue;
        float4 parts[kMaxCluster];
        float2 squares[kMaxCluster];
        float2 shifted_parts[Centred ? kMaxCluster : 1];
#pragma unroll
        for (int q = 0; q < kMaxCluster; ++q)
        {
            if (q < ranks)
            {
                parts[q] = cluster.map_shared_rank(block_values, q)[e];
                squares[q] = *reinterpret_cast<float2 const*>(cluster.map_shared_rank(block_ssq + token, q));
                if constexpr (Centred)
                {
                    shifted_parts[q] = *reinterpret_cast<float2 const*>(cluster.map_shared_rank(block_shifted + token, q));
                }
            }
        }
        int64_t const column = col0 + (e / (TokenGroups * 32)) * 16 + ((e % 32) >> 2);
        // The bias of this fragment's two columns (zeros without one), read while the sums land.
        float const bias0 = bias != nullptr && column < n ? __ldg(bias + column) : 0.f;
        float const bias8 = bias != nullptr && column + 8 < n ? __ldg(bias + column + 8) : 0.f;
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        float2 square = make_float2(0.f, 0.f);
        float2 shifted_sum = make_float2(0.f, 0.f);
#pragma unroll
        for (int q = 0; q < kMaxCluster; ++q)
        {
            if (q < ranks)
            {
                sum = make_float4(sum.x + parts[q].x, sum.y + parts[q].y, sum.z + parts[q].z, sum.w + parts[q].w);
                square = make_float2(square.x + squares[q].x, square.y + squares[q].y);
                if constexpr (Centred)
                {
                    shifted_sum = make_float2(shifted_sum.x + shifted_parts[q].x, shifted_sum.y + shifted_parts[q].y);
                }
            }
        }
        float scale0;
        float scale1;
        if constexpr (Centred)
        {
            scale0 = centred_scale(shifted_sum.x, square.x, float(k), eps);
            scale1 = centred_scale(shifted_sum.y, square.y, float(k), eps);
        }
        else
        {
            scale0 = rsqrtf(square.x / float(k) + eps);
            scale1 = rsqrtf(square.y / float(k) + eps);
        }
        int64_t const row = row0 + token;
        bool const second_row = token + 1 < valid_rows;
        if (column < n)
        {
            store_split<T>(splits, row, column, sum.x * scale0 + bias0);
            if (second_row)
                store_split<T>(splits, row + 1, column, sum.y * scale1 + bias0);
        }
        if (column + 8 < n)
        {
            store_split<T>(splits, row, column + 8, sum.z * scale0 + bias8);
            if (second_row)
                store_split<T>(splits, row + 1, column + 8, sum.w * scale1 + bias8);
        }
    }
    // No block may leave (and free its shared memory) while another still reads it. Those reads
    // have all been consumed above, so the arrival needs no release: a relaxed one does not wait
    // for this thread's global stores to be performed.
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

// ---------------------------------------------------------------- CUDA-core kernel (any shape)

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

constexpr int kGenericCols = 32;      // one lane per column: a warp reads one row segment
constexpr int kGenericChunk = kThreads; // rows of K staged in shared memory at a time
constexpr int kGenericUnroll = 4;

// MR: rows of x per pass (1, 2, 4, 8 or 16). Warp v handles rows v, v+8, ... of each K chunk.
// A non-null `residual`: the input is x + residual, which the first column block stores to `sum`.
// `centred`: the variance statistic, from sums shifted by each row's first input element; `bias`:
// n values added after the scale, or null.
template <typename T, int MR>
__global__ void __launch_bounds__(kThreads)
    fused_generic_kernel(T const* __restrict__ x, T const* __restrict__ residual, T* __restrict__ sum,
        T const* __restrict__ w, int64_t m, int64_t k, int64_t n, float eps, bool centred,
        float const* __restrict__ bias, OutputSplits splits)
{
    __shared__ __align__(16) float x_chunk[kGenericChunk][MR];
    __shared__ float partial[kWarps][MR][kGenericCols];
    __shared__ float partial_ssq[kWarps][MR];
    __shared__ float partial_shifted[kWarps][MR];

    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int64_t const row0 = int64_t(blockIdx.y) * MR;
    int const rows = static_cast<int>(m - row0 < MR ? m - row0 : MR);
    int64_t const col = int64_t(blockIdx.x) * kGenericCols + lane;
    bool const col_ok = col < n;

    float acc[MR] = {};
    float ssq[MR] = {};
    float shifted[MR] = {};
    float shift[MR] = {};
    if (centred)
    {
#pragma unroll
        for (int r = 0; r < MR; ++r)
        {
            if (r < rows)
            {
                int64_t const at = (row0 + r) * k;
                shift[r] = to_float(residual != nullptr ? added<T>(x[at], residual[at]) : x[at]);
            }
        }
    }
    for (int64_t k0 = 0; k0 < k; k0 += kGenericChunk)
    {
        __syncthreads(); // the previous chunk is consumed
        int64_t const kk = k0 + threadIdx.x;
#pragma unroll
        for (int r = 0; r < MR; ++r)
        {
            float v = 0.f;
            if (r < rows && kk < k)
            {
                int64_t const at = (row0 + r) * k + kk;
                T value = x[at];
                if (residual != nullptr)
                {
                    value = added<T>(value, residual[at]);
                    if (blockIdx.x == 0)
                        sum[at] = value;
                }
                v = to_float(value);
            }
            x_chunk[threadIdx.x][r] = v;
            if (!centred)
            {
                ssq[r] += v * v;
            }
            else if (r < rows && kk < k)
            {
                float const d = v - shift[r];
                shifted[r] += d;
                ssq[r] += d * d;
            }
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
        float const d = warp_sum(shifted[r]);
        if (lane == 0)
        {
            partial_ssq[warp][r] = s;
            partial_shifted[warp][r] = d;
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
            float total_shifted = 0.f;
#pragma unroll
            for (int v = 0; v < kWarps; ++v)
            {
                sum += partial[v][r][c];
                total_ssq += partial_ssq[v][r];
                total_shifted += partial_shifted[v][r];
            }
            float const scale = centred ? centred_scale(total_shifted, total_ssq, float(k), eps)
                                        : rsqrtf(total_ssq / float(k) + eps);
            store_split<T>(splits, row0 + r, out_col, sum * scale + (bias != nullptr ? bias[out_col] : 0.f));
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

using WideStrip = MmaLayout<128, 4>;
using NarrowStrip = MmaLayout<32, 8>;
// With the residual's fragments in every stage the wide ring leaves room for two blocks per
// multiprocessor instead of three; the narrow one still fits three.
using WideStripResidual = MmaLayout<128, 4, 2>;
using NarrowStripResidual = MmaLayout<32, 8, 2>;

// The residual add's operands as T (both null: none).
template <typename T>
struct TypedResidual
{
    T const* residual;
    T* sum;

    explicit TypedResidual(ResidualAdd const& add)
        : residual(static_cast<T const*>(add.residual))
        , sum(static_cast<T*>(add.sum))
    {
    }

    bool present() const
    {
        return residual != nullptr;
    }

    // The operands seen from row `row0` of a [m, k] problem on.
    T const* residual_from(int64_t row0, int64_t k) const
    {
        return present() ? residual + row0 * k : nullptr;
    }

    T* sum_from(int64_t row0, int64_t k) const
    {
        return present() ? sum + row0 * k : nullptr;
    }
};

template <typename T, int TokenGroups, typename Layout, bool Centred>
cudaError_t launch_mma(T const* x, TypedResidual<T> const& add, T const* w, int64_t m, int64_t k, int64_t n,
    RowNorm const& norm, OutputSplits const& splits, int64_t strips, int cluster_size, cudaStream_t stream)
{
    int64_t const pass_rows = kTokenGroupRows * TokenGroups;
    return launch_row_windows(m, pass_rows, [&](int64_t row0, int64_t rows, unsigned blocks_y) {
        cudaLaunchAttribute cluster{};
        cluster.id = cudaLaunchAttributeClusterDimension;
        cluster.val.clusterDim.x = static_cast<unsigned>(cluster_size);
        cluster.val.clusterDim.y = 1;
        cluster.val.clusterDim.z = 1;
        cudaLaunchConfig_t config{};
        config.gridDim = dim3(static_cast<unsigned>(strips * cluster_size), blocks_y);
        config.blockDim = dim3(kMmaThreads);
        config.dynamicSmemBytes = Layout::kSharedBytes;
        config.stream = stream;
        config.attrs = &cluster;
        config.numAttrs = 1;
        // launch_row_windows reads the launch's error through cudaGetLastError.
        static_cast<void>(cudaLaunchKernelEx(&config, fused_mma_kernel<T, TokenGroups, Layout, Centred>, x + row0 * k,
            add.residual_from(row0, k), add.sum_from(row0, k), w, rows, k, n, norm.eps, norm.bias,
            shifted<T>(splits, row0)));
    });
}

template <typename T, typename Layout, bool Centred>
cudaError_t launch_mma_rows(T const* x, TypedResidual<T> const& add, T const* w, int64_t m, int64_t k, int64_t n,
    RowNorm const& norm, OutputSplits const& splits, int64_t strips, int cluster_size, cudaStream_t stream)
{
    // One B operand (8 tokens) where it covers M: half the mma work and accumulators of two.
    if (m <= kTokenGroupRows)
        return launch_mma<T, 1, Layout, Centred>(x, add, w, m, k, n, norm, splits, strips, cluster_size, stream);
    return launch_mma<T, 2, Layout, Centred>(x, add, w, m, k, n, norm, splits, strips, cluster_size, stream);
}

template <typename T, typename Layout, typename ResidualLayout, bool Centred>
cudaError_t launch_mma_statistic(T const* x, TypedResidual<T> const& add, T const* w, int64_t m, int64_t k,
    int64_t n, RowNorm const& norm, OutputSplits const& splits, int64_t strips, int cluster_size, cudaStream_t stream)
{
    if (add.present())
        return launch_mma_rows<T, ResidualLayout, Centred>(x, add, w, m, k, n, norm, splits, strips, cluster_size, stream);
    return launch_mma_rows<T, Layout, Centred>(x, add, w, m, k, n, norm, splits, strips, cluster_size, stream);
}

template <typename T, typename Layout, typename ResidualLayout>
cudaError_t launch_mma_layout(T const* x, TypedResidual<T> const& add, T const* w, int64_t m, int64_t k, int64_t n,
    RowNorm const& norm, OutputSplits const& splits, int64_t strips, int cluster_size, cudaStream_t stream)
{
    if (norm.centred)
        return launch_mma_statistic<T, Layout, ResidualLayout, true>(
            x, add, w, m, k, n, norm, splits, strips, cluster_size, stream);
    return launch_mma_statistic<T, Layout, ResidualLayout, false>(
        x, add, w, m, k, n, norm, splits, strips, cluster_size, stream);
}

// Columns per strip. Measured on an H200 (bf16, W* from HBM, M = 1/4/16, forced widths 16/32/128;
// plugins/flashnorm/kernels/DESIGN.md): 32-column strips win where W* is small (576×960: 4.38 vs
// 4.67 µs at M = 1, 4.61 vs 5.43 at M = 16; 576×3072: 5.02 vs 5.21 and 6.02 vs 6.58) and lose from
// 2048×3072 up (7.69 vs 7.41 at M = 1): there the wide strips' 256-byte row pieces read HBM better.
// 16-column strips never won (576×960: 4.63 at best).
int pick_strip_cols(int64_t k, int64_t n)
{
    constexpr int64_t kNarrowMaxWeightElements = int64_t(1) << 21;
    return k * n <= kNarrowMaxWeightElements ? NarrowStrip::kStripCols : WideStrip::kStripCols;
}

// Blocks per strip (the cluster size). Measured on an H200 (bf16, W* from HBM, M = 1/4/16,
// forced sizes 1/2/4/8; plugins/flashnorm/kernels/DESIGN.md): the best size keeps the grid within
// two blocks per multiprocessor and is at most 4 (576×3072: 5.2 µs at 4 vs 5.3 at 8; 2048×16384:
// 20.3 at 2 vs 21.2 at 1 and 26.3 at 4; 4096×6144: 16.8 at 4 vs 22.3 at 8; 4096×28672: 61.5 at 1),
// except for very narrow outputs, where 8 blocks per strip still fit in half a wave (576×960:
// 4.6 µs at 8 vs 4.8 at 4).
int pick_cluster_size(int64_t strips, int sm_count)
{
    if (strips * kMaxCluster * 2 <= int64_t(sm_count))
        return kMaxCluster;
    int size = 4;
    while (size > 1 && strips * size > 2 * int64_t(sm_count))
    {
        size /= 2;
    }
    return size;
}

template <typename T, int MR>
cudaError_t launch_generic(T const* x, TypedResidual<T> const& add, T const* w, int64_t m, int64_t k, int64_t n,
    RowNorm const& norm, OutputSplits const& splits, cudaStream_t stream)
{
    unsigned const blocks_x = static_cast<unsigned>((n + kGenericCols - 1) / kGenericCols);
    return launch_row_windows(m, MR, [&](int64_t row0, int64_t rows, unsigned blocks_y) {
        fused_generic_kernel<T, MR><<<dim3(blocks_x, blocks_y), kThreads, 0, stream>>>(x + row0 * k,
            add.residual_from(row0, k), add.sum_from(row0, k), w, rows, k, n, norm.eps, norm.centred, norm.bias,
            shifted<T>(splits, row0));
    });
}

template <typename T>
cudaError_t launch_generic_rows(T const* x, TypedResidual<T> const& add, T const* w, int64_t m, int64_t k,
    int64_t n, RowNorm const& norm, OutputSplits const& splits, cudaStream_t stream)
{
    // The fewest rows per pass that cover M (up to 16): no accumulators wasted on absent rows.
    if (m <= 1)
        return launch_generic<T, 1>(x, add, w, m, k, n, norm, splits, stream);
    if (m <= 2)
        return launch_generic<T, 2>(x, add, w, m, k, n, norm, splits, stream);
    if (m <= 4)
        return launch_generic<T, 4>(x, add, w, m, k, n, norm, splits, stream);
    if (m <= 8)
        return launch_generic<T, 8>(x, add, w, m, k, n, norm, splits, stream);
    return launch_generic<T, 16>(x, add, w, m, k, n, norm, splits, stream);
}

template <typename T>
cudaError_t launch_fused_16bit(T const* x, TypedResidual<T> const& add, T const* w, int64_t m, int64_t k, int64_t n,
    RowNorm const& norm, OutputSplits const& splits, int sm_count, FusedTuning const& tuning, cudaStream_t stream)
{
    bool const residual_aligned = !add.present()
        || (reinterpret_cast<uintptr_t>(add.residual) % 4 == 0 && reinterpret_cast<uintptr_t>(add.sum) % 4 == 0);
    if (!fused_tensor_core_shape(k, n) || reinterpret_cast<uintptr_t>(w) % 16 != 0
        || reinterpret_cast<uintptr_t>(x) % 4 != 0 || !residual_aligned)
    {
        return launch_generic_rows<T>(x, add, w, m, k, n, norm, splits, stream);
    }
    int const strip_cols = tuning.strip_cols > 0 ? tuning.strip_cols : pick_strip_cols(k, n);
    int64_t const strips = (n + strip_cols - 1) / strip_cols;
    int const size = tuning.cluster_size > 0 ? tuning.cluster_size : pick_cluster_size(strips, sm_count);
    if (strip_cols == NarrowStrip::kStripCols)
        return launch_mma_layout<T, NarrowStrip, NarrowStripResidual>(
            x, add, w, m, k, n, norm, splits, strips, size, stream);
    return launch_mma_layout<T, WideStrip, WideStripResidual>(x, add, w, m, k, n, norm, splits, strips, size, stream);
}

template <typename T, typename Layout>
cudaError_t allow_mma_shared_memory()
{
    // Above 48 KB a kernel's dynamic shared memory must be allowed explicitly, per device.
    int const bytes = static_cast<int>(Layout::kSharedBytes);
    constexpr auto kAttribute = cudaFuncAttributeMaxDynamicSharedMemorySize;
    for (cudaError_t const status : {cudaFuncSetAttribute(fused_mma_kernel<T, 1, Layout, false>, kAttribute, bytes),
             cudaFuncSetAttribute(fused_mma_kernel<T, 2, Layout, false>, kAttribute, bytes),
             cudaFuncSetAttribute(fused_mma_kernel<T, 1, Layout, true>, kAttribute, bytes),
             cudaFuncSetAttribute(fused_mma_kernel<T, 2, Layout, true>, kAttribute, bytes)})
    {
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    return cudaSuccess;
}

} // namespace

bool fused_tuning_supported(FusedTuning const& tuning)
{
    int const strip = tuning.strip_cols;
    int const size = tuning.cluster_size;
    bool const strip_ok = strip == 0 || strip == NarrowStrip::kStripCols || strip == WideStrip::kStripCols;
    bool const cluster_ok = size >= 0 && size <= kMaxCluster && (size & (size - 1)) == 0;
    return strip_ok && cluster_ok;
}

cudaError_t configure_fused_kernels()
{
    for (cudaError_t const status : {allow_mma_shared_memory<__half, WideStrip>(),
             allow_mma_shared_memory<__half, NarrowStrip>(), allow_mma_shared_memory<__nv_bfloat16, WideStrip>(),
             allow_mma_shared_memory<__nv_bfloat16, NarrowStrip>(), allow_mma_shared_memory<__half, WideStripResidual>(),
             allow_mma_shared_memory<__half, NarrowStripResidual>(),
             allow_mma_shared_memory<__nv_bfloat16, WideStripResidual>(),
             allow_mma_shared_memory<__nv_bfloat16, NarrowStripResidual>()})
    {
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    return cudaSuccess;
}

cudaError_t launch_fused(flashnorm_dtype dtype, void const* x, ResidualAdd const& add, void const* w, int64_t m,
    int64_t k, int64_t n, RowNorm const& norm, OutputSplits const& splits, int sm_count, FusedTuning const& tuning,
    cudaStream_t stream)
{
    switch (dtype)
    {
    case FLASHNORM_DTYPE_F32:
        return launch_generic_rows<float>(static_cast<float const*>(x), TypedResidual<float>(add),
            static_cast<float const*>(w), m, k, n, norm, splits, stream);
    case FLASHNORM_DTYPE_F16:
        return launch_fused_16bit<__half>(static_cast<__half const*>(x), TypedResidual<__half>(add),
            static_cast<__half const*>(w), m, k, n, norm, splits, sm_count, tuning, stream);
    case FLASHNORM_DTYPE_BF16:
        return launch_fused_16bit<__nv_bfloat16>(static_cast<__nv_bfloat16 const*>(x),
            TypedResidual<__nv_bfloat16>(add), static_cast<__nv_bfloat16 const*>(w), m, k, n, norm, splits, sm_count,
            tuning, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace flashnorm
