"""Test and tuning hooks of the kernel library (its ``flashnorm_testing_*`` functions): the side
stream's delay that exposes a missing join, forced fused-kernel and epilogue-scale tilings, and
whether this build is the race-mutation build. Used by the GPU tests and benchmarks."""

from __future__ import annotations

import torch

from flashnorm.cuda_ops.abi import Status, load
from flashnorm.cuda_ops.library import context, cuda_device
from flashnorm.errors import FlashNormError


def set_side_delay(cycles: int, device: torch.device | int | None = None) -> None:
    """Test hook: the side stream's work of this thread's context (two-stream's RMS reduction,
    prenorm's narrow GEMMs) and epilogue-scale's reduction (after it let the GEMM start) wait
    `cycles` GPU clock cycles first, so that a missing join would read a stale buffer."""
    load().flashnorm_testing_set_side_delay(context(cuda_device(device)), int(cycles))


def set_fused_tuning(strip_cols: int = 0, cluster_size: int = 0, device: torch.device | int | None = None) -> None:
    """Tuning hook: forces the fused kernel's strip width (32 or 128 columns of W* per
    cluster) and cluster size (1, 2, 4 or 8 blocks per strip) on this thread's context; 0 restores
    the automatic choice."""
    lib = load()
    handle = context(cuda_device(device))
    status = lib.flashnorm_testing_set_fused_tuning(handle, int(strip_cols), int(cluster_size))
    if status != Status.OK:
        raise FlashNormError(lib.flashnorm_context_last_error(handle).decode())


def epilogue_scale_tile_names() -> list[str]:
    """The epilogue-scale GEMM's tile configurations, as the library names them (every build lists
    them; only builds with the CUTLASS kernel run them)."""
    lib = load()
    names = []
    while (name := lib.flashnorm_testing_epilogue_scale_tiles_name(len(names))) is not None:
        names.append(name.decode())
    return names


def set_epilogue_scale_tiles(name: str | None = None, device: torch.device | int | None = None) -> None:
    """Tuning hook: forces the epilogue-scale GEMM's tile configuration (a name from
    `epilogue_scale_tile_names`) on this thread's context; None restores the automatic choice.
    AUTO's choice of strategy does not change."""
    names = epilogue_scale_tile_names()
    if name is not None and name not in names:
        raise FlashNormError(f"epilogue-scale tiles {name!r} are unknown; known: {names}")
    lib = load()
    handle = context(cuda_device(device))
    status = lib.flashnorm_testing_set_epilogue_scale_tiles(handle, 0 if name is None else 1 + names.index(name))
    if status != Status.OK:
        raise FlashNormError(lib.flashnorm_context_last_error(handle).decode())


def join_dropped() -> bool:
    """True for the race-mutation build (``-DFLASHNORM_TESTING_DROP_JOIN=ON``)."""
    return bool(load().flashnorm_testing_join_dropped())
