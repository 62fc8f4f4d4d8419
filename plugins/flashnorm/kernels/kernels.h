// The FlashNorm kernels: the math, once. Each launcher enqueues on the stream it is given and
// returns the launch's error; none allocates, creates or synchronizes anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include <cuda_runtime_api.h>

#include "flashnorm/flashnorm.h"

namespace flashnorm
{

// Where each of the N output columns goes: output i receives columns [offsets[i], offsets[i+1]).
struct OutputSplits
{
    void* outputs[FLASHNORM_MAX_OUTPUTS];
    int64_t offsets[FLASHNORM_MAX_OUTPUTS + 1];
    int32_t count;
};

// inv_rms[m] = rsqrt(mean(x[m, :]²) + eps) in fp32, for the two-stream strategy's side stream.
cudaError_t launch_inv_rms(
    flashnorm_dtype dtype, void const* x, int64_t m, int64_t k, float eps, float* inv_rms, cudaStream_t stream);

// Test hook: one thread spins `cycles` GPU clock cycles on `stream`, holding back the side
// stream's work after it (a slow reduction or GEMM).
cudaError_t launch_delay(int64_t cycles, cudaStream_t stream);

// outputs[i][r, c] = product[r, offsets[i] + c] * inv_rms[r]. `product` is the GEMM result
// [m, n] in `product_dtype` (see product_dtype()).
cudaError_t launch_post_scale(flashnorm_dtype dtype, flashnorm_dtype product_dtype, void const* product,
    float const* inv_rms, int64_t m, int64_t n, OutputSplits const& splits, cudaStream_t stream);

// Device arrays of pointers for cuBLASLt's pointer-array batched GEMMs: the normalize kernel,
// which runs before the GEMMs that read them, copies the first `count` values to `destination`
// (kernel arguments are captured by value, so a CUDA graph replays the same pointers).
struct PointerTable
{
    void const* values[3 * FLASHNORM_MAX_OUTPUTS];
    void const** destination;
    int32_t count;
};

// normalized[m, :] = x[m, :] * rsqrt(mean(x[m, :]²) + eps): fp32 math, stored in `dtype` (the
// prenorm strategy's input to its library GEMMs). `normalized` is [m, k] row-major, m >= 1.
cudaError_t launch_normalize_rows(flashnorm_dtype dtype, void const* x, void* normalized, int64_t m, int64_t k,
    float eps, PointerTable const& pointers, cudaStream_t stream);

// The type the two-stream GEMM writes its unscaled product in. fp16 widens to fp32 because the
// unnormalized product can exceed fp16's range (65504) even when the normalized result does not;
// bf16 keeps its own type (fp32's range, half the bytes of the extra pass).
inline flashnorm_dtype product_dtype(flashnorm_dtype dtype)
{
    return dtype == FLASHNORM_DTYPE_BF16 ? FLASHNORM_DTYPE_BF16 : FLASHNORM_DTYPE_F32;
}

// How the fused kernel's tensor-core grid is cut; 0 picks automatically. Forced values come from
// flashnorm_testing_set_fused_tuning (tests and tuning runs).
struct FusedTuning
{
    int strip_cols = 0;   // columns of W* per cluster: 32 or 128
    int cluster_size = 0; // blocks per strip, splitting K: 1, 2, 4 or 8
};

// Whether the fused kernel has the forced layout (0 in a field: automatic).
bool fused_tuning_supported(FusedTuning const& tuning);

// The residual add in front of the norm: the norm's input is sum = x + residual (each element added
// in fp32 and rounded once to the dtype, as the add in that dtype does), stored to `sum`, [m, k]
// like x. Both null: no add. `sum` overlaps neither x nor residual (capi.cpp checks).
struct ResidualAdd
{
    void const* residual = nullptr;
    void* sum = nullptr;
};

// The fused decode kernel: one launch computes x·W*, sum(x²) and the scaled, split outputs, with
// the residual add where `add` has one. `sm_count` (multiprocessors of the device) sizes the grid.
cudaError_t launch_fused(flashnorm_dtype dtype, void const* x, ResidualAdd const& add, void const* w, int64_t m,
    int64_t k, int64_t n, float eps, OutputSplits const& splits, int sm_count, FusedTuning const& tuning,
    cudaStream_t stream);

// sum = x + residual alone (`count` elements): the residual add of the strategies other than fused,
// which then read `sum` as their x.
cudaError_t launch_residual_add(
    flashnorm_dtype dtype, void const* x, ResidualAdd const& add, int64_t count, cudaStream_t stream);

// Sets the fused kernels' launch attributes on the current device: once, before any launch there
// (flashnorm_context_create does it, outside any capture).
cudaError_t configure_fused_kernels();

// Shapes the fused kernel runs on tensor cores (fp16/bf16, with W* 16-byte and x 4-byte aligned:
// 16-byte rows of W*, pairs of k in x); others take its CUDA-core fallback.
inline bool fused_tensor_core_shape(int64_t k, int64_t n)
{
    return n % 8 == 0 && k % 2 == 0;
}

// The epilogue-scale GEMM's tile configurations: rows×columns of W* per tile; RowSums: the main
// loop sums the rows, else the reduction kernel runs in front; OneWave: at most one tile per
// multiprocessor; PingPong: two consumer warp groups taking turns on 64-row tiles; Clusters: two
// tiles along M share each W* tile (TMA multicast). Any configuration computes any shape (the
// OneWave ones in more waves where the tiles outnumber the multiprocessors): the names say where
// the dispatch runs them.
enum class EpilogueScaleTiles
{
    kRowSums64x32,
    kRowSums64x64,
    kRowSums64x128,
    kRowSumsPingPong64x128,
    kOneWave64x64,
    kOneWave64x64DeepK, // 128-deep K steps
    kPingPong64x64,
    kOneWave128x64,
    k128x64,
    kOneWave128x128,
    k128x128,
    kOneWave128x192,
    k128x192,
    kClusters128x256,
    kOneWaveClusters128x96,
};

// How many configurations EpilogueScaleTiles has, and each one's name: tests and tuning runs force
// them by index (flashnorm_testing_set_epilogue_scale_tiles).
constexpr int kEpilogueScaleTileConfigurations = 15;
static_assert(static_cast<int>(EpilogueScaleTiles::kOneWaveClusters128x96) + 1 == kEpilogueScaleTileConfigurations,
    "kOneWaveClusters128x96 is the last configuration");
char const* epilogue_scale_tiles_name(EpilogueScaleTiles tiles);

// The tiles the epilogue-scale GEMM runs for this shape on `sm_count` multiprocessors (pure host
// arithmetic, in every build: AUTO reads it too).
EpilogueScaleTiles epilogue_scale_tiles(int64_t m, int64_t k, int64_t n, int sm_count);

// Tiles of tile_m × tile_n that cover an m × n output.
inline int64_t tile_count(int64_t m, int64_t n, int64_t tile_m, int64_t tile_n)
{
    return ((m + tile_m - 1) / tile_m) * ((n + tile_n - 1) / tile_n);
}

// A configuration's tile (rows × columns of the output), whether the GEMM then runs at most one tile
// per multiprocessor, and whether its main loop sums the rows.
struct EpilogueScaleTileShape
{
    int64_t rows;
    int64_t columns;
    bool one_wave;
    bool row_sums;
};

constexpr EpilogueScaleTileShape epilogue_scale_tile_shape(EpilogueScaleTiles tiles)
{
    switch (tiles)
    {
    case EpilogueScaleTiles::kRowSums64x32: return {64, 32, true, true};
    case EpilogueScaleTiles::kRowSums64x64: return {64, 64, true, true};
    case EpilogueScaleTiles::kRowSums64x128: return {64, 128, true, true};
    case EpilogueScaleTiles::kRowSumsPingPong64x128: return {64, 128, false, true};
    case EpilogueScaleTiles::kOneWave64x64:
    case EpilogueScaleTiles::kOneWave64x64DeepK: return {64, 64, true, false};
    case EpilogueScaleTiles::kPingPong64x64: return {64, 64, false, false};
    case EpilogueScaleTiles::kOneWave128x64: return {128, 64, true, false};
    case EpilogueScaleTiles::k128x64: return {128, 64, false, false};
    case EpilogueScaleTiles::kOneWave128x128: return {128, 128, true, false};
    case EpilogueScaleTiles::k128x128: return {128, 128, false, false};
    case EpilogueScaleTiles::kOneWave128x192: return {128, 192, true, false};
    case EpilogueScaleTiles::k128x192: return {128, 192, false, false};
    case EpilogueScaleTiles::kClusters128x256: return {128, 256, false, false};
    case EpilogueScaleTiles::kOneWaveClusters128x96: return {128, 96, true, false};
    }
    return {128, 128, false, false};
}

// The epilogue-scale strategy (kernels/epilogue_scale.cu): one CUTLASS sm90 GEMM that scales each
// row by rsqrt(mean(x²)+eps) and TMA-stores each split straight into its output (splits starting
// at multiples of kEpilogueScaleSubtileColumns, 16-byte aligned outputs: the checks below), on the
// tiles epilogue_scale_tiles picks; the row sums in its own main loop or by a reduction kernel
// launched in front, which the GEMM (programmatic dependent launch) overlaps and its epilogue waits
// for (griddepcontrol.wait). fp16/bf16 only. `inv_rms` is m floats of workspace (the reduction
// kernel's output); `delay_cycles` (test hook) holds the reduction's writes back after the GEMM has
// been let start; `forced_tiles` (tuning hook) runs those tiles instead of epilogue_scale_tiles'.
cudaError_t launch_epilogue_scale(flashnorm_dtype dtype, void const* x, void const* w, int64_t m, int64_t k,
    int64_t n, float eps, OutputSplits const& splits, float* inv_rms, int sm_count, int64_t delay_cycles,
    std::optional<EpilogueScaleTiles> forced_tiles, cudaStream_t stream);

// Whether this build has the epilogue-scale GEMM (CUTLASS headers were found at configure time).
bool epilogue_scale_built();

// Sets the epilogue-scale GEMMs' shared-memory attribute on the current device: once, outside any
// capture (flashnorm_context_create does it).
cudaError_t configure_epilogue_scale_kernels();

// The epilogue-scale workspace: inv_rms, m floats.
inline size_t epilogue_scale_workspace_bytes(int64_t m)
{
    return (sizeof(float) * static_cast<size_t>(m) + 255) / 256 * 256;
}

// The columns of the epilogue-scale GEMM's epilogue subtile, the box of its TMA stores: a store
// goes to one split's tensor, so no subtile may straddle two splits.
constexpr int64_t kEpilogueScaleSubtileColumns = 32;

// The CUTLASS GEMM has 16-bit operands only, its TMA loads need row strides of x and W* that are
// multiples of 16 bytes, and its TMA stores every split to start at a multiple of the subtile's
// columns (with N a multiple of 8, every output's rows are then 16-byte multiples too) ...
inline bool epilogue_scale_shape_fits(flashnorm_dtype dtype, int64_t k, int64_t n, int32_t split_count,
    int64_t const* split_sizes)
{
    int64_t begin = 0;
    for (int32_t split = 0; split + 1 < split_count; ++split)
    {
        begin += split_sizes[split];
        if (begin % kEpilogueScaleSubtileColumns != 0)
        {
            return false;
        }
    }
    return dtype != FLASHNORM_DTYPE_F32 && k % 8 == 0 && n % 8 == 0;
}

// ... and 16-byte aligned x, W* and outputs.
inline bool epilogue_scale_pointers_fit(void const* x, void const* w, OutputSplits const& splits)
{
    bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
    for (int split = 0; split < splits.count; ++split)
    {
        aligned = aligned && reinterpret_cast<uintptr_t>(splits.outputs[split]) % 16 == 0;
    }
    return aligned;
}

} // namespace flashnorm
