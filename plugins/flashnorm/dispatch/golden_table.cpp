// Prints AUTO's golden table (tests/plugins/golden/auto_dispatch.csv) to stdout: for each site, statistic,
// dtype, multiprocessor count and build with or without the CUTLASS kernel, every run of consecutive rows
// with one pick (strategy, the epilogue-scale GEMM's tiles where it is picked, and the workspace
// flashnorm_workspace_size reports: `0`, `two_stream(m)` or `prenorm(m)` where it is that strategy's
// size at each row, else the constant byte count reserved for the smaller rows), with the bytes at
// the run's last row. Host C++ only: write_golden.py and tests/plugins/test_dispatch_golden.py
// compile it with dispatch.cpp.
//
// It also checks, on every row, what the table cannot show (exit status 1, the first failure on
// stderr): the workspace covers the picked strategy's own need at that row and every smaller row's.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "dispatch/dispatch.h"

namespace
{

using flashnorm::dispatch::DType;
using flashnorm::dispatch::Problem;
using flashnorm::dispatch::Statistic;
using flashnorm::dispatch::Strategy;

struct Site
{
    char const* name;
    int64_t k;
    std::vector<int64_t> splits;
    // LayerNorm sites are listed under both statistics (AUTO picks alike for both, and the table
    // shows it row for row); RMSNorm sites under the RMS only. A call's bias is not part of the
    // problem: it moves neither the pick nor the workspace (prenorm always reserves its rounding).
    bool layer_norm = false;
};

// Real models' norm→projection sites (benchmarks/shapes.py, and wider models), then constructed
// ones at AUTO's and the kernels' edges: split edges off the 32-column grid, K and N off the
// multiples of 8 the epilogue-scale GEMM needs, odd split runs, K·N around AUTO's weight bounds.
std::vector<Site> const kSites = {
    {"SmolLM2-135M q|k|v", 576, {576, 192, 192}},
    {"SmolLM2-135M gate|up", 576, {1536, 1536}},
    {"Llama-3.2-1B q|k|v", 2048, {2048, 512, 512}},
    {"Llama-3.2-1B gate|up", 2048, {8192, 8192}},
    {"Llama-3.1-8B q|k|v", 4096, {4096, 1024, 1024}},
    {"Llama-3.1-8B gate|up", 4096, {14336, 14336}},
    {"Qwen2.5-7B q|k|v", 3584, {3584, 512, 512}},
    {"Llama-3.1-70B q|k|v", 8192, {8192, 1024, 1024}},
    {"Llama-3.1-70B gate|up", 8192, {28672, 28672}},
    {"one output 960", 576, {960}},
    {"one output 962", 576, {962}},
    {"one output 3072 short K", 576, {3072}},
    {"one output 3072", 2048, {3072}},
    {"one output 6144", 4096, {6144}},
    {"one output 16384", 2048, {16384}},
    {"one output 16392", 2048, {16392}},
    {"one output 28672", 4096, {28672}},
    {"k|q|v order", 576, {192, 576, 192}},
    {"last split off 8", 576, {576, 192, 196}},
    {"wide splits", 2048, {16384, 16384}},
    {"pair below 2^25", 2048, {5504, 5504}},
    {"three widths", 2048, {2048, 1024, 512}},
    {"edge off 32 columns", 2048, {8184, 8200}},
    {"narrow last split", 2048, {16376, 16}},
    {"K off 8 q|k|v", 2040, {2048, 512, 512}},
    {"K off 8 gate|up", 2040, {8192, 8192}},
    {"small K", 130, {24, 72}},
    {"small K wide", 130, {5000}},
    {"small splits", 256, {64, 64, 32}},
    // Pre-LN encoders' LayerNorm→projection sites (benchmarks/shapes.py LN_SITES): ViT-B/16 and the
    // Whisper-small encoder (hidden 768, MLP 3072), CLIP ViT-L/14 (hidden 1024, MLP 4096).
    {"ViT-B/16 q|k|v", 768, {768, 768, 768}, true},
    {"ViT-B/16 fc1", 768, {3072}, true},
    {"CLIP ViT-L/14 q|k|v", 1024, {1024, 1024, 1024}, true},
    {"CLIP ViT-L/14 fc1", 1024, {4096}, true},
};

struct StatisticName
{
    char const* name;
    Statistic statistic;
};
StatisticName const kStatistics[] = {{"rms", Statistic::kRms}, {"variance", Statistic::kVariance}};

struct Dtype
{
    char const* name;
    DType dtype;
};
Dtype const kDtypes[] = {{"f32", DType::kF32}, {"f16", DType::kF16}, {"bf16", DType::kBF16}};

// An H200's or H100 SXM's multiprocessors, an H100 PCIe's, an H20's.
int const kMultiprocessors[] = {132, 114, 78};

// Every row from 1 to kContiguousRows, then these: a run's m_from..m_to are the table's rows in between.
constexpr int64_t kContiguousRows = 16384;
int64_t const kLargeRows[] = {32768, 54614, 60000, 65536, 131072};

char const* strategy_name(Strategy strategy)
{
    switch (strategy)
    {
    case Strategy::kTwoStream: return "two_stream";
    case Strategy::kFused: return "fused";
    case Strategy::kPrenorm: return "prenorm";
    case Strategy::kEpilogueScale: return "epilogue_scale";
    }
    return "?";
}

std::string workspace_rule(Problem const& problem, size_t bytes)
{
    if (bytes == 0)
        return "0";
    if (bytes == flashnorm::dispatch::workspace_bytes(problem, Strategy::kTwoStream, false))
        return "two_stream(m)";
    if (bytes == flashnorm::dispatch::workspace_bytes(problem, Strategy::kPrenorm, false))
        return "prenorm(m)";
    return std::to_string(bytes);
}

int failures = 0;

void fail(std::string const& what)
{
    if (failures++ == 0)
        std::fprintf(stderr, "%s\n", what.c_str());
}

} // namespace

// `--every-row`: one line per row with its exact workspace bytes (for comparing two builds of the
// policy row by row; the committed table is the default, runs of rows).
int main(int argc, char** argv)
{
    bool const every_row = argc > 1 && std::strcmp(argv[1], "--every-row") == 0;
    std::printf("site,k,splits,statistic,dtype,multiprocessors,epilogue_scale_built,m_from,m_to,strategy,tiles,"
                "workspace,workspace_bytes_at_m_to\n");
    std::vector<int64_t> rows;
    for (int64_t m = 1; m <= kContiguousRows; ++m)
        rows.push_back(m);
    for (int64_t m : kLargeRows)
        rows.push_back(m);
    for (Site const& site : kSites)
    {
        Problem problem{};
        problem.k = site.k;
        problem.split_count = static_cast<int32_t>(site.splits.size());
        std::string splits;
        for (size_t i = 0; i < site.splits.size(); ++i)
        {
            problem.split_sizes[i] = site.splits[i];
            problem.n += site.splits[i];
            splits += (i ? "|" : "") + std::to_string(site.splits[i]);
        }
        for (StatisticName const& statistic : kStatistics)
        {
        if (statistic.statistic == Statistic::kVariance && !site.layer_norm)
            continue;
        problem.statistic = statistic.statistic;
        for (Dtype const& dtype : kDtypes)
        {
            problem.dtype = dtype.dtype;
            for (int multiprocessors : kMultiprocessors)
            {
                for (bool built : {true, false})
                {
                    std::string const prefix = std::string(site.name) + "," + std::to_string(site.k) + "," + splits
                        + "," + statistic.name + "," + dtype.name + "," + std::to_string(multiprocessors) + ","
                        + (built ? "1" : "0");
                    std::string run_pick;
                    int64_t run_from = 0;
                    int64_t previous = 0;
                    size_t previous_bytes = 0;
                    size_t largest_need = 0;
                    auto const flush = [&] {
                        if (run_from > 0)
                            std::printf("%s,%lld,%lld,%s,%zu\n", prefix.c_str(), static_cast<long long>(run_from),
                                static_cast<long long>(previous), run_pick.c_str(), previous_bytes);
                    };
                    for (int64_t m : rows)
                    {
                        problem.m = m;
                        flashnorm::dispatch::Choice const choice
                            = flashnorm::dispatch::choose(problem, multiprocessors, built);
                        std::string tiles = "-";
                        if (choice.strategy == Strategy::kEpilogueScale)
                            tiles = flashnorm::dispatch::epilogue_scale_tiles_name(
                                flashnorm::dispatch::epilogue_scale_tiles(m, problem.k, problem.n, multiprocessors));
                        std::string const pick = std::string(strategy_name(choice.strategy)) + "," + tiles + ","
                            + workspace_rule(problem, choice.workspace_bytes);
                        size_t const need = flashnorm::dispatch::workspace_bytes(problem, choice.strategy, true);
                        largest_need = need > largest_need ? need : largest_need;
                        if (choice.workspace_bytes < largest_need)
                            fail(prefix + ": at " + std::to_string(m) + " rows the workspace ("
                                + std::to_string(choice.workspace_bytes) + " bytes) misses "
                                + std::to_string(largest_need) + " bytes that this row or a smaller one needs");
                        if (every_row)
                            std::printf("%s,%lld,%lld,%s,%zu\n", prefix.c_str(), static_cast<long long>(m),
                                static_cast<long long>(m), pick.c_str(), choice.workspace_bytes);
                        else if (pick != run_pick)
                        {
                            flush();
                            run_pick = pick;
                            run_from = m;
                        }
                        previous = m;
                        previous_bytes = choice.workspace_bytes;
                    }
                    if (!every_row)
                        flush();
                }
            }
        }
        }
    }
    return failures == 0 ? 0 : 1;
}
