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

    // Where one column goes: the output that owns it, and the column's index there.
    struct SplitColumn
    {
        Element* output;
        int64_t width;
        int64_t column;
        int64_t end; // the owning split's last column + 1, in the global numbering
    };

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

        // Per tile, begin() works out once what every store of this thread needs, so that a store
        // costs a few 32-bit compares and one add. A thread's accumulators lie in two rows of the
        // tile in wgmma's layout (r and r + 8 of a warp's 16) and in one column range of at most the
        // tile's width, which meets the split of its first column and often the next one. Looking
        // the split up per element pair instead (a walk over FLASHNORM_MAX_OUTPUTS 64-bit offsets
        // and pointers, about 150 PTX instructions a pair) made the kernel 1.0-1.25x slower on the
        // H200 (kernels/NOTES.md). Elements outside these rows and two splits take the general
        // path (locate).
        int first_row = 0;
        int second_row = 0;
        float first_scale = 0.0f;
        float second_scale = 0.0f;
        int split_begin = 0;    // first global column of the split of this thread's first column
        int split_end = 0;      // one past its last, = first column of the next split
        int next_split_end = 0; // one past the next split's last column
        // Byte address of global column 0 of a row, in a split's numbering: [row][split], row 0 =
        // first_row, 1 = second_row; split 0 = this thread's first split, 1 = the next one.
        uintptr_t column_zero[2][2] = {};

        CUTLASS_DEVICE void begin()
        {
            wait_for_reduction();
            first_row = rows - int(get<0>(residue));
            // The first row offset other than 0 among this thread's coordinates; they are static,
            // so this folds to a constant.
            int second_offset = 0;
            CUTLASS_PRAGMA_UNROLL
            for (int i = size(relative) - 1; i >= 0; --i)
            {
                int const offset = int(get<0>(relative(i)));
                second_offset = offset != 0 ? offset : second_offset;
            }
            second_row = first_row + second_offset;
            // Through L2 (ld.global.cg), as the reduction grid wrote them.
            first_scale = first_row < rows ? __ldcg(params.inv_rms + first_row) : 0.0f;
            second_scale = second_row < rows ? __ldcg(params.inv_rms + second_row) : 0.0f;

            int const first_col = cols - int(get<1>(residue));
            SplitColumn const here = locate(first_col < cols ? first_col : cols - 1);
            split_begin = int(here.end - here.width);
            split_end = int(here.end);
            SplitColumn const next = locate(split_end < cols ? split_end : cols - 1);
            next_split_end = split_end < cols ? int(next.end) : split_end;
            SplitColumn const splits[2] = {here, next};
            int const own_rows[2] = {first_row, second_row};
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < 2; ++r)
            {
                CUTLASS_PRAGMA_UNROLL
                for (int split = 0; split < 2; ++split)
                {
                    int64_t const begin_column = splits[split].end - splits[split].width;
                    // Unsigned wrap-around: the sum with a column of this split is the real address.
                    column_zero[r][split] = reinterpret_cast<uintptr_t>(splits[split].output)
                        + uintptr_t(own_rows[r] * splits[split].width - begin_column) * sizeof(Element);
                }
            }
        }

        CUTLASS_DEVICE float scale_of(int row) const
        {
            if (row == first_row)
            {
                return first_scale;
            }
            if (row == second_row)
            {
                return second_scale;
            }
            return __ldcg(params.inv_rms + row);
        }

        // The address of (row, col) when the columns col..last_col lie in one of this thread's two
        // splits and row is one of its two rows; 0 otherwise (then locate() answers).
        CUTLASS_DEVICE uintptr_t fast_address(int row, int col, int last_col) const
        {
            bool const in_first = col >= split_begin && last_col < split_end;
            bool const in_next = col >= split_end && last_col < next_split_end;
            if ((row != first_row && row != second_row) || !(in_first || in_next))
            {
                return 0;
            }
            // Constant indices only: a run-time index would put column_zero in local memory.
            uintptr_t const first_split_zero = row == first_row ? column_zero[0][0] : column_zero[1][0];
            uintptr_t const next_split_zero = row == first_row ? column_zero[0][1] : column_zero[1][1];
            return (in_first ? first_split_zero : next_split_zero) + uintptr_t(col) * sizeof(Element);
        }

        // The split of global column `col`, found with constant indices only: indexing the split
        // table with a run-time index put it in local memory (ptxas: a 168-byte stack frame).
        CUTLASS_DEVICE SplitColumn locate(int col) const
        {
            OutputSplits const& splits = params.splits;
            SplitColumn found{static_cast<Element*>(splits.outputs[0]), splits.offsets[1], col, splits.offsets[1]};
            CUTLASS_PRAGMA_UNROLL
            for (int split = 1; split < FLASHNORM_MAX_OUTPUTS; ++split)
            {
                if (split < splits.count && col >= splits.offsets[split])
                {
                    found = {static_cast<Element*>(splits.outputs[split]),
                        splits.offsets[split + 1] - splits.offsets[split], col - splits.offsets[split],
                        splits.offsets[split + 1]};
                }
            }
            return found;
        }

        // Stores through st.global, which the compiler knows cannot touch local or shared memory.
        CUTLASS_DEVICE static void store_one(Element* address, float value)
        {
            Element const rounded(value);
            __stcg(reinterpret_cast<unsigned short*>(address), reinterpret_cast<unsigned short const&>(rounded));
        }

        CUTLASS_DEVICE void store_element(int row, int col, float value) const
        {
            if (row < rows && col < cols)
            {
                uintptr_t const address = fast_address(row, col, col);
                if (address != 0)
                {
                    store_one(reinterpret_cast<Element*>(address), value);
                    return;
                }
                SplitColumn const target = locate(col);
                store_one(target.output + row * target.width + target.column, value);
            }
        }

        // Two elements: one 4-byte store when they are neighbours in one row of one split at an
        // aligned address (the accumulator layout's usual case), else one store each. The fallback
        // repeats store_element's on purpose: one shared address helper measured 1-7 % slower
        // (kernels/NOTES.md, "Why store_pair repeats").
        CUTLASS_DEVICE void store_pair(int row, int col, float first, int next_row, int next_col, float second) const
        {
            if (row < rows && next_row == row && next_col == col + 1 && next_col < cols)
            {
                uintptr_t address = fast_address(row, col, next_col);
                if (address == 0)
                {
                    SplitColumn const target = locate(col);
                    address = next_col < target.end
                        ? reinterpret_cast<uintptr_t>(target.output + row * target.width + target.column)
                        : 0;
                }
                if (address != 0 && address % (2 * sizeof(Element)) == 0)
                {
                    cutlass::Array<Element, 2> pair;
                    pair[0] = Element(first);
                    pair[1] = Element(second);
                    __stcg(reinterpret_cast<unsigned int*>(address), reinterpret_cast<unsigned int const&>(pair));
                    return;
                }
            }
            store_element(row, col, first);
            store_element(next_row, next_col, second);
        }

        template <typename ElementAccumulator, int FragmentSize>
        CUTLASS_DEVICE cutlass::Array<ElementAccumulator, FragmentSize> visit(
            cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m, int epi_n)
        {
            Tensor relative_mn = relative(_, _, _, epi_m, epi_n);
            int const first_col = cols - int(get<1>(residue));
            auto const row_of = [&](int i) { return first_row + int(get<0>(relative_mn(epi_v * FragmentSize + i))); };
            auto const col_of = [&](int i) { return first_col + int(get<1>(relative_mn(epi_v * FragmentSize + i))); };
            float scaled[FragmentSize];
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < FragmentSize; ++i)
            {
                int const row = row_of(i);
                scaled[i] = float(frg_acc[i]) * (row < rows ? scale_of(row) : 0.0f);
            }
            if constexpr (FragmentSize % 2 == 0)
            {
                CUTLASS_PRAGMA_UNROLL
                for (int i = 0; i < FragmentSize; i += 2)
                {
                    store_pair(row_of(i), col_of(i), scaled[i], row_of(i + 1), col_of(i + 1), scaled[i + 1]);
                }
            }
            else
            {
                CUTLASS_PRAGMA_UNROLL
                for (int i = 0; i < FragmentSize; ++i)
                {
                    store_element(row_of(i), col_of(i), scaled[i]);
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

using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CooperativeEpilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;

// Small M (to 256 rows): 64-row tiles, two consumer warp groups taking turns (ping-pong), so
// narrow problems still spread over many multiprocessors; from 129 rows, the large tiles instead
// where they are enough to fill the multiprocessors (H200: Llama-3.1-8B gate/up at M = 256 130 µs
// against 204; at M = 64 they took 97 µs against 67, kernels/NOTES.md).
template <class Element>
using SmallTileGemm = ScaledGemm<Element, Shape<_64, _64, _64>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;
// Larger M, both consumer warp groups on one tile (cooperative): 128×128 tiles, or 128×64 where
// 128×128 ones would leave multiprocessors idle (SmolLM2 qkv at M = 1024: 64 tiles of 128×128 on
// 132). Measured slower on the H200 and not used (kernels/NOTES.md): 128×256 tiles in clusters of
// two along M, and ping-pong 64×128 / 64×256 tiles beyond 256 rows.
template <class Element>
using NarrowTileGemm = ScaledGemm<Element, Shape<_128, _64, _64>, Cooperative, CooperativeEpilogue>;
template <class Element>
using LargeTileGemm = ScaledGemm<Element, Shape<_128, _128, _64>, Cooperative, CooperativeEpilogue>;
constexpr int64_t kSmallTileMaxRows = 256;

int64_t tile_count(int64_t m, int64_t n, int64_t tile_m, int64_t tile_n)
{
    return ((m + tile_m - 1) / tile_m) * ((n + tile_n - 1) / tile_n);
}

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
    if (m > 128 && tile_count(m, n, 128, 128) >= sm_count)
    {
        return launch_gemm<LargeTileGemm<Element>>(a, b, m, k, n, inv_rms, splits, sm_count, stream);
    }
    if (m <= kSmallTileMaxRows)
    {
        return launch_gemm<SmallTileGemm<Element>>(a, b, m, k, n, inv_rms, splits, sm_count, stream);
    }
    return launch_gemm<NarrowTileGemm<Element>>(a, b, m, k, n, inv_rms, splits, sm_count, stream);
}

} // namespace

bool epilogue_scale_built()
{
    return true;
}

cudaError_t configure_epilogue_scale_kernels()
{
    for (cudaError_t const status :
        {configure_gemm<SmallTileGemm<cutlass::bfloat16_t>>(), configure_gemm<NarrowTileGemm<cutlass::bfloat16_t>>(),
            configure_gemm<LargeTileGemm<cutlass::bfloat16_t>>(),
            configure_gemm<SmallTileGemm<cutlass::half_t>>(), configure_gemm<NarrowTileGemm<cutlass::half_t>>(),
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
