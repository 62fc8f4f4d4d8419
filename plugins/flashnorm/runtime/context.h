// The per-execution-context state and the strategies built on a library GEMM (two-stream,
// prenorm). Fork/join lives here and only here: everything a call needs is created once in
// flashnorm_context_create, so a call allocates, creates and synchronizes nothing and can be
// captured into a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "flashnorm/flashnorm.h"
#include "kernels/kernels.h"

namespace flashnorm
{

// The workspace layouts and the split runs are the dispatch unit's (dispatch/dispatch.h: AUTO sizes
// the workspace from them); the strategies below carve their workspace by them.
using dispatch::kGemmWorkspaceBytes;
using dispatch::PrenormLayout;
using dispatch::SplitRun;
using dispatch::TwoStreamLayout;

inline TwoStreamLayout two_stream_layout(int64_t m, int64_t n, flashnorm_dtype dtype)
{
    return dispatch::two_stream_layout(m, n, dispatch_dtype(dtype));
}

inline PrenormLayout prenorm_layout(int64_t m, int64_t k, int64_t n, flashnorm_dtype dtype, int runs)
{
    return dispatch::prenorm_layout(m, k, n, dispatch_dtype(dtype), runs);
}

// Consecutive splits of one width: prenorm runs each run as one GEMM, a pointer-array batched one
// for several splits, tiled like a GEMM over their whole width where a GEMM per split was up to
// 1.2× slower (docs/history/2026-11-29-kernel-notes.md, "Prenorm: one batched GEMM per run").
inline int split_runs(flashnorm_problem const& problem, SplitRun (&runs)[FLASHNORM_MAX_OUTPUTS])
{
    return dispatch::split_runs(problem.num_outputs, problem.split_sizes, runs);
}

// The bias a GEMM adds in cuBLASLt's epilogue (prenorm): none, or its type and alignment.
struct GemmBias
{
    // kNoBias, or the cudaDataType_t of the bias vector (fp32, or the output type).
    int32_t type = kNoBias;
    uint32_t alignment = 0;
    static constexpr int32_t kNoBias = -1;
    bool operator==(GemmBias const& other) const
    {
        return type == other.type && alignment == other.alignment;
    }
};

// A GEMM shape as cuBLASLt sees it: [m,k]·W[:, n columns] with W's rows w_ld elements apart (the
// full N when prenorm reads one split's column slice), written in out_dtype, plus a bias. Pointer
// alignment is part of the key because the heuristic may only pick kernels that the actual pointers
// satisfy.
struct GemmKey
{
    int64_t m, k, n, w_ld;
    flashnorm_dtype dtype, out_dtype;
    uint32_t x_alignment, w_alignment, out_alignment;
    // > 1: that many GEMMs of this shape in one pointer-array batched call (arrays of W slices,
    // x and outputs in device memory; the batch's biases n apart).
    int32_t batch = 1;
    GemmBias bias{};
    bool operator==(GemmKey const& other) const;
};

struct GemmKeyHash
{
    size_t operator()(GemmKey const& key) const;
};

// Descriptors, layouts and the chosen algorithm for one GemmKey: made on its first call. A key
// cuBLASLt has no algorithm for is kept too (usable false), so that a call asks the heuristic once.
struct GemmPlan
{
    bool usable = true;
    cublasLtMatmulDesc_t operation = nullptr;
    cublasLtMatrixLayout_t w_layout = nullptr;
    cublasLtMatrixLayout_t x_layout = nullptr;
    cublasLtMatrixLayout_t product_layout = nullptr; // D (and C, unread: beta = 0)
    cublasLtMatmulPreference_t preference = nullptr;
    cublasLtMatmulAlgo_t algorithm{};
    size_t workspace_bytes = 0;
};

} // namespace flashnorm

struct flashnorm_context
{
    int device = 0;
    int sm_count = 0;
    cudaStream_t side_stream = nullptr;
    cudaEvent_t fork = nullptr;
    cudaEvent_t join = nullptr;
    cublasLtHandle_t cublas = nullptr;
    std::unordered_map<flashnorm::GemmKey, flashnorm::GemmPlan, flashnorm::GemmKeyHash> plans;
    // Test hook: the side stream's work (two-stream's inv_rms, prenorm's narrow GEMMs) is held
    // back this many GPU clock cycles.
    int64_t side_delay_cycles = 0;
    // The fused kernel's strip width and blocks per strip: chosen per shape unless forced by
    // flashnorm_testing_set_fused_tuning (tests and tuning runs).
    flashnorm::FusedTuning fused_tuning;
    // The epilogue-scale GEMM's tiles: chosen per shape (epilogue_scale_tiles) unless forced by
    // flashnorm_testing_set_epilogue_scale_tiles (tests and tuning runs).
    std::optional<flashnorm::EpilogueScaleTiles> epilogue_scale_tiles;
    // The epilogue-scale strategy is in this build and the device is compute capability 9.0.
    bool epilogue_scale_usable = false;
    std::string last_error;
};

namespace flashnorm
{

flashnorm_status create_context(flashnorm_context* context);
void destroy_context(flashnorm_context* context);

// y = (x·W*) scaled per row + bias, split: GEMM on `stream` ‖ the row scales on the side stream,
// joined before the post-scale reads either result.
flashnorm_status run_two_stream(flashnorm_context* context, flashnorm_problem const& problem, void const* x,
    void const* w, float const* bias, OutputSplits const& splits, void* workspace, cudaStream_t stream);

// y = x̂·W* + bias, split: x̂ (the normalized x) into the workspace, then one cuBLASLt GEMM per run
// of equal-width splits (SplitRun) from the column slices of W* straight into the outputs, the bias
// in its epilogue: the widest run on `stream`, the others on the side stream beside it (forked after
// x̂ is written, joined before the call returns).
flashnorm_status run_prenorm(flashnorm_context* context, flashnorm_problem const& problem, void const* x,
    void const* w, float const* bias, OutputSplits const& splits, void* workspace, cudaStream_t stream);

} // namespace flashnorm
