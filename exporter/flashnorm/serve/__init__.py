"""Triton Inference Server: model repositories for a TensorRT plan with the FlashNorm plugin,
or for an ONNX model served by ONNX Runtime (Triton's ONNX Runtime backend, or its Python
backend): language models and embedding models (encoders) alike."""

from flashnorm.serve.config import ModelConfigOptions, parse_model_config, validated_model_config
from flashnorm.serve.engine_profile import CheckedEngineSignature, check_engine_signature
from flashnorm.serve.repository import (
    RepositoryResult,
    write_engine_repository,
    write_onnx_python_repository,
    write_onnxruntime_repository,
)
from flashnorm.serve.tensors import (
    TritonSignature,
    TritonTensor,
    signature_from_engine,
    signature_from_io_specs,
    signature_from_onnx,
    vocabulary_from_onnx,
)

__all__ = [
    "CheckedEngineSignature",
    "ModelConfigOptions",
    "TritonSignature",
    "RepositoryResult",
    "TritonTensor",
    "check_engine_signature",
    "parse_model_config",
    "signature_from_engine",
    "signature_from_io_specs",
    "signature_from_onnx",
    "validated_model_config",
    "vocabulary_from_onnx",
    "write_engine_repository",
    "write_onnx_python_repository",
    "write_onnxruntime_repository",
]
