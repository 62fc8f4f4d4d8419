/*
 * Where the plugin's messages go: the logger TensorRT hands over through setLoggerFinder
 * (loadLibrary, trtexec --dynamicPlugins), else the logger of the TensorRT library already in
 * the process (self-registration at dlopen), else stderr.
 */
#ifndef FLASHNORM_TRT_PLUGIN_LOG_H
#define FLASHNORM_TRT_PLUGIN_LOG_H

#include <NvInferRuntime.h>

#include <string>

namespace flashnorm
{
namespace trt
{

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;
void setFallbackLogger(nvinfer1::ILogger* logger) noexcept;
void log(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept;

inline void logError(std::string const& message) noexcept
{
    log(nvinfer1::ILogger::Severity::kERROR, message);
}

} // namespace trt
} // namespace flashnorm

#endif // FLASHNORM_TRT_PLUGIN_LOG_H
