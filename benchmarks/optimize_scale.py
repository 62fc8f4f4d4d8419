"""`flashnorm optimize` at scale: wall time and peak RSS, against copying the weight file.

Two models:
- a synthetic Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads / 8 KV heads,
  FFN 8192, vocab 32000, untied LM head: 1.10 B float32 parameters, 4.4 GB) with external
  data and the legacy exporter's decomposed RMSNorm spelling
  (`Cast→Pow→ReduceMean→Add→Sqrt→Div(1,·)→Mul(x,·)→Cast→Mul(gain,·)`), built here from
  random weights written straight to its data file;
- SmolLM2-135M exported by `flashnorm export` (legacy exporter, inline weights), if given.

Every measured command runs in its own process; its peak RSS is that process's VmHWM read
at exit, its time the wall clock around it. The weight-file baseline is
`cp` of the data file (page cache warm for both, as for the optimizer), with and without an
fsync, since `flashnorm.modelio.save` fsyncs before renaming.

    python benchmarks/optimize_scale.py --workdir /tmp/fnbench --json results.json
    python benchmarks/optimize_scale.py --smollm /tmp/smollm2.onnx --skip-synthetic
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 8192
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight, in the order it is written to the data file."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"embed": (self.vocab, h)}
        for i in range(self.layers):
            shapes |= {
                f"l{i}.attn_norm": (h,), f"l{i}.wq": (h, h), f"l{i}.wk": (h, kv), f"l{i}.wv": (h, kv),
                f"l{i}.wo": (h, h), f"l{i}.mlp_norm": (h,), f"l{i}.wgate": (h, self.ffn),
                f"l{i}.wup": (h, self.ffn), f"l{i}.wdown": (self.ffn, h),
            }
        shapes |= {"final_norm": (h,), "lm_head": (h, self.vocab)}
        return shapes

    def parameters(self) -> int:
        return sum(math.prod(s) for s in self.weight_shapes().values())


class _GraphBuilder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        self._count += 1
        output = f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=f"{op_type}_{self._count}", **attrs))
        return output

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def rms_norm(self, x: str, gain: str) -> str:
        """The legacy torch.onnx spelling of LlamaRMSNorm (float32 model: the Casts are no-ops)."""
        xf = self.op("Cast", [x], to=TensorProto.FLOAT)
        mean_square = self.op("ReduceMean", [self.op("Pow", [xf, "two"])], axes=[-1], keepdims=1)
        inverse_rms = self.op("Div", ["one", self.op("Sqrt", [self.op("Add", [mean_square, "eps"])])])
        normed = self.op("Cast", [self.op("Mul", [xf, inverse_rms])], to=TensorProto.FLOAT)
        return self.op("Mul", [gain, normed])


def _external(name: str, shape: tuple[int, ...], location: str, offset: int, length: int) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name=name, dims=list(shape), data_type=TensorProto.FLOAT)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = TensorProto.EXTERNAL
    return tensor


def build_llama(path: Path, shape: LlamaShape, seed: int) -> None:
    """Write the synthetic model to `path` and its weights to `path.data`, one tensor at a time."""
    rng = np.random.default_rng(seed)
    location = path.name + ".data"
    weights: list[onnx.TensorProto] = []
    with open(path.with_name(location), "wb") as data:
        for name, dims in shape.weight_shapes().items():
            if len(dims) == 1:  # norm gains: around 1, some negative (as in trained models)
                values = (1.0 + 0.5 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
            else:
                values = rng.standard_normal(dims, dtype=np.float32) * np.float32(0.02)
            offset = data.tell()
            values.tofile(data)
            weights.append(_external(name, dims, location, offset, values.nbytes))
            del values

    b = _GraphBuilder()
    b.const("two", np.array(2.0, np.float32))
    b.const("one", np.array(1.0, np.float32))
    b.const("eps", np.array(1e-5, np.float32))
    b.const("attn_scale", np.array(1.0 / math.sqrt(shape.head_dim), np.float32))
    group = shape.heads // shape.kv_heads
    b.const("q_shape", np.array([0, 0, shape.kv_heads, group, shape.head_dim], np.int64))
    b.const("kv_shape", np.array([0, 0, shape.kv_heads, 1, shape.head_dim], np.int64))
    b.const("out_shape", np.array([0, 0, shape.hidden], np.int64))

    h = b.op("Gather", ["embed", "input_ids"], axis=0)
    for i in range(shape.layers):
        x = b.rms_norm(h, f"l{i}.attn_norm")
        q = b.op("Transpose", [b.op("Reshape", [b.op("MatMul", [x, f"l{i}.wq"]), "q_shape"])], perm=[0, 2, 3, 1, 4])
        k = b.op("Transpose", [b.op("Reshape", [b.op("MatMul", [x, f"l{i}.wk"]), "kv_shape"])], perm=[0, 2, 3, 4, 1])
        v = b.op("Transpose", [b.op("Reshape", [b.op("MatMul", [x, f"l{i}.wv"]), "kv_shape"])], perm=[0, 2, 3, 1, 4])
        probs = b.op("Softmax", [b.op("Mul", [b.op("MatMul", [q, k]), "attn_scale"])], axis=-1)
        context = b.op("Reshape", [b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 3, 1, 2, 4]), "out_shape"])
        h = b.op("Add", [h, b.op("MatMul", [context, f"l{i}.wo"])])
        x = b.rms_norm(h, f"l{i}.mlp_norm")
        gate = b.op("MatMul", [x, f"l{i}.wgate"])
        act = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), b.op("MatMul", [x, f"l{i}.wup"])])
        h = b.op("Add", [h, b.op("MatMul", [act, f"l{i}.wdown"])])
    logits = b.op("MatMul", [b.rms_norm(h, "final_norm"), "lm_head"])
    b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))

    graph = helper.make_graph(
        b.nodes, "synthetic_llama",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", shape.vocab])],
        b.initializers + weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="flashnorm-benchmark")
    model.ir_version = 8
    helper.set_model_props(model, {"synthetic": json.dumps(dataclasses.asdict(shape)), "seed": str(seed)})
    path.write_bytes(model.SerializeToString())
    onnx.checker.check_model(str(path))


# ---------------------------------------------------------------------------------------------
# Measurement


# Runs a module or a script as __main__ and reports the process's peak RSS at exit. VmHWM is
# the high-water mark of this process's own address space; `ru_maxrss` from wait4 would also
# count the parent's memory at fork time (Linux keeps the pre-exec high-water mark).
_PEAK_RSS_WRAPPER = """
import atexit, runpy, sys
def report():
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    print(f"FLASHNORM_PEAK_RSS_KB {peak}", file=sys.stderr, flush=True)
atexit.register(report)
kind, target, sys.argv = sys.argv[1], sys.argv[2], sys.argv[2:]
runpy.run_module(target, run_name="__main__") if kind == "module" else exec(compile(target, "<benchmark>", "exec"))
"""


def measure(kind: str, target: str, args: list[str]) -> dict[str, float]:
    """Run a module (`kind="module"`) or Python source (`"source"`) with `args` in a child
    process; its wall time and its own peak RSS."""
    command = [sys.executable, "-c", _PEAK_RSS_WRAPPER, kind, target, *args]
    start = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{target} {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
    peak_kb = int(result.stderr.rsplit("FLASHNORM_PEAK_RSS_KB", 1)[1].split()[0])
    modified = [line for line in result.stderr.splitlines() if line.startswith("modified ")]
    return {"seconds": wall, "peak_rss_mb": peak_kb / 1024, **({"note": modified[-1]} if modified else {})}


def _files(model: Path) -> list[Path]:
    return [p for p in (model, model.with_name(model.name + ".data")) if p.exists()]


def _remove(model: Path) -> None:
    for path in _files(model):
        path.unlink()


def copy_baseline(files: list[Path], workdir: Path, repeats: int) -> dict[str, float]:
    """Median wall time of `cp` of the model's files, without and with an fsync of the copies."""
    target = workdir / "copy"
    target.mkdir(exist_ok=True)
    copies = [target / f.name for f in files]
    plain, synced = [], []
    for _ in range(repeats):
        for timings, sync in ((plain, False), (synced, True)):
            start = time.perf_counter()
            subprocess.run(["cp", *map(str, files), str(target)], check=True)
            if sync:
                subprocess.run(["sync", *map(str, copies)], check=True)
            timings.append(time.perf_counter() - start)
            for copy in copies:
                copy.unlink()
    return {"cp_seconds": float(np.median(plain)), "cp_fsync_seconds": float(np.median(synced))}


def _largest_tensor_mb(model: Path) -> tuple[str, float]:
    proto = onnx.load(str(model), load_external_data=False)
    sizes = {}
    for tensor in proto.graph.initializer:
        length = {e.key: e.value for e in tensor.external_data}.get("length")
        sizes[tensor.name] = int(length) if length else len(tensor.raw_data)
    name = max(sizes, key=sizes.get)
    return name, sizes[name] / 2**20


_IO_ONLY = """
import sys, numpy as np, onnx_graphsurgeon as gs
from flashnorm import modelio
from flashnorm.modelio.values import stored_values
source, destination, mode = sys.argv[1:4]
graph = modelio.load(source)
# The fold pass's weight edits without its matcher: q/k/v, gate/up and the LM head scaled
# row-wise by a float32 gain, W* = diag(g)·W. Modes: none (load + save only); eager (fold's
# formula, float64 then cast back, into NumPy arrays held until save); derived (the same
# formula as modelio.DerivedValues, computed while saving); derived_f32 (modelio.DerivedValues scaling
# the freshly read array in place in float32: bit-identical for float32 weights and gains,
# since the float64 product of two float32 values is exact; checked below).
def fold64(w, gain):
    return (w.astype(np.float64) * gain.reshape(-1, 1)).astype(w.dtype)
def fold32(w, gain):
    return np.multiply(w, gain.reshape(-1, 1), out=w)
def after_gain(node):
    # MatMul(Mul(gain, normed), W): a projection right after an RMSNorm's gain.
    source = node.inputs[0].inputs[0] if node.inputs[0].inputs else None
    return source is not None and source.op == "Mul" and any(
        isinstance(t, gs.Constant) and len(t.shape) == 1 for t in source.inputs)
weights = {id(n.inputs[1]): n.inputs[1] for n in graph.nodes
           if n.op == "MatMul" and isinstance(n.inputs[1], gs.Constant) and after_gain(n)}
checked = False
for tensor in weights.values():
    if mode == "none":
        break
    gain = np.random.default_rng().uniform(-2, 2, tensor.shape[0]).astype(np.float32)
    if not checked:
        reference = fold64(stored_values(tensor).load(), gain)
        assert np.array_equal(fold32(stored_values(tensor).load(), gain), reference), "float32 fold differs"
        checked, reference = True, None
    if mode == "eager":
        tensor.values = fold64(tensor.values, gain)
    else:
        fold = fold64 if mode == "derived" else fold32
        tensor.values = modelio.DerivedValues(tensor, lambda w, g=gain, f=fold: f(w, g))
print(f"modified {0 if mode == 'none' else len(weights)} weights", file=sys.stderr)
modelio.save(graph, destination)
"""


def run_case(name: str, model: Path, workdir: Path, repeats: int, only: set[str] | None = None) -> dict:
    files = _files(model)
    total_mb = sum(f.stat().st_size for f in files) / 2**20
    largest_name, largest_mb = _largest_tensor_mb(model)
    out = workdir / f"{model.stem}.out.onnx"
    result = {"model": name, "files_mb": round(total_mb, 1), "largest_tensor": largest_name,
              "largest_tensor_mb": round(largest_mb, 1)}
    for f in files:  # warm the page cache, as a previous run would
        subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)
    result |= copy_baseline(files, workdir, repeats)
    commands = {
        "load_save": ("source", _IO_ONLY, [str(model), str(out), "none"]),
        "io_modify_eager": ("source", _IO_ONLY, [str(model), str(out), "eager"]),
        "io_modify_derived": ("source", _IO_ONLY, [str(model), str(out), "derived"]),
        "io_modify_derived_f32": ("source", _IO_ONLY, [str(model), str(out), "derived_f32"]),
        "optimize": ("module", "flashnorm.cli", ["optimize", str(model), "-o", str(out), "-q"]),
    }
    for label, (kind, target, arguments) in commands.items():
        if only and label not in only:
            continue
        runs = []
        for _ in range(repeats):
            _remove(out)
            runs.append(measure(kind, target, arguments))
        result[label] = {
            "seconds": round(float(np.median([r["seconds"] for r in runs])), 2),
            "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs), 0),
            **({"note": runs[-1]["note"]} if "note" in runs[-1] else {}),
        }
        result[label]["time_vs_cp"] = round(result[label]["seconds"] / result["cp_seconds"], 2)
        result[label]["rss_above_largest_mb"] = round(result[label]["peak_rss_mb"] - largest_mb, 0)
        print(f"{name} {label}: {result[label]}", file=sys.stderr, flush=True)
    _remove(out)
    return result


def environment() -> dict[str, str]:
    import onnx_graphsurgeon
    import onnxruntime

    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as handle:
        names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{names[0] if names else cpu} ({os.cpu_count()} cores)",
        "memory_gb": str(round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)),
        "python": platform.python_version(),
        "numpy": np.__version__, "onnx": onnx.__version__, "onnx_graphsurgeon": onnx_graphsurgeon.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/flashnorm-bench"))
    parser.add_argument("--smollm", type=Path, help="SmolLM2-135M exported by `flashnorm export` (legacy)")
    parser.add_argument("--skip-synthetic", action="store_true")
    parser.add_argument("--layers", type=int, default=LlamaShape.layers, help="synthetic model depth")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--only", help="comma-separated subset of: load_save, io_modify_eager, io_modify_derived, "
                                       "io_modify_derived_f32, optimize")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None

    results = {"environment": environment(), "cases": []}
    if args.smollm:
        results["cases"].append(run_case("SmolLM2-135M (legacy export, inline)", args.smollm, args.workdir, args.repeats, only))
    if not args.skip_synthetic:
        shape = LlamaShape(layers=args.layers)
        model = args.workdir / f"llama_{shape.layers}l.onnx"
        if not model.exists():
            start = time.perf_counter()
            build_llama(model, shape, args.seed)
            print(f"built {model} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        name = f"synthetic Llama {shape.parameters() / 1e9:.2f} B (external data)"
        results["cases"].append(run_case(name, model, args.workdir, args.repeats, only) | {"shape": dataclasses.asdict(shape)})
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
