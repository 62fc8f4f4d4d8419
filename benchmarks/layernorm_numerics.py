"""The LayerNorm numerics table of docs/LAYERNORM.md: one LayerNorm site folded and deferred, in
fp32, fp16 and bf16, on rows whose mean is |μ|/σ times their standard deviation.

    python benchmarks/layernorm_numerics.py                       # the table: 5 draws per cell
    python benchmarks/layernorm_numerics.py --draws 2 --ratios 0,100 --dtypes float16

Per cell and draw: `synthetic.build_half_layer_norm_model` (K = 128, three MatMul + Add
projections) in fp32 and in the dtype, the latter optimized with fold ("folded") and fold,defer
("deferred"); 4 × 16 rows (z + μ)·s, z standard normal, μ = ±|μ|/σ per row, s ∈ [0.5, 2],
rounded to the dtype. Each model's relative L2 error over all outputs against the float64 run of
the fp32 model. One markdown row per cell: the unfolded error's range and the folded and deferred
errors' ratios to it (min–max over the draws). fp16 runs on ONNX Runtime's CPU kernels, bf16 on
`validate.bfloat16`'s emulation.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SPELLINGS = {"layer_normalization": "LayerNormalization", "ln_decomposed_cast": "decomposed (torch fp16 form)"}
ROWS = (4, 16)
HIDDEN = 128


def _outputs(model, x: np.ndarray) -> list[np.ndarray]:
    import onnxruntime as ort
    from onnx import TensorProto

    from flashnorm.validate.bfloat16 import emulate_bfloat16

    if any(t.data_type == TensorProto.BFLOAT16 for t in model.graph.initializer):
        model = emulate_bfloat16(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    typed = x.astype(np.float16) if session.get_inputs()[0].type == "tensor(float16)" else x
    return [np.asarray(o, np.float64) for o in session.run(None, {name: typed})]


def _rel_l2(actual: list[np.ndarray], expected: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((a - e) ** 2) for a, e in zip(actual, expected))
                         / sum(np.sum(e ** 2) for e in expected)))


def measure(spelling: str, dtype: str, ratio: float, rng: np.random.Generator) -> dict[str, float]:
    """One draw: {'unfolded', 'folded', 'deferred'} relative L2 errors against float64."""
    import onnx_graphsurgeon as gs

    from flashnorm.passes import run_passes
    from synthetic import build_half_layer_norm_model, float64_model, half_dtype, run

    seed = int(rng.integers(2**31))
    original = build_half_layer_norm_model(spelling, seed, "float32", hidden=HIDDEN)
    half = build_half_layer_norm_model(spelling, seed, dtype, hidden=HIDDEN)
    with contextlib.redirect_stdout(io.StringIO()):  # onnx-graphsurgeon's bfloat16 notes
        folded = gs.export_onnx(run_passes(gs.import_onnx(half), ["fold"])[0])
        deferred = gs.export_onnx(run_passes(gs.import_onnx(folded), ["defer"])[0])
        offset = ratio * rng.choice([-1.0, 1.0], ROWS + (1,))
        x = ((rng.standard_normal(ROWS + (HIDDEN,)) + offset) * rng.uniform(0.5, 2.0))
        x = x.astype(half_dtype(dtype)).astype(np.float32)
        truth = [np.asarray(o, np.float64) for o in run(float64_model(original), {"x": x.astype(np.float64)})]
        return {name: _rel_l2(_outputs(model, x), truth)
                for name, model in (("unfolded", half), ("folded", folded), ("deferred", deferred))}


def _span(values: list[float], digits: str) -> str:
    return f"{min(values):{digits}}–{max(values):{digits}}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--ratios", default="0,1,10,100", help="|μ|/σ values, comma-separated")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--seed", type=int, default=20261207)
    args = parser.parse_args(argv)
    from flashnorm.progress import Progress

    Progress.enabled = False
    rng = np.random.default_rng(args.seed)
    print("| spelling | dtype | \\|μ\\|/σ | unfolded error | folded / unfolded | deferred / unfolded |")
    print("|---|---|---|---|---|---|")
    for spelling, label in SPELLINGS.items():
        for dtype in args.dtypes.split(","):
            for ratio in (float(r) for r in args.ratios.split(",")):
                draws = [measure(spelling, dtype, ratio, rng) for _ in range(args.draws)]
                unfolded = [d["unfolded"] for d in draws]
                folded = [d["folded"] / d["unfolded"] for d in draws]
                deferred = [d["deferred"] / d["unfolded"] for d in draws]
                print(f"| {label} | {dtype} | {ratio:g} | {_span(unfolded, '.1e')} | {_span(folded, '.3g')} | "
                      f"{_span(deferred, '.3g')} |", flush=True)


if __name__ == "__main__":
    main()
