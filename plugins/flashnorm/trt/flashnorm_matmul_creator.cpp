#include "flashnorm_matmul_creator.h"

#include <cstdint>
#include <string>

#include "flashnorm_matmul_plugin.h"
#include "plugin_log.h"

namespace flashnorm
{
namespace trt
{
namespace
{
/* Integers arrive as int32 from the ONNX parser and from serialized engines; Python users
 * building fields by hand often pass int64, which is accepted too. */
bool readIntegers(nvinfer1::PluginField const& field, std::vector<int32_t>& out)
{
    out.clear();
    if (field.data == nullptr || field.length < 0)
    {
        return false;
    }
    if (field.type == nvinfer1::PluginFieldType::kINT32)
    {
        auto const* values = static_cast<int32_t const*>(field.data);
        out.assign(values, values + field.length);
        return true;
    }
    if (field.type == nvinfer1::PluginFieldType::kINT64)
    {
        auto const* values = static_cast<int64_t const*>(field.data);
        for (int32_t i = 0; i < field.length; ++i)
        {
            if (values[i] < INT32_MIN || values[i] > INT32_MAX)
            {
                return false;
            }
            out.push_back(static_cast<int32_t>(values[i]));
        }
        return true;
    }
    return false;
}

bool readFloat(nvinfer1::PluginField const& field, float& out)
{
    if (field.data == nullptr || field.length != 1)
    {
        return false;
    }
    if (field.type == nvinfer1::PluginFieldType::kFLOAT32)
    {
        out = *static_cast<float const*>(field.data);
        return true;
    }
    if (field.type == nvinfer1::PluginFieldType::kFLOAT64)
    {
        out = static_cast<float>(*static_cast<double const*>(field.data));
        return true;
    }
    return false;
}
} // namespace

FlashNormMatMulCreator::FlashNormMatMulCreator(int32_t outputs)
    : mOutputs(outputs)
{
    // Declared fields are all the parser forwards from the node (plugin_version and
    // plugin_namespace are not fields).
    mFields.emplace_back("eps", nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1);
    mFields.emplace_back("splits", nullptr, nvinfer1::PluginFieldType::kINT32, 0);
    mFields.emplace_back("strategy", nullptr, nvinfer1::PluginFieldType::kINT32, 1);
    mFields.emplace_back("statistic", nullptr, nvinfer1::PluginFieldType::kINT32, 1);
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

nvinfer1::IPluginV3* FlashNormMatMulCreator::createPlugin(
    char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept
{
    try
    {
        std::string const pluginName = name != nullptr ? name : getPluginName();
        if (fc == nullptr || (fc->nbFields > 0 && fc->fields == nullptr))
        {
            logError(pluginName + ": no plugin fields given (eps and splits are required)");
            return nullptr;
        }
        MatMulAttributes attributes;
        bool haveEps = false;
        bool haveSplits = false;
        bool haveMultiprocessors = false;
        for (int32_t i = 0; i < fc->nbFields; ++i)
        {
            nvinfer1::PluginField const& field = fc->fields[i];
            std::string const fieldName = field.name != nullptr ? field.name : "";
            if (fieldName == "eps")
            {
                haveEps = readFloat(field, attributes.eps);
                if (!haveEps)
                {
                    logError(pluginName + ": field eps must be one FLOAT32");
                    return nullptr;
                }
            }
            else if (fieldName == "splits")
            {
                haveSplits = readIntegers(field, attributes.splits);
                if (!haveSplits)
                {
                    logError(pluginName + ": field splits must be an INT32 array");
                    return nullptr;
                }
            }
            else if (fieldName == "strategy")
            {
                std::vector<int32_t> strategy;
                if (!readIntegers(field, strategy) || strategy.size() != 1)
                {
                    logError(pluginName + ": field strategy must be one INT32");
                    return nullptr;
                }
                attributes.strategy = strategy[0];
            }
            else if (fieldName == "statistic")
            {
                std::vector<int32_t> statistic;
                if (!readIntegers(field, statistic) || statistic.size() != 1)
                {
                    logError(pluginName + ": field statistic must be one INT32");
                    return nullptr;
                }
                attributes.statistic = statistic[0];
            }
            else if (fieldName == "multiprocessors")
            {
                std::vector<int32_t> multiprocessors;
                if (!readIntegers(field, multiprocessors) || multiprocessors.size() != 1)
                {
                    logError(pluginName + ": field multiprocessors must be one INT32");
                    return nullptr;
                }
                attributes.multiprocessors = multiprocessors[0];
                haveMultiprocessors = true;
            }
            else
            {
                log(nvinfer1::ILogger::Severity::kWARNING, pluginName + ": ignoring unknown field '" + fieldName + "'");
            }
        }
        if (!haveEps || !haveSplits)
        {
            logError(pluginName + ": missing required field " + (haveEps ? "splits" : "eps"));
            return nullptr;
        }
        // A node never names it (not a declared field): a build records the build device's. A plan
        // serialized before the field existed reserved the workspace of the count AUTO assumed then.
        if (!haveMultiprocessors)
        {
            attributes.multiprocessors = phase == nvinfer1::TensorRTPhase::kBUILD
                ? flashnorm_current_multiprocessors()
                : flashnorm_measured_multiprocessors();
        }
        if (static_cast<int32_t>(attributes.splits.size()) != mOutputs)
        {
            logError(pluginName + ": " + getPluginName() + " has " + std::to_string(mOutputs)
                + " outputs, but splits holds " + std::to_string(attributes.splits.size()) + " sizes");
            return nullptr;
        }
        std::string why;
        if (!validateAttributes(attributes, why))
        {
            logError(pluginName + ": " + why);
            return nullptr;
        }
        return new FlashNormMatMulPlugin(pluginName, std::move(attributes));
    }
    catch (std::exception const& e)
    {
        logError(std::string("createPlugin failed: ") + e.what());
        return nullptr;
    }
}

nvinfer1::PluginFieldCollection const* FlashNormMatMulCreator::getFieldNames() noexcept
{
    return &mFieldCollection;
}

char const* FlashNormMatMulCreator::getPluginName() const noexcept
{
    return pluginName(mOutputs);
}

char const* FlashNormMatMulCreator::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* FlashNormMatMulCreator::getPluginNamespace() const noexcept
{
    return kPluginNamespace;
}

} // namespace trt
} // namespace flashnorm
