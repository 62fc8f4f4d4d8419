#include "flashnorm_matmul_plugin.h"

#include <cmath>
#include <cstdint>
#include <new>
#include <numeric>

#include <cuda_runtime_api.h>

#include "plugin_log.h"

namespace flashnorm
{
namespace trt
{
namespace
{
// x, W*, and the bias where the node has one (nodes and plans written before it have not).
constexpr int32_t kMinInputs = 2;
constexpr int32_t kMaxInputs = 3;
constexpr int32_t kBiasInput = 2;

bool validInputCount(int32_t nbInputs)
{
    return nbInputs >= kMinInputs && nbInputs <= kMaxInputs;
}
// The kernel library wants a 256-byte aligned workspace; TensorRT does not document the
// alignment of the one it hands to enqueue, so ask for this much more and align it here.
constexpr size_t kWorkspaceAlignment = 256;

void* alignWorkspace(void* workspace)
{
    auto const address = reinterpret_cast<uintptr_t>(workspace);
    return reinterpret_cast<void*>((address + kWorkspaceAlignment - 1) & ~(uintptr_t{kWorkspaceAlignment} - 1));
}

bool toKernelType(nvinfer1::DataType type, flashnorm_dtype& out)
{
    switch (type)
    {
    case nvinfer1::DataType::kFLOAT: out = FLASHNORM_DTYPE_F32; return true;
    case nvinfer1::DataType::kHALF: out = FLASHNORM_DTYPE_F16; return true;
    case nvinfer1::DataType::kBF16: out = FLASHNORM_DTYPE_BF16; return true;
    default: return false;
    }
}

bool isSupportedType(nvinfer1::DataType type)
{
    flashnorm_dtype unused;
    return toKernelType(type, unused);
}
} // namespace

char const* pluginName(int32_t outputs) noexcept
{
    static char const* const kNames[FLASHNORM_MAX_OUTPUTS] = {"FlashNormMatMul1", "FlashNormMatMul2",
        "FlashNormMatMul3", "FlashNormMatMul4", "FlashNormMatMul5", "FlashNormMatMul6", "FlashNormMatMul7",
        "FlashNormMatMul8"};
    static_assert(FLASHNORM_MAX_OUTPUTS == 8, "one plugin name per output count");
    return outputs >= 1 && outputs <= FLASHNORM_MAX_OUTPUTS ? kNames[outputs - 1] : nullptr;
}

bool validateAttributes(MatMulAttributes const& attributes, std::string& why)
{
    if (!std::isfinite(attributes.eps) || attributes.eps < 0.0F)
    {
        why = "eps must be a finite, non-negative float, got " + std::to_string(attributes.eps);
        return false;
    }
    if (attributes.splits.empty() || attributes.splits.size() > FLASHNORM_MAX_OUTPUTS)
    {
        why = "splits must hold 1 to " + std::to_string(FLASHNORM_MAX_OUTPUTS) + " sizes, got "
            + std::to_string(attributes.splits.size());
        return false;
    }
    for (int32_t size : attributes.splits)
    {
        if (size <= 0)
        {
            why = "every split size must be positive, got " + std::to_string(size);
            return false;
        }
    }
    if (attributes.strategy < FLASHNORM_STRATEGY_AUTO || attributes.strategy > FLASHNORM_STRATEGY_EPILOGUE_SCALE)
    {
        why = "strategy must be 0 (auto), 1 (two-stream), 2 (fused), 3 (prenorm) or 4 (epilogue-scale), got "
            + std::to_string(attributes.strategy);
        return false;
    }
    if (attributes.multiprocessors <= 0)
    {
        why = "multiprocessors must be positive, got " + std::to_string(attributes.multiprocessors);
        return false;
    }
    if (attributes.statistic != FLASHNORM_STATISTIC_RMS && attributes.statistic != FLASHNORM_STATISTIC_VARIANCE)
    {
        why = "statistic must be 0 (RMS) or 1 (variance), got " + std::to_string(attributes.statistic);
        return false;
    }
    return true;
}

FlashNormMatMulPlugin::FlashNormMatMulPlugin(std::string name, MatMulAttributes attributes)
    : mName(std::move(name))
    , mAttributes(std::move(attributes))
    , mTotalColumns(std::accumulate(mAttributes.splits.begin(), mAttributes.splits.end(), int64_t{0}))
{
    mSerializedFields.reserve(5); // getFieldsToSerialize is noexcept: allocate here
}

FlashNormMatMulPlugin::~FlashNormMatMulPlugin()
{
    if (mContext != nullptr)
    {
        flashnorm_context_destroy(mContext);
    }
}

nvinfer1::IPluginCapability* FlashNormMatMulPlugin::getCapabilityInterface(
    nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* FlashNormMatMulPlugin::clone() noexcept
{
    // A clone carries the attributes only: kernel-library contexts belong to one execution
    // context each and are created in attachToContext.
    try
    {
        auto* cloned = new FlashNormMatMulPlugin(mName, mAttributes);
        cloned->mInputs = mInputs;
        return cloned;
    }
    catch (std::exception const& e)
    {
        logError(mName + ": clone failed: " + e.what());
        return nullptr;
    }
}

char const* FlashNormMatMulPlugin::getPluginName() const noexcept
{
    return pluginName(static_cast<int32_t>(mAttributes.splits.size()));
}

char const* FlashNormMatMulPlugin::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* FlashNormMatMulPlugin::getPluginNamespace() const noexcept
{
    return kPluginNamespace;
}

int32_t FlashNormMatMulPlugin::getNbOutputs() const noexcept
{
    return static_cast<int32_t>(mAttributes.splits.size());
}

int32_t FlashNormMatMulPlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
    nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (!validInputCount(nbInputs) || nbOutputs != getNbOutputs())
    {
        logError(mName + ": expects 2 or 3 inputs (x, W, bias) and " + std::to_string(getNbOutputs())
            + " outputs, got " + std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
        return 1;
    }
    if (!isSupportedType(inputTypes[0]) || inputTypes[1] != inputTypes[0])
    {
        logError(mName + ": x and W must share one type among float32, float16 and bfloat16 (got types "
            + std::to_string(static_cast<int32_t>(inputTypes[0])) + " and "
            + std::to_string(static_cast<int32_t>(inputTypes[1])) + ")");
        return 1;
    }
    if (nbInputs > kBiasInput && inputTypes[kBiasInput] != nvinfer1::DataType::kFLOAT)
    {
        logError(mName + ": the bias must be float32 (got type "
            + std::to_string(static_cast<int32_t>(inputTypes[kBiasInput])) + ")");
        return 1;
    }
    for (int32_t i = 0; i < nbOutputs; ++i)
    {
        outputTypes[i] = inputTypes[0];
    }
    return 0;
}

int32_t FlashNormMatMulPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept
{
    if (!validInputCount(nbInputs) || nbShapeInputs != 0 || nbOutputs != getNbOutputs())
    {
        logError(mName + ": unexpected input/output count in getOutputShapes");
        return 1;
    }
    if (nbInputs > kBiasInput
        && (inputs[kBiasInput].nbDims != 1
            || (inputs[kBiasInput].d[0]->isConstant() && inputs[kBiasInput].d[0]->getConstantValue() != mTotalColumns)))
    {
        logError(mName + ": the bias must be [N] with N = " + std::to_string(mTotalColumns) + ", the splits' sum");
        return 1;
    }
    nvinfer1::DimsExprs const& x = inputs[0];
    nvinfer1::DimsExprs const& w = inputs[1];
    if (x.nbDims < 1 || w.nbDims != 2)
    {
        logError(mName + ": x must be [..., K] and W must be [K, N], got ranks " + std::to_string(x.nbDims) + " and "
            + std::to_string(w.nbDims));
        return 1;
    }
    if (w.d[1]->isConstant() && w.d[1]->getConstantValue() != mTotalColumns)
    {
        logError(mName + ": W has " + std::to_string(w.d[1]->getConstantValue())
            + " columns but the splits add up to " + std::to_string(mTotalColumns));
        return 1;
    }
    nvinfer1::IDimensionExpr const* xK = x.d[x.nbDims - 1];
    if (xK->isConstant() && w.d[0]->isConstant() && xK->getConstantValue() != w.d[0]->getConstantValue())
    {
        logError(mName + ": x has K=" + std::to_string(xK->getConstantValue()) + " but W has "
            + std::to_string(w.d[0]->getConstantValue()) + " rows");
        return 1;
    }
    for (int32_t i = 0; i < nbOutputs; ++i)
    {
        outputs[i] = x;
        outputs[i].d[x.nbDims - 1] = exprBuilder.constant(mAttributes.splits[i]);
    }
    return 0;
}

bool FlashNormMatMulPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (!validInputCount(nbInputs) || nbOutputs != getNbOutputs() || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != nvinfer1::TensorFormat::kLINEAR)
    {
        return false;
    }
    // The bias is float32 whatever x is.
    if (pos == kBiasInput && nbInputs > kBiasInput)
    {
        return desc.type == nvinfer1::DataType::kFLOAT;
    }
    // x decides the type; W and every output must match it.
    return pos == 0 ? isSupportedType(desc.type) : desc.type == inOut[0].desc.type;
}

int32_t FlashNormMatMulPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (!validInputCount(nbInputs) || nbOutputs != getNbOutputs())
    {
        logError(mName + ": unexpected input/output count in configurePlugin");
        return 1;
    }
    nvinfer1::Dims const& x = in[0].desc.dims;
    nvinfer1::Dims const& w = in[1].desc.dims;
    if (x.nbDims < 1 || w.nbDims != 2)
    {
        logError(mName + ": x must be [..., K] and W must be [K, N]");
        return 1;
    }
    int64_t const k = x.d[x.nbDims - 1];
    if (k >= 0 && w.d[0] >= 0 && k != w.d[0])
    {
        logError(mName + ": x has K=" + std::to_string(k) + " but W has " + std::to_string(w.d[0]) + " rows");
        return 1;
    }
    if (nbInputs > kBiasInput)
    {
        nvinfer1::Dims const& bias = in[kBiasInput].desc.dims;
        if (bias.nbDims != 1 || (bias.d[0] >= 0 && bias.d[0] != mTotalColumns))
        {
            logError(mName + ": the bias must be [N] with N = " + std::to_string(mTotalColumns));
            return 1;
        }
    }
    mInputs = nbInputs;
    return 0;
}

bool FlashNormMatMulPlugin::describeProblem(
    nvinfer1::Dims const& xDims, nvinfer1::DataType type, flashnorm_problem& problem) const
{
    problem = flashnorm_problem{};
    if (xDims.nbDims < 1 || !toKernelType(type, problem.dtype))
    {
        return false;
    }
    int64_t rows = 1;
    for (int32_t i = 0; i < xDims.nbDims - 1; ++i)
    {
        if (xDims.d[i] < 0)
        {
            return false;
        }
        rows *= xDims.d[i];
    }
    problem.m = rows;
    problem.k = xDims.d[xDims.nbDims - 1];
    problem.n = mTotalColumns;
    problem.num_outputs = static_cast<int32_t>(mAttributes.splits.size());
    for (size_t i = 0; i < mAttributes.splits.size(); ++i)
    {
        problem.split_sizes[i] = mAttributes.splits[i];
    }
    problem.eps = mAttributes.eps;
    problem.strategy = static_cast<flashnorm_strategy>(mAttributes.strategy);
    problem.multiprocessors = mAttributes.multiprocessors;
    problem.statistic = static_cast<flashnorm_statistic>(mAttributes.statistic);
    return problem.k > 0;
}

size_t FlashNormMatMulPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    if (!validInputCount(nbInputs))
    {
        return 0;
    }
    // Sized for the profile's largest x: the library's workspace covers any smaller M on the same
    // multiprocessors, the recorded ones every enqueue passes too.
    flashnorm_problem problem;
    if (!describeProblem(inputs[0].max, inputs[0].desc.type, problem))
    {
        return 0;
    }
    size_t const bytes = flashnorm_workspace_size(&problem);
    return bytes == 0 ? 0 : bytes + kWorkspaceAlignment;
}

int32_t FlashNormMatMulPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (!validInputCount(nbInputs) || nbOutputs != getNbOutputs())
    {
        logError(mName + ": unexpected input/output count in onShapeChange");
        return 1;
    }
    flashnorm_problem problem;
    if (!describeProblem(in[0].dims, in[0].type, problem) || in[1].dims.nbDims != 2 || in[1].dims.d[0] != problem.k
        || in[1].dims.d[1] != problem.n || in[1].type != in[0].type)
    {
        logError(mName + ": inconsistent shapes or types of x and W at runtime");
        return 1;
    }
    if (nbInputs > kBiasInput
        && (in[kBiasInput].dims.nbDims != 1 || in[kBiasInput].dims.d[0] != problem.n
            || in[kBiasInput].type != nvinfer1::DataType::kFLOAT))
    {
        logError(mName + ": the bias must be float32 [N] at runtime");
        return 1;
    }
    mInputs = nbInputs;
    return 0;
}

bool FlashNormMatMulPlugin::ensureContext(cudaStream_t stream)
{
    if (mContext != nullptr)
    {
        return true;
    }
    // Only a build-phase object (builder timing) gets here; creating handles and streams
    // inside a capture would break the graph, so refuse rather than corrupt it.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone)
    {
        logError(mName + ": enqueue during a CUDA-graph capture on a plugin never attached to an execution context");
        return false;
    }
    flashnorm_status const status = flashnorm_context_create(&mContext);
    if (status != FLASHNORM_STATUS_OK)
    {
        mContext = nullptr;
        logError(mName + ": cannot create the kernel-library context: " + flashnorm_status_string(status));
        return false;
    }
    return true;
}

int32_t FlashNormMatMulPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs,
    void* workspace, cudaStream_t stream) noexcept
{
    flashnorm_problem problem;
    if (!describeProblem(inputDesc[0].dims, inputDesc[0].type, problem))
    {
        logError(mName + ": unsupported x descriptor at enqueue");
        return 1;
    }
    if (!ensureContext(stream))
    {
        return 1;
    }
    size_t const workspaceBytes = flashnorm_workspace_size(&problem);
    void* const alignedWorkspace = workspaceBytes == 0 ? nullptr : alignWorkspace(workspace);
    float const* const bias = mInputs > kBiasInput ? static_cast<float const*>(inputs[kBiasInput]) : nullptr;
    flashnorm_status const status = flashnorm_matmul(
        mContext, &problem, inputs[0], inputs[1], bias, outputs, alignedWorkspace, workspaceBytes, stream);
    if (status != FLASHNORM_STATUS_OK)
    {
        logError(mName + ": flashnorm_matmul failed: " + flashnorm_status_string(status) + ": "
            + flashnorm_context_last_error(mContext));
        return 1;
    }
    return 0;
}

nvinfer1::IPluginV3* FlashNormMatMulPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    // One clone per execution context, each with its own side stream, events and cuBLASLt
    // handle: contexts that run concurrently (Triton instance groups) never share them.
    FlashNormMatMulPlugin* attached = nullptr;
    try
    {
        attached = new FlashNormMatMulPlugin(mName, mAttributes);
        attached->mInputs = mInputs;
    }
    catch (std::exception const& e)
    {
        logError(mName + ": attachToContext failed: " + e.what());
        return nullptr;
    }
    flashnorm_status const status = flashnorm_context_create(&attached->mContext);
    if (status != FLASHNORM_STATUS_OK)
    {
        attached->mContext = nullptr;
        logError(mName + ": cannot create the kernel-library context: " + flashnorm_status_string(status));
        delete attached;
        return nullptr;
    }
    return attached;
}

nvinfer1::PluginFieldCollection const* FlashNormMatMulPlugin::getFieldsToSerialize() noexcept
{
    // Rebuilt on every call: the fields point into this object's own attributes.
    mSerializedFields.assign({
        {"eps", &mAttributes.eps, nvinfer1::PluginFieldType::kFLOAT32, 1},
        {"splits", mAttributes.splits.data(), nvinfer1::PluginFieldType::kINT32,
            static_cast<int32_t>(mAttributes.splits.size())},
        {"strategy", &mAttributes.strategy, nvinfer1::PluginFieldType::kINT32, 1},
        {"statistic", &mAttributes.statistic, nvinfer1::PluginFieldType::kINT32, 1},
        {"multiprocessors", &mAttributes.multiprocessors, nvinfer1::PluginFieldType::kINT32, 1},
    });
    mSerializedCollection.nbFields = static_cast<int32_t>(mSerializedFields.size());
    mSerializedCollection.fields = mSerializedFields.data();
    return &mSerializedCollection;
}

} // namespace trt
} // namespace flashnorm
