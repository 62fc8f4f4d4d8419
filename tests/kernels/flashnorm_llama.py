"""A SmolLM2-135M-architecture Llama whose norm→projection sites run through a FlashNorm op.

Test support for the long-generation proof (tests/kernels/test_long_generation.py). The
reference is transformers' own `LlamaForCausalLM`; the FlashNorm version is a copy of it in
which every foldable RMSNorm→projection site is replaced by one call of a FlashNorm op:

    input_layernorm          → q_proj | k_proj | v_proj    (one call, three outputs)
    post_attention_layernorm → gate_proj | up_proj          (one call, two outputs, the
                                                             residual add before it included)
    final norm               → lm_head                      (an untied copy: the embedding keeps
                                                             the unfolded table)

with the gain folded into the weight, W* = diag(g)·Wᵀ in the [K, N] layout the kernel takes,
and the norms themselves gone (the ops compute rsqrt(mean(x²)+eps) themselves).

A FlashNorm op is any callable `op(x, w_kn, eps, splits) -> list[Tensor]` computing
`(x · w_kn) ⊙ rsqrt(mean(x², -1) + eps)` split by columns: the real one is
`flashnorm.cuda_ops.flashnorm_matmul`; `reference_flashnorm_op` is the same math in PyTorch.
A FlashNorm add op, `add_op(x, residual, w_kn, eps, splits) -> (h, list[Tensor])`, also forms
the decoder layer's residual add h = x + residual (rounded once to x's dtype) and runs the op on
h: the real one is `flashnorm.cuda_ops.flashnorm_add_matmul`, `reference_flashnorm_add_op` the
same in PyTorch. Each layer's post-attention add runs inside its gate|up call through it, as in
the decode step of benchmarks/decode_step.py; the add before the next layer's q|k|v (and the
final norm) stays transformers' own, so both ops run in every layer.

`random_llama` is a seeded random initialisation of the architecture with random norm gains, a
quarter of them negative, so a fold that drops or misplaces a gain changes the logits; the
long-generation test also folds the real trained SmolLM2-135M the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

from flashnorm.cuda_ops import reference_add, reference_matmul

FlashNormOp = Callable[[torch.Tensor, torch.Tensor, float, Sequence[int]], list[torch.Tensor]]
FlashNormAddOp = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, Sequence[int]], tuple[torch.Tensor, list[torch.Tensor]]
]

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    max_position_embeddings=8192,
    hidden_act="silu",
)


def llama_config(**overrides):
    """A LlamaConfig of the SmolLM2-135M architecture, with `overrides` (tiny CPU variants)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**SMOLLM2_135M, **overrides})


def random_llama(
    config, seed: int, device: torch.device | str = "cpu", negative_gain_fraction: float = 0.25
) -> nn.Module:
    """A float32 LlamaForCausalLM on `device` with seeded random weights and random norm gains.

    Weights use transformers' own initialisation, drawn on `device` (seconds on a CPU for
    135M parameters, nothing on a GPU). Gains are |g| ~ U(0.5, 1.5) with a random sign
    (negative with `negative_gain_fraction`), drawn per norm, so folding is exercised with
    non-trivial, sign-changing gains.
    """
    from transformers import LlamaForCausalLM

    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = LlamaForCausalLM(config)
        model.config._attn_implementation = "sdpa"
        generator = torch.Generator().manual_seed(seed + 1)
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                size = module.weight.shape
                magnitude = 0.5 + torch.rand(size, generator=generator)
                sign = torch.where(torch.rand(size, generator=generator) < negative_gain_fraction, -1.0, 1.0)
                module.weight.data.copy_(magnitude * sign)
    return model.eval()


# The FlashNorm math in PyTorch (fp32 accumulation and fp32 RMS, outputs in x's dtype): the
# library's own reference, which its custom op also runs on the CPU.
reference_flashnorm_op: FlashNormOp = reference_matmul


def reference_flashnorm_add_op(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, splits: Sequence[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The add op's math in PyTorch: h = x + residual in fp32, rounded once, then the op on h."""
    total = reference_add(x, residual)
    return total, reference_matmul(total, w, eps, splits)


class _FusedSite(nn.Module):
    """One norm→projections site: a single op call whose outputs several projections share.

    Each projection replaced by a `_SiteOutput` asks the site for its column block; the op
    runs once per distinct input tensor (q, k and v receive the very same tensor object).
    """

    def __init__(self, weight_kn: torch.Tensor, eps: float, splits: Sequence[int], op: FlashNormOp):
        super().__init__()
        self.register_buffer("weight", weight_kn.contiguous())
        self.eps = float(eps)
        self.splits = [int(s) for s in splits]
        self.op = op
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] = []

    def outputs_for(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self._input is not x:
            self._outputs = self.op(x.contiguous(), self.weight, self.eps, self.splits)
            self._input = x
        return self._outputs

    def forget(self) -> None:
        self._input = None
        self._outputs = []


class _SiteOutput(nn.Module):
    """Stands in for one nn.Linear of a fused site: returns that projection's column block."""

    def __init__(self, site: _FusedSite, index: int):
        super().__init__()
        self.site = site
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.site.outputs_for(x)[self.index]


class _AddFusedLayer(nn.Module):
    """A decoder layer whose post-attention residual add runs inside its gate|up call:
    h = attention + residual and gate, up = the op on h, in one `add_op` call, then the MLP and
    its own residual add as transformers computes them. The attention's q|k|v projections are
    already a FlashNorm site, which also stands in for the input norm."""

    def __init__(
        self, layer: nn.Module, gate_up_weight: torch.Tensor, eps: float, splits: Sequence[int], add_op: FlashNormAddOp
    ):
        super().__init__()
        self.self_attn = layer.self_attn
        self.down_proj = layer.mlp.down_proj
        self.act_fn = layer.mlp.act_fn
        self.register_buffer("gate_up_weight", gate_up_weight.contiguous())
        self.eps = float(eps)
        self.splits = [int(s) for s in splits]
        self.add_op = add_op

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        # Every keyword the model passes its layers (mask, positions, cache, ...) is the
        # attention's, as in transformers' own LlamaDecoderLayer.
        attention, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        total, (gate, up) = self.add_op(
            attention.contiguous(), hidden_states.contiguous(), self.gate_up_weight, self.eps, self.splits
        )
        return total + self.down_proj(self.act_fn(gate) * up)


def _folded_weight(gain: torch.Tensor, linears: Sequence[nn.Linear]) -> torch.Tensor:
    """W* = diag(g)·[W_1ᵀ | W_2ᵀ | ...], [K, N], computed in float64 and returned as float32."""
    for linear in linears:
        if linear.bias is not None:
            raise ValueError("a FlashNorm site folds bias-free projections only")
    w_kn = torch.cat([linear.weight.detach().double().t() for linear in linears], dim=1)
    return (gain.detach().double()[:, None] * w_kn).float()


def flashnorm_llama(model: nn.Module, op: FlashNormOp, add_op: FlashNormAddOp) -> nn.Module:
    """A float32 copy of `model` in which every norm→projection site makes one call: `add_op`
    (the residual add before the norm included) at gate|up, `op` at q|k|v and the LM head.

    Fold in float64 from the float32 master weights; cast the result with `.to(dtype)`.
    """
    folded = copy.deepcopy(model)
    eps = float(model.config.rms_norm_eps)
    for index, layer in enumerate(folded.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        site = _FusedSite(_folded_weight(layer.input_layernorm.weight, qkv), eps, [p.out_features for p in qkv], op)
        attn.q_proj, attn.k_proj, attn.v_proj = (_SiteOutput(site, i) for i in range(3))
        gate_up = [mlp.gate_proj, mlp.up_proj]
        gate_up_weight = _folded_weight(layer.post_attention_layernorm.weight, gate_up)
        folded.model.layers[index] = _AddFusedLayer(
            layer, gate_up_weight, eps, [p.out_features for p in gate_up], add_op
        )

    # The LM head is tied to the embedding: fold into an untied copy, never into the shared
    # table (the embedding lookup must keep the unscaled rows).
    head = folded.lm_head
    site = _FusedSite(_folded_weight(folded.model.norm.weight, [head]), eps, [head.out_features], op)
    folded.lm_head = _SiteOutput(site, 0)
    folded.model.norm = nn.Identity()
    return folded


def forget_site_inputs(model: nn.Module) -> None:
    """Drop the tensors the fused sites hold on to between calls."""
    for module in model.modules():
        if isinstance(module, _FusedSite):
            module.forget()


@dataclasses.dataclass
class Schedule:
    """Which tokens a long generation feeds.

    Positions [0, prefill) go in one forward (M = prefill rows: the multi-row path); then one
    token per step (M = 1, the decode path) with a KV cache. Tokens before `greedy_start` are
    random (diverse inputs for the teacher-forced comparison); from `greedy_start` on, each
    token is the reference model's greedy choice.
    """

    total: int
    prefill: int
    greedy_start: int

    def __post_init__(self):
        if not 0 < self.prefill <= self.greedy_start <= self.total:
            raise ValueError(f"need 0 < prefill <= greedy_start <= total, got {self}")


def _cache_keyword(model: nn.Module) -> str:
    # transformers renamed `past_key_values` to `cache`; the device and this machine differ.
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@torch.inference_mode()
def run_generation(
    model: nn.Module, schedule: Schedule, prompt: torch.Tensor, tokens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feeds `schedule.total` tokens through `model` with a KV cache; returns (tokens, logits).

    `prompt` holds the random tokens for positions [0, greedy_start). With `tokens` given
    (teacher forcing), the same tokens are fed and the model's own choices are ignored;
    otherwise the model chooses greedily from greedy_start on. `logits[t]` (float32, on the
    model's device) is the distribution after seeing tokens[0..t].
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    if tokens is None:
        tokens = torch.empty(schedule.total, dtype=torch.long, device=device)
        tokens[: schedule.greedy_start] = prompt[: schedule.greedy_start].to(device)
        choose = True
    else:
        tokens = tokens.to(device)
        choose = False
    vocab = model.config.vocab_size
    logits = torch.empty(schedule.total, vocab, dtype=torch.float32, device=device)
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers releases whose DynamicCache takes no config
        cache = DynamicCache()
    cache_kw = _cache_keyword(model)

    out = model(input_ids=tokens[None, : schedule.prefill], use_cache=True, **{cache_kw: cache})
    logits[: schedule.prefill] = out.logits[0].float()
    for t in range(schedule.prefill, schedule.total):
        if choose and t >= schedule.greedy_start:
            tokens[t] = torch.argmax(logits[t - 1])
        out = model(input_ids=tokens[None, t : t + 1], use_cache=True, **{cache_kw: cache})
        logits[t] = out.logits[0, -1].float()
    forget_site_inputs(model)
    return tokens, logits


@dataclasses.dataclass
class Comparison:
    """Per-step agreement of a candidate's logits with a reference's, on the same tokens."""

    relative_error: torch.Tensor  # [T]  ‖cand_t − ref_t‖ / ‖ref_t‖
    lagged_error: torch.Tensor  # [T-1] ‖cand_t − ref_{t−1}‖ / ‖ref_t‖, for t ≥ 1
    reference_change: torch.Tensor  # [T-1] ‖ref_t − ref_{t−1}‖ / ‖ref_t‖, for t ≥ 1
    greedy_agreement: int  # leading greedy steps where argmax(cand_t) == the fed next token
    greedy_steps: int  # greedy steps compared
    lag_min_change: float = 0.0  # steps where the reference moved less than this prove nothing

    @property
    def max_error(self) -> float:
        return float(self.relative_error.max())

    @property
    def worst_step(self) -> int:
        return int(self.relative_error.argmax())

    @property
    def median_error(self) -> float:
        return float(self.relative_error.median())

    def _lagged(self) -> torch.Tensor:
        # A step shows the lag signature when the candidate is at least as near the reference's
        # previous step as its own. Where the reference barely moved between two steps (a
        # repeated greedy token), rounding noise alone can tip that, so those steps are left out.
        return (self.lagged_error <= self.relative_error[1:]) & (self.reference_change > self.lag_min_change)

    @property
    def lag_checked_steps(self) -> int:
        return int((self.reference_change > self.lag_min_change).sum())

    @property
    def lagged_steps(self) -> int:
        """Steps that match the reference's previous step at least as well as their own."""
        return int(self._lagged().sum())

    def first_lagged_step(self) -> int | None:
        hits = torch.nonzero(self._lagged())
        return None if hits.numel() == 0 else int(hits[0, 0]) + 1

    def summary(self) -> str:
        lag = self.first_lagged_step()
        return (
            f"rel err max {self.max_error:.3e} (step {self.worst_step}), median {self.median_error:.3e}; "
            f"steps matching the reference's previous step: {self.lagged_steps} of {self.lag_checked_steps}"
            + ("" if lag is None else f" (first at step {lag})")
            + f"; greedy agreement {self.greedy_agreement}/{self.greedy_steps}"
        )


def compare(
    reference: torch.Tensor, candidate: torch.Tensor, tokens: torch.Tensor, schedule: Schedule, lag_min_change: float = 0.0
) -> Comparison:
    """Compares per-step logits [T, V]; greedy agreement counts steps greedy_start-1 … T-2.

    The lag check skips steps where the reference changed by `lag_min_change` or less
    (relative): set it to the error tolerance, below which two steps cannot be told apart.
    """
    reference = reference.double()
    candidate = candidate.double()
    ref_norm = reference.norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)
    relative = (candidate - reference).norm(dim=-1) / ref_norm
    lagged = (candidate[1:] - reference[:-1]).norm(dim=-1) / ref_norm[1:]
    change = (reference[1:] - reference[:-1]).norm(dim=-1) / ref_norm[1:]
    steps = range(schedule.greedy_start - 1, schedule.total - 1)
    choices = torch.argmax(candidate[schedule.greedy_start - 1 : schedule.total - 1], dim=-1)
    fed = tokens[schedule.greedy_start : schedule.total].to(choices.device)
    mismatch = torch.nonzero(choices != fed)
    agreement = len(steps) if mismatch.numel() == 0 else int(mismatch[0, 0])
    return Comparison(relative.cpu(), lagged.cpu(), change.cpu(), agreement, len(steps), lag_min_change)


def bf16_error_budget(bf16_reference_error: torch.Tensor, factor: float = 2.0) -> float:
    """The largest per-step error a bf16 FlashNorm model may show against the fp32 model.

    bf16 keeps 8 significant bits, so both bf16 models drift from the fp32 one by rounding
    alone; FlashNorm rounds differently (one rounding of diag(g)·W instead of rounding the
    normalized activations and then their product with g). The budget: no worse than `factor`
    times the worst drift of the bf16 original itself over the same steps.
    """
    return factor * float(bf16_reference_error.max())

