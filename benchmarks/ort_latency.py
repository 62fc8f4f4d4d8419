"""ONNX Runtime CPU latency of a model before and after `flashnorm optimize`.

Both models run in sessions built from the same SessionOptions, on the same random inputs
(batch 1 × `--sequence` tokens, a full-sequence forward pass). Runs alternate between the
two sessions so that load from other processes hits both alike; the result is the median
(and minimum) of each, the median of the per-pair ratios with a 95 % bootstrap interval, and
the two models' logits difference. Also counts
the norm ops ONNX Runtime fused in each model (folding keeps a gain of ones so that ONNX
Runtime still recognises the norm).

    python benchmarks/ort_latency.py original.onnx optimized.onnx --runs 200 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

_FUSED_NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization")


def session_options(threads: int, optimized_model: Path | None = None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if optimized_model is not None:
        options.optimized_model_filepath = str(optimized_model)
    return options


def make_inputs(session: ort.InferenceSession, sequence: int, vocab: int, rng: np.random.Generator) -> dict:
    feeds = {}
    for arg in session.get_inputs():
        if arg.name == "input_ids":
            feeds[arg.name] = rng.integers(0, vocab, (1, sequence), dtype=np.int64)
        elif arg.name == "attention_mask":
            feeds[arg.name] = np.ones((1, sequence), dtype=np.int64)
        elif arg.name == "position_ids":
            feeds[arg.name] = np.arange(sequence, dtype=np.int64)[None, :]
        else:
            raise SystemExit(f"don't know how to feed input {arg.name!r} ({arg.type}, {arg.shape})")
    return feeds


def fused_norm_counts(model: Path, threads: int) -> dict[str, int]:
    """Op types of the graph ONNX Runtime actually runs, for the norm-related ones."""
    with tempfile.TemporaryDirectory() as scratch:
        dumped = Path(scratch) / "ort_optimized.onnx"
        ort.InferenceSession(str(model), session_options(threads, dumped), providers=["CPUExecutionProvider"])
        graph = onnx.load(str(dumped), load_external_data=False).graph
    counts = collections.Counter(node.op_type for node in graph.node)
    return {op: counts[op] for op in (*_FUSED_NORMS, "MatMul", "FusedMatMul", "ReduceMean", "Pow", "Sqrt") if counts[op]}


def _bootstrap_median_ci(ratios: np.ndarray, rng: np.random.Generator, samples: int = 10000) -> tuple[float, float]:
    """95 % bootstrap interval of the median of the per-pair ratios."""
    picks = rng.integers(0, ratios.size, (samples, ratios.size))
    medians = np.median(ratios[picks], axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("original", type=Path)
    parser.add_argument("optimized", type=Path)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--runs", type=int, default=200, help="timed runs per model")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    rng = np.random.default_rng()
    options = session_options(args.threads)
    sessions = {
        name: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for name, path in (("original", args.original), ("optimized", args.optimized))
    }
    vocab = sessions["original"].get_outputs()[0].shape[-1]
    if not isinstance(vocab, int):
        raise SystemExit(f"the first output's last dimension (vocabulary) is not static: {vocab}")
    feeds = make_inputs(sessions["original"], args.sequence, vocab, rng)

    outputs = {name: session.run(None, feeds)[0] for name, session in sessions.items()}
    difference = np.abs(outputs["original"].astype(np.float64) - outputs["optimized"])
    for _ in range(args.warmup):
        for session in sessions.values():
            session.run(None, feeds)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    load_before = os.getloadavg()[0]
    for run in range(args.runs):
        order = list(sessions) if run % 2 == 0 else list(reversed(sessions))
        for name in order:
            start = time.perf_counter()
            sessions[name].run(None, feeds)
            times[name].append(time.perf_counter() - start)

    original, optimized = (np.array(times[n]) * 1e3 for n in ("original", "optimized"))
    result = {
        "environment": {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": args.threads,
            "onnxruntime": ort.__version__, "onnx": onnx.__version__, "numpy": np.__version__,
        },
        "models": {"original": str(args.original), "optimized": str(args.optimized)},
        "input": f"batch 1 x {args.sequence} tokens", "runs": args.runs, "warmup": args.warmup,
        "median_ms": {"original": round(float(np.median(original)), 2), "optimized": round(float(np.median(optimized)), 2)},
        "p10_p90_ms": {
            "original": [round(float(v), 2) for v in np.percentile(original, [10, 90])],
            "optimized": [round(float(v), 2) for v in np.percentile(optimized, [10, 90])],
        },
        "min_ms": {"original": round(float(original.min()), 2), "optimized": round(float(optimized.min()), 2)},
        "median_ratio_optimized_over_original": round(float(np.median(optimized / original)), 3),
        "median_ratio_ci95": [round(float(v), 3) for v in _bootstrap_median_ci(optimized / original, rng)],
        "load_average_1min_before_after": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "logits_max_abs_diff": float(difference.max()),
        "logits_max_rel_diff": float((difference / (np.abs(outputs["original"]).max())).max()),
        "ort_graph_ops": {name: fused_norm_counts(path, args.threads)
                          for name, path in (("original", args.original), ("optimized", args.optimized))},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
