"""The custom ops ``torch.ops.flashnorm.matmul`` and ``torch.ops.flashnorm.add_matmul`` (and the
``library_*`` names Inductor's lowering keeps), each with a fake implementation for shapes, and the
ops' arithmetic in PyTorch (``reference_matmul``, ``reference_add``), which CPU tensors run.

CUDA tensors call the library (``flashnorm.cuda_ops.library``); CPU tensors run the same
arithmetic in PyTorch, so models and tests can trace and check the ops on a machine without a GPU.
Both ops end in ``statistic`` (``"rms"``, the default, or ``"variance"`` for a LayerNorm whose mean
the fold centred out of ``w``) and ``bias`` (None, or float32 [N] added after the row scale), so
that calls written before them keep their meaning.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashnorm.cuda_ops.library import (
    check_bias,
    check_like_x,
    check_statistic,
    checked_splits,
    flashnorm_add_matmul,
    flashnorm_matmul,
)


def row_scale(x32: torch.Tensor, eps: float, statistic: str) -> torch.Tensor:
    """The row statistic of fp32 rows, [..., 1]: rsqrt(mean(x²) + eps), or for ``"variance"``
    rsqrt(mean((x − mean x)²) + eps)."""
    centred = x32 - x32.mean(dim=-1, keepdim=True) if statistic == "variance" else x32
    return torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps)


def reference_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: Sequence[int],
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The op's arithmetic in PyTorch: fp32 accumulation, the fp32 statistic and bias, each split
    rounded once to x's dtype (what the library's fused, two-stream and epilogue-scale strategies
    compute)."""
    x32 = x.float()
    y = (x32 @ w.float()) * row_scale(x32, eps, statistic)
    if bias is not None:
        y = y + bias.float()
    return [part.to(x.dtype).contiguous() for part in y.split(list(splits), dim=-1)]


def reference_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """x + residual added in fp32 and rounded once to x's dtype (the library's residual add)."""
    return (x.float() + residual.float()).to(x.dtype)


def _run_op(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: list[int],
    strategy: str,
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    splits = checked_splits(x, w, splits, strategy)
    if x.is_cuda:
        return flashnorm_matmul(x, w, eps, splits, strategy, statistic=statistic, bias=bias)
    check_statistic(statistic)
    check_bias(x, w, bias)
    return reference_matmul(x, w, eps, splits, statistic, bias)


def _op_shapes(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: list[int],
    strategy: str,
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    splits = checked_splits(x, w, splits, strategy)
    check_statistic(statistic)
    check_bias(x, w, bias)
    return [x.new_empty(*x.shape[:-1], size) for size in splits]


matmul_op = torch.library.custom_op("flashnorm::matmul", _run_op, mutates_args=())
matmul_op.__doc__ = """``torch.ops.flashnorm.matmul(x, w, eps, splits, strategy, statistic="rms", bias=None)``: one
output per split, ``(x · w)[..., split_i] ⊙ s + bias[split_i]`` with s the row statistic, on the current
stream (module docstring)."""
matmul_op.register_fake(_op_shapes)
# The same call under another name, which Inductor never rewrites: what ``inductor_form`` keeps.
library_op = torch.library.custom_op("flashnorm::library_matmul", _run_op, mutates_args=())
library_op.register_fake(_op_shapes)


def _run_add_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: list[int],
    strategy: str,
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    splits = checked_splits(x, w, splits, strategy)
    check_like_x(x, residual)
    if x.is_cuda:
        total, outputs = flashnorm_add_matmul(x, residual, w, eps, splits, strategy, statistic=statistic, bias=bias)
        return [total, *outputs]
    check_statistic(statistic)
    check_bias(x, w, bias)
    total = reference_add(x, residual)
    return [total, *reference_matmul(total, w, eps, splits, statistic, bias)]


def _add_op_shapes(
    x: torch.Tensor,
    residual: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: list[int],
    strategy: str,
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    check_like_x(x, residual)
    return [x.new_empty(x.shape), *_op_shapes(x, w, eps, splits, strategy, statistic, bias)]


add_matmul_op = torch.library.custom_op("flashnorm::add_matmul", _run_add_op, mutates_args=())
add_matmul_op.__doc__ = """``torch.ops.flashnorm.add_matmul(x, residual, w, eps, splits, strategy, statistic="rms",
bias=None)``: ``[h, y_0, y_1, ...]`` with ``h = x + residual`` and ``y_i = (h · w)[..., split_i] ⊙ s(h) +
bias[split_i]``: the residual add of a decoder layer and the norm→projection after it in one call."""
add_matmul_op.register_fake(_add_op_shapes)
library_add_op = torch.library.custom_op("flashnorm::library_add_matmul", _run_add_op, mutates_args=())
library_add_op.register_fake(_add_op_shapes)
