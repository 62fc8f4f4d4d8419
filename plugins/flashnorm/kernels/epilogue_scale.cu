// The epilogue-scale strategy: one CUTLASS sm90 GEMM (TMA loads, warp-specialized wgmma main loop)
// that scales each accumulator row by inv_rms[row] and stores every column straight into its
// split's output. Where the row sums come from depends on the tile:
//
// - 64-row tiles on short K (to 1024) to 1024 rows, and on longer K to 256 rows where 64×64 tiles
//   would exceed one wave and 64×128 ones do not: the main loop itself sums the squares of
//   each tile's rows of x from the A tiles the TMA brings into shared memory, and scales the
//   accumulators before the epilogue stores them (RowSumMainloop). One kernel, launched with
//   programmatic stream serialization; its joins: the producer's griddepcontrol.wait before its
//   first load (x may be written by the kernel before it), and each stage's full barrier, which
//   the sums wait on as the wgmma does.
// - every other problem: a reduction kernel in front, overlapped with the GEMM's main loop through
//   programmatic dependent launch (PDL):
//     reduction kernel: griddepcontrol.launch_dependents at entry, then inv_rms[m] = rsqrt(...)
//     GEMM (launched with programmatic stream serialization): main loop over x and W*; the
//     epilogue executes griddepcontrol.wait, which returns once the reduction grid has completed
//     and its writes are visible, and only then reads inv_rms.
//
// The race-test mutant (FLASHNORM_TESTING_DROP_JOIN) drops the joins: both griddepcontrol.waits,
// and the main loop's wait before it reads a stage's squares (it reads them before the stage lands).
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

// Blocks until the grids this GEMM was launched after (programmatic stream serialization) have
// completed and their writes are visible (PTX griddepcontrol.wait; returns at once when launched
// without PDL): the reduction kernel, for the epilogue's read of inv_rms; whatever ran before,
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

// The epilogue visitor (root of the fusion tree): value = acc · inv_rms[row] (or acc, where the
// main loop has scaled the accumulators: ScalesRows false), stored from registers to
// outputs[split(col)][row, col - offset]. Eight consecutive columns of one row and split move as
// one 16-byte store where the address allows (reduce(), below).
template <class Element, bool ScalesRows>
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
        return (!ScalesRows || args.inv_rms != nullptr) && args.splits.count >= 1;
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
            first_row = rows - int(get<0>(residue));
            second_row = first_row + second_row_offset(relative);
            if constexpr (ScalesRows)
            {
                wait_for_previous_grids();
                // Through L2 (ld.global.cg), as the reduction grid wrote them.
                first_scale = first_row < rows ? __ldcg(params.inv_rms + first_row) : 0.0f;
                second_scale = second_row < rows ? __ldcg(params.inv_rms + second_row) : 0.0f;
            }

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
        CUTLASS_DEVICE void store_element(int row, int col, Element value) const
        {
            if (row < rows && col < cols)
            {
                uintptr_t address = fast_address(row, col, col);
                if (address == 0)
                {
                    SplitColumn const target = locate(col);
                    address = reinterpret_cast<uintptr_t>(target.output + row * target.width + target.column);
                }
                __stcg(reinterpret_cast<unsigned short*>(address), reinterpret_cast<unsigned short const&>(value));
            }
        }

        // Eight consecutive columns of one row (two packed per word): one 16-byte store where they
        // lie in one split at a 16-byte aligned address, else one store each.
        CUTLASS_DEVICE void store_eight(int row, int col, uint32_t const (&words)[4]) const
        {
            if (row < rows && col + 7 < cols)
            {
                uintptr_t const address = fast_address(row, col, col + 7);
                if (address != 0 && address % 16 == 0)
                {
                    __stcg(reinterpret_cast<uint4*>(address), make_uint4(words[0], words[1], words[2], words[3]));
                    return;
                }
            }
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < 8; ++i)
            {
                unsigned short const bits = static_cast<unsigned short>(words[i / 2] >> (16 * (i % 2)));
                store_element(row, col + i, reinterpret_cast<Element const&>(bits));
            }
        }

        // The scaled values; reduce() stores them once the whole subtile has been visited.
        template <typename ElementAccumulator, int FragmentSize>
        CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
            cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m, int epi_n)
        {
            Tensor relative_mn = relative(_, _, _, epi_m, epi_n);
            cutlass::Array<float, FragmentSize> scaled;
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < FragmentSize; ++i)
            {
                int const row = first_row + int(get<0>(relative_mn(epi_v * FragmentSize + i)));
                scaled[i] = ScalesRows ? float(frg_acc[i]) * (row < rows ? scale_of(row) : 0.0f) : float(frg_acc[i]);
            }
            return scaled;
        }

        // Stores one subtile. In wgmma's accumulator layout the four threads of a quad (lanes 4q..4q+3)
        // share two rows, r and r + 8, and thread t holds columns 8g + 2t and 8g + 2t + 1 of each
        // 8-column group g: a 4-byte piece of every group. Four shuffles per group of four turn that
        // around, so that thread t holds all eight columns of group 4b + t and stores them as one
        // 16-byte vector: a warp then writes whole 32-byte sectors (8 rows x 32 bytes per store)
        // instead of half sectors from 4-byte stores (kernels/NOTES.md, "16-byte stores").
        template <class STensor, class SyncFn, class VTensor>
        CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor visit_results)
        {
            using Fragment = typename cute::remove_cvref_t<VTensor>::value_type;
            constexpr int kFragment = Fragment::kElements;
            constexpr int kElements = kFragment * decltype(size(visit_results))::value;
            constexpr int kGroups = kElements / 4; // 8-column groups of each of the thread's two rows
            static_assert(kElements % 16 == 0, "a subtile must give each thread whole groups of four");
            Tensor relative_mn = relative(_, _, _, epi_m, epi_n);
            int const row_zero = int(get<0>(relative_mn(0)));
            int const col_zero = int(get<1>(relative_mn(0)));

            // pieces[h][g]: columns 8g + 2t, +1 of the thread's row h (offsets are static: these
            // indices fold to constants).
            uint32_t pieces[2][kGroups];
            int row_of[2] = {first_row + row_zero, first_row + row_zero};
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < kElements; e += 2)
            {
                int const h = int(get<0>(relative_mn(e))) != row_zero ? 1 : 0;
                int const g = (int(get<1>(relative_mn(e))) - col_zero) / 8;
                cutlass::Array<Element, 2> pair;
                pair[0] = Element(visit_results(e / kFragment)[e % kFragment]);
                pair[1] = Element(visit_results((e + 1) / kFragment)[(e + 1) % kFragment]);
                pieces[h][g] = reinterpret_cast<uint32_t const&>(pair);
                row_of[h] = first_row + int(get<0>(relative_mn(e)));
            }

            int const lane = int(threadIdx.x % 32);
            int const t = lane % 4;
            int const quad = lane - t;
            // Column of group 0's first column: this thread's first column less its 2t.
            int const group_zero = cols - int(get<1>(residue)) + col_zero - 2 * t;
            CUTLASS_PRAGMA_UNROLL
            for (int h = 0; h < 2; ++h)
            {
                CUTLASS_PRAGMA_UNROLL
                for (int block = 0; block < kGroups / 4; ++block)
                {
                    uint32_t words[4] = {};
                    CUTLASS_PRAGMA_UNROLL
                    for (int step = 0; step < 4; ++step)
                    {
                        // Send my piece of group 4·block + (t + step) % 4; receive group 4·block + t's
                        // piece from thread (t - step) % 4. Indices by selects, not by a run-time subscript.
                        int const send_group = (t + step) % 4;
                        uint32_t send = pieces[h][4 * block];
                        CUTLASS_PRAGMA_UNROLL
                        for (int i = 1; i < 4; ++i)
                        {
                            send = send_group == i ? pieces[h][4 * block + i] : send;
                        }
                        int const source = (t - step + 4) % 4;
                        uint32_t const received = __shfl_sync(0xffffffffu, send, quad + source);
                        CUTLASS_PRAGMA_UNROLL
                        for (int i = 0; i < 4; ++i)
                        {
                            words[i] = source == i ? received : words[i];
                        }
                    }
                    store_eight(row_of[h], group_zero + 8 * (4 * block + t), words);
                }
            }
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

// CUTLASS's warp-specialized sm90 main loop for one warp group's 64-row tile, with the RMS
// reduction in it: each consumer thread also sums the squares of its two accumulator rows of x
// from every A tile the TMA brings into shared memory, and after the last tile scales its
// accumulators by those rows' inv_rms, so the epilogue only stores.
//
// A tile's squares are read after its stage's full-barrier wait and before the warp group's
// wgmma on it is issued, while the previous tile's wgmma still runs. The stage is released (by
// one thread of the warp group) once that wgmma has completed, which every warp's issue, and so
// every warp's reads, precede: no reader is still reading when the producer refills it. On the
// H200 reading after the issue instead, with each stage then held one iteration longer, measured
// slower (SmolLM2-135M q|k|v at 64 rows 5.87 µs against 5.52, Llama-3.2-1B q|k|v 13.5 against
// 11.6: kernels/NOTES.md).
//
// The producer waits for the grids before it on the stream (griddepcontrol.wait) before its first
// load, so the GEMM can be launched with programmatic stream serialization: its launch and
// prologue overlap the previous kernel's tail (SmolLM2-135M q|k|v at 64 rows 5.26 µs against 5.52
// without it), and x written by that kernel (the residual add) is complete before the TMA reads it.
//
// In an SW128 K-major tile of a 16-bit type each 128-byte line holds 64 consecutive K elements
// of one row, and the swizzle only permutes a line's 16-byte chunks. The unswizzled offsets of a
// row's chunks therefore address the same row's chunks in another order, which a sum ignores.
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
    };

    struct Params : Base::Params
    {
        float eps;
        float inverse_k; // 1/K, formed once on the host
    };

    template <class ProblemShape>
    static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace)
    {
        return {Base::to_underlying_arguments(problem_shape, args, workspace), args.eps,
            1.0f / float(get<2>(problem_shape))};
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

        // Element offsets of this thread's chunks in stage 0, unswizzled (see above).
        auto const unswizzled = SmemLayoutA{}.layout_b();
        int const quad_lane = thread_idx % 4;
        int chunk_offsets[kChunksPerThread];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kChunksPerThread; ++j)
        {
            int const row = rows[j % 2];
            int const chunk = quad_lane + 4 * (j / 2);
            chunk_offsets[j] = int(unswizzled(row, 8 * chunk, 0));
        }
        int const stage_elements = int(unswizzled(0, 0, 1));
        ElementA const* const smem_a = shared_tensors.smem_A.data();
        float square_sums[2] = {0.0f, 0.0f};
        auto add_squares = [&](int stage) {
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
        };

        PipelineState smem_pipe_release = smem_pipe_read;
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        warpgroup_fence_operand(accum);
        CUTLASS_PRAGMA_NO_UNROLL
        for (int k_tile = 0; k_tile < k_tile_count; ++k_tile)
        {
            int const stage = smem_pipe_read.index();
#ifdef FLASHNORM_TESTING_DROP_JOIN
            add_squares(stage);
#endif
            pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
#ifndef FLASHNORM_TESTING_DROP_JOIN
            add_squares(stage);
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

        float inv_rms[2];
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r)
        {
            float sum = square_sums[r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            inv_rms[r] = rsqrtf(sum * params.inverse_k + params.eps);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i)
        {
            accum(i) *= int(get<0>(coordinates(i))) == first_row ? inv_rms[0] : inv_rms[1];
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
    using Store = RowScaleSplitStore<Element, !SumsInMainLoop>;
    using ClusterShape = Shape<Int<ClusterM>, _1, _1>;
    using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<cutlass::arch::Sm90,
        cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
        float, float, void, cutlass::layout::RowMajor, kAlignmentElements, void, cutlass::layout::RowMajor,
        kAlignmentElements, EpilogueSchedule, Store>::CollectiveOp;
    using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<cutlass::arch::Sm90,
        cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignmentElements, Element,
        cutlass::layout::RowMajor, kAlignmentElements, float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
            sizeof(typename CollectiveEpilogue::SharedStorage))>,
        KernelSchedule>::CollectiveOp;
    using CollectiveMainloop = cute::conditional_t<SumsInMainLoop, RowSumMainloop<BuiltMainloop>, BuiltMainloop>;
    using Kernel
        = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
};

using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CooperativeEpilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;

// 64-row tiles, one warp group per tile. Short K (to kRowSumsMaxK) to kRowSumsMaxRows rows: the
// main loop sums the rows (RowSumMainloop). One wave of tiles where the narrowest of 64×32, 64×64
// and 64×128 that number at most the multiprocessors does (the non-persistent kernel, one tile
// per block, no tile scheduler), else 64×128 tiles on two consumer warp groups taking turns
// (ping-pong). H200, 2026-12-03 (kernels/NOTES.md, "Short K beyond 256 rows, long K back to the
// reduction kernel"): SmolLM2-135M q|k|v at M = 256 5.55 µs on 120 tiles of 64×32 against 5.88 on
// 60 of 64×64, at 512 6.1 against 7.9 on 128-row tiles; gate|up at 256 7.4 on 64×128 tiles
// against 8.8 on ping-pong 64×64 ones, at 1024 14.1 against 17.7 on 128×128.
template <class Element, class TileShape>
using RowSumOneWaveGemm = ScaledGemm<Element, TileShape, cutlass::gemm::KernelTmaWarpSpecialized,
    cutlass::epilogue::TmaWarpSpecialized, 1, true>;
template <class Element>
using RowSumPingPongGemm = ScaledGemm<Element, Shape<_64, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
    cutlass::epilogue::TmaWarpSpecialized, 1, true>;
constexpr int64_t kRowSumsMaxK = 1024;
constexpr int64_t kRowSumsMaxRows = 1024;
// Longer K, to 256 rows: the same 64-row tiles with the reduction kernel in front, where the sums'
// loads and squares in each K step of the main loop cost more than they save (H200: Llama-3.1-8B
// q|k|v at M = 128 26.5 µs against 32.2, gate|up at 64 65.2 against 70.3); one wave of 64×64 tiles
// (128-deep K steps on K ≥ 4096), else one wave of 64×128 tiles with the sums in the main loop
// (twice the wgmma work per K step hides them: H200, 2026-12-03, Llama-3.2-1B gate|up at M = 64
// 22.0 µs against 23.3 on ping-pong 64×64 tiles, q|k|v at 256 13.3 against 16.1, Llama-3.1-8B q|k|v
// at 128 23.0 against 26.2), else ping-pong 64×64 tiles.
template <class Element, class TileShape>
using OneWaveGemm = ScaledGemm<Element, TileShape, cutlass::gemm::KernelTmaWarpSpecialized,
    cutlass::epilogue::TmaWarpSpecialized>;
template <class Element>
using SmallTileGemm = ScaledGemm<Element, Shape<_64, _64, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
    cutlass::epilogue::TmaWarpSpecialized>;
constexpr int64_t kSmallTileMaxRows = 256;
constexpr int64_t kLongKOneWaveMinK = 4096;
// Otherwise both consumer warp groups on one tile (cooperative), the reduction kernel in front:
// 128×128 tiles, or 128×64 where 128×128 ones would leave multiprocessors idle; on long K, 128×256
// tiles in clusters of two along M where they fill the multiprocessors in waves at least 80 % full.
// Measured slower there on the H200 (kernels/NOTES.md): ping-pong 64×128 / 64×256 tiles on long K
// or at 4096 rows.
template <class Element>
using NarrowTileGemm = ScaledGemm<Element, Shape<_128, _64, _64>, Cooperative, CooperativeEpilogue>;
template <class Element>
using LargeTileGemm = ScaledGemm<Element, Shape<_128, _128, _64>, Cooperative, CooperativeEpilogue>;
template <class Element>
using WideTileGemm = ScaledGemm<Element, Shape<_128, _256, _64>, Cooperative, CooperativeEpilogue, 2>;
constexpr int64_t kWideTileMinK = 2048;

int64_t tile_count(int64_t m, int64_t n, int64_t tile_m, int64_t tile_n)
{
    return ((m + tile_m - 1) / tile_m) * ((n + tile_n - 1) / tile_n);
}

// 128×256 tiles pay off where each tile's main loop is long and the last wave is not mostly idle:
// on the H200 (2026-12-01 23:55 UTC, Nsight Compute) Llama-3.1-8B gate/up at M = 256, 1024, 4096
// took 108.5 / 334.7 / 1312.9 µs against 115.5 / 413.1 / 1583.6 with 128×128 tiles, while
// Llama-3.1-8B qkv at M = 1024 (192 wide tiles: the second wave 45 % full) took 105.2 against 91.8
// and SmolLM2 gate/up at M = 4096 (K = 576) 46.2 against 44.4.
bool wide_tiles_fit(int64_t m, int64_t k, int64_t n, int sm_count)
{
    int64_t const tiles = tile_count(m, n, 128, 256);
    int64_t const waves = (tiles + sm_count - 1) / sm_count;
    return m > 128 && k >= kWideTileMinK && tiles >= sm_count && 5 * tiles >= 4 * waves * sm_count;
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

template <class Element>
cudaError_t configure_gemms()
{
    for (cudaError_t const status : {configure_gemm<RowSumOneWaveGemm<Element, Shape<_64, _32, _64>>>(),
             configure_gemm<RowSumOneWaveGemm<Element, Shape<_64, _64, _64>>>(),
             configure_gemm<RowSumOneWaveGemm<Element, Shape<_64, _128, _64>>>(),
             configure_gemm<RowSumPingPongGemm<Element>>(), configure_gemm<OneWaveGemm<Element, Shape<_64, _64, _64>>>(),
             configure_gemm<OneWaveGemm<Element, Shape<_64, _64, _128>>>(), configure_gemm<SmallTileGemm<Element>>(),
             configure_gemm<NarrowTileGemm<Element>>(), configure_gemm<LargeTileGemm<Element>>(),
             configure_gemm<WideTileGemm<Element>>()})
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
cudaError_t launch_gemm(T const* x, Element const* w, int64_t m, int64_t k, int64_t n, float eps,
    float* inv_rms, OutputSplits const& splits, int sm_count, int64_t delay_cycles, cudaStream_t stream)
{
    if constexpr (!Gemm::kSumsInMainLoop)
    {
        dim3 const grid(static_cast<unsigned>((m + kInvRmsRowsPerBlock - 1) / kInvRmsRowsPerBlock));
        inv_rms_releasing_kernel<T><<<grid, kInvRmsRowsPerBlock * 32, 0, stream>>>(x, m, k, eps, inv_rms, delay_cycles);
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
    // The built collective's arguments; RowSumMainloop's add eps.
    typename Kernel::MainloopArguments mainloop{};
    static_cast<typename Gemm::BuiltMainloop::Arguments&>(mainloop)
        = {reinterpret_cast<typename Kernel::ElementA const*>(x), stride_x,
            reinterpret_cast<typename Kernel::ElementB const*>(w), stride_w};
    if constexpr (Gemm::kSumsInMainLoop)
    {
        mainloop.eps = eps;
    }
    typename Kernel::Arguments arguments{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1}, mainloop,
        {{Gemm::kSumsInMainLoop ? nullptr : inv_rms, splits}, nullptr, {}, nullptr, {}}, hardware};
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

template <typename T, class Element>
cudaError_t launch_typed(void const* input, void const* weight, int64_t m, int64_t k, int64_t n, float eps,
    OutputSplits const& splits, float* inv_rms, int sm_count, int64_t delay_cycles, cudaStream_t stream)
{
    auto const* x = static_cast<T const*>(input);
    auto const* w = static_cast<Element const*>(weight);
    auto const launch = [&](auto gemm) {
        return launch_gemm<decltype(gemm)>(x, w, m, k, n, eps, inv_rms, splits, sm_count, delay_cycles, stream);
    };
    if (k <= kRowSumsMaxK && m <= kRowSumsMaxRows)
    {
        if (tile_count(m, n, 64, 32) <= sm_count)
        {
            return launch(RowSumOneWaveGemm<Element, Shape<_64, _32, _64>>{});
        }
        if (tile_count(m, n, 64, 64) <= sm_count)
        {
            return launch(RowSumOneWaveGemm<Element, Shape<_64, _64, _64>>{});
        }
        if (tile_count(m, n, 64, 128) <= sm_count)
        {
            return launch(RowSumOneWaveGemm<Element, Shape<_64, _128, _64>>{});
        }
        return launch(RowSumPingPongGemm<Element>{});
    }
    if (wide_tiles_fit(m, k, n, sm_count))
    {
        return launch(WideTileGemm<Element>{});
    }
    if (m > 128 && tile_count(m, n, 128, 128) >= sm_count)
    {
        return launch(LargeTileGemm<Element>{});
    }
    if (m <= kSmallTileMaxRows)
    {
        if (tile_count(m, n, 64, 64) > sm_count)
        {
            if (tile_count(m, n, 64, 128) <= sm_count)
            {
                return launch(RowSumOneWaveGemm<Element, Shape<_64, _128, _64>>{});
            }
            return launch(SmallTileGemm<Element>{});
        }
        if (k >= kLongKOneWaveMinK)
        {
            return launch(OneWaveGemm<Element, Shape<_64, _64, _128>>{});
        }
        return launch(OneWaveGemm<Element, Shape<_64, _64, _64>>{});
    }
    return launch(NarrowTileGemm<Element>{});
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
