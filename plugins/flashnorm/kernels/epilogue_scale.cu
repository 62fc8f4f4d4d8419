// The epilogue-scale strategy: one CUTLASS sm90 GEMM (TMA loads, warp-specialized wgmma main loop)
// that scales each accumulator row by its statistic (the RMS, or for the variance the sums shifted by
// the row's first element: device.cuh, centred_scale), adds the bias and stores every column straight
// into its split's output. Where the row sums come from depends on the tile:
//
// - the RowSums tiles (64 rows; where they run: dispatch::epilogue_scale_tiles, dispatch.cpp's
//   kTiles): the main loop itself sums the squares of
//   each tile's rows of x from the A tiles the TMA brings into shared memory, and scales the
//   accumulators before the epilogue stores them (RowSumMainloop). One kernel, launched with
//   programmatic stream serialization; its joins: the producer's griddepcontrol.wait before its
//   first load (x may be written by the kernel before it), and each stage's full barrier, which
//   the sums wait on as the wgmma does.
// - every other problem: a reduction kernel in front, overlapped with the GEMM's main loop through
//   programmatic dependent launch (PDL):
//     reduction kernel: griddepcontrol.launch_dependents at entry, then scales[m] = the statistic
//     GEMM (launched with programmatic stream serialization): main loop over x and W*; the
//     epilogue executes griddepcontrol.wait, which returns once the reduction grid has completed
//     and its writes are visible, and only then reads the scales.
//
// The race-test mutant (FLASHNORM_TESTING_DROP_JOIN) drops the joins: both griddepcontrol.waits,
// and the main loop's wait before it reads a stage's squares (it reads them before the stage lands).
//
// Why a custom epilogue node instead of a grouped (pointer-array) GEMM with one group per split:
// the splits share A and the scale vector, and a column tile of the one [M, N] GEMM lies in one
// split or straddles two. The node stages each 32-column subtile in the collective's own store
// buffers (D is `void` to CUTLASS, which keeps the buffers and its store pipeline but stores
// nothing itself) and TMA-stores it into the one split it lies in, through one tensor map per
// split built on the host with the kernel's parameters: no device arrays of problem shapes and
// pointers (which a grouped GEMM reads, so a capture-safe call would need an extra kernel to write
// them) and no descriptor rewrites on the device. Splits must therefore start at multiples of 32
// columns (dispatch::epilogue_scale_shape_fits). On the H200 this made the kernel 0.68-0.95x as long as
// storing from registers (2026-12-03: SmolLM2-135M q|k|v at 1024 rows 9.0 -> 6.1 µs; kernels/DESIGN.md).
#include "kernels/kernels.h"

// Which tiles run a shape (epilogue_scale_tiles), and why, is the dispatch unit's:
// dispatch/dispatch.cpp (kTiles and the measurements behind them).

#ifdef FLASHNORM_HAVE_CUTLASS

#include "device.cuh"

#include <type_traits>
#include <utility>

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

// Blocks until the grids this GEMM was launched after (programmatic stream serialization) have
// completed and their writes are visible (PTX griddepcontrol.wait; returns at once when launched
// without PDL): the reduction kernel, for the epilogue's read of the scales; whatever ran before,
// for the main loop's first load.
__device__ __forceinline__ void wait_for_previous_grids()
{
#ifndef FLASHNORM_TESTING_DROP_JOIN
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The offset of a thread's second accumulator row from its first (wgmma's layout gives a thread
// two rows, r and r + 8 of its warp's 16): the first nonzero row offset among its coordinates,
// which are static, so this folds to a constant.
template <class Coordinates>
CUTLASS_DEVICE int second_row_offset(Coordinates const& coordinates)
{
    int const first = int(get<0>(coordinates(0)));
    int offset = 0;
    CUTLASS_PRAGMA_UNROLL
    for (int i = size(coordinates) - 1; i >= 0; --i)
    {
        int const candidate = int(get<0>(coordinates(i))) - first;
        offset = candidate != 0 ? candidate : offset;
    }
    return offset;
}

// Whether two swizzled layouts (ComposedLayout<Swizzle, offset, Layout>) have the same swizzle and
// the same layout once coalesced: their types may still differ in how the modes are spelled.
template <class First, class Second>
constexpr bool same_swizzled_layout(First first, Second second)
{
    return cute::is_same_v<decltype(first.layout_a()), decltype(second.layout_a())>
        && cute::is_same_v<decltype(coalesce(first.layout_b())), decltype(coalesce(second.layout_b()))>;
}

// The epilogue visitor (root of the fusion tree): value = acc · scales[row] (or acc, where the
// main loop has scaled the accumulators: ScalesRows false) + bias[column], staged in the collective's shared-memory
// store buffers and written to its split's output by one TMA tensor store. Each split is its own
// [M, width] tensor map whose box is the epilogue subtile; splits start at multiples of the
// subtile's columns, so a subtile lies in one split (a box starting left of a tensor, which a
// straddling subtile would need for the later split, is an illegal instruction on the H200), and
// TMA writes only the elements inside the tensor, which clips the M tail and a last split narrower
// than the box. The collective's store pipeline orders the buffer's reuse after the TMA unit has
// read it, as for its own D.
template <class Element, bool ScalesRows, class EpilogueTile>
struct RowScaleSplitStore
{
    // With ElementD = void the collective sizes its store buffers (which this visitor fills) by this.
    using ElementAux = Element;

    // One buffer of the collective's store pipeline, as the builder lays it out for a row-major
    // 16-bit D of this subtile (the staged tensor reduce() receives is asserted to match).
    using SmemLayoutAtom = decltype(cutlass::epilogue::collective::detail::sm90_get_epilogue_smem_swizzle_layout_atom<
        cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>, Element, EpilogueTile>());
    using StageLayout = decltype(tile_to_shape(
        SmemLayoutAtom{}, make_shape(size<0>(EpilogueTile{}), size<1>(EpilogueTile{})), Step<_1, _2>{}));
    // A split's output: [M, width] row-major, rows width apart.
    using SplitLayout = Layout<Shape<int32_t, int32_t>, Stride<int64_t, _1>>;
    using SplitStore = decltype(make_tma_copy(
        SM90_TMA_STORE{}, make_tensor(static_cast<Element*>(nullptr), SplitLayout{}), StageLayout{}));

    struct SharedStorage
    {
    };

    struct Arguments
    {
        float const* scales = nullptr;
        float const* bias = nullptr; // n values added after the scale, or null
        OutputSplits splits{};
    };

    struct Params
    {
        float const* scales;
        float const* bias;
        OutputSplits splits;
        SplitStore split_stores[FLASHNORM_MAX_OUTPUTS];
    };

    template <class ProblemShape>
    static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*)
    {
        Params params{args.scales, args.bias, args.splits, {}};
        int32_t const rows = static_cast<int32_t>(get<0>(problem_shape));
        for (int split = 0; split < args.splits.count; ++split)
        {
            int64_t const width = args.splits.offsets[split + 1] - args.splits.offsets[split];
            params.split_stores[split] = make_tma_copy(SM90_TMA_STORE{},
                make_tensor(static_cast<Element*>(args.splits.outputs[split]),
                    make_layout(make_shape(rows, static_cast<int32_t>(width)), make_stride(width, _1{}))),
                StageLayout{});
        }
        return params;
    }

    // TMA: 16-byte aligned outputs whose rows are a multiple of 16 bytes apart, each split starting
    // at a multiple of the subtile's columns.
    template <class ProblemShape>
    static bool can_implement(ProblemShape const&, Arguments const& args)
    {
        if ((ScalesRows && args.scales == nullptr) || args.splits.count < 1)
        {
            return false;
        }
        for (int split = 0; split < args.splits.count; ++split)
        {
            int64_t const width = args.splits.offsets[split + 1] - args.splits.offsets[split];
            if (reinterpret_cast<uintptr_t>(args.splits.outputs[split]) % 16 != 0
                || width * int64_t(sizeof(Element)) % 16 != 0
                || args.splits.offsets[split] % int64_t(size<1>(EpilogueTile{})) != 0)
            {
                return false;
            }
        }
        return true;
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
        : params(&params)
    {
    }

    // The kernel's parameters (grid constants): the tensor maps are addressed there, not copied.
    Params const* params = nullptr;

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

    template <class CoordTensor, class Residue, class TiledCopy>
    struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks
    {
        CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor relative_, Residue residue_, int rows_, int columns_,
            int tile_row_, int tile_col_, TiledCopy tiled_copy_, int thread_idx_, Params const* params_)
            : relative(relative_)
            , residue(residue_)
            , rows(rows_)
            , columns(columns_)
            , tile_row(tile_row_)
            , tile_col(tile_col_)
            , tiled_copy(tiled_copy_)
            , thread_idx(thread_idx_)
            , params(params_)
        {
        }

        CoordTensor relative; // (CPY,CPY_M,CPY_N,EPI_M,EPI_N): coordinates from this thread's first element
        Residue residue;      // (M, N) minus this thread's first element's global coordinate
        int rows;
        int columns;
        int tile_row; // the CTA tile's first row and column
        int tile_col;
        TiledCopy tiled_copy; // the collective's register-to-shared copy for its own D
        int thread_idx;
        Params const* params;

        // A thread's accumulators lie in two rows of the tile in wgmma's layout (r and r + 8 of a
        // warp's 16): their scales are read once per tile.
        int first_row = 0;
        int second_row = 0;
        float first_scale = 0.0f;
        float second_scale = 0.0f;
        // This thread's first element's global column (the bias's index).
        int first_column = 0;
        // The store buffer reduce() last filled, which tma_store() then writes out.
        Element* staged = nullptr;

        CUTLASS_DEVICE void begin()
        {
            first_column = columns - int(get<1>(residue));
            if constexpr (ScalesRows)
            {
                first_row = rows - int(get<0>(residue));
                second_row = first_row + second_row_offset(relative);
                wait_for_previous_grids();
                // Through L2 (ld.global.cg), as the reduction grid wrote them.
                first_scale = first_row < rows ? __ldcg(params->scales + first_row) : 0.0f;
                second_scale = second_row < rows ? __ldcg(params->scales + second_row) : 0.0f;
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
            return row < rows ? __ldcg(params->scales + row) : 0.0f;
        }

        // The scaled values plus the bias; reduce() stages them once the whole subtile has been visited.
        template <typename ElementAccumulator, int FragmentSize>
        CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
            cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m, int epi_n)
        {
            cutlass::Array<float, FragmentSize> scaled;
            Tensor relative_mn = relative(_, _, _, epi_m, epi_n);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < FragmentSize; ++i)
            {
                float value = float(frg_acc[i]);
                if constexpr (ScalesRows)
                {
                    int const row = first_row + int(get<0>(relative_mn(epi_v * FragmentSize + i)));
                    value *= scale_of(row);
                }
                if (params->bias != nullptr)
                {
                    // Columns past N are clipped by the TMA store; their bias is never read.
                    int const column = first_column + int(get<1>(relative_mn(epi_v * FragmentSize + i)));
                    value += column < columns ? __ldg(params->bias + column) : 0.0f;
                }
                scaled[i] = value;
            }
            return scaled;
        }

        // Converts the subtile to Element and copies it into the current store buffer with the
        // collective's own register-to-shared copy (stmatrix), as the collective does for a D.
        template <class STensor, class SyncFn, class VTensor>
        CUTLASS_DEVICE void reduce(STensor&& buffer, SyncFn const&, int, int, bool, VTensor visit_results)
        {
            using Fragment = typename cute::remove_cvref_t<VTensor>::value_type;
            constexpr int kFragment = Fragment::kElements;
            static_assert(same_swizzled_layout(decltype(buffer.layout()){},
                              decltype(as_position_independent_swizzle_tensor(
                                  make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), StageLayout{}))
                                           .layout()){}),
                "the collective's store buffer is laid out as the tensor maps' box");
            auto const thread_copy = tiled_copy.get_slice(thread_idx);
            Tensor values = make_tensor<Element>(make_layout(shape(thread_copy.partition_S(buffer))));
            Tensor value_fragments = recast<cutlass::Array<Element, kFragment>>(values);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(visit_results); ++i)
            {
                value_fragments(i) = cutlass::NumericArrayConverter<Element, float, kFragment>{}(visit_results(i));
            }
            copy(tiled_copy, values, thread_copy.partition_D(buffer));
            staged = raw_pointer_cast(buffer.data());
        }

        // Called by the collective once every thread's shared-memory writes are visible to TMA
        // (fence and barrier), on the subtile reduce() last staged; it commits the stores after.
        CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int, bool issue_tma_store)
        {
            if (!issue_tma_store)
            {
                return;
            }
            int const row = tile_row + epi_m * int(size<0>(EpilogueTile{}));
            int const col = tile_col + epi_n * int(size<1>(EpilogueTile{}));
            Tensor buffer
                = as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(staged), StageLayout{}));
            // The one split the subtile lies in (none past N).
            OutputSplits const& splits = params->splits;
            CUTLASS_PRAGMA_UNROLL
            for (int split = 0; split < FLASHNORM_MAX_OUTPUTS; ++split)
            {
                int const begin = int(splits.offsets[split]);
                int const end = int(splits.offsets[split + 1]);
                if (split < splits.count && begin <= col && col < end)
                {
                    SplitStore const& store = params->split_stores[split];
                    Tensor output = store.get_tma_tensor(make_shape(rows, end - begin));
                    Tensor box = local_tile(domain_offset(make_coord(row, col - begin), output), EpilogueTile{},
                        make_coord(_0{}, _0{}));
                    auto const block_copy = store.get_slice(_0{});
                    copy(store, block_copy.partition_S(buffer), block_copy.partition_D(box));
                }
            }
        }
    };

    template <bool ReferenceSrc, class... Args>
    CUTLASS_DEVICE auto get_consumer_store_callbacks(
        cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args)
    {
        static_assert(ReferenceSrc, "values are staged through the collective's register-to-shared copy");
        static_assert(cute::is_same_v<cute::remove_cvref_t<decltype(args.epi_tile)>, EpilogueTile>,
            "the collective's epilogue subtile is the tensor maps' box");
        auto [M, N, K, L] = args.problem_shape_mnkl;
        auto [m, n, k, l] = args.tile_coord_mnkl;
        return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD), decltype(args.tiled_copy)>(
            args.tCcD, args.residue_tCcD, int(M), int(N), int(m) * int(size<0>(args.tile_shape_mnk)),
            int(n) * int(size<1>(args.tile_shape_mnk)), args.tiled_copy, args.thread_idx, params);
    }
};

// CUTLASS's warp-specialized sm90 main loop, except on a last row block that x fills only in part.
// There the producer loads only the rows that exist, rounded up to whole swizzle atoms (8 rows ×
// 128 bytes), as at most one box each of 1, 2, 4, ... atoms (the binary digits of the atom count),
// instead of the tile's one box of which the TMA unit fills the rows past x with zeros. On the
// H200 those fills cost the GEMM in proportion to the rows filled and to K (Llama-3.1-8B q|k|v on
// 128×128 tiles at 144 rows 40.5 µs, 25.7 with x's tensor map spanning 256 rows of a padded x, 25.6
// loaded this way; clipping the stores past M instead costs nothing), and each further box of a
// stage costs too (Llama-3.2-1B q|k|v on 64×64 tiles at 112 rows 11.6 µs with one box per atom,
// 9.2 this way, 9.6 at 128 rows; kernels/DESIGN.md). The stage's full barrier expects the whole
// tile's bytes (the pipeline's fixed count): the producer completes the bytes it does not load
// itself (mbarrier.complete_tx) after its expect, so the phase still ends only once every box has
// landed. Rows past x keep whatever the stage held: an accumulator row depends on its own row of A
// only, and the epilogue stores no row past M.
template <class Base>
struct PartialRowBlockMainloop : Base
{
    using typename Base::ElementA;
    using typename Base::MainloopPipeline;
    using typename Base::PipelineState;
    using typename Base::SmemLayoutA;
    using typename Base::SmemLayoutAtomA;
    using typename Base::SmemLayoutB;
    using typename Base::TensorStorage;
    using typename Base::TileShape;

    static constexpr int kTileRows = size<0>(TileShape{});
    static constexpr int kTileK = size<2>(TileShape{});
    static constexpr int kAtomRows = size<0>(SmemLayoutAtomA{});
    static constexpr int kAtomK = size<1>(SmemLayoutAtomA{});
    static constexpr int kTileAtoms = kTileRows / kAtomRows;
    // Boxes of 1, 2, 4, ... atoms, each fewer than a tile's: a block missing fewer rows than an atom
    // loads the tile's own box.
    static constexpr int kBoxSizes = cute::log_2(static_cast<unsigned>(kTileAtoms));
    static_assert(sizeof_bits_v<ElementA> == 16 && kTileRows % kAtomRows == 0 && kTileK % kAtomK == 0
            && cute::has_single_bit(static_cast<unsigned>(kTileAtoms))
            && cute::is_same_v<SmemLayoutAtomA, decltype(GMMA::Layout_K_SW128_Atom<ElementA>{})>,
        "A tiles of a power of two of SW128 K-major atoms of a 16-bit type");
    static_assert(decltype(SmemLayoutA{}.layout_b()(Int<kAtomRows>{}, _0{}, _0{}))::value == kAtomRows * kAtomK,
        "a stage stacks its atoms along M first, as the boxes do");

    // x: [M, K] row-major, rows K apart.
    using RowsLayout = Layout<Shape<int32_t, int32_t>, Stride<int64_t, _1>>;
    // A box of `Atoms` atoms stacked along M, as they lie in the tile's stage.
    template <int Atoms>
    using BoxLayout = decltype(tile_to_shape(SmemLayoutAtomA{}, Shape<Int<Atoms * kAtomRows>, Int<kAtomK>>{}));

    template <class Rows, size_t... Size>
    static auto make_box_loads(Rows const& x, std::index_sequence<Size...>)
    {
        return cute::make_tuple(make_tma_copy(SM90_TMA_LOAD{}, x, BoxLayout<(1 << Size)>{})...);
    }

    using BoxLoads = decltype(make_box_loads(make_tensor(static_cast<ElementA const*>(nullptr), RowsLayout{}),
        std::make_index_sequence<kBoxSizes>{}));

    struct Params : Base::Params
    {
        BoxLoads box_loads_a;
        int32_t rows;
        int32_t k;
    };

    template <class ProblemShape>
    static Params to_underlying_arguments(ProblemShape const& problem_shape, typename Base::Arguments const& args,
        void* workspace)
    {
        int32_t const rows = int32_t(get<0>(problem_shape));
        int32_t const k = int32_t(get<2>(problem_shape));
        auto const x = make_tensor(reinterpret_cast<ElementA const*>(args.ptr_A),
            make_layout(make_shape(rows, k), make_stride(int64_t(get<0>(args.dA)), _1{})));
        return {Base::to_underlying_arguments(problem_shape, args, workspace),
            make_box_loads(x, std::make_index_sequence<kBoxSizes>{}), rows, k};
    }

    template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
    CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
        cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& block_coord, KTileIterator k_tile_iter,
        int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors)
    {
        int const first_row = int(get<0>(block_coord)) * kTileRows;
        int const present_rows = params.rows - first_row;
        if (present_rows > kTileRows - kAtomRows)
        {
            Base::load(params, pipeline, smem_pipe_write, load_inputs, block_coord, k_tile_iter, k_tile_count,
                thread_idx, block_rank_in_cluster, shared_tensors);
            return;
        }
        if (!cute::elect_one_sync())
        {
            return;
        }
        // B as the built main loop loads it: this block's slice of the tile, multicast to the
        // blocks of its cluster along M, which share the tile.
        constexpr int kClusterM = size<0>(typename Base::DispatchPolicy::ClusterShape{});
        static_assert(size<1>(typename Base::DispatchPolicy::ClusterShape{}) == 1, "clusters along M only");
        Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
        auto const block_load_b = params.tma_load_b.get_slice(block_rank_in_cluster % kClusterM);
        Tensor tBgB = block_load_b.partition_S(get<1>(load_inputs)(_, _, get<1>(block_coord), _, get<3>(block_coord)));
        Tensor tBsB = block_load_b.partition_D(sB);
        uint16_t const multicast_b = kClusterM > 1 ? uint16_t((1u << kClusterM) - 1u) : uint16_t(0);

        // None where the block lies wholly past x (the second of a cluster's two along M).
        int const atoms = present_rows > 0 ? (present_rows + kAtomRows - 1) / kAtomRows : 0;
        uint32_t const bytes_not_loaded = uint32_t((kTileAtoms - atoms) * kAtomRows * kTileK * int(sizeof(ElementA)));
        auto const unswizzled = SmemLayoutA{}.layout_b();
        int const stage_elements = int(unswizzled(0, 0, 1));

        CUTLASS_PRAGMA_NO_UNROLL
        for (; k_tile_count > 0; --k_tile_count)
        {
            pipeline.producer_acquire(smem_pipe_write);
            auto* const barrier = pipeline.producer_get_barrier(smem_pipe_write);
            ElementA* const stage_a = shared_tensors.smem_A.data() + smem_pipe_write.index() * stage_elements;
            int const k_tile = int(*k_tile_iter);
            int loaded_atoms = 0;
            cute::for_each(make_int_sequence<kBoxSizes>{}, [&](auto size) {
                constexpr int kAtoms = 1 << decltype(size)::value;
                if (atoms & kAtoms)
                {
                    auto const& box_load = get<decltype(size)::value>(params.box_loads_a);
                    auto const block_load = box_load.get_slice(_0{});
                    int const row = loaded_atoms * kAtomRows;
                    Tensor rows = local_tile(
                        domain_offset(make_coord(first_row + row, k_tile * kTileK),
                            box_load.get_tma_tensor(make_shape(params.rows, params.k))),
                        Shape<Int<kAtoms * kAtomRows>, Int<kAtomK>>{}, make_coord(_0{}, _));
                    CUTLASS_PRAGMA_UNROLL
                    for (int k_atom = 0; k_atom < kTileK / kAtomK; ++k_atom)
                    {
                        // The box's first element is an atom's, which the swizzle leaves in place.
                        Tensor destination = make_tensor(
                            make_smem_ptr(stage_a + unswizzled(row, k_atom * kAtomK, 0)), BoxLayout<kAtoms>{});
                        copy(box_load.with(*barrier), block_load.partition_S(rows(_, _, k_atom)),
                            block_load.partition_D(destination));
                    }
                    loaded_atoms += kAtoms;
                }
            });
            copy(params.tma_load_b.with(*barrier, multicast_b), tBgB(_, _, _, k_tile),
                tBsB(_, _, _, smem_pipe_write.index()));
            // After the loads, so that they leave as early as the built main loop's: in either
            // order the phase's count of bytes reaches zero only once both this and every load
            // have completed theirs.
            cutlass::arch::ClusterTransactionBarrier::complete_transaction(barrier, block_rank_in_cluster, bytes_not_loaded);
            ++k_tile_iter;
            ++smem_pipe_write;
        }
    }
};

// CUTLASS's warp-specialized sm90 main loop for one warp group's 64-row tile, with the statistic's
// reduction in it: each consumer thread also sums the squares of its two accumulator rows of x
// (for the variance: Σ(x − c) and Σ(x − c)², c the row's first element) from every A tile the TMA
// brings into shared memory, and after the last tile scales its accumulators by those rows' scales,
// so the epilogue only adds the bias and stores.
//
// A tile's squares are read after its stage's full-barrier wait and before the warp group's
// wgmma on it is issued, while the previous tile's wgmma still runs. The stage is released (by
// one thread of the warp group) once that wgmma has completed, which every warp's issue, and so
// every warp's reads, precede: no reader is still reading when the producer refills it. On the
// H200 reading after the issue instead, with each stage then held one iteration longer, measured
// slower (SmolLM2-135M q|k|v at 64 rows 5.87 µs against 5.52, Llama-3.2-1B q|k|v 13.5 against
// 11.6: kernels/DESIGN.md).
//
// The producer waits for the grids before it on the stream (griddepcontrol.wait) before its first
// load, so the GEMM can be launched with programmatic stream serialization: its launch and
// prologue overlap the previous kernel's tail (SmolLM2-135M q|k|v at 64 rows 5.26 µs against 5.52
// without it), and x written by that kernel (the residual add) is complete before the TMA reads it.
//
// In an SW128 K-major tile of a 16-bit type each 128-byte line holds 64 consecutive K elements
// of one row, and the swizzle only permutes a line's 16-byte chunks: the chunk in slot s of row r's
// line is the row's logical chunk s ^ (r mod 8). The unswizzled offsets of a row's chunks therefore
// address the same row's chunks in another order, which a sum ignores; the variance's sums also
// need each chunk's K (the TMA zero-fills the K tail, which shifted would count) and the row's first
// element, both found through that XOR.
template <class Base>
struct RowSumMainloop : Base
{
    using typename Base::ElementA;
    using typename Base::MainloopPipeline;
    using typename Base::PipelineState;
    using typename Base::SmemLayoutA;
    using typename Base::SmemLayoutB;
    using typename Base::TensorStorage;
    using typename Base::TileShape;
    using typename Base::TiledMma;

    static constexpr int kTileK = size<2>(TileShape{});
    static constexpr int kChunksPerRow = kTileK / 8;
    // A quad's four threads share two rows: each reads a quarter of both rows' chunks.
    static constexpr int kChunksPerThread = 2 * kChunksPerRow / 4;
    static_assert(size(TiledMma{}) == cutlass::NumThreadsPerWarpGroup && size<0>(TileShape{}) == 64,
        "one warp group on a 64-row tile: two accumulator rows per thread, shared by a quad");
    static_assert(sizeof_bits_v<ElementA> == 16 && kTileK % 64 == 0
            && cute::is_same_v<typename Base::SmemLayoutAtomA, decltype(GMMA::Layout_K_SW128_Atom<ElementA>{})>,
        "the row sums read 128-byte lines of an SW128 K-major A tile of a 16-bit type");

    struct Arguments : Base::Arguments
    {
        float eps = 0.0f;
        bool centred = false; // the variance statistic
    };

    struct Params : Base::Params
    {
        float eps;
        float inverse_k; // 1/K, formed once on the host
        int32_t k;
        bool centred;
    };

    template <class ProblemShape>
    static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace)
    {
        return {Base::to_underlying_arguments(problem_shape, args, workspace), args.eps,
            1.0f / float(get<2>(problem_shape)), int32_t(get<2>(problem_shape)), args.centred};
    }

    template <class... LoadArguments>
    CUTLASS_DEVICE void load(Params const& params, LoadArguments&&... arguments)
    {
        wait_for_previous_grids();
        Base::load(params, static_cast<LoadArguments&&>(arguments)...);
    }

    template <class FrgTensorC>
    CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
        int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const& params)
    {
        Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
        Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
        TiledMma tiled_mma;
        // A and B fragments are the same for every thread of the warp group (descriptors).
        auto const warp_group_mma = tiled_mma.get_slice(0);
        Tensor tCrA = warp_group_mma.make_fragment_A(warp_group_mma.partition_A(sA));
        Tensor tCrB = warp_group_mma.make_fragment_B(warp_group_mma.partition_B(sB));

        // This thread's two rows of the tile.
        Tensor coordinates = tiled_mma.get_slice(thread_idx).partition_C(make_identity_tensor(take<0, 2>(TileShape{})));
        int const first_row = int(get<0>(coordinates(0)));
        int const rows[2] = {first_row, first_row + second_row_offset(coordinates)};

        // Element offsets of this thread's chunks in stage 0, unswizzled (see above), and for the
        // variance each chunk's logical K within the tile and each row's first element's offset.
        auto const unswizzled = SmemLayoutA{}.layout_b();
        int const quad_lane = thread_idx % 4;
        int chunk_offsets[kChunksPerThread];
        int chunk_k[kChunksPerThread];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kChunksPerThread; ++j)
        {
            int const row = rows[j % 2];
            int const slot = quad_lane + 4 * (j / 2);
            chunk_offsets[j] = int(unswizzled(row, 8 * slot, 0));
            chunk_k[j] = 8 * ((slot & ~7) | ((slot & 7) ^ (row & 7)));
        }
        int const first_offsets[2] = {int(unswizzled(rows[0], 8 * (rows[0] & 7), 0)),
            int(unswizzled(rows[1], 8 * (rows[1] & 7), 0))};
        int const stage_elements = int(unswizzled(0, 0, 1));
        ElementA const* const smem_a = shared_tensors.smem_A.data();
        bool const centred = params.centred;
        float square_sums[2] = {0.0f, 0.0f};
        float shifted_sums[2] = {0.0f, 0.0f};
        float shifts[2] = {0.0f, 0.0f};
        // One stage's sums: Σx², or (centred) the sums shifted by each row's first element, which the
        // first K tile provides (every thread of a quad reads the same one), over the chunks inside K.
        auto add_stage = [&](int stage, int k_tile) {
            if (!centred)
            {
                CUTLASS_PRAGMA_UNROLL
                for (int j = 0; j < kChunksPerThread; ++j)
                {
                    uint4 const bits = *reinterpret_cast<uint4 const*>(smem_a + stage * stage_elements + chunk_offsets[j]);
                    cutlass::Array<ElementA, 8> const& chunk = reinterpret_cast<cutlass::Array<ElementA, 8> const&>(bits);
                    CUTLASS_PRAGMA_UNROLL
                    for (int e = 0; e < 8; ++e)
                    {
                        float const value = float(chunk[e]);
                        square_sums[j % 2] += value * value;
                    }
                }
                return;
            }
            if (k_tile == 0)
            {
                shifts[0] = float(smem_a[stage * stage_elements + first_offsets[0]]);
                shifts[1] = float(smem_a[stage * stage_elements + first_offsets[1]]);
            }
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kChunksPerThread; ++j)
            {
                if (k_tile * kTileK + chunk_k[j] < params.k)
                {
                    uint4 const bits = *reinterpret_cast<uint4 const*>(smem_a + stage * stage_elements + chunk_offsets[j]);
                    cutlass::Array<ElementA, 8> const& chunk = reinterpret_cast<cutlass::Array<ElementA, 8> const&>(bits);
                    CUTLASS_PRAGMA_UNROLL
                    for (int e = 0; e < 8; ++e)
                    {
                        float const d = float(chunk[e]) - shifts[j % 2];
                        shifted_sums[j % 2] += d;
                        square_sums[j % 2] += d * d;
                    }
                }
            }
        };

        PipelineState smem_pipe_release = smem_pipe_read;
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        warpgroup_fence_operand(accum);
        CUTLASS_PRAGMA_NO_UNROLL
        for (int k_tile = 0; k_tile < k_tile_count; ++k_tile)
        {
            int const stage = smem_pipe_read.index();
#ifdef FLASHNORM_TESTING_DROP_JOIN
            add_stage(stage, k_tile);
#endif
            pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
#ifndef FLASHNORM_TESTING_DROP_JOIN
            add_stage(stage, k_tile);
#endif
            warpgroup_fence_operand(accum);
            warpgroup_arrive();
            CUTLASS_PRAGMA_UNROLL
            for (int k_block = 0; k_block < size<2>(tCrA); ++k_block)
            {
                cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), accum);
                tiled_mma.accumulate_ = GMMA::ScaleOut::One;
            }
            warpgroup_commit_batch();
            // The previous tile's wgmma is done with its stage: release it (the base class's
            // mma_tail releases the last one, as after its own main loop).
            if (k_tile > 0)
            {
                warpgroup_wait<1>();
                warpgroup_fence_operand(accum);
                pipeline.consumer_release(smem_pipe_release);
                ++smem_pipe_release;
            }
            ++smem_pipe_read;
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(accum);

        float scales[2];
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r)
        {
            float sum = square_sums[r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            float shifted = shifted_sums[r];
            shifted += __shfl_xor_sync(0xffffffffu, shifted, 1);
            shifted += __shfl_xor_sync(0xffffffffu, shifted, 2);
            float const mean = shifted * params.inverse_k; // of x − c (0 for the RMS)
            scales[r] = centred ? rsqrtf(fmaxf(sum * params.inverse_k - mean * mean, 0.0f) + params.eps)
                                : rsqrtf(sum * params.inverse_k + params.eps);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i)
        {
            accum(i) *= int(get<0>(coordinates(i))) == first_row ? scales[0] : scales[1];
        }
        warpgroup_fence_operand(accum);
    }
};

// One GEMM configuration: x [M,K] row-major (A, K-major), W* [K,N] row-major (B, N-major), fp32
// accumulation, no C, no D (the epilogue node stores). A cluster of ClusterM tiles along M shares
// each W* tile (TMA multicast). SumsInMainLoop: the row sums by RowSumMainloop, else by the
// reduction kernel in front.
template <class Element, class TileShape, class KernelSchedule, class EpilogueSchedule, int ClusterM = 1,
    bool SumsInMainLoop = false>
struct ScaledGemm
{
    static constexpr int kClusterM = ClusterM;
    static constexpr bool kSumsInMainLoop = SumsInMainLoop;
    static constexpr int64_t kTileRows = decltype(size<0>(TileShape{}))::value;
    static constexpr int64_t kTileColumns = decltype(size<1>(TileShape{}))::value;
    // The builder's own choice for these schedules (EpilogueTileAuto: 64 or 128 rows, 32 columns),
    // spelled out because the visitor's tensor maps take it as their box and the split edges
    // (epilogue_scale_shape_fits) must fall on its columns.
    using EpilogueTile
        = Shape<Int<decltype(size<0>(TileShape{}))::value>, Int<static_cast<int>(kEpilogueScaleSubtileColumns)>>;
    using Store = RowScaleSplitStore<Element, !SumsInMainLoop, EpilogueTile>;
    using ClusterShape = Shape<Int<ClusterM>, _1, _1>;
    using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<cutlass::arch::Sm90,
        cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile,
        float, float, void, cutlass::layout::RowMajor, kAlignmentElements, void, cutlass::layout::RowMajor,
        kAlignmentElements, EpilogueSchedule, Store>::CollectiveOp;
    using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<cutlass::arch::Sm90,
        cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignmentElements, Element,
        cutlass::layout::RowMajor, kAlignmentElements, float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
            sizeof(typename CollectiveEpilogue::SharedStorage))>,
        KernelSchedule>::CollectiveOp;
    using CollectiveMainloop = cute::conditional_t<SumsInMainLoop, RowSumMainloop<PartialRowBlockMainloop<BuiltMainloop>>,
        PartialRowBlockMainloop<BuiltMainloop>>;
    using Kernel
        = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
};

using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CooperativeEpilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;

// 64-row tiles, one warp group per tile, the row sums in the main loop (RowSumMainloop): one wave,
// or two consumer warp groups taking turns (ping-pong).
template <class Element, class TileShape>
using RowSumOneWaveGemm = ScaledGemm<Element, TileShape, cutlass::gemm::KernelTmaWarpSpecialized,
    cutlass::epilogue::TmaWarpSpecialized, 1, true>;
template <class Element>
using RowSumPingPongGemm = ScaledGemm<Element, Shape<_64, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
    cutlass::epilogue::TmaWarpSpecialized, 1, true>;
// 64-row tiles, the reduction kernel in front: one wave, or ping-pong.
template <class Element, class TileShape>
using OneWaveGemm = ScaledGemm<Element, TileShape, cutlass::gemm::KernelTmaWarpSpecialized,
    cutlass::epilogue::TmaWarpSpecialized>;
template <class Element>
using SmallTileGemm = ScaledGemm<Element, Shape<_64, _64, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
    cutlass::epilogue::TmaWarpSpecialized>;
// 128-row tiles, both consumer warp groups on one (cooperative), the reduction kernel in front; the
// 128×96 and 128×256 ones in clusters of two along M that share each W* tile, the others alone.
template <class Element>
using NarrowTileGemm = ScaledGemm<Element, Shape<_128, _64, _64>, Cooperative, CooperativeEpilogue>;
template <class Element>
using LargeTileGemm = ScaledGemm<Element, Shape<_128, _128, _64>, Cooperative, CooperativeEpilogue>;
template <class Element>
using TallWideTileGemm = ScaledGemm<Element, Shape<_128, _192, _64>, Cooperative, CooperativeEpilogue>;
template <class Element>
using WideTileGemm = ScaledGemm<Element, Shape<_128, _256, _64>, Cooperative, CooperativeEpilogue, 2>;
template <class Element>
using PairedTileGemm = ScaledGemm<Element, Shape<_128, _96, _64>, Cooperative, CooperativeEpilogue, 2>;
// scales[m] = the statistic of row m. Lets the GEMM launched after it (PDL) start at once;
// `delay_cycles` (test hook) holds the writes back after that.
template <typename T>
__global__ void __launch_bounds__(kRowScaleRowsPerBlock * 32) row_scale_releasing_kernel(T const* __restrict__ x,
    int64_t m, int64_t k, float eps, bool centred, float* __restrict__ scales, int64_t delay_cycles)
{
    asm volatile("griddepcontrol.launch_dependents;");
    if (delay_cycles > 0)
    {
        long long const start = clock64();
        while (clock64() - start < delay_cycles)
        {
        }
    }
    store_row_scale(x, m, k, eps, centred, scales);
}

template <class Gemm>
cudaError_t configure_gemm()
{
    using Kernel = typename Gemm::Kernel;
    return cudaFuncSetAttribute(
        cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::SharedStorageSize);
}

template <class Element>
cudaError_t configure_gemms()
{
    for (cudaError_t const status : {configure_gemm<RowSumOneWaveGemm<Element, Shape<_64, _32, _64>>>(),
             configure_gemm<RowSumOneWaveGemm<Element, Shape<_64, _64, _64>>>(),
             configure_gemm<RowSumOneWaveGemm<Element, Shape<_64, _128, _64>>>(),
             configure_gemm<RowSumPingPongGemm<Element>>(), configure_gemm<OneWaveGemm<Element, Shape<_64, _64, _64>>>(),
             configure_gemm<OneWaveGemm<Element, Shape<_64, _64, _128>>>(),
             configure_gemm<SmallTileGemm<Element>>(), configure_gemm<NarrowTileGemm<Element>>(),
             configure_gemm<LargeTileGemm<Element>>(), configure_gemm<TallWideTileGemm<Element>>(),
             configure_gemm<WideTileGemm<Element>>(), configure_gemm<PairedTileGemm<Element>>()})
    {
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    return cudaSuccess;
}

// Launches the GEMM, with programmatic stream serialization, and in front of it the reduction
// kernel where the GEMM's main loop does not sum the rows itself.
template <class Gemm, typename T, class Element>
cudaError_t launch_gemm(T const* x, Element const* w, int64_t m, int64_t k, int64_t n, RowNorm const& norm,
    float* scales, OutputSplits const& splits, int sm_count, int64_t delay_cycles, cudaStream_t stream)
{
    if constexpr (!Gemm::kSumsInMainLoop)
    {
        dim3 const grid(static_cast<unsigned>((m + kRowScaleRowsPerBlock - 1) / kRowScaleRowsPerBlock));
        row_scale_releasing_kernel<T><<<grid, kRowScaleRowsPerBlock * 32, 0, stream>>>(
            x, m, k, norm.eps, norm.centred, scales, delay_cycles);
        cudaError_t const status = cudaGetLastError();
        if (status != cudaSuccess)
        {
            return status;
        }
    }
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
    // The built collective's arguments; RowSumMainloop's add eps and the statistic.
    typename Kernel::MainloopArguments mainloop{};
    static_cast<typename Gemm::BuiltMainloop::Arguments&>(mainloop)
        = {reinterpret_cast<typename Kernel::ElementA const*>(x), stride_x,
            reinterpret_cast<typename Kernel::ElementB const*>(w), stride_w};
    if constexpr (Gemm::kSumsInMainLoop)
    {
        mainloop.eps = norm.eps;
        mainloop.centred = norm.centred;
    }
    typename Kernel::Arguments arguments{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1}, mainloop,
        {{Gemm::kSumsInMainLoop ? nullptr : scales, norm.bias, splits}, nullptr, {}, nullptr, {}}, hardware};
    if (Kernel::can_implement(arguments) == false)
    {
        return cudaErrorInvalidValue;
    }
    typename Kernel::Params const params = Kernel::to_underlying_arguments(arguments, nullptr);

    cudaLaunchAttribute attributes[2];
    attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[0].val.programmaticStreamSerializationAllowed = 1;
    attributes[1].id = cudaLaunchAttributeClusterDimension;
    attributes[1].val.clusterDim.x = Gemm::kClusterM;
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

// A tile configuration as a type (the launch below checks its GEMM's tile at compile time).
template <EpilogueScaleTiles Tiles>
using Configuration = std::integral_constant<EpilogueScaleTiles, Tiles>;

template <typename T, class Element>
cudaError_t launch_typed(void const* input, void const* weight, int64_t m, int64_t k, int64_t n, RowNorm const& norm,
    OutputSplits const& splits, float* scales, int sm_count, int64_t delay_cycles, EpilogueScaleTiles tiles,
    cudaStream_t stream)
{
    auto const* x = static_cast<T const*>(input);
    auto const* w = static_cast<Element const*>(weight);
    // Each configuration's GEMM has the tile the dispatch unit's table gives it (dispatch.h,
    // epilogue_scale_tile_shape), the tile the dispatch's choice and AUTO's one-wave rule count.
    auto const launch = [&](auto configuration, auto gemm) {
        using Gemm = decltype(gemm);
        constexpr EpilogueScaleTileShape tile = epilogue_scale_tile_shape(decltype(configuration)::value);
        static_assert(Gemm::kTileRows == tile.rows && Gemm::kTileColumns == tile.columns
                && Gemm::kSumsInMainLoop == tile.row_sums,
            "the GEMM's tile is not the one dispatch/dispatch.h gives its configuration");
        return launch_gemm<Gemm>(x, w, m, k, n, norm, scales, splits, sm_count, delay_cycles, stream);
    };
    using Tiles = EpilogueScaleTiles;
    switch (tiles)
    {
    case Tiles::kRowSums64x32:
        return launch(Configuration<Tiles::kRowSums64x32>{}, RowSumOneWaveGemm<Element, Shape<_64, _32, _64>>{});
    case Tiles::kRowSums64x64:
        return launch(Configuration<Tiles::kRowSums64x64>{}, RowSumOneWaveGemm<Element, Shape<_64, _64, _64>>{});
    case Tiles::kRowSums64x128:
        return launch(Configuration<Tiles::kRowSums64x128>{}, RowSumOneWaveGemm<Element, Shape<_64, _128, _64>>{});
    case Tiles::kRowSumsPingPong64x128:
        return launch(Configuration<Tiles::kRowSumsPingPong64x128>{}, RowSumPingPongGemm<Element>{});
    case Tiles::kOneWave64x64:
        return launch(Configuration<Tiles::kOneWave64x64>{}, OneWaveGemm<Element, Shape<_64, _64, _64>>{});
    case Tiles::kOneWave64x64DeepK:
        return launch(Configuration<Tiles::kOneWave64x64DeepK>{}, OneWaveGemm<Element, Shape<_64, _64, _128>>{});
    case Tiles::kPingPong64x64: return launch(Configuration<Tiles::kPingPong64x64>{}, SmallTileGemm<Element>{});
    case Tiles::kOneWave128x64: return launch(Configuration<Tiles::kOneWave128x64>{}, NarrowTileGemm<Element>{});
    case Tiles::k128x64: return launch(Configuration<Tiles::k128x64>{}, NarrowTileGemm<Element>{});
    case Tiles::kOneWave128x128: return launch(Configuration<Tiles::kOneWave128x128>{}, LargeTileGemm<Element>{});
    case Tiles::k128x128: return launch(Configuration<Tiles::k128x128>{}, LargeTileGemm<Element>{});
    case Tiles::kOneWave128x192: return launch(Configuration<Tiles::kOneWave128x192>{}, TallWideTileGemm<Element>{});
    case Tiles::k128x192: return launch(Configuration<Tiles::k128x192>{}, TallWideTileGemm<Element>{});
    case Tiles::kClusters128x256: return launch(Configuration<Tiles::kClusters128x256>{}, WideTileGemm<Element>{});
    case Tiles::kOneWaveClusters128x96:
        return launch(Configuration<Tiles::kOneWaveClusters128x96>{}, PairedTileGemm<Element>{});
    }
    return cudaErrorInvalidValue;
}

} // namespace

bool epilogue_scale_built()
{
    return true;
}

cudaError_t configure_epilogue_scale_kernels()
{
    cudaError_t const status = configure_gemms<cutlass::bfloat16_t>();
    return status != cudaSuccess ? status : configure_gemms<cutlass::half_t>();
}

cudaError_t launch_epilogue_scale(flashnorm_dtype dtype, void const* x, void const* w, int64_t m, int64_t k,
    int64_t n, RowNorm const& norm, OutputSplits const& splits, float* scales, int sm_count, int64_t delay_cycles,
    std::optional<EpilogueScaleTiles> forced_tiles, cudaStream_t stream)
{
    EpilogueScaleTiles const tiles = forced_tiles ? *forced_tiles : epilogue_scale_tiles(m, k, n, sm_count);
    switch (dtype)
    {
    case FLASHNORM_DTYPE_BF16:
        return launch_typed<__nv_bfloat16, cutlass::bfloat16_t>(
            x, w, m, k, n, norm, splits, scales, sm_count, delay_cycles, tiles, stream);
    case FLASHNORM_DTYPE_F16:
        return launch_typed<__half, cutlass::half_t>(
            x, w, m, k, n, norm, splits, scales, sm_count, delay_cycles, tiles, stream);
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

cudaError_t launch_epilogue_scale(flashnorm_dtype, void const*, void const*, int64_t, int64_t, int64_t,
    RowNorm const&, OutputSplits const&, float*, int, int64_t, std::optional<EpilogueScaleTiles>, cudaStream_t)
{
    return cudaErrorNotSupported;
}

} // namespace flashnorm

#endif
