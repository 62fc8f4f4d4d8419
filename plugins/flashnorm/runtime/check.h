// One macro checks every CUDA runtime and cuBLASLt call: on failure it records what failed
// (call text, error string, file:line) on the context and returns the matching status.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "flashnorm/flashnorm.h"

struct flashnorm_context;

namespace flashnorm
{

struct CallResult
{
    flashnorm_status status;
    char const* detail;
};

inline CallResult check_result(cudaError_t error)
{
    return {error == cudaSuccess ? FLASHNORM_STATUS_OK : FLASHNORM_STATUS_CUDA_ERROR, cudaGetErrorString(error)};
}

inline CallResult check_result(cublasStatus_t status)
{
    return {status == CUBLAS_STATUS_SUCCESS ? FLASHNORM_STATUS_OK : FLASHNORM_STATUS_CUBLAS_ERROR,
        cublasLtGetStatusString(status)};
}

// Stores the message on `context` (may be null) and returns `status`.
flashnorm_status record_error(
    flashnorm_context* context, flashnorm_status status, char const* what, char const* detail, char const* where);

} // namespace flashnorm

#define FLASHNORM_STRINGIFY_(x) #x
#define FLASHNORM_STRINGIFY(x) FLASHNORM_STRINGIFY_(x)
#define FLASHNORM_CHECK(context, call)                                                                          \
    do                                                                                                          \
    {                                                                                                           \
        ::flashnorm::CallResult const flashnorm_result_ = ::flashnorm::check_result(call);                      \
        if (flashnorm_result_.status != FLASHNORM_STATUS_OK)                                                    \
        {                                                                                                       \
            return ::flashnorm::record_error(context, flashnorm_result_.status, #call, flashnorm_result_.detail, \
                __FILE__ ":" FLASHNORM_STRINGIFY(__LINE__));                                                    \
        }                                                                                                       \
    } while (0)
