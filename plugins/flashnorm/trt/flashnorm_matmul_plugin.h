/*
 * FlashNormMatMul<N>: TensorRT IPluginV3 front end of the FlashNorm kernel library.
 *
 * One plugin name per output count N = 1 .. FLASHNORM_MAX_OUTPUTS (FlashNormMatMul3 for
 * q|k|v, FlashNormMatMul2 for gate|up): TensorRT's ONNX parser finds a node's model-local
 * reference function by op type alone, so each arity needs its own op type, and the plugin
 * creator is looked up by that same op type (exporter/flashnorm/contract.py).
 *
 *   inputs : x [..., K], W* [K, N]          (one dtype: fp32, fp16 or bf16)
 *            [bias [N], fp32]               (nodes and plans written before it have two inputs)
 *   outputs: y_i [..., N_i], sum(N_i) = N    y = (x · W*) ⊙ s + bias, split by columns, s the row's
 *                                            statistic: rsqrt(mean(x²) + eps) (field statistic 0, or
 *                                            absent as in plans written before it) or, W* centred,
 *                                            rsqrt(mean((x − mean x)²) + eps) (statistic 1)
 *
 * The plugin only translates TensorRT descriptors into a flashnorm_problem and calls
 * flashnorm_matmul (flashnorm/flashnorm.h); the math, the streams and the cuBLASLt handle
 * live in the kernel library's context, one per attached clone (one per execution context).
 */
#ifndef FLASHNORM_TRT_FLASHNORM_MATMUL_PLUGIN_H
#define FLASHNORM_TRT_FLASHNORM_MATMUL_PLUGIN_H

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "flashnorm/flashnorm.h"

namespace flashnorm
{
namespace trt
{

constexpr char const* kPluginNamePrefix = "FlashNormMatMul";
constexpr char const* kPluginVersion = "1";
constexpr char const* kPluginNamespace = "flashnorm";

/* "FlashNormMatMul<outputs>" for 1 <= outputs <= FLASHNORM_MAX_OUTPUTS, else nullptr. */
char const* pluginName(int32_t outputs) noexcept;

/* The plugin's attributes: what the ONNX node carries and what an engine serializes. */
struct MatMulAttributes
{
    float eps{0.0F};
    std::vector<int32_t> splits;
    int32_t strategy{FLASHNORM_STRATEGY_AUTO};
    /* flashnorm_statistic: RMS (0, also where the node or the plan has no such field) or variance (1). */
    int32_t statistic{FLASHNORM_STATISTIC_RMS};
    /* The multiprocessors AUTO picks for, in getWorkspaceSize and at every enqueue alike: recorded
     * when the plugin is made for a build (the build device's) and serialized into the plan, so that
     * on any GPU the plan runs on AUTO's pick fits the workspace TensorRT reserved at build time
     * (flashnorm_problem.multiprocessors). Not a node attribute: createPlugin fills it. */
    int32_t multiprocessors{0};
};

class FlashNormMatMulPlugin final : public nvinfer1::IPluginV3,
                                    public nvinfer1::IPluginV3OneCore,
                                    public nvinfer1::IPluginV3OneBuild,
                                    public nvinfer1::IPluginV3OneRuntime
{
public:
    FlashNormMatMulPlugin(std::string name, MatMulAttributes attributes);
    ~FlashNormMatMulPlugin() override;

    FlashNormMatMulPlugin(FlashNormMatMulPlugin const&) = delete;
    FlashNormMatMulPlugin& operator=(FlashNormMatMulPlugin const&) = delete;

    /* IPluginV3 */
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    /* IPluginV3OneCore */
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    /* IPluginV3OneBuild */
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    /* IPluginV3OneRuntime */
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    /* The problem for an x of `xDims` (rows = product of all but the last dimension). */
    bool describeProblem(nvinfer1::Dims const& xDims, nvinfer1::DataType type, flashnorm_problem& problem) const;
    /* Creates the kernel-library context on first use outside a capture (build-phase timing). */
    bool ensureContext(cudaStream_t stream);

    std::string mName;
    MatMulAttributes mAttributes;
    int64_t mTotalColumns{0};
    /* 2 (x, W*) or 3 (and the bias), as configurePlugin and onShapeChange last saw: enqueue is not told. */
    int32_t mInputs{2};

    flashnorm_context* mContext{nullptr};

    std::vector<nvinfer1::PluginField> mSerializedFields;
    nvinfer1::PluginFieldCollection mSerializedCollection{};
};

/* Checks attributes for everything the kernel library would refuse; on failure writes why. */
bool validateAttributes(MatMulAttributes const& attributes, std::string& why);

} // namespace trt
} // namespace flashnorm

#endif // FLASHNORM_TRT_FLASHNORM_MATMUL_PLUGIN_H
