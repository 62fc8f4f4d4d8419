/*
 * Exercises libflashnorm_plugin.so exactly as TensorRT sees it: through a plugin registry of a
 * TensorRT runtime library loaded at run time, never by linking to the plugin.
 *
 *   flashnorm_trt_harness --runtime libnvinfer_lean.so.11 --plugin libflashnorm_plugin.so
 *                         [--route loadLibrary|dlopen] [--gpu]
 *
 * CPU part (no GPU needed): the plugin library is registered (loadLibrary → getCreators, or
 * plain dlopen → self-registration), the creator is found exactly once, plugins are created
 * from fields in the build and runtime phases, the build capability answers types and
 * formats, getFieldsToSerialize round-trips through createPlugin, clone keeps the fields, bad
 * fields are refused; the multiprocessors a build records (the current device's) reach the plan,
 * whose plugin asks the workspace the building one asked, and a plan without them gets 132; the
 * statistic field round-trips, and a node or plan written before it (no statistic, two inputs)
 * loads as RMS; the third input (the bias) must be float32 [N].
 *
 * GPU part (--gpu): attachToContext with a dummy resource context, onShapeChange and enqueue
 * on device buffers at SmolLM2-135M's projection shapes (K=576 → q|k|v = 576+192+192 and
 * gate|up = 1536+1536) in fp32/fp16/bf16 and every strategy, checked against a float64 CPU
 * reference; the enqueue captured in a CUDA graph and replayed on fresh inputs; two attached
 * contexts enqueued concurrently on two streams, both checked; plans recorded on 78, 114 and 132
 * multiprocessors enqueued in the workspace each asked for, whatever the device's count; LayerNorm
 * plans (statistic 1, a float32 bias as the third input, rows whose mean is 10 times their spread)
 * in every strategy, checked against a float64 LayerNorm of the same inputs, beside the plans
 * written before the field (no statistic, two inputs), which still compute RMSNorm.
 *
 * Prints one line per check and exits non-zero if any failed.
 */
#include <NvInferRuntime.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace
{
using namespace nvinfer1;

char const* const kNamePrefix = "FlashNormMatMul";
char const* const kVersion = "1";
char const* const kNamespace = "flashnorm";

// The multiprocessors AUTO's boundaries were measured on (an H200's): what a plan serialized before
// the plugin recorded its build device's count had its workspace sized for.
constexpr int32_t kMeasuredMultiprocessors = 132;

int gFailures = 0;
int gChecks = 0;

/* The plugin name for `outputs` outputs: FlashNormMatMul<outputs>. */
std::string nameFor(size_t outputs)
{
    return kNamePrefix + std::to_string(outputs);
}

IPluginCreatorV3One* creatorFor(IPluginRegistry* registry, size_t outputs)
{
    return static_cast<IPluginCreatorV3One*>(registry->getCreator(nameFor(outputs).c_str(), kVersion, kNamespace));
}

bool check(bool ok, std::string const& what)
{
    ++gChecks;
    std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
    std::fflush(stdout);
    if (!ok)
    {
        ++gFailures;
    }
    return ok;
}

/* What TensorRT hands to attachToContext; the plugin uses neither member. */
class DummyResourceContext : public IPluginResourceContext
{
public:
    IGpuAllocator* getGpuAllocator() const noexcept override
    {
        return nullptr;
    }
    IErrorRecorder* getErrorRecorder() const noexcept override
    {
        return nullptr;
    }
};

/* A plugin's fields: a node's (no multiprocessors) or a plan's (with them); without a statistic as
 * nodes and plans were written before the field existed. */
struct Fields
{
    float eps;
    std::vector<int32_t> splits;
    int32_t strategy;
    std::optional<int32_t> multiprocessors;
    std::optional<int32_t> statistic;
    std::vector<PluginField> list;
    PluginFieldCollection collection{};

    Fields(float eps_, std::vector<int32_t> splits_, int32_t strategy_,
        std::optional<int32_t> multiprocessors_ = std::nullopt, std::optional<int32_t> statistic_ = std::nullopt)
        : eps(eps_)
        , splits(std::move(splits_))
        , strategy(strategy_)
        , multiprocessors(multiprocessors_)
        , statistic(statistic_)
    {
        list = {{"eps", &eps, PluginFieldType::kFLOAT32, 1},
            {"splits", splits.data(), PluginFieldType::kINT32, static_cast<int32_t>(splits.size())},
            {"strategy", &strategy, PluginFieldType::kINT32, 1}};
        if (statistic)
        {
            list.push_back({"statistic", &*statistic, PluginFieldType::kINT32, 1});
        }
        if (multiprocessors)
        {
            list.push_back({"multiprocessors", &*multiprocessors, PluginFieldType::kINT32, 1});
        }
        collection = {static_cast<int32_t>(list.size()), list.data()};
    }
};

/* The fields a plugin serializes, read back into comparable values. */
struct SerializedFields
{
    bool ok{false};
    float eps{0};
    std::vector<int32_t> splits;
    int32_t strategy{-1};
    int32_t multiprocessors{-1};
    int32_t statistic{-1};
};

SerializedFields readSerialized(PluginFieldCollection const* fc)
{
    SerializedFields out;
    if (fc == nullptr)
    {
        return out;
    }
    int seen = 0;
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        std::string const name = f.name;
        if (name == "eps" && f.type == PluginFieldType::kFLOAT32 && f.length == 1)
        {
            out.eps = *static_cast<float const*>(f.data);
            ++seen;
        }
        else if (name == "splits" && f.type == PluginFieldType::kINT32)
        {
            auto const* v = static_cast<int32_t const*>(f.data);
            out.splits.assign(v, v + f.length);
            ++seen;
        }
        else if (name == "strategy" && f.type == PluginFieldType::kINT32 && f.length == 1)
        {
            out.strategy = *static_cast<int32_t const*>(f.data);
            ++seen;
        }
        else if (name == "multiprocessors" && f.type == PluginFieldType::kINT32 && f.length == 1)
        {
            out.multiprocessors = *static_cast<int32_t const*>(f.data);
            ++seen;
        }
        else if (name == "statistic" && f.type == PluginFieldType::kINT32 && f.length == 1)
        {
            out.statistic = *static_cast<int32_t const*>(f.data);
            ++seen;
        }
    }
    out.ok = seen == 5;
    return out;
}

/* The serialized fields are `want`'s (its multiprocessors where it has them; its statistic, RMS
 * where it has none). */
bool sameFields(SerializedFields const& got, Fields const& want)
{
    return got.ok && got.eps == want.eps && got.splits == want.splits && got.strategy == want.strategy
        && (!want.multiprocessors || got.multiprocessors == *want.multiprocessors)
        && got.statistic == want.statistic.value_or(0);
}

/* What a plugin serializes. */
SerializedFields serializedBy(IPluginV3* plugin)
{
    auto* runtime = plugin == nullptr ? nullptr
                                      : static_cast<IPluginV3OneRuntime*>(
                                          plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    return runtime == nullptr ? SerializedFields{} : readSerialized(runtime->getFieldsToSerialize());
}

/* The current device's multiprocessors, or the measured count where no device answers (the count a
 * build records). */
int32_t currentMultiprocessors()
{
    int device = 0;
    int count = 0;
    if (cudaGetDevice(&device) != cudaSuccess
        || cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count < 1)
    {
        cudaGetLastError();
        return kMeasuredMultiprocessors;
    }
    return count;
}

template <typename T>
T* capability(IPluginV3* plugin, PluginCapabilityType type)
{
    return plugin == nullptr ? nullptr : static_cast<T*>(plugin->getCapabilityInterface(type));
}

Dims makeDims(std::vector<int64_t> const& values)
{
    Dims dims{};
    dims.nbDims = static_cast<int32_t>(values.size());
    for (size_t i = 0; i < values.size(); ++i)
    {
        dims.d[i] = values[i];
    }
    return dims;
}

PluginTensorDesc makeDesc(std::vector<int64_t> const& dims, DataType type)
{
    PluginTensorDesc desc{};
    desc.dims = makeDims(dims);
    desc.type = type;
    desc.format = TensorFormat::kLINEAR;
    desc.scale = 1.0F;
    return desc;
}

DynamicPluginTensorDesc makeDynamic(std::vector<int64_t> const& dims, DataType type)
{
    DynamicPluginTensorDesc d{};
    d.desc = makeDesc(dims, type);
    d.min = d.opt = d.max = d.desc.dims;
    return d;
}

/* The workspace `plugin` asks for SmolLM2-135M's gate|up (K = 576, 1536 + 1536) in fp16 on
 * x[1, rows, 576]: where AUTO's pick depends on the multiprocessors (the fused kernel, no workspace,
 * to 16 rows on 78 of them; the epilogue-scale GEMM from 9 rows on 132, in builds with CUTLASS). */
size_t gateUpWorkspace(IPluginV3* plugin, int64_t rows)
{
    auto* build = capability<IPluginV3OneBuild>(plugin, PluginCapabilityType::kBUILD);
    std::vector<DynamicPluginTensorDesc> in
        = {makeDynamic({1, rows, 576}, DataType::kHALF), makeDynamic({576, 3072}, DataType::kHALF)};
    std::vector<DynamicPluginTensorDesc> out
        = {makeDynamic({1, rows, 1536}, DataType::kHALF), makeDynamic({1, rows, 1536}, DataType::kHALF)};
    return build == nullptr ? 0 : build->getWorkspaceSize(in.data(), 2, out.data(), 2);
}

/* ------------------------------------------------------------------------------------ CPU */

void cpuChecks(IPluginRegistry* registry)
{
    int32_t nbCreators = 0;
    IPluginCreatorInterface* const* all = registry->getAllCreators(&nbCreators);
    bool eachOnce = true;
    for (size_t outputs = 1; outputs <= 8; ++outputs)
    {
        int copies = 0;
        for (int32_t i = 0; i < nbCreators; ++i)
        {
            auto* c = static_cast<IPluginCreatorV3One*>(all[i]);
            if (std::string(all[i]->getInterfaceInfo().kind) == "PLUGIN CREATOR_V3ONE"
                && std::string(c->getPluginName()) == nameFor(outputs) && std::string(c->getPluginNamespace()) == kNamespace)
            {
                ++copies;
            }
        }
        eachOnce = eachOnce && copies == 1;
    }
    check(eachOnce, "registry holds each of FlashNormMatMul1..8 exactly once");

    IPluginCreatorInterface* found = creatorFor(registry, 3);
    if (!check(found != nullptr, "getCreator(FlashNormMatMul3, 1, flashnorm)"))
    {
        return;
    }
    check(std::string(found->getInterfaceInfo().kind) == "PLUGIN CREATOR_V3ONE", "creator is an IPluginCreatorV3One");
    auto* creator = static_cast<IPluginCreatorV3One*>(found);

    PluginFieldCollection const* names = creator->getFieldNames();
    bool fieldsOk = names != nullptr && names->nbFields == 4;
    if (fieldsOk)
    {
        fieldsOk = std::string(names->fields[0].name) == "eps" && names->fields[0].type == PluginFieldType::kFLOAT32
            && std::string(names->fields[1].name) == "splits" && names->fields[1].type == PluginFieldType::kINT32
            && std::string(names->fields[2].name) == "strategy" && names->fields[2].type == PluginFieldType::kINT32
            && std::string(names->fields[3].name) == "statistic" && names->fields[3].type == PluginFieldType::kINT32;
    }
    check(fieldsOk,
        "getFieldNames = eps FLOAT32, splits INT32, strategy INT32, statistic INT32 (multiprocessors is recorded, "
        "not declared)");

    Fields qkv(1e-5F, {576, 192, 192}, 1, 114, 1);
    for (TensorRTPhase phase : {TensorRTPhase::kBUILD, TensorRTPhase::kRUNTIME})
    {
        char const* phaseName = phase == TensorRTPhase::kBUILD ? "build" : "runtime";
        std::unique_ptr<IPluginV3> plugin(creator->createPlugin("layer0.qkv", &qkv.collection, phase));
        if (!check(plugin != nullptr, std::string("createPlugin from fields, ") + phaseName + " phase"))
        {
            continue;
        }
        auto* core = capability<IPluginV3OneCore>(plugin.get(), PluginCapabilityType::kCORE);
        auto* build = capability<IPluginV3OneBuild>(plugin.get(), PluginCapabilityType::kBUILD);
        auto* runtime = capability<IPluginV3OneRuntime>(plugin.get(), PluginCapabilityType::kRUNTIME);
        check(core != nullptr && build != nullptr && runtime != nullptr,
            std::string("core, build and runtime capabilities present, ") + phaseName);
        if (core == nullptr || build == nullptr || runtime == nullptr)
        {
            continue;
        }
        check(std::string(core->getPluginName()) == nameFor(3) && std::string(core->getPluginVersion()) == kVersion
                && std::string(core->getPluginNamespace()) == kNamespace,
            "core reports name FlashNormMatMul3, version 1, namespace flashnorm");
        check(build->getNbOutputs() == 3, "getNbOutputs = 3 for splits 576,192,192");

        for (DataType type : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
        {
            DataType in[2] = {type, type};
            DataType out[3] = {DataType::kINT8, DataType::kINT8, DataType::kINT8};
            bool ok = build->getOutputDataTypes(out, 3, in, 2) == 0 && out[0] == type && out[1] == type && out[2] == type;
            check(ok, "getOutputDataTypes passes type " + std::to_string(static_cast<int>(type)) + " through");
        }
        {
            DataType in[2] = {DataType::kHALF, DataType::kFLOAT};
            DataType out[3];
            check(build->getOutputDataTypes(out, 3, in, 2) != 0, "getOutputDataTypes refuses x fp16 with W fp32");
        }
        {
            std::vector<DynamicPluginTensorDesc> io = {makeDynamic({1, 8, 576}, DataType::kHALF),
                makeDynamic({576, 960}, DataType::kHALF), makeDynamic({1, 8, 576}, DataType::kHALF),
                makeDynamic({1, 8, 192}, DataType::kHALF), makeDynamic({1, 8, 192}, DataType::kHALF)};
            bool all = true;
            for (int32_t pos = 0; pos < 5; ++pos)
            {
                all = all && build->supportsFormatCombination(pos, io.data(), 2, 3);
            }
            check(all, "supportsFormatCombination accepts fp16 linear x, W and outputs");
            io[1].desc.type = DataType::kFLOAT;
            check(!build->supportsFormatCombination(1, io.data(), 2, 3), "supportsFormatCombination refuses W of another type");
            io[0].desc.type = DataType::kINT8;
            check(!build->supportsFormatCombination(0, io.data(), 2, 3), "supportsFormatCombination refuses int8 x");
            io[0].desc.type = DataType::kHALF;
            io[0].desc.format = TensorFormat::kCHW32;
            check(!build->supportsFormatCombination(0, io.data(), 2, 3), "supportsFormatCombination refuses non-linear formats");
        }
        {
            std::vector<DynamicPluginTensorDesc> in = {makeDynamic({4, 2048, 576}, DataType::kBF16), makeDynamic({576, 960}, DataType::kBF16)};
            std::vector<DynamicPluginTensorDesc> out = {makeDynamic({4, 2048, 576}, DataType::kBF16),
                makeDynamic({4, 2048, 192}, DataType::kBF16), makeDynamic({4, 2048, 192}, DataType::kBF16)};
            check(build->configurePlugin(in.data(), 2, out.data(), 3) == 0, "configurePlugin accepts x[4,2048,576], W[576,960]");
            size_t const ws = build->getWorkspaceSize(in.data(), 2, out.data(), 3);
            std::printf("INFO workspace for M=8192, K=576, N=960 bf16: %zu bytes\n", ws);
            in[1] = makeDynamic({512, 960}, DataType::kBF16);
            check(build->configurePlugin(in.data(), 2, out.data(), 3) != 0, "configurePlugin refuses K mismatch (576 vs 512)");
        }
        {
            // The third input: the bias, float32 [N], whatever x's type.
            DataType types[3] = {DataType::kHALF, DataType::kHALF, DataType::kFLOAT};
            DataType out[3] = {DataType::kINT8, DataType::kINT8, DataType::kINT8};
            check(build->getOutputDataTypes(out, 3, types, 3) == 0 && out[0] == DataType::kHALF && out[2] == DataType::kHALF,
                "getOutputDataTypes takes x, W and an fp32 bias");
            types[2] = DataType::kHALF;
            check(build->getOutputDataTypes(out, 3, types, 3) != 0, "getOutputDataTypes refuses an fp16 bias");
            std::vector<DynamicPluginTensorDesc> io = {makeDynamic({1, 8, 576}, DataType::kBF16),
                makeDynamic({576, 960}, DataType::kBF16), makeDynamic({960}, DataType::kFLOAT),
                makeDynamic({1, 8, 576}, DataType::kBF16), makeDynamic({1, 8, 192}, DataType::kBF16),
                makeDynamic({1, 8, 192}, DataType::kBF16)};
            bool all = true;
            for (int32_t pos = 0; pos < 6; ++pos)
            {
                all = all && build->supportsFormatCombination(pos, io.data(), 3, 3);
            }
            check(all, "supportsFormatCombination accepts bf16 x, W and outputs with an fp32 bias");
            io[2].desc.type = DataType::kBF16;
            check(!build->supportsFormatCombination(2, io.data(), 3, 3), "supportsFormatCombination refuses a bf16 bias");
            io[2].desc.type = DataType::kFLOAT;
            io[3].desc.type = DataType::kFLOAT;
            check(!build->supportsFormatCombination(3, io.data(), 3, 3),
                "supportsFormatCombination refuses an fp32 output beside bf16 x (the bias's type is its own)");
            std::vector<DynamicPluginTensorDesc> in = {makeDynamic({2, 64, 576}, DataType::kBF16),
                makeDynamic({576, 960}, DataType::kBF16), makeDynamic({960}, DataType::kFLOAT)};
            std::vector<DynamicPluginTensorDesc> outs = {makeDynamic({2, 64, 576}, DataType::kBF16),
                makeDynamic({2, 64, 192}, DataType::kBF16), makeDynamic({2, 64, 192}, DataType::kBF16)};
            check(build->configurePlugin(in.data(), 3, outs.data(), 3) == 0, "configurePlugin accepts a bias [960]");
            check(build->getWorkspaceSize(in.data(), 3, outs.data(), 3) == build->getWorkspaceSize(in.data(), 2, outs.data(), 3),
                "the bias moves no workspace");
            in[2] = makeDynamic({961}, DataType::kFLOAT);
            check(build->configurePlugin(in.data(), 3, outs.data(), 3) != 0, "configurePlugin refuses a bias [961]");
        }

        SerializedFields serialized = readSerialized(runtime->getFieldsToSerialize());
        check(sameFields(serialized, qkv),
            std::string("getFieldsToSerialize returns eps, splits, strategy, statistic, multiprocessors as given, ")
                + phaseName);
        Fields again(
            serialized.eps, serialized.splits, serialized.strategy, serialized.multiprocessors, serialized.statistic);
        std::unique_ptr<IPluginV3> restored(creator->createPlugin("layer0.qkv", &again.collection, TensorRTPhase::kRUNTIME));
        check(restored != nullptr
                && sameFields(readSerialized(capability<IPluginV3OneRuntime>(restored.get(), PluginCapabilityType::kRUNTIME)
                                                 ->getFieldsToSerialize()),
                    qkv),
            "serialized fields round-trip through createPlugin(kRUNTIME)");

        std::unique_ptr<IPluginV3> cloned(plugin->clone());
        check(cloned != nullptr
                && sameFields(readSerialized(capability<IPluginV3OneRuntime>(cloned.get(), PluginCapabilityType::kRUNTIME)
                                                 ->getFieldsToSerialize()),
                    qkv),
            std::string("clone keeps the fields, ") + phaseName);
    }

    {
        // Parser-style fields without the optional strategy: accepted with strategy 0 (auto).
        float eps = 1e-6F;
        int32_t splits[2] = {1536, 1536};
        PluginField list[2] = {{"eps", &eps, PluginFieldType::kFLOAT32, 1}, {"splits", splits, PluginFieldType::kINT32, 2}};
        PluginFieldCollection fc{2, list};
        std::unique_ptr<IPluginV3> plugin(creatorFor(registry, 2)->createPlugin("layer0.mlp", &fc, TensorRTPhase::kBUILD));
        SerializedFields s = plugin ? readSerialized(capability<IPluginV3OneRuntime>(plugin.get(), PluginCapabilityType::kRUNTIME)
                                                         ->getFieldsToSerialize())
                                    : SerializedFields{};
        check(s.ok && s.strategy == 0 && s.splits == std::vector<int32_t>{1536, 1536} && s.eps == eps,
            "strategy is optional and defaults to 0 (auto)");
        check(s.ok && s.statistic == 0, "statistic is optional and defaults to 0 (RMS)");
    }
    {
        // A plan serialized before the statistic existed: eps, splits, strategy and multiprocessors.
        Fields old(1e-5F, {576, 192, 192}, 0, 132);
        std::unique_ptr<IPluginV3> plugin(creator->createPlugin("layer0.qkv", &old.collection, TensorRTPhase::kRUNTIME));
        SerializedFields const s = serializedBy(plugin.get());
        check(s.ok && s.statistic == 0 && s.multiprocessors == 132,
            "a plan written before the statistic field loads, computing RMS (statistic 0)");
        Fields badStatistic(1e-5F, {576, 192, 192}, 0, std::nullopt, 2);
        std::unique_ptr<IPluginV3> refused(creator->createPlugin("statistic", &badStatistic.collection, TensorRTPhase::kBUILD));
        check(refused == nullptr, "createPlugin refuses statistic 2");
    }
    {
        float eps = 1e-5F;
        int64_t splits64[2] = {1536, 1536};
        PluginField list[2] = {{"eps", &eps, PluginFieldType::kFLOAT32, 1}, {"splits", splits64, PluginFieldType::kINT64, 2}};
        PluginFieldCollection fc{2, list};
        std::unique_ptr<IPluginV3> plugin(creatorFor(registry, 2)->createPlugin("int64", &fc, TensorRTPhase::kBUILD));
        check(plugin != nullptr, "INT64 splits (Python-built fields) are accepted");
    }
    {
        // A node's fields hold no multiprocessors: a build records the current device's, and a plan
        // serialized before the plugin recorded them gets the count its workspace was sized for.
        Fields node(1e-6F, {1536, 1536}, 0);
        std::unique_ptr<IPluginV3> built(creatorFor(registry, 2)->createPlugin("layer0.mlp", &node.collection, TensorRTPhase::kBUILD));
        int32_t const device = currentMultiprocessors();
        check(serializedBy(built.get()).multiprocessors == device,
            "a build records the current device's multiprocessors (" + std::to_string(device) + ")");
        std::unique_ptr<IPluginV3> old(creatorFor(registry, 2)->createPlugin("layer0.mlp", &node.collection, TensorRTPhase::kRUNTIME));
        check(serializedBy(old.get()).multiprocessors == kMeasuredMultiprocessors,
            "a plan without multiprocessors picks for the 132 its workspace was sized for");
    }
    {
        // Builds on devices of 78, 114 and 132 multiprocessors: each plan's plugin (made from the
        // fields the build serialized, runtime phase) asks the workspace the building plugin asked.
        bool same = true;
        for (int32_t recorded : {78, 114, 132})
        {
            Fields build(1e-6F, {1536, 1536}, 0, recorded);
            std::unique_ptr<IPluginV3> built(creatorFor(registry, 2)->createPlugin("layer0.mlp", &build.collection, TensorRTPhase::kBUILD));
            SerializedFields const serialized = serializedBy(built.get());
            Fields plan(
                serialized.eps, serialized.splits, serialized.strategy, serialized.multiprocessors, serialized.statistic);
            std::unique_ptr<IPluginV3> restored(creatorFor(registry, 2)->createPlugin("layer0.mlp", &plan.collection, TensorRTPhase::kRUNTIME));
            same = same && built != nullptr && restored != nullptr;
            for (int64_t rows : {9, 16, 64, 320})
            {
                same = same && gateUpWorkspace(built.get(), rows) == gateUpWorkspace(restored.get(), rows);
            }
            std::printf("INFO workspace for SmolLM2 gate|up fp16 at 16 rows, %d multiprocessors recorded: %zu bytes\n",
                recorded, built ? gateUpWorkspace(built.get(), 16) : 0);
        }
        check(same, "builds recording 78, 114 and 132 multiprocessors: each plan's plugin asks the building plugin's workspace");
    }
    {
        float eps = 1e-5F;
        PluginField list[1] = {{"eps", &eps, PluginFieldType::kFLOAT32, 1}};
        PluginFieldCollection fc{1, list};
        std::unique_ptr<IPluginV3> plugin(creator->createPlugin("nosplits", &fc, TensorRTPhase::kBUILD));
        check(plugin == nullptr, "createPlugin refuses missing splits");
    }
    {
        Fields bad(1e-5F, {576, 0, 192}, 0);
        std::unique_ptr<IPluginV3> plugin(creator->createPlugin("zero", &bad.collection, TensorRTPhase::kBUILD));
        check(plugin == nullptr, "createPlugin refuses a zero split");
        Fields badStrategy(1e-5F, {576}, 7);
        std::unique_ptr<IPluginV3> plugin2(creatorFor(registry, 1)->createPlugin("strategy", &badStrategy.collection, TensorRTPhase::kBUILD));
        check(plugin2 == nullptr, "createPlugin refuses strategy 7");
        Fields negativeEps(-1.0F, {576}, 0);
        std::unique_ptr<IPluginV3> plugin3(creatorFor(registry, 1)->createPlugin("eps", &negativeEps.collection, TensorRTPhase::kBUILD));
        check(plugin3 == nullptr, "createPlugin refuses a negative eps");
        Fields twoSplits(1e-5F, {576, 192}, 0);
        std::unique_ptr<IPluginV3> plugin4(creator->createPlugin("arity", &twoSplits.collection, TensorRTPhase::kBUILD));
        check(plugin4 == nullptr, "FlashNormMatMul3 refuses splits of 2 sizes");
        for (int32_t multiprocessors : {0, -8})
        {
            Fields badMultiprocessors(1e-5F, {576}, 0, multiprocessors);
            std::unique_ptr<IPluginV3> plugin5(creatorFor(registry, 1)->createPlugin("multiprocessors", &badMultiprocessors.collection, TensorRTPhase::kRUNTIME));
            check(plugin5 == nullptr, "createPlugin refuses multiprocessors " + std::to_string(multiprocessors));
        }
    }
}

/* ------------------------------------------------------------------------------------ GPU */

#define CUDA_OK(call) cudaOk((call), #call, __LINE__)
bool cudaOk(cudaError_t status, char const* what, int line)
{
    if (status != cudaSuccess)
    {
        std::printf("FAIL CUDA %s at line %d: %s\n", what, line, cudaGetErrorString(status));
        ++gFailures;
        return false;
    }
    return true;
}

size_t elementSize(DataType type)
{
    return type == DataType::kFLOAT ? 4 : 2;
}

char const* typeName(DataType type)
{
    return type == DataType::kFLOAT ? "fp32" : type == DataType::kHALF ? "fp16" : "bf16";
}

/* Rounds to `type` on the host and returns both the device bytes and the rounded values. */
std::vector<uint8_t> encode(std::vector<double>& values, DataType type)
{
    std::vector<uint8_t> bytes(values.size() * elementSize(type));
    for (size_t i = 0; i < values.size(); ++i)
    {
        if (type == DataType::kFLOAT)
        {
            float v = static_cast<float>(values[i]);
            std::memcpy(&bytes[i * 4], &v, 4);
            values[i] = v;
        }
        else if (type == DataType::kHALF)
        {
            __half h = __float2half_rn(static_cast<float>(values[i]));
            std::memcpy(&bytes[i * 2], &h, 2);
            values[i] = __half2float(h);
        }
        else
        {
            __nv_bfloat16 b = __float2bfloat16_rn(static_cast<float>(values[i]));
            std::memcpy(&bytes[i * 2], &b, 2);
            values[i] = __bfloat162float(b);
        }
    }
    return bytes;
}

double decode(uint8_t const* bytes, size_t i, DataType type)
{
    if (type == DataType::kFLOAT)
    {
        float v;
        std::memcpy(&v, bytes + i * 4, 4);
        return v;
    }
    if (type == DataType::kHALF)
    {
        __half h;
        std::memcpy(&h, bytes + i * 2, 2);
        return __half2float(h);
    }
    __nv_bfloat16 b;
    std::memcpy(&b, bytes + i * 2, 2);
    return __bfloat162float(b);
}

/* max |y − ref| / max |ref| per output; the tolerance covers the output rounding of the type
 * plus fp32 accumulation (and TF32-free fp32 GEMMs). */
double tolerance(DataType type)
{
    return type == DataType::kFLOAT ? 1e-4 : type == DataType::kHALF ? 4e-3 : 2e-2;
}

struct Problem
{
    int64_t m;
    int64_t k;
    std::vector<int32_t> splits;
    DataType type;
    float eps;
    // LayerNorm: the statistic field 1, a float32 bias as the third input, rows whose mean is `mean`
    // times their spread. Otherwise a plan as written before the field: no statistic, two inputs.
    bool layer_norm = false;
    double mean = 0.0;
    int64_t n() const
    {
        int64_t total = 0;
        for (int32_t s : splits)
        {
            total += s;
        }
        return total;
    }
};

/* Device buffers and the float64 reference for one problem instance. */
struct Instance
{
    Problem p;
    std::vector<double> x, w, bias;
    void* dX{nullptr};
    void* dW{nullptr};
    void* dBias{nullptr};
    std::vector<void*> dY;
    void* dWorkspace{nullptr};

    explicit Instance(Problem problem)
        : p(std::move(problem))
    {
    }
    ~Instance()
    {
        cudaFree(dX);
        cudaFree(dW);
        cudaFree(dBias);
        for (void* y : dY)
        {
            cudaFree(y);
        }
        cudaFree(dWorkspace);
    }

    bool allocate(size_t workspace)
    {
        size_t const es = elementSize(p.type);
        bool ok = CUDA_OK(cudaMalloc(&dX, p.m * p.k * es)) && CUDA_OK(cudaMalloc(&dW, p.k * p.n() * es));
        for (int32_t s : p.splits)
        {
            void* y = nullptr;
            ok = ok && CUDA_OK(cudaMalloc(&y, p.m * s * es));
            dY.push_back(y);
        }
        ok = ok && CUDA_OK(cudaMalloc(&dWorkspace, workspace > 0 ? workspace : 1));
        ok = ok && (!p.layer_norm || CUDA_OK(cudaMalloc(&dBias, p.n() * sizeof(float))));
        return ok;
    }

    /* Fresh random x (never zeros: rows have a random scale, values in ±[0.05, 1]). */
    bool uploadX(std::mt19937_64& rng)
    {
        std::uniform_real_distribution<double> mag(0.05, 1.0);
        std::uniform_real_distribution<double> rowScale(0.25, 4.0);
        std::bernoulli_distribution sign(0.5);
        x.resize(p.m * p.k);
        for (int64_t r = 0; r < p.m; ++r)
        {
            double const s = rowScale(rng);
            double const mean = (r % 2 ? -p.mean : p.mean) * s;
            for (int64_t c = 0; c < p.k; ++c)
            {
                x[r * p.k + c] = mean + s * mag(rng) * (sign(rng) ? 1 : -1);
            }
        }
        std::vector<uint8_t> bytes = encode(x, p.type);
        return CUDA_OK(cudaMemcpy(dX, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
    }

    bool uploadW(std::mt19937_64& rng)
    {
        std::normal_distribution<double> normal(0.0, 1.0 / std::sqrt(static_cast<double>(p.k)));
        w.resize(p.k * p.n());
        for (double& v : w)
        {
            v = normal(rng);
        }
        std::vector<uint8_t> bytes = encode(w, p.type);
        if (!CUDA_OK(cudaMemcpy(dW, bytes.data(), bytes.size(), cudaMemcpyHostToDevice)))
        {
            return false;
        }
        if (!p.layer_norm)
        {
            return true;
        }
        // LayerNorm's W is centred (the fold does it): each column minus its mean, so that
        // x·W = (x − mean x)·W and the result is LayerNorm's; the bias ~ N(0, 1) in fp32.
        for (int64_t j = 0; j < p.n(); ++j)
        {
            double mean = 0;
            for (int64_t c = 0; c < p.k; ++c)
            {
                mean += w[c * p.n() + j];
            }
            mean /= static_cast<double>(p.k);
            for (int64_t c = 0; c < p.k; ++c)
            {
                w[c * p.n() + j] -= mean;
            }
        }
        bytes = encode(w, p.type);
        std::normal_distribution<double> unit(0.0, 1.0);
        bias.resize(p.n());
        std::vector<float> values(p.n());
        for (int64_t j = 0; j < p.n(); ++j)
        {
            values[j] = static_cast<float>(unit(rng));
            bias[j] = values[j];
        }
        return CUDA_OK(cudaMemcpy(dW, bytes.data(), bytes.size(), cudaMemcpyHostToDevice))
            && CUDA_OK(cudaMemcpy(dBias, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice));
    }

    /* Worst relative error over all outputs against (x·W)·s + bias in float64, s = rsqrt(mean(x²)+eps)
     * or (LayerNorm) rsqrt(mean((x − mean x)²)+eps). */
    double error()
    {
        int64_t const n = p.n();
        std::vector<double> ref(p.m * n, 0.0);
        for (int64_t r = 0; r < p.m; ++r)
        {
            double mean = 0;
            if (p.layer_norm)
            {
                for (int64_t c = 0; c < p.k; ++c)
                {
                    mean += x[r * p.k + c];
                }
                mean /= static_cast<double>(p.k);
            }
            double ss = 0;
            for (int64_t c = 0; c < p.k; ++c)
            {
                ss += (x[r * p.k + c] - mean) * (x[r * p.k + c] - mean);
            }
            double const inv = 1.0 / std::sqrt(ss / static_cast<double>(p.k) + static_cast<double>(p.eps));
            double* row = &ref[r * n];
            for (int64_t c = 0; c < p.k; ++c)
            {
                double const xv = x[r * p.k + c];
                double const* wr = &w[c * n];
                for (int64_t j = 0; j < n; ++j)
                {
                    row[j] += xv * wr[j];
                }
            }
            for (int64_t j = 0; j < n; ++j)
            {
                row[j] = row[j] * inv + (p.layer_norm ? bias[j] : 0.0);
            }
        }
        double worst = 0;
        int64_t offset = 0;
        for (size_t o = 0; o < p.splits.size(); ++o)
        {
            int64_t const width = p.splits[o];
            std::vector<uint8_t> bytes(p.m * width * elementSize(p.type));
            if (!CUDA_OK(cudaMemcpy(bytes.data(), dY[o], bytes.size(), cudaMemcpyDeviceToHost)))
            {
                return INFINITY;
            }
            double maxRef = 0, maxDiff = 0;
            for (int64_t r = 0; r < p.m; ++r)
            {
                for (int64_t j = 0; j < width; ++j)
                {
                    double const want = ref[r * n + offset + j];
                    double const got = decode(bytes.data(), r * width + j, p.type);
                    maxRef = std::max(maxRef, std::fabs(want));
                    maxDiff = std::max(maxDiff, std::isfinite(got) ? std::fabs(got - want) : INFINITY);
                }
            }
            worst = std::max(worst, maxRef > 0 ? maxDiff / maxRef : maxDiff);
            offset += width;
        }
        return worst;
    }
};

/* A plugin attached to its own (dummy) execution context, shaped for one problem. */
struct Attached
{
    std::unique_ptr<IPluginV3> plugin;
    IPluginV3OneRuntime* runtime{nullptr};
    size_t workspace{0};
    std::vector<PluginTensorDesc> in, out;
};

/* A plan's plugin, attached: made from a plan's fields (`multiprocessors` recorded, or none as in a
 * plan serialized before the plugin recorded them). */
bool attach(IPluginRegistry* registry, Problem const& p, int32_t strategy, DummyResourceContext& context, Attached& a,
    std::optional<int32_t> multiprocessors = std::nullopt)
{
    Fields fields(p.eps, p.splits, strategy, multiprocessors,
        p.layer_norm ? std::optional<int32_t>(1) : std::nullopt);
    IPluginCreatorV3One* creator = creatorFor(registry, p.splits.size());
    if (creator == nullptr)
    {
        return false;
    }
    std::unique_ptr<IPluginV3> base(creator->createPlugin("harness", &fields.collection, TensorRTPhase::kRUNTIME));
    if (base == nullptr)
    {
        return false;
    }
    auto* baseRuntime = capability<IPluginV3OneRuntime>(base.get(), PluginCapabilityType::kRUNTIME);
    a.plugin.reset(baseRuntime->attachToContext(&context));
    if (a.plugin == nullptr)
    {
        return false;
    }
    a.runtime = capability<IPluginV3OneRuntime>(a.plugin.get(), PluginCapabilityType::kRUNTIME);
    // x as [1, M, K], the layout of a prefill/decode activation; LayerNorm's bias [N] as the third input.
    std::vector<DynamicPluginTensorDesc> din = {makeDynamic({1, p.m, p.k}, p.type), makeDynamic({p.k, p.n()}, p.type)};
    if (p.layer_norm)
    {
        din.push_back(makeDynamic({p.n()}, DataType::kFLOAT));
    }
    std::vector<DynamicPluginTensorDesc> dout;
    for (int32_t s : p.splits)
    {
        dout.push_back(makeDynamic({1, p.m, s}, p.type));
    }
    auto* build = capability<IPluginV3OneBuild>(base.get(), PluginCapabilityType::kBUILD);
    int32_t const inputs = static_cast<int32_t>(din.size());
    a.workspace = build->getWorkspaceSize(din.data(), inputs, dout.data(), static_cast<int32_t>(dout.size()));
    for (auto const& d : din)
    {
        a.in.push_back(d.desc);
    }
    for (auto const& d : dout)
    {
        a.out.push_back(d.desc);
    }
    return a.runtime->onShapeChange(a.in.data(), inputs, a.out.data(), static_cast<int32_t>(a.out.size())) == 0;
}

int32_t enqueue(Attached& a, Instance& inst, cudaStream_t stream)
{
    void const* inputs[3] = {inst.dX, inst.dW, inst.dBias};
    return a.runtime->enqueue(a.in.data(), a.out.data(), inputs, inst.dY.data(), inst.dWorkspace, stream);
}

std::string label(Problem const& p, int32_t strategy)
{
    std::string splits;
    for (int32_t s : p.splits)
    {
        splits += (splits.empty() ? "" : "+") + std::to_string(s);
    }
    return std::string(typeName(p.type)) + " M=" + std::to_string(p.m) + " K=" + std::to_string(p.k) + " N=" + splits
        + " strategy=" + std::to_string(strategy)
        + (p.layer_norm ? " LayerNorm (statistic 1, fp32 bias, mean " + std::to_string(int(p.mean)) + "x spread)"
                        : " RMS plan written before the statistic (two inputs)");
}

void gpuChecks(IPluginRegistry* registry, std::mt19937_64& rng)
{
    int device = 0;
    cudaDeviceProp prop{};
    if (!CUDA_OK(cudaGetDevice(&device)) || !CUDA_OK(cudaGetDeviceProperties(&prop, device)))
    {
        return;
    }
    std::printf("INFO device %d: %s, sm_%d%d\n", device, prop.name, prop.major, prop.minor);
    DummyResourceContext context;
    cudaStream_t stream = nullptr;
    if (!CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)))
    {
        return;
    }

    std::vector<std::vector<int32_t>> const shapes = {{576, 192, 192}, {1536, 1536}};
    // Every strategy on decode and small-batch rows; auto and two-stream on prefill rows.
    struct Case
    {
        int64_t m;
        std::vector<int32_t> strategies;
    };
    std::vector<Case> const cases = {{1, {0, 1, 2, 3}}, {8, {0, 1, 2, 3}}, {77, {0, 1, 3}}, {512, {0, 1, 3}}};
    for (DataType type : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
    {
        for (auto const& splits : shapes)
        {
            for (Case const& c : cases)
            {
                for (int32_t strategy : c.strategies)
                {
                    Problem p{c.m, 576, splits, type, 1e-5F};
                    Attached a;
                    if (!check(attach(registry, p, strategy, context, a), "attachToContext + onShapeChange " + label(p, strategy)))
                    {
                        continue;
                    }
                    Instance inst(p);
                    if (!inst.allocate(a.workspace) || !inst.uploadW(rng) || !inst.uploadX(rng))
                    {
                        continue;
                    }
                    int32_t const rc = enqueue(a, inst, stream);
                    bool const synced = CUDA_OK(cudaStreamSynchronize(stream));
                    double const err = (rc == 0 && synced) ? inst.error() : INFINITY;
                    char buf[64];
                    std::snprintf(buf, sizeof buf, " rel err %.3g (tol %.0e)", err, tolerance(type));
                    check(rc == 0 && err < tolerance(type), "enqueue " + label(p, strategy) + buf);
                }
            }
        }
    }

    // LayerNorm plans: the statistic field and the bias input, every strategy, decode to prefill rows.
    std::vector<Case> const layerNormCases = {{1, {0, 1, 2, 3}}, {8, {0, 1, 2, 3}}, {77, {0, 1, 3}}, {512, {0, 1, 3}}};
    for (DataType type : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
    {
        for (Case const& c : layerNormCases)
        {
            for (int32_t strategy : c.strategies)
            {
                Problem p{c.m, 768, {768, 768, 768}, type, 1e-6F, true, 10.0};
                Attached a;
                if (!check(attach(registry, p, strategy, context, a), "attachToContext + onShapeChange " + label(p, strategy)))
                {
                    continue;
                }
                Instance inst(p);
                if (!inst.allocate(a.workspace) || !inst.uploadW(rng) || !inst.uploadX(rng))
                {
                    continue;
                }
                int32_t const rc = enqueue(a, inst, stream);
                bool const synced = CUDA_OK(cudaStreamSynchronize(stream));
                double const err = (rc == 0 && synced) ? inst.error() : INFINITY;
                char buf[64];
                std::snprintf(buf, sizeof buf, " rel err %.3g (tol %.0e)", err, tolerance(type));
                check(rc == 0 && err < tolerance(type), "enqueue " + label(p, strategy) + buf);
            }
        }
    }

    // CUDA graph: warm-up enqueue, capture (thread-local mode, as trtexec and Triton do),
    // then replay on inputs uploaded after capture.
    for (int32_t strategy : {0, 1, 2, 3})
    {
        Problem p{strategy == 2 ? 4 : 64, 576, {576, 192, 192}, DataType::kHALF, 1e-5F};
        Attached a;
        if (!check(attach(registry, p, strategy, context, a), "attach for graph capture " + label(p, strategy)))
        {
            continue;
        }
        Instance inst(p);
        if (!inst.allocate(a.workspace) || !inst.uploadW(rng) || !inst.uploadX(rng))
        {
            continue;
        }
        bool ok = enqueue(a, inst, stream) == 0 && CUDA_OK(cudaStreamSynchronize(stream));
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        ok = ok && CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        int32_t const rc = ok ? enqueue(a, inst, stream) : 1;
        bool const ended = ok && CUDA_OK(cudaStreamEndCapture(stream, &graph));
        ok = ok && rc == 0 && ended && CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        check(ok, "enqueue captured into a CUDA graph " + label(p, strategy));
        if (ok)
        {
            bool replayOk = true;
            double worst = 0;
            for (int replay = 0; replay < 3 && replayOk; ++replay)
            {
                replayOk = inst.uploadX(rng) && CUDA_OK(cudaGraphLaunch(exec, stream)) && CUDA_OK(cudaStreamSynchronize(stream));
                worst = std::max(worst, replayOk ? inst.error() : INFINITY);
            }
            char buf[64];
            std::snprintf(buf, sizeof buf, " rel err %.3g", worst);
            check(replayOk && worst < tolerance(p.type), "graph replay on 3 fresh inputs " + label(p, strategy) + buf);
        }
        if (exec)
        {
            cudaGraphExecDestroy(exec);
        }
        if (graph)
        {
            cudaGraphDestroy(graph);
        }
    }

    // Builder timing enqueues a build-phase plugin that was never attached: it creates its
    // kernel-library context on first use, outside any capture.
    {
        Problem p{16, 576, {576, 192, 192}, DataType::kHALF, 1e-5F};
        Fields fields(p.eps, p.splits, 0);
        IPluginCreatorV3One* creator = creatorFor(registry, p.splits.size());
        std::unique_ptr<IPluginV3> plugin(creator->createPlugin("timing", &fields.collection, TensorRTPhase::kBUILD));
        Attached a;
        a.runtime = capability<IPluginV3OneRuntime>(plugin.get(), PluginCapabilityType::kRUNTIME);
        a.in = {makeDesc({1, p.m, p.k}, p.type), makeDesc({p.k, p.n()}, p.type)};
        for (int32_t s : p.splits)
        {
            a.out.push_back(makeDesc({1, p.m, s}, p.type));
        }
        Instance inst(p);
        bool ok = inst.allocate(1 << 20) && inst.uploadW(rng) && inst.uploadX(rng);
        int32_t const rc = ok ? enqueue(a, inst, stream) : 1;
        ok = ok && rc == 0 && CUDA_OK(cudaStreamSynchronize(stream));
        double const err = ok ? inst.error() : INFINITY;
        check(ok && err < tolerance(p.type), "unattached build-phase plugin enqueues outside a capture (builder timing)");

        std::unique_ptr<IPluginV3> fresh(creator->createPlugin("timing", &fields.collection, TensorRTPhase::kBUILD));
        a.runtime = capability<IPluginV3OneRuntime>(fresh.get(), PluginCapabilityType::kRUNTIME);
        cudaGraph_t graph = nullptr;
        bool refused = CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal))
            && enqueue(a, inst, stream) != 0;
        refused = CUDA_OK(cudaStreamEndCapture(stream, &graph)) && refused;
        if (graph)
        {
            cudaGraphDestroy(graph);
        }
        check(refused && cudaGetLastError() == cudaSuccess,
            "unattached plugin refuses to create its context inside a capture, and the capture stays valid");

        Problem empty{0, 576, {1536, 1536}, DataType::kBF16, 1e-5F};
        Attached e;
        Instance none(empty);
        bool emptyOk = attach(registry, empty, 0, context, e) && none.allocate(e.workspace);
        check(emptyOk && enqueue(e, none, stream) == 0 && CUDA_OK(cudaStreamSynchronize(stream)),
            "enqueue with zero rows (x[1,0,576]) succeeds and writes nothing");
    }

    // Plans built on devices of other multiprocessor counts, run on this one: AUTO picks for the
    // recorded count at every enqueue, so each runs in exactly the workspace its build asked for
    // (at 16 rows: none where 78 were recorded, the fused kernel's, while on 132 AUTO takes the
    // epilogue-scale GEMM, which needs one).
    for (int32_t recorded : {78, 114, 132})
    {
        for (int64_t m : {16, 320})
        {
            Problem p{m, 576, {1536, 1536}, DataType::kHALF, 1e-5F};
            Attached a;
            std::string const what = label(p, 0) + " recorded on " + std::to_string(recorded) + " multiprocessors";
            if (!check(attach(registry, p, 0, context, a, recorded), "attach " + what))
            {
                continue;
            }
            Instance inst(p);
            if (!inst.allocate(a.workspace) || !inst.uploadW(rng) || !inst.uploadX(rng))
            {
                continue;
            }
            int32_t const rc = enqueue(a, inst, stream);
            bool const synced = CUDA_OK(cudaStreamSynchronize(stream));
            double const err = (rc == 0 && synced) ? inst.error() : INFINITY;
            char buf[96];
            std::snprintf(buf, sizeof buf, " in its %zu-byte workspace, rel err %.3g", a.workspace, err);
            check(rc == 0 && err < tolerance(p.type), "enqueue " + what + buf);
        }
    }

    // Two execution contexts, two streams, enqueued back to back many times so their work
    // overlaps; each must see only its own side stream and workspace.
    for (int32_t strategy : {0, 1})
    {
        Problem p{256, 576, {1536, 1536}, DataType::kBF16, 1e-5F};
        Attached a0, a1;
        bool ok = attach(registry, p, strategy, context, a0) && attach(registry, p, strategy, context, a1);
        Instance i0(p), i1(p);
        cudaStream_t s0 = nullptr, s1 = nullptr;
        ok = ok && i0.allocate(a0.workspace) && i1.allocate(a1.workspace) && i0.uploadW(rng) && i1.uploadW(rng)
            && i0.uploadX(rng) && i1.uploadX(rng) && CUDA_OK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking))
            && CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
        for (int iteration = 0; ok && iteration < 20; ++iteration)
        {
            ok = enqueue(a0, i0, s0) == 0 && enqueue(a1, i1, s1) == 0;
        }
        ok = ok && CUDA_OK(cudaStreamSynchronize(s0)) && CUDA_OK(cudaStreamSynchronize(s1));
        double const e0 = ok ? i0.error() : INFINITY;
        double const e1 = ok ? i1.error() : INFINITY;
        char buf[96];
        std::snprintf(buf, sizeof buf, " rel err %.3g / %.3g", e0, e1);
        check(ok && e0 < tolerance(p.type) && e1 < tolerance(p.type),
            "two contexts on two streams, concurrently " + label(p, strategy) + buf);
        if (s0)
        {
            cudaStreamDestroy(s0);
        }
        if (s1)
        {
            cudaStreamDestroy(s1);
        }
    }
    cudaStreamDestroy(stream);
}

int usage()
{
    std::fprintf(stderr,
        "usage: flashnorm_trt_harness --runtime LIBNVINFER[_LEAN].so --plugin libflashnorm_plugin.so "
        "[--route loadLibrary|dlopen] [--gpu]\n");
    return 2;
}
} // namespace

int main(int argc, char** argv)
{
    std::string runtimePath, pluginPath, route = "loadLibrary";
    bool gpu = false;
    for (int i = 1; i < argc; ++i)
    {
        std::string const arg = argv[i];
        if (arg == "--runtime" && i + 1 < argc)
        {
            runtimePath = argv[++i];
        }
        else if (arg == "--plugin" && i + 1 < argc)
        {
            pluginPath = argv[++i];
        }
        else if (arg == "--route" && i + 1 < argc)
        {
            route = argv[++i];
        }
        else if (arg == "--gpu")
        {
            gpu = true;
        }
        else
        {
            return usage();
        }
    }
    if (runtimePath.empty() || pluginPath.empty() || (route != "loadLibrary" && route != "dlopen"))
    {
        return usage();
    }

    // RTLD_LOCAL on purpose: the way Python extensions and Triton backends load TensorRT.
    void* trt = dlopen(runtimePath.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!check(trt != nullptr, "dlopen " + runtimePath + (trt ? "" : std::string(": ") + dlerror())))
    {
        return 1;
    }
    using GetRegistry = IPluginRegistry* (*) ();
    using GetVersion = int32_t (*)();
    auto getRegistry = reinterpret_cast<GetRegistry>(dlsym(trt, "getPluginRegistry"));
    auto getVersion = reinterpret_cast<GetVersion>(dlsym(trt, "getInferLibVersion"));
    if (!check(getRegistry != nullptr, "runtime exports getPluginRegistry"))
    {
        return 1;
    }
    if (getVersion != nullptr)
    {
        std::printf("INFO runtime library version %d\n", getVersion());
    }
    IPluginRegistry* registry = getRegistry();

    void* handle = nullptr;
    if (route == "loadLibrary")
    {
        handle = registry->loadLibrary(pluginPath.c_str());
        check(handle != nullptr, "IPluginRegistry::loadLibrary(" + pluginPath + ")");
    }
    else
    {
        void* lib = dlopen(pluginPath.c_str(), RTLD_NOW | RTLD_LOCAL);
        check(lib != nullptr, "dlopen plugin (self-registration)" + std::string(lib ? "" : std::string(": ") + dlerror()));
    }

    cpuChecks(registry);

    if (gpu && creatorFor(registry, 3) != nullptr)
    {
        std::random_device rd;
        uint64_t const seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
        std::printf("INFO GPU checks, seed %llu\n", static_cast<unsigned long long>(seed));
        std::mt19937_64 rng(seed);
        gpuChecks(registry, rng);
    }

    if (handle != nullptr)
    {
        registry->deregisterLibrary(handle);
        check(creatorFor(registry, 1) == nullptr && creatorFor(registry, 3) == nullptr,
            "deregisterLibrary removes the creators");
    }
    std::printf("%s: %d of %d checks passed\n", gFailures == 0 ? "OK" : "FAILED", gChecks - gFailures, gChecks);
    return gFailures == 0 ? 0 : 1;
}
