"""One decode step (and one prefill) of a Llama-architecture model, with and without FlashNorm,
eager and under torch.compile, each captured in a CUDA graph.

    python benchmarks/decode_step.py --out DIR      # GPU: DIR/decode_step.{md,json,png}
    python benchmarks/decode_step.py --smoke        # CPU: a tiny model, wall clock, checks the script

Models: SmolLM2-135M-shaped and Llama-3.2-1B-shaped (their published sizes; tied embeddings),
random weights (projections N(0, 1/K), norm gains |g| ~ U(0.5, 1.5) with a quarter negative), bf16.
A static KV cache of 1024 positions per sequence (filled with random values; the decode step
writes its position and attends over the whole cache under a mask, as a static cache does).

Variants (one step each, all in a CUDA graph, so launch gaps are not measured):
  eager            h = h + delta, F.rms_norm(h, gain), then x @ W, per site (PyTorch's fused norm
                   + cuBLAS)
  eager+flashnorm  h, *y = torch.ops.flashnorm.add_matmul(h, delta, W*, eps, splits) at every
                   norm→projection site (q|k|v, gate|up, final norm → LM head), W* = diag(g)·W
                   folded in fp32: the residual add, the norm and the projection in one call
  compile          torch.compile(fullgraph=True) of the eager layer and head
  compile+flashnorm  the same of the FlashNorm layer and head: the op inside the compiled graph,
                   which Inductor keeps as the library call where AUTO picks the fused kernel (the
                   add then runs inside it) and compiles to the add and the prenorm arithmetic
                   elsewhere (flashnorm.cuda_ops.add_inductor_form)
  compile+flashnorm-matmul  the same with the add left to Inductor, h = h + delta, then
                   torch.ops.flashnorm.matmul(h, ...): the op without the residual add
  compile+fold     torch.compile of the folded model without the library: h = h + delta, the
                   weightless norm x ⊙ rsqrt(mean(x²)+eps), rounded to bf16, then x̂ @ W*
                   (Proposition 1 alone; Inductor fuses the add and the norm into one kernel)
  compile+norm-free  torch.compile of the model with every norm deleted (h = h + delta, then h @ W*):
                   the ceiling, what the step would cost if the norms cost nothing; its logits are
                   not the model's (reported, not judged), so the tables can say what share of the
                   norms' cost each FlashNorm variant recovers
The layer is one function, compiled once per shape and called for every layer with that layer's
weights (shapes, not identities, are guarded), so compile time does not grow with depth.

Residual adds: every norm→projection site follows a residual add (h + o_proj(a) before the MLP's
norm, h + down(m) before the next layer's or the final norm). A layer takes (h, delta) and returns
(h, delta) with its last add still pending, so that the add sits in the same compiled graph as the
norm after it in every variant, as it would in a whole-model compile: Inductor fuses it into the
norm's kernel in `compile`, the library runs it inside the fused kernel in `compile+flashnorm`.
The first layer's delta is a zero tensor (an exact no-op add, in every variant).

Shapes: decode at batch 1, 8, 64 (one token per sequence at position 512) and a 1×512 prefill
(positions 0..511). Prefill computes the LM head for the last position only, as servers do.

Times: median µs per graph replay, each replay between two CUDA events, in two rounds over all
variants (round 2 re-times the same graphs after round 1 finished): the rounds' spread is the
noise. Logits: each variant's last-position logits against the fp32 model's (same weights,
same cache contents), as ‖Δ‖/‖ref‖ and max |Δ|.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))
from flashnorm import cuda_ops  # noqa: E402  (registers torch.ops.flashnorm.matmul)


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_splits(self) -> list[int]:
        return [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]


MODELS = {
    "smollm2-135m": Config("SmolLM2-135M", 576, 1536, 30, 9, 3, 49152, 100000.0),
    "llama-3.2-1b": Config("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, 500000.0),
}
TINY = Config("tiny", 64, 128, 2, 4, 2, 256, 10000.0)
VARIANTS = ("eager", "eager+flashnorm", "compile", "compile+flashnorm", "compile+flashnorm-matmul", "compile+fold",
            "compile+norm-free")
# How a residual add + norm→projection site is computed (see the docstring).
SITES = ("norm", "flashnorm", "flashnorm-matmul", "fold", "norm-free")
# The variant whose logits are not the model's: the norms deleted (the ceiling).
NORM_FREE = "norm-free"
CACHE = 1024
DECODE_POSITION = 512
# (label, batch, tokens per sequence, first position)
SHAPES = [("decode b=1", 1, 1, DECODE_POSITION), ("decode b=8", 8, 1, DECODE_POSITION),
          ("decode b=16", 16, 1, DECODE_POSITION), ("decode b=64", 64, 1, DECODE_POSITION),
          ("prefill 1x512", 1, 512, 0)]


@dataclasses.dataclass
class Weights:
    """One model's weights in one dtype; `folded` holds W* = diag(g)·W for the FlashNorm sites."""

    embedding: torch.Tensor  # [V, H]
    layers: list[dict[str, torch.Tensor]]
    final_gain: torch.Tensor
    head_folded: torch.Tensor  # [H, V] = diag(final_gain)·embeddingᵀ


def random_weights(config: Config, seed: int, device: str) -> Weights:
    """fp32 master weights, seeded; norm gains |g| ~ U(0.5, 1.5), a quarter of them negative."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device) * std

    def gain() -> torch.Tensor:
        magnitude = 0.5 + torch.rand(config.hidden, generator=generator, device=device)
        sign = torch.where(torch.rand(config.hidden, generator=generator, device=device) < 0.25, -1.0, 1.0)
        return magnitude * sign

    h, i = config.hidden, config.intermediate
    layers = []
    for _ in range(config.layers):
        layer = dict(
            attn_gain=gain(),
            wqkv=normal(h, sum(config.qkv_splits), std=h**-0.5),
            wo=normal(h, h, std=h**-0.5),
            mlp_gain=gain(),
            wgu=normal(h, 2 * i, std=h**-0.5),
            wdown=normal(i, h, std=i**-0.5),
        )
        layer["wqkv_folded"] = layer["attn_gain"][:, None] * layer["wqkv"]
        layer["wgu_folded"] = layer["mlp_gain"][:, None] * layer["wgu"]
        layers.append(layer)
    embedding = normal(config.vocab, h, std=1.0)
    final_gain = gain()
    return Weights(embedding, layers, final_gain, (final_gain[:, None] * embedding.t()).contiguous())


def cast(weights: Weights, dtype: torch.dtype) -> Weights:
    return Weights(
        weights.embedding.to(dtype),
        [{name: tensor.to(dtype).contiguous() for name, tensor in layer.items()} for layer in weights.layers],
        weights.final_gain.to(dtype),
        weights.head_folded.to(dtype),
    )


def rope_tables(config: Config, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inverse = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2, device=device).float() / config.head_dim)
    angles = torch.outer(torch.arange(CACHE, device=device).float(), inverse)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def make_site(sites: str, size: int, eps: float) -> Callable[..., tuple[torch.Tensor, list[torch.Tensor]]]:
    """One residual add and norm→projection site, (h, delta) → (h + delta, [split outputs]): `w` is
    W for "norm", W* for the others."""

    def site(h: torch.Tensor, delta: torch.Tensor, gain: torch.Tensor, w: torch.Tensor,
             splits: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if sites == "flashnorm":
            total, *outputs = torch.ops.flashnorm.add_matmul(h, delta, w, eps, splits, "auto")
            return total, outputs
        h = h + delta
        if sites == "flashnorm-matmul":
            return h, torch.ops.flashnorm.matmul(h, w, eps, splits, "auto")
        if sites == "fold":
            h32 = h.float()
            normalized = (h32 * torch.rsqrt(h32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(h.dtype)
            return h, list((normalized @ w).split(splits, dim=-1))
        if sites == NORM_FREE:
            return h, list((h @ w).split(splits, dim=-1))
        return h, list((F.rms_norm(h, (size,), gain, eps) @ w).split(splits, dim=-1))

    return site


def make_layer(config: Config, sites: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """One decoder layer: (h, delta) [B, T, H] → (h, delta), the residual stream and its pending add,
    writing this step's k/v into the caches at `positions`.
    `mask` is [G·T, S] (True: attend), G query heads per KV head stacked along the query axis so
    that one SDPA call over the un-repeated KV cache serves grouped-query attention."""
    h_size, i_size, eps = config.hidden, config.intermediate, config.eps
    heads, kv_heads, d = config.heads, config.kv_heads, config.head_dim
    group = heads // kv_heads
    qkv_splits = config.qkv_splits
    site = make_site(sites, h_size, eps)

    def layer(h, delta, cos, sin, positions, mask, k_cache, v_cache, attn_gain, wqkv, wo, mlp_gain, wgu, wdown):
        batch, tokens, _ = h.shape
        h, (q, k, v) = site(h, delta, attn_gain, wqkv, qkv_splits)
        q = _rotate(q.view(batch, tokens, heads, d).transpose(1, 2), cos, sin)
        k = _rotate(k.view(batch, tokens, kv_heads, d).transpose(1, 2), cos, sin)
        v = v.view(batch, tokens, kv_heads, d).transpose(1, 2)
        k_cache.index_copy_(2, positions, k.to(k_cache.dtype))
        v_cache.index_copy_(2, positions, v.to(v_cache.dtype))
        grouped = q.reshape(batch, kv_heads, group * tokens, d)
        attention = F.scaled_dot_product_attention(grouped, k_cache, v_cache, attn_mask=mask)
        attention = attention.reshape(batch, heads, tokens, d).transpose(1, 2).reshape(batch, tokens, heads * d)
        h, (gate, up) = site(h, attention @ wo, mlp_gain, wgu, [i_size, i_size])
        return h, (F.silu(gate) * up) @ wdown

    return layer


def make_head(config: Config, sites: str) -> Callable[..., torch.Tensor]:
    """Final norm and tied LM head on the last position: [B, T, H] → logits [B, V]."""
    h_size, eps, vocab = config.hidden, config.eps, config.vocab
    site = make_site(sites, h_size, eps)

    def head(h, delta, final_gain, embedding, head_folded):
        last, last_delta = h[:, -1], delta[:, -1]
        if sites == "norm":
            return F.linear(F.rms_norm(last + last_delta, (h_size,), final_gain, eps), embedding)
        return site(last, last_delta, final_gain, head_folded, [vocab])[1][0]

    return head


class Model:
    """A step function over fixed weights and caches: step(tokens [B, T], first position) → logits."""

    def __init__(self, config: Config, weights: Weights, caches: list[tuple[torch.Tensor, torch.Tensor]],
                 tables: tuple[torch.Tensor, torch.Tensor], sites: str, compiled: bool) -> None:
        self.config, self.weights, self.caches, self.folded = config, weights, caches, sites != "norm"
        self.cos_table, self.sin_table = tables
        self.layer = make_layer(config, sites)
        self.head = make_head(config, sites)
        if compiled:
            self.layer = torch.compile(self.layer, fullgraph=True, dynamic=False)
            self.head = torch.compile(self.head, fullgraph=True, dynamic=False)

    def step(self, tokens: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        config = self.config
        group = config.heads // config.kv_heads
        positions = first + torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = self.cos_table[positions], self.sin_table[positions]
        mask = torch.arange(CACHE, device=tokens.device)[None, :] <= positions[:, None]
        mask = mask.repeat(group, 1)
        h = self.weights.embedding[tokens]
        delta = torch.zeros_like(h)
        for layer, (k_cache, v_cache) in zip(self.weights.layers, self.caches):
            wqkv = layer["wqkv_folded"] if self.folded else layer["wqkv"]
            wgu = layer["wgu_folded"] if self.folded else layer["wgu"]
            h, delta = self.layer(h, delta, cos.to(h.dtype), sin.to(h.dtype), positions, mask, k_cache, v_cache,
                                  layer["attn_gain"], wqkv, layer["wo"], layer["mlp_gain"], wgu, layer["wdown"])
        return self.head(h, delta, self.weights.final_gain, self.weights.embedding, self.weights.head_folded)


def random_caches(config: Config, batch: int, seed: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, config.kv_heads, CACHE, config.head_dim)
    return [(torch.randn(shape, generator=generator, device=device), torch.randn(shape, generator=generator, device=device))
            for _ in range(config.layers)]


def errors(got: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    delta = got.float() - reference
    return dict(relative=(delta.norm() / reference.norm()).item(), max_abs=delta.abs().max().item())


class Captured:
    """`call` warmed up on a side stream (compiling there if it compiles), then captured in a graph."""

    def __init__(self, call: Callable[[], torch.Tensor]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = call()
        self.graph.replay()  # a capture computes nothing: the output is written by the first replay
        torch.cuda.synchronize()

    def time_us(self, replays: int) -> float:
        for _ in range(5):
            self.graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for start, end in events:
            start.record()
            self.graph.replay()
            end.record()
        torch.cuda.synchronize()
        return 1e3 * statistics.median(start.elapsed_time(end) for start, end in events)


def run_shape(config: Config, master: Weights, bf16: Weights, label: str, batch: int, tokens_per_row: int,
              first_position: int, replays: int, seed: int) -> list[dict]:
    device = "cuda"
    tables = rope_tables(config, device)
    caches32 = random_caches(config, batch, seed, device)
    caches16 = [(k.bfloat16(), v.bfloat16()) for k, v in caches32]
    tokens = torch.randint(0, config.vocab, (batch, tokens_per_row), device=device,
                           generator=torch.Generator(device=device).manual_seed(seed + 1))
    first = torch.tensor(first_position, device=device)
    with torch.no_grad():
        reference = Model(config, master, caches32, tables, sites="norm", compiled=False).step(tokens, first)
    rows, captured = [], {}
    for variant in VARIANTS:
        sites = variant.partition("+")[2] or "norm"
        model = Model(config, bf16, caches16, tables, sites=sites, compiled="compile" in variant)
        started = time.perf_counter()
        with torch.no_grad():
            captured[variant] = Captured(lambda model=model: model.step(tokens, first))
        rows.append(dict(model=config.name, shape=label, variant=variant, setup_s=round(time.perf_counter() - started, 1),
                         **errors(captured[variant].output, reference)))
    for round_index in (1, 2):
        for row in rows:
            row[f"us_round{round_index}"] = round(captured[row["variant"]].time_us(replays), 1)
    del captured
    torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | shape | variant | µs (round 1) | µs (round 2) | vs compile | logits ‖Δ‖/‖ref‖ vs fp32 | max abs Δ |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["shape"] == row["shape"] and r["variant"] == "compile")
        ratio = row["us_round1"] / base["us_round1"], row["us_round2"] / base["us_round2"]
        lines.append(f"| {row['model']} | {row['shape']} | {row['variant']} | {row['us_round1']:.1f} | {row['us_round2']:.1f} "
                     f"| {ratio[0]:.2f}× / {ratio[1]:.2f}× | {row['relative']:.2e} | {row['max_abs']:.3f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> str:
    """Per model: round-1 µs per shape and variant (top) and each compiled variant's µs relative to
    torch.compile's (bottom, where the target is); '' if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"no plot: {error}"
    models = list(dict.fromkeys(row["model"] for row in rows))
    figure, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7), squeeze=False)
    for column, model in enumerate(models):
        shapes = list(dict.fromkeys(row["shape"] for row in rows if row["model"] == model))
        variants = list(dict.fromkeys(row["variant"] for row in rows if row["model"] == model))
        us = {(r["shape"], r["variant"]): r["us_round1"] for r in rows if r["model"] == model}
        width = 0.8 / len(variants)
        axis = axes[0][column]
        for index, variant in enumerate(variants):
            axis.bar([x + index * width for x in range(len(shapes))], [us[s, variant] for s in shapes], width,
                     label=variant)
        axis.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes)
        axis.set_ylabel("µs per step (CUDA-graph replay, median)")
        axis.set_title(f"{model}-shaped, bf16, random weights")
        axis.legend(fontsize=8)
        compiled = [v for v in variants if v.startswith("compile+")] if "compile" in variants else []
        width = 0.8 / max(len(compiled), 1)
        axis = axes[1][column]
        ratios = {variant: [us[s, variant] / us[s, "compile"] for s in shapes] for variant in compiled}
        for index, variant in enumerate(compiled):
            axis.bar([x + index * width for x in range(len(shapes))], ratios[variant], width, label=variant,
                     color=f"C{variants.index(variant)}")
        axis.axhline(1.0, color="black", linewidth=0.8)
        spread = max([abs(r - 1.0) for values in ratios.values() for r in values] + [0.04])
        axis.set_ylim(1.0 - 1.2 * spread, 1.0 + 1.2 * spread)
        axis.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes)
        axis.set_ylabel("µs relative to torch.compile")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    return f"plot: {path.name}"


def environment() -> dict[str, str]:
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               torch=torch.__version__, cuda=str(torch.version.cuda), python=platform.python_version(),
               library=str(cuda_ops.library_path()))
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError) as error:
            env["driver"] = f"unknown ({error})"
    return env


def smoke() -> list[dict]:
    """CPU: the tiny model, eager only (the ops' CPU arithmetic), every site form against fp32."""
    master = random_weights(TINY, 0, "cpu")
    tables = rope_tables(TINY, "cpu")
    rows = []
    for label, batch, tokens_per_row, first_position in [("decode b=3", 3, 1, 5), ("prefill 1x7", 1, 7, 0)]:
        caches = random_caches(TINY, batch, 1, "cpu")
        tokens = torch.randint(0, TINY.vocab, (batch, tokens_per_row), generator=torch.Generator().manual_seed(2))
        first = torch.tensor(first_position)
        reference = Model(TINY, master, caches, tables, sites="norm", compiled=False).step(tokens, first)
        for sites in SITES:
            caches16 = [(k.bfloat16(), v.bfloat16()) for k, v in caches]
            model = Model(TINY, cast(master, torch.bfloat16), caches16, tables, sites=sites, compiled=False)
            started = time.perf_counter()
            logits = model.step(tokens, first)
            rows.append(dict(model=TINY.name, shape=label, variant="eager" if sites == "norm" else f"eager+{sites}",
                             wall_ms=round(1e3 * (time.perf_counter() - started), 2), **errors(logits, reference)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny model, eager, checks the script")
    args = parser.parse_args(argv)
    if args.smoke:
        for row in smoke():
            print(row)
        return 0
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    cuda_ops.warm_up()
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    print(env, flush=True)
    rows: list[dict] = []

    def write() -> str:  # after every shape, so a run stopped at its time limit keeps what it measured
        table = markdown(rows)
        (args.out / "decode_step.md").write_text(f"{env}\n\n{table}\n")
        (args.out / "decode_step.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1) + "\n")
        return table

    for seed, name in enumerate(args.models):
        config = MODELS[name]
        master = random_weights(config, seed, "cuda")
        bf16 = cast(master, torch.bfloat16)
        for label, batch, tokens_per_row, first_position in SHAPES:
            started = time.perf_counter()
            shape_rows = run_shape(config, master, bf16, label, batch, tokens_per_row, first_position,
                                   args.replays if tokens_per_row == 1 else max(args.replays // 4, 20), seed + 10)
            rows += shape_rows
            for row in shape_rows:
                print(row, flush=True)
            print(f"{config.name} {label}: {time.perf_counter() - started:.0f} s", flush=True)
            write()
        del master, bf16
        torch.cuda.empty_cache()
    table = write()
    note = plot(rows, args.out / "decode_step.png")
    print(table)
    print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
