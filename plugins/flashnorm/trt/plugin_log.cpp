#include "plugin_log.h"

#include <atomic>
#include <cstdio>

namespace flashnorm
{
namespace trt
{
namespace
{
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};
std::atomic<nvinfer1::ILogger*> gFallbackLogger{nullptr};
} // namespace

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    gLoggerFinder.store(finder);
}

void setFallbackLogger(nvinfer1::ILogger* logger) noexcept
{
    gFallbackLogger.store(logger);
}

void log(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept
{
    std::string const text = std::string("[flashnorm] ") + message;
    nvinfer1::ILogger* logger = nullptr;
    if (nvinfer1::ILoggerFinder* finder = gLoggerFinder.load())
    {
        logger = finder->findLogger();
    }
    if (logger == nullptr)
    {
        logger = gFallbackLogger.load();
    }
    if (logger != nullptr)
    {
        logger->log(severity, text.c_str());
    }
    else if (severity <= nvinfer1::ILogger::Severity::kWARNING)
    {
        std::fprintf(stderr, "%s\n", text.c_str());
    }
}

} // namespace trt
} // namespace flashnorm
