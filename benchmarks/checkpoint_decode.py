"""One decode step of a SmolLM2-135M-shaped model: the original checkpoint against its
folded checkpoint (`flashnorm fold-checkpoint`), both loaded with stock transformers, bf16,
static KV cache, under torch.compile.

    python benchmarks/checkpoint_decode.py --out DIR     # GPU: DIR/checkpoint_decode.{json,md}
    python benchmarks/checkpoint_decode.py --smoke       # CPU: a 2-layer model, eager, checks the script

Model: SmolLM2-135M's published shape (576 hidden, 1536 MLP, 30 layers, 9 heads / 3 KV heads,
49152 vocabulary, tied embeddings), random weights, norm gains |g| ~ U(0.5, 1.5) with a quarter
negative. The original is written as a float32 checkpoint, folded with fold_checkpoint
(--dtype bfloat16: W·g formed in float64, one rounding), and both are loaded in bf16.

Step: one token after a CONTEXT-token prefill into a StaticCache of CACHE positions (attention
covers the whole static cache under a mask, so every call does the same work; transformers
versions that track the cache length themselves advance it, which CACHE leaves room for).
Variants: eager (each call between two CUDA events, launch gaps included) and
torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA graphs: one replay per call).
Times: median µs of ITERS calls, in two rounds alternating original/folded; the rounds'
spread is the noise. Logits: the folded model's step logits against the original's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))
from flashnorm.checkpoint import fold_checkpoint  # noqa: E402
from flashnorm.progress import Progress  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
               rms_norm_eps=1e-5, max_position_embeddings=2048)
CONTEXT = 512
CACHE = 2048
ITERS = 300


def build_checkpoints(root: Path, shape: dict) -> tuple[Path, Path, dict]:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape)
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if "RMSNorm" in type(module).__name__:
                size = module.weight.numel()
                magnitude = torch.rand(size, generator=generator) + 0.5
                sign = torch.where(torch.rand(size, generator=generator) < 0.25, -1.0, 1.0)
                module.weight.copy_(magnitude * sign)
    model.save_pretrained(root / "original")
    Progress.enabled = False
    report = fold_checkpoint(root / "original", root / "folded", dtype="bfloat16")
    return root / "original", root / "folded", report


def load(path: Path, device: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()


def decoder(model, device: str, compiled: bool):
    """A callable doing one decode step (token at position CONTEXT) on a prefilled static cache."""
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (1, CONTEXT), generator=generator).to(device)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(CONTEXT, device=device), use_cache=True)
    token = torch.tensor([[7]], device=device)
    position = torch.tensor([CONTEXT], device=device)

    def forward(ids, pos):
        return model(input_ids=ids, past_key_values=cache, cache_position=pos, position_ids=pos[None], use_cache=True).logits

    step = torch.compile(forward, mode="reduce-overhead", fullgraph=True) if compiled else forward

    def call():
        with torch.no_grad():
            return step(token, position)

    return call


def time_calls(call, device: str, iters: int) -> list[float]:
    for _ in range(5):
        call()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
    else:
        for _ in range(iters):
            started = time.perf_counter()
            call()
            times.append((time.perf_counter() - started) * 1e6)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for checkpoint_decode.json and .md")
    parser.add_argument("--smoke", action="store_true", help="CPU, 2 layers, eager only, few iterations")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shape = dict(SMOLLM2, num_hidden_layers=2) if args.smoke else SMOLLM2
    iters = 5 if args.smoke else ITERS
    modes = [False] if args.smoke else [False, True]
    result: dict = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "torch": torch.__version__, "python": platform.python_version(), "shape": shape,
                    "context": CONTEXT, "iters": iters}
    import transformers

    result["transformers"] = transformers.__version__
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    out = args.out
    if out:
        out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        if out:
            (out / "checkpoint_decode.json").write_text(json.dumps(result, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        original_path, folded_path, report = build_checkpoints(Path(tmp), shape)
        result["fold"] = {"folded": report["folded"], "norm_sites": report["norm_sites"],
                          "seconds": round(time.monotonic() - started, 1)}
        models = {"original": load(original_path, device), "folded": load(folded_path, device)}
    for compiled in modes:
        label = "compile" if compiled else "eager"
        started = time.monotonic()
        calls = {name: decoder(model, device, compiled) for name, model in models.items()}
        logits = {name: call().float() for name, call in calls.items()}
        for _ in range(2):  # let reduce-overhead record and replay its graphs
            for call in calls.values():
                call()
        result[label] = {"setup_seconds": round(time.monotonic() - started, 1),
                         "logits_rel_err": float((logits["folded"] - logits["original"]).norm() / logits["original"].norm()),
                         "top1_equal": bool(torch.equal(logits["folded"].argmax(-1), logits["original"].argmax(-1))),
                         "rounds": []}
        for _ in range(2):
            medians = {name: statistics.median(time_calls(call, device, iters)) for name, call in calls.items()}
            result[label]["rounds"].append(medians)
            save()
        print(label, json.dumps(result[label]), flush=True)
    save()
    if out:
        lines = ["| variant | original µs | folded µs | folded/original | logits rel err (bf16) | top-1 equal |", "|---|---|---|---|---|---|"]
        for label in ("eager", "compile"):
            if label in result:
                r = result[label]
                o = [round(x["original"], 1) for x in r["rounds"]]
                f = [round(x["folded"], 1) for x in r["rounds"]]
                ratio = statistics.mean(x["folded"] / x["original"] for x in r["rounds"])
                lines.append(f"| {label} | {' / '.join(map(str, o))} | {' / '.join(map(str, f))} | {ratio:.3f} | "
                             f"{r['logits_rel_err']:.2e} | {r['top1_equal']} |")
        (out / "checkpoint_decode.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
