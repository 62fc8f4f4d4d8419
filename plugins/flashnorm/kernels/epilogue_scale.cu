// The epilogue-scale strategy: one CUTLASS sm90 GEMM (TMA loads, warp-specialized wgmma main loop)
// whose epilogue multiplies each accumulator row by inv_rms[row] and stores every column straight
// into its split's output, and in front of it the RMS reduction, overlapped with the GEMM's main
// loop through programmatic dependent launch (PDL):
//
//   reduction kernel: griddepcontrol.launch_dependents at entry, then inv_rms[m] = rsqrt(...)
//   GEMM (launched with programmatic stream serialization): main loop over x and W*; the
//   epilogue executes griddepcontrol.wait, which returns once the reduction grid has completed
//   and its writes are visible, and only then reads inv_rms.
//
// That wait is the join: the race-test mutant (FLASHNORM_TESTING_DROP_JOIN) leaves it out.
//
// Why a custom epilogue node instead of a grouped (pointer-array) GEMM with one group per split:
// the splits share A and the scale vector, and a column tile of the one [M, N] GEMM lies in one
// split or straddles two; storing from registers by each element's global column needs no device
// arrays of problem shapes and pointers (which a grouped GEMM reads, so a capture-safe call would
// need an extra kernel to write them) and no per-group TMA descriptor rewrites. D is `void` to
// CUTLASS, so its shared-memory staging and TMA store are compiled out.
#include "kernels/kernels.h"

#ifdef FLASHNORM_HAVE_CUTLASS

#include "device.cuh"

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

namespace flashnorm
{
namespace
{

using namespace cute;

// TMA needs 16-byte aligned bases and row strides: 8 elements of a 16-bit type.
constexpr int kAlignmentElements = 8;

// Blocks until the reduction grid this GEMM was launched after has completed and its writes are
// visible (PTX griddepcontrol.wait; returns at once when launched without PDL).
__device__ __forceinline__ void wait_for_reduction()
{
#ifndef FLASHNORM_TESTING_DROP_JOIN
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The epilogue visitor (root of the fusion tree): value = acc · inv_rms[row], stored from
// registers to outputs[split(col)][row, col - offset]. Adjacent column pairs of one row and
// split move as one 4-byte store where the address allows.
template <class Element>
struct RowScaleSplitStore
{
    // With ElementD = void the collective sizes its (unused) D staging types by this.
    using ElementAux = Element;

    struct SharedStorage
    {
    };

    struct Arguments
    {
        float const* inv_rms = nullptr;
        OutputSplits splits{};
    };
    using Params = Arguments;

    template <class ProblemShape>
    static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*)
    {
        return args;
    }

    template <class ProblemShape>
    static bool can_implement(ProblemShape const&, Arguments const& args)
    {
        return args.inv_rms != nullptr && args.splits.count >= 1;
    }

    template <class ProblemShape>
    static size_t get_workspace_size(ProblemShape const&, Arguments const&)
    {
        return 0;
    }

    template <class ProblemShape>
    static cutlass::Status initialize_workspace(
        ProblemShape const&, Arguments const&, void*, cudaStream_t, cutlass::CudaHostAdapter* = nullptr)
    {
        return cutlass::Status::kSuccess;
    }

    CUTLASS_HOST_DEVICE RowScaleSplitStore() {}

    CUTLASS_HOST_DEVICE RowScaleSplitStore(Params const& params, SharedStorage const&)
        : params(params)
    {
    }

    Params params;

    CUTLASS_DEVICE bool is_producer_load_needed() const
    {
        return false;
    }

    CUTLASS_DEVICE bool is_C_load_needed() const
    {
        return false;
    }

    template <class... Args>
    CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&)
    {
        return cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks{};
    }

    template <class CoordTensor, class Residue>
    struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks
    {
        CUTLASS_DEVICE ConsumerStoreCallbacks(
            CoordTensor relative_, Residue residue_, int rows_, int cols_, Params const& params_)
            : relative(relative_)
            , residue(residue_)
            , rows(rows_)
            , cols(cols_)
            , params(params_)
        {
        }

        CoordTensor relative; // (CPY,CPY_M,CPY_N,EPI_M,EPI_N): coordinates from this thread's first element
        Residue residue;      // (M, N) minus this thread's first element's global coordinate
        int rows;
        int cols;
        Params const& params;

        CUTLASS_DEVICE void begin()
        {
            wait_for_reduction();
        }

        // One element, if inside the problem.
        CUTLASS_DEVICE void store(int row, int col, float value) const
        {
            if (row >= rows || col >= cols)
            {
                return;
            }
            int const split = split_of(params.splits, col);
            int64_t const offset = params.splits.offsets[split];
            int64_t const width = params.splits.offsets[split + 1] - offset;
            static_cast<Element*>(params.splits.outputs[split])[row * width + (col - offset)]
                = Element(value * params.inv_rms[row]);
        }

        // Two elements: one 4-byte store when they are neighbours in one row of one split at an
        // aligned address (the accumulator layout's usual case), else one store each.
        CUTLASS_DEVICE void store_pair(int row, int col, float first, int next_row, int next_col, float second) const
        {
            if (row < rows && next_row == row && next_col == col + 1 && next_col < cols)
            {
                int const split = split_of(params.splits, col);
                int64_t const offset = params.splits.offsets[split];
                int64_t const width = params.splits.offsets[split + 1] - offset;
                Element* const address
                    = static_cast<Element*>(params.splits.outputs[split]) + row * width + (col - offset);
                if (next_col < offset + width && reinterpret_cast<uintptr_t>(address) % (2 * sizeof(Element)) == 0)
                {
                    float const scale = params.inv_rms[row];
                    cutlass::Array<Element, 2> pair;
                    pair[0] = Element(first * scale);
                    pair[1] = Element(second * scale);
                    *reinterpret_cast<cutlass::Array<Element, 2>*>(address) = pair;
                    return;
                }
            }
            store(row, col, first);
            store(next_row, next_col, second);
        }

        template <typename ElementAccumulator, int FragmentSize>
        CUTLASS_DEVICE cutlass::Array<ElementAccumulator, FragmentSize> visit(
            cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m, int epi_n)
        {
            Tensor relative_mn = relative(_, _, _, epi_m, epi_n);
            int const first_row = rows - int(get<0>(residue));
            int const first_col = cols - int(get<1>(residue));
            auto const row_of = [&](int i) { return first_row + int(get<0>(relative_mn(epi_v * FragmentSize + i))); };
            auto const col_of = [&](int i) { return first_col + int(get<1>(relative_mn(epi_v * FragmentSize + i))); };
            if constexpr (FragmentSize % 2 == 0)
            {
                CUTLASS_PRAGMA_UNROLL
                for (int i = 0; i < FragmentSize; i += 2)
                {
                    store_pair(row_of(i), col_of(i), float(frg_acc[i]), row_of(i + 1), col_of(i + 1),
                        float(frg_acc[i + 1]));
                }
            }
            else
            {
                CUTLASS_PRAGMA_UNROLL
                for (int i = 0; i < FragmentSize; ++i)
                {
                    store(row_of(i), col_of(i), float(frg_acc[i]));
                }
            }
            return frg_acc;
        }
    };

    template <bool ReferenceSrc, class... Args>
    CUTLASS_DEVICE auto get_consumer_store_callbacks(
        cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args)
    {
        auto [M, N, K, L] = args.problem_shape_mnkl;
        return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(
            args.tCcD, args.residue_tCcD, int(M), int(N), params);
    }
};

// One GEMM configuration: x [M,K] row-major (A, K-major), W* [K,N] row-major (B, N-major), fp32
// accumulation, no C, no D (the epilogue node stores).
template <class Element, class TileShape, class KernelSchedule, class EpilogueSchedule>
struct ScaledGemm
{
    using Store = RowScaleSplitStore<Element>;
    using ClusterShape = Shape<_1, _1, _1>;
    using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<cutlass::arch::Sm90,
        cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
        float, float, void, cutlass::layout::RowMajor, kAlignmentElements, void, cutlass::layout::RowMajor,
        kAlignmentElements, EpilogueSchedule, Store>::CollectiveOp;
    using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<cutlass::arch::Sm90,
        cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignmentElements, Element,
        cutlass::layout::RowMajor, kAlignmentElements, float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
            sizeof(typename CollectiveEpilogue::SharedStorage))>,
        KernelSchedule>::CollectiveOp;
    using Kernel
        = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
};

// Small M (to 256 rows): 64-row tiles, two consumer warp groups taking turns (ping-pong), so
// narrow problems still spread over many multiprocessors. Larger M: 128×128 tiles, both consumer
// warp groups on one tile (cooperative).
template <class Element>
using SmallTileGemm = ScaledGemm<Element, Shape<_64, _64, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
    cutlass::epilogue::TmaWarpSpecialized>;
template <class Element>
using LargeTileGemm = ScaledGemm<Element, Shape<_128, _128, _64>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative>;
constexpr int64_t kSmallTileMaxRows = 256;

// inv_rms[m] = rsqrt(mean(x[m,:]²) + eps). Lets the GEMM launched after it (PDL) start at once;
// `delay_cycles` (test hook) holds the writes back after that.
template <typename T>
__global__ void __launch_bounds__(kInvRmsRowsPerBlock * 32) inv_rms_releasing_kernel(
    T const* __restrict__ x, int64_t m, int64_t k, float eps, float* __restrict__ inv_rms, int64_t delay_cycles)
{
    asm volatile("griddepcontrol.launch_dependents;");
    if (delay_cycles > 0)
    {
        long long const start = clock64();
        while (clock64() - start < delay_cycles)
        {
        }
    }
    store_row_inv_rms(x, m, k, eps, inv_rms);
}

template <class Gemm>
cudaError_t configure_gemm()
{
    using Kernel = typename Gemm::Kernel;
    return cudaFuncSetAttribute(
        cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::SharedStorageSize);
}

template <class Gemm, class Element>
cudaError_t launch_gemm(Element const* x, Element const* w, int64_t m, int64_t k, int64_t n,
    float const* inv_rms, OutputSplits const& splits, int sm_count, cudaStream_t stream)
{
    using Kernel = typename Gemm::Kernel;
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    int const M = static_cast<int>(m);
    int const N = static_cast<int>(n);
    int const K = static_cast<int>(k);
    cutlass::KernelHardwareInfo hardware;
    hardware.device_id = 0;
    hardware.sm_count = sm_count;
    // x: (M,K) K-major, rows K apart; W*: (N,K) N-major, rows of W* (K index) N apart.
    StrideA stride_x{};
    get<0>(stride_x) = k;
    get<2>(stride_x) = m * k;
    StrideB stride_w{};
    get<1>(stride_w) = n;
    get<2>(stride_w) = n * k;
    typename Kernel::Arguments arguments{cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {reinterpret_cast<typename Kernel::ElementA const*>(x), stride_x,
            reinterpret_cast<typename Kernel::ElementB const*>(w), stride_w},
        {{inv_rms, splits}, nullptr, {}, nullptr, {}},
        hardware};
    if (Kernel::can_implement(arguments) == false)
    {
        return cudaErrorInvalidValue;
    }
    typename Kernel::Params const params = Kernel::to_underlying_arguments(arguments, nullptr);

    cudaLaunchAttribute attributes[2];
    attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[0].val.programmaticStreamSerializationAllowed = 1;
    attributes[1].id = cudaLaunchAttributeClusterDimension;
    attributes[1].val.clusterDim.x = 1;
    attributes[1].val.clusterDim.y = 1;
    attributes[1].val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = Kernel::get_grid_shape(params);
    config.blockDim = Kernel::get_block_shape();
    config.dynamicSmemBytes = Kernel::SharedStorageSize;
    config.stream = stream;
    config.attrs = attributes;
    config.numAttrs = 2;
    return cudaLaunchKernelEx(&config, cutlass::device_kernel<Kernel>, params);
}

template <typename T, class Element>
cudaError_t launch_typed(void const* x, void const* w, int64_t m, int64_t k, int64_t n, float eps,
    OutputSplits const& splits, float* inv_rms, int sm_count, int64_t delay_cycles, cudaStream_t stream)
{
    dim3 const grid(static_cast<unsigned>((m + kInvRmsRowsPerBlock - 1) / kInvRmsRowsPerBlock));
    inv_rms_releasing_kernel<T>
        <<<grid, kInvRmsRowsPerBlock * 32, 0, stream>>>(static_cast<T const*>(x), m, k, eps, inv_rms, delay_cycles);
    cudaError_t const status = cudaGetLastError();
    if (status != cudaSuccess)
    {
        return status;
    }
    auto const* a = static_cast<Element const*>(x);
    auto const* b = static_cast<Element const*>(w);
    if (m <= kSmallTileMaxRows)
    {
        return launch_gemm<SmallTileGemm<Element>>(a, b, m, k, n, inv_rms, splits, sm_count, stream);
    }
    return launch_gemm<LargeTileGemm<Element>>(a, b, m, k, n, inv_rms, splits, sm_count, stream);
}

} // namespace

bool epilogue_scale_built()
{
    return true;
}

cudaError_t configure_epilogue_scale_kernels()
{
    for (cudaError_t const status : {configure_gemm<SmallTileGemm<cutlass::bfloat16_t>>(),
             configure_gemm<LargeTileGemm<cutlass::bfloat16_t>>(), configure_gemm<SmallTileGemm<cutlass::half_t>>(),
             configure_gemm<LargeTileGemm<cutlass::half_t>>()})
    {
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    return cudaSuccess;
}

cudaError_t launch_epilogue_scale(flashnorm_dtype dtype, void const* x, void const* w, int64_t m, int64_t k,
    int64_t n, float eps, OutputSplits const& splits, float* inv_rms, int sm_count, int64_t delay_cycles,
    cudaStream_t stream)
{
    switch (dtype)
    {
    case FLASHNORM_DTYPE_BF16:
        return launch_typed<__nv_bfloat16, cutlass::bfloat16_t>(
            x, w, m, k, n, eps, splits, inv_rms, sm_count, delay_cycles, stream);
    case FLASHNORM_DTYPE_F16:
        return launch_typed<__half, cutlass::half_t>(x, w, m, k, n, eps, splits, inv_rms, sm_count, delay_cycles, stream);
    case FLASHNORM_DTYPE_F32: break;
    }
    return cudaErrorInvalidValue;
}

} // namespace flashnorm

#else // !FLASHNORM_HAVE_CUTLASS

namespace flashnorm
{

bool epilogue_scale_built()
{
    return false;
}

cudaError_t configure_epilogue_scale_kernels()
{
    return cudaSuccess;
}

cudaError_t launch_epilogue_scale(flashnorm_dtype, void const*, void const*, int64_t, int64_t, int64_t, float,
    OutputSplits const&, float*, int, int64_t, cudaStream_t)
{
    return cudaErrorNotSupported;
}

} // namespace flashnorm

#endif
