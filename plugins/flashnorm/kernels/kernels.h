// The FlashNorm kernels: the math, once. Each launcher enqueues on the stream it is given and
// returns the launch's error; none allocates, creates or synchronizes anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include <cuda_runtime_api.h>

#include "dispatch/dispatch.h"
#include "flashnorm/flashnorm.h"

namespace flashnorm
{

// The dispatch unit (dispatch/dispatch.h) says which strategy and tiles run and how much workspace
// they take, in host-only types; the kernels and the runtime read it through these names.
static_assert(static_cast<int>(dispatch::DType::kF32) == FLASHNORM_DTYPE_F32
        && static_cast<int>(dispatch::DType::kF16) == FLASHNORM_DTYPE_F16
        && static_cast<int>(dispatch::DType::kBF16) == FLASHNORM_DTYPE_BF16,
    "dispatch::DType mirrors flashnorm_dtype");
static_assert(dispatch::kMaxOutputs == FLASHNORM_MAX_OUTPUTS, "dispatch::kMaxOutputs mirrors FLASHNORM_MAX_OUTPUTS");
static_assert(static_cast<int>(dispatch::Statistic::kRms) == FLASHNORM_STATISTIC_RMS
        && static_cast<int>(dispatch::Statistic::kVariance) == FLASHNORM_STATISTIC_VARIANCE,
    "dispatch::Statistic mirrors flashnorm_statistic");
constexpr dispatch::DType dispatch_dtype(flashnorm_dtype dtype)
{
    return static_cast<dispatch::DType>(dtype);
}
using dispatch::EpilogueScaleTiles;
using dispatch::EpilogueScaleTileShape;
using dispatch::epilogue_scale_tile_shape;
using dispatch::epilogue_scale_tiles;
using dispatch::epilogue_scale_tiles_name;
using dispatch::epilogue_scale_workspace_bytes;
using dispatch::fused_tensor_core_shape;
using dispatch::kEpilogueScaleSubtileColumns;
using dispatch::kEpilogueScaleTileConfigurations;
using dispatch::tile_count;

// Where each of the N output columns goes: output i receives columns [offsets[i], offsets[i+1]).
struct OutputSplits
{
    void* outputs[FLASHNORM_MAX_OUTPUTS];
    int64_t offsets[FLASHNORM_MAX_OUTPUTS + 1];
    int32_t count;
};

// The norm a call applies around its product: the row statistic's eps, which statistic, and the bias
// added after the row scale (n fp32 values, or none).
struct RowNorm
{
    float eps = 0.f;
    // The variance (LayerNorm, W* centred): rsqrt(mean((x − mean x)²) + eps); else the RMS,
    // rsqrt(mean(x²) + eps).
    bool centred = false;
    float const* bias = nullptr;
};

inline RowNorm row_norm(flashnorm_problem const& problem, float const* bias)
{
    return RowNorm{problem.eps, problem.statistic == FLASHNORM_STATISTIC_VARIANCE, bias};
}

// scales[r] = row r's statistic in fp32 (RowNorm::centred), for the two-stream strategy's side stream.
cudaError_t launch_row_scales(flashnorm_dtype dtype, void const* x, int64_t m, int64_t k, RowNorm const& norm,
    float* scales, cudaStream_t stream);

// Test hook: one thread spins `cycles` GPU clock cycles on `stream`, holding back the side
// stream's work after it (a slow reduction or GEMM).
cudaError_t launch_delay(int64_t cycles, cudaStream_t stream);

// outputs[i][r, c] = product[r, offsets[i] + c] * scales[r] + bias[offsets[i] + c] (bias null: none).
// `product` is the GEMM result [m, n] in `product_dtype` (see product_dtype()).
cudaError_t launch_post_scale(flashnorm_dtype dtype, flashnorm_dtype product_dtype, void const* product,
    float const* scales, float const* bias, int64_t m, int64_t n, OutputSplits const& splits, cudaStream_t stream);

// Device arrays of pointers for cuBLASLt's pointer-array batched GEMMs: the normalize kernel,
// which runs before the GEMMs that read them, copies the first `count` values to `destination`
// (kernel arguments are captured by value, so a CUDA graph replays the same pointers).
struct PointerTable
{
    void const* values[3 * FLASHNORM_MAX_OUTPUTS];
    void const** destination;
    int32_t count;
};
static_assert(sizeof(PointerTable::values) == dispatch::kPointerTableBytes, "the prenorm workspace holds the values");

// The bias the prenorm GEMMs add where cuBLASLt takes no fp32 bias beside the outputs' type: the
// normalize kernel rounds bias[0, n) to the I/O dtype into `rounded` as it runs (null bias: nothing).
struct RoundedBias
{
    float const* bias = nullptr;
    void* rounded = nullptr;
    int64_t n = 0;
};

// normalized[r, :] = x[r, :] * rsqrt(mean(x[r, :]²) + eps), or (norm.centred) (x[r, :] − mean) *
// rsqrt(mean((x[r, :] − mean)²) + eps): fp32 math, stored in `dtype` (the prenorm strategy's input to
// its library GEMMs). `normalized` is [m, k] row-major, m >= 1. norm.bias is not read (the GEMMs add
// it); `bias` is rounded where asked.
cudaError_t launch_normalize_rows(flashnorm_dtype dtype, void const* x, void* normalized, int64_t m, int64_t k,
    RowNorm const& norm, PointerTable const& pointers, RoundedBias const& bias, cudaStream_t stream);

// The type the two-stream GEMM writes its unscaled product in (dispatch::product_dtype says why).
inline flashnorm_dtype product_dtype(flashnorm_dtype dtype)
{
    return static_cast<flashnorm_dtype>(dispatch::product_dtype(dispatch_dtype(dtype)));
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

// The fused decode kernel: one launch computes x·W*, the row sums and the scaled, biased, split
// outputs, with the residual add where `add` has one. `sm_count` (multiprocessors of the device)
// sizes the grid.
cudaError_t launch_fused(flashnorm_dtype dtype, void const* x, ResidualAdd const& add, void const* w, int64_t m,
    int64_t k, int64_t n, RowNorm const& norm, OutputSplits const& splits, int sm_count, FusedTuning const& tuning,
    cudaStream_t stream);

// sum = x + residual alone (`count` elements): the residual add of the strategies other than fused,
// which then read `sum` as their x.
cudaError_t launch_residual_add(
    flashnorm_dtype dtype, void const* x, ResidualAdd const& add, int64_t count, cudaStream_t stream);

// Sets the fused kernels' launch attributes on the current device: once, before any launch there
// (flashnorm_context_create does it, outside any capture).
cudaError_t configure_fused_kernels();

// The epilogue-scale strategy (kernels/epilogue_scale.cu): one CUTLASS sm90 GEMM that scales each
// row by its statistic, adds the bias and TMA-stores each split straight into its output (splits
// starting at multiples of kEpilogueScaleSubtileColumns, 16-byte aligned outputs: the checks below),
// on the tiles dispatch::epilogue_scale_tiles picks on `sm_count` multiprocessors; the row sums in its
// own main loop or by a reduction kernel launched in front, which the GEMM (programmatic dependent
// launch) overlaps and its epilogue waits for (griddepcontrol.wait). fp16/bf16 only. `scales` is m
// floats of workspace (the reduction kernel's output); `delay_cycles` (test hook) holds the
// reduction's writes back after the GEMM has been let start; `forced_tiles` (tuning hook) runs those
// tiles instead of epilogue_scale_tiles'.
cudaError_t launch_epilogue_scale(flashnorm_dtype dtype, void const* x, void const* w, int64_t m, int64_t k,
    int64_t n, RowNorm const& norm, OutputSplits const& splits, float* scales, int sm_count, int64_t delay_cycles,
    std::optional<EpilogueScaleTiles> forced_tiles, cudaStream_t stream);

// Whether this build has the epilogue-scale GEMM (CUTLASS headers were found at configure time).
bool epilogue_scale_built();

// Sets the epilogue-scale GEMMs' shared-memory attribute on the current device: once, outside any
// capture (flashnorm_context_create does it).
cudaError_t configure_epilogue_scale_kernels();

// The shapes the epilogue-scale GEMM takes (dispatch::epilogue_scale_shape_fits) ...
inline bool epilogue_scale_shape_fits(flashnorm_dtype dtype, int64_t k, int64_t n, int32_t split_count,
    int64_t const* split_sizes)
{
    return dispatch::epilogue_scale_shape_fits(dispatch_dtype(dtype), k, n, split_count, split_sizes);
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
