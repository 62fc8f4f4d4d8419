/*
 * How TensorRT finds the FlashNormMatMul creator. Two routes, one library:
 *
 * 1. Loaded by plain dlopen (Polygraphy --plugins, trtexec --staticPlugins, Triton's
 *    plugins= backend option, LD_PRELOAD): a static initializer registers the creator under
 *    namespace "flashnorm" with the registry of the TensorRT library in the process. That
 *    library is found without linking to it: first through the global symbol scope, then by
 *    asking the dynamic loader for an already-loaded libnvinfer / libnvinfer_lean /
 *    libnvinfer_dispatch (RTLD_NOLOAD loads nothing and also finds libraries loaded with
 *    RTLD_LOCAL, as Python extension modules and Triton backends load TensorRT). If no
 *    TensorRT library is loaded yet (LD_PRELOAD, Polygraphy loading plugins before it creates
 *    a builder), libnvinfer.so.<major> is loaded by its soname from the library search path,
 *    exactly as a plugin linked to libnvinfer would load it; the process's own later load of
 *    the same file then gets the same copy. Where none is found, nothing is registered and
 *    the library still loads.
 *
 * 2. Loaded by IPluginRegistry::loadLibrary (trtexec --dynamicPlugins, the lean and
 *    version-compatible runtimes): TensorRT calls the exported setLoggerFinder and
 *    getCreators and registers the creators itself. Because the static initializer has
 *    already run by then (dlopen comes first), getCreators withdraws the self-registration
 *    from that registry before handing out the creator, so the registry ends up with
 *    exactly one entry, owned by the library handle (deregisterLibrary removes it).
 *
 * The library therefore has no DT_NEEDED on any TensorRT library (it builds against the
 * headers only) and works with the full, lean and dispatch runtimes alike.
 *
 * One creator per output count (FlashNormMatMul1 .. FlashNormMatMul8), registered together.
 * TensorRT for RTX has no plugin layers: its ONNX parser creates a plugin for a node whose
 * creator is registered and then aborts the process. In a process where TensorRT-RTX is loaded
 * and no TensorRT library is, getCreators therefore hands out no creators (with a warning), and
 * the parser builds FlashNormMatMul<N> nodes from their model-local reference functions.
 * FLASHNORM_PLUGIN_NO_AUTOREGISTER=1 turns route 1 off.
 */
#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "flashnorm_matmul_creator.h"
#include "flashnorm_matmul_plugin.h"
#include "plugin_log.h"

namespace flashnorm
{
namespace trt
{
namespace
{
using GetPluginRegistryFn = nvinfer1::IPluginRegistry* (*) ();
using GetLoggerFn = nvinfer1::ILogger* (*) ();

/* Never destroyed: a registry may still hold the pointers while the process exits. */
nvinfer1::IPluginCreatorInterface* const* creators()
{
    static auto* const instances = [] {
        auto* list = new nvinfer1::IPluginCreatorInterface*[FLASHNORM_MAX_OUTPUTS];
        for (int32_t outputs = 1; outputs <= FLASHNORM_MAX_OUTPUTS; ++outputs)
        {
            list[outputs - 1] = new FlashNormMatMulCreator(outputs);
        }
        return list;
    }();
    return instances;
}

struct SelfRegistration
{
    std::mutex mutex;
    nvinfer1::IPluginRegistry* registry{nullptr}; // where the static initializer registered, if anywhere
};

SelfRegistration& selfRegistration()
{
    static auto* state = new SelfRegistration();
    return *state;
}

/* A symbol of a TensorRT library that is already loaded, or nullptr. */
void* findLoadedTensorRTSymbol(char const* symbol)
{
    if (void* found = dlsym(RTLD_DEFAULT, symbol))
    {
        return found;
    }
    static char const* const kLibraries[] = {
        "libnvinfer.so.11", "libnvinfer.so.10", "libnvinfer.so",
        "libnvinfer_lean.so.11", "libnvinfer_lean.so.10", "libnvinfer_lean.so",
        "libnvinfer_dispatch.so.11", "libnvinfer_dispatch.so.10", "libnvinfer_dispatch.so",
    };
    for (char const* library : kLibraries)
    {
        // RTLD_NOLOAD: only a handle to a library that is loaded already. The handle is
        // kept (never dlclose'd) so that library outlives our registration in it.
        if (void* handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD))
        {
            if (void* found = dlsym(handle, symbol))
            {
                return found;
            }
            dlclose(handle);
        }
    }
    return nullptr;
}

/* Whether TensorRT for RTX is loaded and no TensorRT library is: then no plugin layer can be
 * made, and a registered creator would only lead its parser into aborting the process. */
bool hostIsTensorRTRtx()
{
    static char const* const kRtxLibraries[] = {"libtensorrt_rtx.so.1", "libtensorrt_rtx.so"};
    bool rtx = false;
    for (char const* library : kRtxLibraries)
    {
        if (void* handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD))
        {
            dlclose(handle);
            rtx = true;
        }
    }
    return rtx && findLoadedTensorRTSymbol("createInferBuilder_INTERNAL") == nullptr
        && findLoadedTensorRTSymbol("createInferRuntime_INTERNAL") == nullptr;
}

/* Loads the full TensorRT runtime by soname (the major these headers declare first), as a
 * DT_NEEDED entry would; returns its symbol, or nullptr where it is not on the search path. */
void* loadTensorRTSymbol(char const* symbol)
{
    static char const* const kLibraries[] = {
        NV_TENSORRT_MAJOR == 10 ? "libnvinfer.so.10" : "libnvinfer.so.11",
        NV_TENSORRT_MAJOR == 10 ? "libnvinfer.so.11" : "libnvinfer.so.10",
    };
    for (char const* library : kLibraries)
    {
        if (void* handle = dlopen(library, RTLD_LAZY | RTLD_LOCAL))
        {
            if (void* found = dlsym(handle, symbol))
            {
                return found;
            }
            dlclose(handle);
        }
    }
    return nullptr;
}

void registerWithLoadedTensorRT()
{
    char const* disabled = std::getenv("FLASHNORM_PLUGIN_NO_AUTOREGISTER");
    if (disabled != nullptr && disabled[0] != '\0' && disabled[0] != '0')
    {
        return;
    }
    void* registrySymbol = findLoadedTensorRTSymbol("getPluginRegistry");
    if (registrySymbol == nullptr)
    {
        registrySymbol = loadTensorRTSymbol("getPluginRegistry");
    }
    auto const getRegistry = reinterpret_cast<GetPluginRegistryFn>(registrySymbol);
    if (getRegistry == nullptr)
    {
        return; // no TensorRT to be found: loadLibrary/getCreators remains the route
    }
    if (auto const getLogger = reinterpret_cast<GetLoggerFn>(findLoadedTensorRTSymbol("getLogger")))
    {
        setFallbackLogger(getLogger());
    }
    nvinfer1::IPluginRegistry* registry = getRegistry();
    if (registry == nullptr)
    {
        return;
    }
    // Another copy of this library (or a different build) may be registered already.
    if (registry->getCreator(pluginName(1), kPluginVersion, kPluginNamespace) != nullptr)
    {
        log(nvinfer1::ILogger::Severity::kWARNING,
            "FlashNormMatMul creators are already registered; this library's copies are not registered again");
        return;
    }
    std::lock_guard<std::mutex> lock(selfRegistration().mutex);
    int32_t registered = 0;
    for (int32_t i = 0; i < FLASHNORM_MAX_OUTPUTS; ++i)
    {
        registered += registry->registerCreator(*creators()[i], kPluginNamespace) ? 1 : 0;
    }
    if (registered > 0)
    {
        selfRegistration().registry = registry;
    }
}

struct RegisterAtLoad
{
    RegisterAtLoad()
    {
        registerWithLoadedTensorRT();
    }
};

RegisterAtLoad const gRegisterAtLoad;
} // namespace
} // namespace trt
} // namespace flashnorm

extern "C" __attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    flashnorm::trt::setLoggerFinder(finder);
}

extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(
    int32_t& nbCreators)
{
    using namespace flashnorm::trt;
    if (hostIsTensorRTRtx())
    {
        log(nvinfer1::ILogger::Severity::kWARNING,
            "TensorRT for RTX has no plugin layers: no FlashNormMatMul creators are registered, and "
            "FlashNormMatMul<N> nodes are built from their model-local reference functions");
        nbCreators = 0;
        return creators();
    }
    {
        // The loader that calls getCreators registers the creators itself: withdraw the
        // registrations the static initializer made so that they are not there twice.
        std::lock_guard<std::mutex> lock(selfRegistration().mutex);
        if (selfRegistration().registry != nullptr)
        {
            for (int32_t i = 0; i < FLASHNORM_MAX_OUTPUTS; ++i)
            {
                selfRegistration().registry->deregisterCreator(*creators()[i]);
            }
            selfRegistration().registry = nullptr;
        }
    }
    nbCreators = FLASHNORM_MAX_OUTPUTS;
    return creators();
}
