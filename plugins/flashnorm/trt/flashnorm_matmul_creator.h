/*
 * The creators TensorRT's ONNX parser and engine deserializer use to make FlashNormMatMul<N>:
 * one per output count N, each making plugins with exactly N outputs.
 *
 * Fields (as the parser passes ONNX attributes): eps FLOAT32 (required), splits INT32 array
 * of N sizes (required; INTS arrive as int32), strategy INT32 (optional, default 0 = auto) and
 * statistic INT32 (optional, default 0 = RMS, 1 = variance: nodes and plans written before it have
 * none and compute RMSNorm); the defer pass writes both on every node, so the parser finds every
 * declared field.
 *
 * A plan's fields also hold multiprocessors INT32, which the plugin records when it is made for a
 * build and serializes (MatMulAttributes::multiprocessors). It is not declared (getFieldNames):
 * the parser forwards only declared fields and warns on every node that lacks one, and a node has
 * no business naming the build device; TensorRT hands a plan's serialized fields to createPlugin
 * whether declared or not (NvInferRuntime.h: getFieldsToSerialize need not match getFieldNames).
 * Without it, createPlugin takes the current device's count in the build phase and, in the runtime
 * phase (a plan serialized before the field existed), the count that plan's workspace was sized
 * for, flashnorm_measured_multiprocessors().
 */
#ifndef FLASHNORM_TRT_FLASHNORM_MATMUL_CREATOR_H
#define FLASHNORM_TRT_FLASHNORM_MATMUL_CREATOR_H

#include <NvInferRuntime.h>

#include <cstdint>
#include <vector>

namespace flashnorm
{
namespace trt
{

class FlashNormMatMulCreator final : public nvinfer1::IPluginCreatorV3One
{
public:
    explicit FlashNormMatMulCreator(int32_t outputs);

    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

private:
    int32_t mOutputs;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

} // namespace trt
} // namespace flashnorm

#endif // FLASHNORM_TRT_FLASHNORM_MATMUL_CREATOR_H
