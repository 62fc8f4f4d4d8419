"""The PyTorch binding of the FlashNorm CUDA library (``libflashnorm.so``, C ABI in
``plugins/flashnorm/include/flashnorm/flashnorm.h``; the kernels are ``plugins/flashnorm/kernels/``).

    y_i = (x · W*)[:, cols_i] ⊙ s + bias[cols_i],  s = rsqrt(mean(x², -1) + eps)        (statistic "rms")
                                                   or rsqrt(mean((x - mean x)², -1) + eps)  ("variance")

Ways in:

- ``flashnorm_matmul(x, w, eps, splits, strategy, out=None)``: a direct ctypes call (outputs may
  be supplied with ``out``). torch.compile cannot trace it: it breaks the graph at every call.
- ``flashnorm_add_matmul(x, residual, w, eps, ...)`` and ``torch.ops.flashnorm.add_matmul``: the
  residual add in front of the norm (h = x + residual) in the same call; returns h too. In a
  decode step the fused kernel does the add as it reads x, so the add costs no kernel.
- ``torch.ops.flashnorm.matmul(x, w, eps, splits, strategy)`` (also ``matmul_op``): the same call
  registered as a PyTorch custom op, with a fake implementation for shapes, so torch.compile
  compiles the model around it without a graph break and CUDA graphs capture it. CUDA tensors run
  the library; CPU tensors run the same arithmetic in PyTorch (``reference_matmul``), so models
  and tests can trace and check the op on a machine without a GPU. Under Inductor, ``"auto"``
  keeps the library call where AUTO picks the fused kernel and becomes PyTorch ops elsewhere
  (``inductor_form``).

The library is found through the environment variable ``FLASHNORM_LIBRARY`` or, failing that,
at ``build/plugins/flashnorm/libflashnorm.so`` under the repository root (build it with
``cmake -S . -B build -G Ninja && cmake --build build``).

The modules, one direction: ``abi`` (the header in ctypes: enums, the problem struct, prototypes,
loading; no torch) → ``library`` (typed calls, execution contexts, argument checks) → ``ops``
(the custom ops and their PyTorch arithmetic) → ``lowering`` (Inductor); ``testing`` holds the
library's test and tuning hooks. Importing this package registers the ops and the lowering.
A test that replaces a name replaces it where it is looked up: ``abi._library`` (the loaded
library), ``lowering.resolve_strategy`` (AUTO's answer as Inductor's lowering asks it).
"""

from flashnorm.cuda_ops import abi, library, lowering, ops, testing
from flashnorm.cuda_ops.abi import DEFAULT_LIBRARY, library_path
from flashnorm.cuda_ops.library import (
    STATISTICS,
    STRATEGIES,
    current_multiprocessors,
    flashnorm_add_matmul,
    flashnorm_matmul,
    resolve_strategy,
    strategy_available,
    warm_up,
    workspace_size,
)
from flashnorm.cuda_ops.lowering import add_inductor_form, inductor_form, prenorm_form
from flashnorm.cuda_ops.ops import add_matmul_op, library_add_op, library_op, matmul_op, reference_add, reference_matmul
from flashnorm.cuda_ops.testing import (
    epilogue_scale_tile_names,
    join_dropped,
    set_epilogue_scale_tiles,
    set_fused_tuning,
    set_side_delay,
)

__all__ = [
    "DEFAULT_LIBRARY", "STATISTICS", "STRATEGIES", "abi", "add_inductor_form", "add_matmul_op", "current_multiprocessors",
    "epilogue_scale_tile_names", "flashnorm_add_matmul", "flashnorm_matmul", "inductor_form", "join_dropped",
    "library", "library_add_op", "library_op", "library_path", "lowering", "matmul_op", "ops", "prenorm_form",
    "reference_add", "reference_matmul", "resolve_strategy", "set_epilogue_scale_tiles", "set_fused_tuning",
    "set_side_delay", "strategy_available", "testing", "warm_up", "workspace_size",
]
