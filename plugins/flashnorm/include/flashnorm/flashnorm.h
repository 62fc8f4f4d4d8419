/*
 * FlashNorm kernel library: C ABI.
 *
 *   y = (x · W*) ⊙ s + bias      per row of x, s the row's statistic:
 *   RMS (RMSNorm):          s = rsqrt(mean(x², axis=-1) + eps)
 *   variance (LayerNorm):   s = rsqrt(mean((x − mean(x))², axis=-1) + eps)
 *
 * x is [M, K] row-major, W* is [K, N] row-major (the ONNX MatMul layout, the norm's gain
 * already folded in; for the variance, W*'s columns also centred, 1ᵀW* = 0, so that
 * x·W* = (x − mean(x))·W* and no mean is subtracted). The N columns may be split into several
 * outputs [M, N_i] (q|k|v, gate|up), each written straight to its own buffer. Inputs and outputs
 * share one dtype; accumulation, the statistic and the bias (N floats, or none) are fp32, and
 * each output element is rounded once: y = cast((x·W*)[r, j] · s_r + bias[j]).
 *
 * Every front end (TensorRT plugin, Python binding, tests) calls only this header.
 */
#ifndef FLASHNORM_FLASHNORM_H
#define FLASHNORM_FLASHNORM_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FLASHNORM_API __declspec(dllexport)
#else
#define FLASHNORM_API __attribute__((visibility("default")))
#endif

typedef enum flashnorm_dtype
{
    FLASHNORM_DTYPE_F32 = 0,
    FLASHNORM_DTYPE_F16 = 1,
    FLASHNORM_DTYPE_BF16 = 2,
} flashnorm_dtype;

typedef enum flashnorm_strategy
{
    FLASHNORM_STRATEGY_AUTO = 0,       /* picks by M, K·N, the splits, the dtype and the device's
                                          multiprocessors (flashnorm_problem.multiprocessors); every
                                          threshold (measured on H200) is in dispatch/dispatch.cpp, its
                                          picks over a grid of shapes and multiprocessor counts in
                                          tests/plugins/golden/auto_dispatch.csv */
    FLASHNORM_STRATEGY_TWO_STREAM = 1, /* cuBLASLt GEMM on the caller's stream ‖ the statistic on a side
                                          stream; the post-scale adds the bias */
    FLASHNORM_STRATEGY_FUSED = 2,      /* one kernel: GEMV + the row sums + scale and bias in its epilogue */
    FLASHNORM_STRATEGY_PRENORM = 3,    /* x̂ = x ⊙ s (variance: (x − mean x) ⊙ s) into the workspace (one
                                          rounding to the I/O dtype), then one cuBLASLt GEMM per run of
                                          consecutive equal-width splits (batched over the run) writing
                                          the outputs directly, the bias in its epilogue (fp32 where
                                          cuBLASLt takes it, else rounded to the I/O dtype first: the
                                          arithmetic of F.layer_norm + F.linear); all runs but the widest
                                          on the side stream, joined before the call returns; for large
                                          M, where a pass over the N-wide output costs more than one over
                                          the K-wide input */
    FLASHNORM_STRATEGY_EPILOGUE_SCALE = 4, /* one CUTLASS sm90 GEMM scaling each row by its statistic, adding
                                          the bias and storing each split straight into its output. On some
                                          tiles (dispatch/dispatch.cpp says which) its main loop sums
                                          the rows from the x tiles it loads; on the others a
                                          reduction kernel runs first and the GEMM, launched after it
                                          with programmatic dependent launch, overlaps it and waits for
                                          it before its epilogue.
                                          Its epilogue TMA-stores 32-column subtiles, each into one
                                          split: fp16/bf16 with K and N multiples of 8, every split
                                          starting at a multiple of 32 columns, 16-byte aligned x, W*
                                          and outputs, on compute capability 9.0, in builds that found
                                          the CUTLASS headers; elsewhere FLASHNORM_STATUS_UNSUPPORTED.
                                          AUTO picks it in its measured region only (dispatch/),
                                          never for split edges off the 32-column grid, and runs
                                          two_stream instead where the device or the pointers
                                          refuse it */
} flashnorm_strategy;

/* The statistic the row scale divides by (flashnorm_problem.statistic). */
typedef enum flashnorm_statistic
{
    FLASHNORM_STATISTIC_RMS = 0,      /* RMSNorm: rsqrt(mean(x²) + eps) */
    FLASHNORM_STATISTIC_VARIANCE = 1, /* LayerNorm with W* centred: rsqrt(mean((x − mean x)²) + eps), from
                                         sums shifted by the row's first element (kernels/DESIGN.md,
                                         "The statistic's numerics") */
} flashnorm_statistic;

typedef enum flashnorm_status
{
    FLASHNORM_STATUS_OK = 0,
    FLASHNORM_STATUS_INVALID_ARGUMENT = 1,
    FLASHNORM_STATUS_UNSUPPORTED = 2,
    FLASHNORM_STATUS_WORKSPACE_TOO_SMALL = 3,
    FLASHNORM_STATUS_CUDA_ERROR = 4,
    FLASHNORM_STATUS_CUBLAS_ERROR = 5,
} flashnorm_status;

#define FLASHNORM_MAX_OUTPUTS 8

/* Opaque per-execution-context state: side stream, fork/join events, cuBLASLt handle and
 * preference, algorithm cache. Create once (never inside a CUDA-graph capture); every
 * flashnorm_matmul call on it is then allocation-free, sync-free and capture-safe. One
 * context must not be used from two host threads at once. */
typedef struct flashnorm_context flashnorm_context;

typedef struct flashnorm_problem
{
    int64_t m;                                   /* rows of x (tokens); may be 0 */
    int64_t k;                                   /* hidden size */
    int64_t n;                                   /* total output columns = sum(split_sizes) */
    int32_t num_outputs;                         /* 1 .. FLASHNORM_MAX_OUTPUTS */
    int64_t split_sizes[FLASHNORM_MAX_OUTPUTS];  /* columns of each output, in W* order */
    flashnorm_dtype dtype;
    float eps;
    flashnorm_strategy strategy;
    int32_t multiprocessors;                     /* the device AUTO picks for: 0, the device's own (see
                                                    below); n > 0, a device of n multiprocessors */
    flashnorm_statistic statistic;               /* RMS (0, what a zero-initialized problem holds) or
                                                    variance; AUTO picks alike for both */
} flashnorm_problem;

/* AUTO's pick, and with it the workspace it needs, depends on the multiprocessors of the device
 * (where the epilogue-scale GEMM's tiles run in one wave). flashnorm_workspace_size and the calls
 * must therefore pick for one count: pass them the same problem. multiprocessors = 0 (what a
 * zero-initialized problem holds) is the device's own: in flashnorm_matmul and flashnorm_add_matmul
 * the context's device's, in flashnorm_workspace_size and flashnorm_resolve_strategy
 * flashnorm_current_multiprocessors() (so ask those on the device the calls will run on). A caller
 * that sizes the workspace on one device and runs on another (a TensorRT plan, built on one GPU and
 * run on any) records the count where it sizes it and passes that count to every call. Only AUTO
 * reads the field: an explicit strategy ignores it, and the kernels size their grids for the
 * device they run on whatever it says. */

/* Creates a context on the current CUDA device. */
FLASHNORM_API flashnorm_status flashnorm_context_create(flashnorm_context** context);
FLASHNORM_API void flashnorm_context_destroy(flashnorm_context* context);

/* Bytes of device workspace flashnorm_matmul needs for this problem or any smaller M (under AUTO
 * too, whichever strategy it picks for the smaller M, on the problem's multiprocessors). The
 * workspace must be 256-byte aligned. */
FLASHNORM_API size_t flashnorm_workspace_size(flashnorm_problem const* problem);

/* The strategy AUTO resolves to for this problem on its multiprocessors (never AUTO). */
FLASHNORM_API flashnorm_strategy flashnorm_resolve_strategy(flashnorm_problem const* problem);

/* The multiprocessors of the current CUDA device: the count multiprocessors = 0 stands for in
 * flashnorm_workspace_size and flashnorm_resolve_strategy. Where no device answers (no GPU, no
 * driver), flashnorm_measured_multiprocessors(). */
FLASHNORM_API int32_t flashnorm_current_multiprocessors(void);

/* The multiprocessors AUTO's boundaries were measured on (an H200's, 132): the count for a caller
 * that must pick as this library did before flashnorm_problem.multiprocessors existed (a TensorRT
 * plan serialized without it sized its workspace for this count). */
FLASHNORM_API int32_t flashnorm_measured_multiprocessors(void);

/* Enqueues y_i = (x · W*)[:, cols_i] ⊙ s + bias[cols_i] on `stream`, s the problem's statistic of each
 * row. Asynchronous; returns before the GPU finishes. outputs[i] points to an [m, split_sizes[i]]
 * row-major buffer; bias is NULL (none) or n fp32 values in device memory. */
FLASHNORM_API flashnorm_status flashnorm_matmul(flashnorm_context* context, flashnorm_problem const* problem,
    void const* x, void const* w, float const* bias, void* const* outputs, void* workspace, size_t workspace_bytes,
    cudaStream_t stream);

/* The same with the residual add in front of the norm, as a decoder layer has it: sum = x + residual
 * (each element added in fp32 and rounded once to the dtype, as that add in the dtype computes) is
 * written to `sum` and is the norm's input: y_i = (sum · W*)[:, cols_i] ⊙ s(sum) + bias[cols_i].
 * x, residual and sum are [m, k] row-major; sum overlaps neither x nor residual. The fused strategy
 * forms the sum as it reads x and writes it from the same kernel (a decode step's add then costs no
 * launch of its own); the others add in a kernel first and read the sum. Workspace as for
 * flashnorm_matmul. */
FLASHNORM_API flashnorm_status flashnorm_add_matmul(flashnorm_context* context, flashnorm_problem const* problem,
    void const* x, void const* residual, void* sum, void const* w, float const* bias, void* const* outputs,
    void* workspace, size_t workspace_bytes, cudaStream_t stream);

FLASHNORM_API char const* flashnorm_status_string(flashnorm_status status);

/* The last error's detail on this context (thread-unsafe, for messages only). */
FLASHNORM_API char const* flashnorm_context_last_error(flashnorm_context const* context);

/* Test hook: the side stream's work (two-stream's reduction, prenorm's narrow-split GEMMs) and the
 * epilogue-scale strategy's reduction (after it has let the GEMM start) wait
 * this many GPU clock cycles before it writes, so that a missing join would read a stale buffer.
 * 0 (the default) disables it. */
FLASHNORM_API void flashnorm_testing_set_side_delay(flashnorm_context* context, int64_t cycles);

/* Tuning hook: forces the fused kernel's strip width (32 or 128 columns of W* per cluster) and
 * cluster size (1, 2, 4 or 8 blocks per strip, splitting K) on this context; 0 restores the
 * automatic choice. Any other value is FLASHNORM_STATUS_INVALID_ARGUMENT. */
FLASHNORM_API flashnorm_status flashnorm_testing_set_fused_tuning(
    flashnorm_context* context, int32_t strip_cols, int32_t cluster_size);

/* Tuning hook: forces the epilogue-scale GEMM's tile configuration on this context, `tiles` being
 * 1 + a configuration's index (flashnorm_testing_epilogue_scale_tiles_name); 0 restores the
 * automatic choice, anything else is FLASHNORM_STATUS_INVALID_ARGUMENT. Every configuration computes
 * every shape the strategy takes; AUTO still picks the strategy as before. */
FLASHNORM_API flashnorm_status flashnorm_testing_set_epilogue_scale_tiles(flashnorm_context* context, int32_t tiles);

/* The name of the epilogue-scale GEMM's tile configuration `index` (from 0), NULL past the last. */
FLASHNORM_API char const* flashnorm_testing_epilogue_scale_tiles_name(int32_t index);

/* 1 if `strategy` can run on this context's device in this build (AUTO: always 1), else 0. */
FLASHNORM_API int flashnorm_strategy_available(flashnorm_context const* context, flashnorm_strategy strategy);

/* 1 if this build was made with FLASHNORM_TESTING_DROP_JOIN (the race mutation), else 0. */
FLASHNORM_API int flashnorm_testing_join_dropped(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASHNORM_FLASHNORM_H */
