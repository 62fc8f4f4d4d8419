"""The hostile-file corpus of tests/test_hostile_inputs.py, and the driver that runs every command
against it.

`build(root)` writes, under `root/work` (the commands' current folder):
- `models/`: ONNX files whose external data leaves the folder (`../`, absolute, a symlink), names
  a NUL byte, is a FIFO or a device node, is declared beyond its file, or is replaced while it is
  read (and a checkpoint whose shard is); a model that is a FIFO, a device node, a sparse 64 MiB file of zeros, a truncated file, a
  tensor whose declared size is 2**40 bytes; GGUF files with truncated and oversized headers;
  engine plans that are a FIFO, a device node, a TensorRT-RTX plan.
- `hf_*/`: Hugging Face checkpoints whose index maps tensors to `../` and absolute shard names, a
  NUL byte, or is a list; whose safetensors header is oversized, truncated, or declares data beyond
  the file; whose shard is a FIFO, a device node or a symlink out; whose config.json is not JSON.
- `outside/`: what a traversing name reaches (a valid shard, bytes).
- `out/`: special files where outputs are named: a device node (as /dev/null and /dev/full are), a
  FIFO, a socket, a symlink to a device.
Device nodes are made with os.mknod, which needs root; elsewhere `skipped` says why.

`python hostile.py ROOT CASE...` runs the named cases in this process, one after another, each
through `flashnorm.cli.main` with -q, and prints one JSON line per case: its exit status, stderr,
wall time, the files that changed under ROOT, the special files replaced, the temporaries left.
The test runs the driver in a subprocess and restarts it past a case that hangs in native code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import signal
import socket
import stat
import struct
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

CASE_SECONDS = 10.0
"""The most one case may take: every one is a refusal that needs no more than a few reads."""
SPARSE_BYTES = 64 << 20
"""A sparse file of zeros this large (no disk used): read at a hostile-size pace (1.2 MB/s was
measured for a sparse .onnx, 2026-12-06), refusing it would take about a minute."""
TEMPORARY = ("flashnorm-", ".tmp", ".old")
"""Staged files and folders (flashnorm.files, the exporter's scratch folders), by name."""

# A tiny Llama (what transformers' LlamaConfig writes, the fields the loaders read).
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
          "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32"}
SHAPES = {"model.embed_tokens.weight": (64, 16), "model.layers.0.input_layernorm.weight": (16,),
          "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.weight": (8, 16),
          "model.layers.0.self_attn.v_proj.weight": (8, 16), "model.layers.0.self_attn.o_proj.weight": (16, 16),
          "model.layers.0.post_attention_layernorm.weight": (16,), "model.layers.0.mlp.gate_proj.weight": (32, 16),
          "model.layers.0.mlp.up_proj.weight": (32, 16), "model.layers.0.mlp.down_proj.weight": (16, 32),
          "model.norm.weight": (16,), "lm_head.weight": (64, 16)}


@dataclasses.dataclass
class Case:
    """One command line against one hostile file. `names`: a text the refusal's line must hold
    (what it refused), or "" where any one line will do. `race`: a data file to replace as soon as
    the command, past its path guard, opens or reads it (deterministic concurrent replacement)."""

    id: str
    argv: list[str]
    names: str = ""
    race: str = ""
    statuses: tuple[int, ...] = (2,)
    """The exit statuses that refuse it: 2, and for `compare --engine` 3 as well (TensorRT cannot
    load the plan: nothing was compared, said with TensorRT's reason; on a machine without a GPU
    TensorRT cannot tell a corrupt plan from one built for a GPU)."""


# ---------------------------------------------------------------------------------------------
# Files


def _model(rng: np.random.Generator):
    import synthetic

    return synthetic.build_norm_model("pow_div", rng)


def _external(model, location: str) -> bytes:
    """`model` with every initializer's data declared at `location` (offsets as a save would
    lay them out), and those bytes."""
    import onnx
    from onnx import numpy_helper

    data = bytearray()
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in copy.graph.initializer:
        raw = numpy_helper.to_array(tensor).tobytes()
        data += b"\0" * (-len(data) % 64)
        offset = len(data)
        data += raw
        tensor.ClearField("raw_data")
        for field in ("float_data", "int64_data", "int32_data", "double_data"):
            tensor.ClearField(field)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(raw)))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
    return copy.SerializeToString(), bytes(data)


def _oversized_tensor(model) -> bytes:
    """`model` serialized with one more initializer whose raw_data declares 2**40 bytes and holds 8:
    a reader that trusts the length allocates a terabyte."""
    import onnx

    tensor = onnx.TensorProto(name="huge", data_type=onnx.TensorProto.FLOAT, dims=[1 << 38])
    body = tensor.SerializeToString()
    raw_data = b"\x4a" + _varint(1 << 40) + b"\0" * 8  # field 9 (raw_data), wire type 2
    initializer = body + raw_data
    graph = model.graph.SerializeToString() + b"\x2a" + _varint(len(initializer)) + initializer  # field 5
    head = onnx.ModelProto()
    head.CopyFrom(model)
    head.ClearField("graph")
    return head.SerializeToString() + b"\x3a" + _varint(len(graph)) + graph  # ModelProto.graph: field 7


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _safetensors(rng: np.random.Generator) -> bytes:
    header, blobs, offset = {}, [], 0
    for name, shape in SHAPES.items():
        blob = rng.standard_normal(shape).astype(np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def _gguf_header(tensors: int, kvs: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, kvs)


def _gguf_string(text: bytes, declared: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if declared is None else declared) + text


def _checkpoint(folder: Path, shard: bytes | None = None, index: Any = None, config: bytes | None = None) -> Path:
    folder.mkdir()
    (folder / "config.json").write_bytes(config if config is not None else json.dumps(CONFIG).encode())
    if shard is not None:
        (folder / "model.safetensors").write_bytes(shard)
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _mknod(path: Path, major: int, minor: int) -> None:
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))


def _socket(path: Path) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.close()  # the socket file stays: a name nothing listens on


def build(root: Path, rng: np.random.Generator) -> list[str]:
    """Write the corpus under `root` (see the module docstring) and its cases (`root/cases.json`,
    for the driver); returns what was left out and why."""
    import onnx

    work, home, tmp = root / "work", root / "home", root / "tmp"
    for folder in (work, home, tmp):
        folder.mkdir()
    models, outside, out = work / "models", work / "outside", work / "out"
    for folder in (models, outside, out):
        folder.mkdir()
    root_user = os.geteuid() == 0
    skipped = [] if root_user else ["device nodes (os.mknod needs root): the device-node inputs and outputs"]

    model = _model(rng)
    onnx.save(model, models / "good.onnx")
    good_bytes = (models / "good.onnx").read_bytes()
    shard = _safetensors(rng)
    (outside / "secret.bin").write_bytes(_external(model, "x")[1])
    (outside / "evil.safetensors").write_bytes(shard)
    (models / "plugin.so").write_bytes(rng.bytes(512))

    def external(name: str, location: str) -> None:
        (models / name).write_bytes(_external(model, location)[0])

    external("traverse.onnx", "../outside/secret.bin")
    external("absolute.onnx", str(outside / "secret.bin"))
    external("nul.onnx", "secret\0.bin")
    external("beyond.onnx", "beyond.onnx.data")
    (models / "beyond.onnx.data").write_bytes(b"\0" * 16)  # it declares more than these 16 bytes
    external("symlink.onnx", "symlink.onnx.data")
    (models / "symlink.onnx.data").symlink_to(outside / "secret.bin")
    external("fifo.onnx", "fifo.onnx.data")
    os.mkfifo(models / "fifo.onnx.data")
    if root_user:
        external("device.onnx", "device.onnx.data")
        _mknod(models / "device.onnx.data", 1, 5)  # as /dev/zero: endless zeros
        _mknod(models / "device_model.onnx", 1, 5)
    os.mkfifo(models / "fifo_model.onnx")
    with open(models / "sparse.onnx", "wb") as sparse:
        sparse.truncate(SPARSE_BYTES)
    (models / "truncated.onnx").write_bytes(good_bytes[: len(good_bytes) // 2])
    (models / "oversized.onnx").write_bytes(_oversized_tensor(model))
    retrained = _model(np.random.default_rng(rng.integers(2**63)))  # the same graph, other weights
    graph, weights = _external(model, "race.onnx.data")
    (models / "race.onnx").write_bytes(graph)
    (models / "race.onnx.data").write_bytes(weights)
    (models / "race.replacement").write_bytes(_external(retrained, "x")[1])
    _checkpoint(work / "hf_race", shard=shard)
    (work / "hf_race" / "model.replacement").write_bytes(_safetensors(rng))

    _checkpoint(work / "hf_good", shard=shard)
    for name, shard_name in (("hf_traverse", "../outside/evil.safetensors"),
                             ("hf_absolute", str(outside / "evil.safetensors")), ("hf_nul", "model\0.safetensors")):
        _checkpoint(work / name, index={"weight_map": {n: shard_name for n in SHAPES}})  # the index names the only shard
    _checkpoint(work / "hf_list_index", index={"weight_map": [["model-00001-of-00001.safetensors", n] for n in SHAPES]})
    (work / "hf_list_index" / "model-00001-of-00001.safetensors").write_bytes(shard)
    header_size = struct.unpack("<Q", shard[:8])[0]
    _checkpoint(work / "hf_oversized_header", shard=struct.pack("<Q", 1 << 60) + shard[8:])
    _checkpoint(work / "hf_truncated_header", shard=shard[: 8 + header_size // 2])
    _checkpoint(work / "hf_beyond", shard=shard[: 8 + header_size + 64])  # offsets past the end
    _checkpoint(work / "hf_bad_config", shard=shard, config=b"[" * 100_000)
    _checkpoint(work / "hf_fifo")
    os.mkfifo(work / "hf_fifo" / "model.safetensors")
    _checkpoint(work / "hf_symlink")
    (work / "hf_symlink" / "model.safetensors").symlink_to(outside / "evil.safetensors")
    if root_user:
        _checkpoint(work / "hf_device")
        _mknod(work / "hf_device" / "model.safetensors", 1, 5)

    gguf = {
        "truncated.gguf": _gguf_header(1, 1)[:10],
        "oversized.gguf": _gguf_header(2**63 - 1, 2**63 - 1),
        "long_string.gguf": _gguf_header(0, 1) + _gguf_string(b"general.architecture") + struct.pack("<I", 8)
                            + _gguf_string(b"llama", declared=1 << 62),
    }
    for name, content in gguf.items():
        (models / name).write_bytes(content)

    (models / "rtx.plan").write_bytes(b"vtrt" + rng.bytes(256))
    os.mkfifo(models / "fifo.plan")
    if root_user:
        _mknod(models / "device.plan", 1, 5)

    os.mkfifo(out / "fifo")
    _socket(out / "socket")
    if root_user:
        _mknod(out / "null_device", 1, 3)  # as /dev/null
        _mknod(out / "full_device", 1, 7)  # as /dev/full
        (out / "link_to_device").symlink_to(out / "null_device")
    else:
        (out / "link_to_device").symlink_to(out / "fifo")
    (root / "cases.json").write_text(json.dumps([dataclasses.asdict(c) for c in cases(root_user, root)]))
    return skipped


def cases(root_user: bool, root: Path) -> list[Case]:
    """Every command line of the corpus `build` writes under `root` (device nodes only for root)."""
    outside = root / "work" / "outside"
    onnx_files = {"traverse.onnx": "../outside/secret.bin", "absolute.onnx": str(outside / "secret.bin"),
                  "nul.onnx": "", "beyond.onnx": "", "symlink.onnx": "", "fifo.onnx": "fifo.onnx.data",
                  **({"device.onnx": "device.onnx.data", "device_model.onnx": ""} if root_user else {}),
                  "fifo_model.onnx": "", "sparse.onnx": "", "truncated.onnx": "", "oversized.onnx": ""}
    checkpoints = {"hf_traverse": "../outside/evil.safetensors", "hf_absolute": str(outside / "evil.safetensors"),
                   "hf_nul": "", "hf_list_index": "", "hf_oversized_header": "", "hf_truncated_header": "",
                   "hf_beyond": "", "hf_bad_config": "", "hf_fifo": "", "hf_symlink": "",
                   **({"hf_device": ""} if root_user else {})}
    gguf = ["truncated.gguf", "oversized.gguf", "long_string.gguf"]
    plans = ["rtx.plan", "fifo.plan", *(["device.plan"] if root_user else [])]
    specials = ["fifo", "socket", "link_to_device", *(["null_device", "full_device"] if root_user else [])]
    cases: list[Case] = []
    good = "models/good.onnx"
    for name, refused in onnx_files.items():
        model, stem = f"models/{name}", name.split(".")[0]
        lines = {
            "inspect": ["inspect", model],
            "optimize": ["optimize", model, "-o", f"out/{stem}.onnx"],
            "compare-reference": ["compare", model, good],
            "compare-candidate": ["compare", good, model],
            "build": ["build", model, "-o", f"out/{stem}.plan", "--backend", "tensorrt-rtx"],
            "triton": ["triton", "--onnx", model, "--triton-backend", "python", "-o", f"out/{stem}_repo"],
            "demo": ["demo", "--exported", model, "-o", f"out/{stem}_demo"],
        }
        cases += [Case(f"{command}:{name}", argv, refused) for command, argv in lines.items()]
    cases.append(Case("optimize:data replaced while read", ["optimize", "models/race.onnx", "-o", "out/race.onnx"],
                      race="models/race.onnx.data"))
    cases.append(Case("fold-checkpoint:shard replaced while read", ["fold-checkpoint", "hf_race", "-o", "folded_race"],
                      race="hf_race/model.safetensors"))
    for source, refused in [*checkpoints.items(), *((f"models/{g}", "") for g in gguf)]:
        stem = Path(source).name.split(".")[0]
        cases.append(Case(f"export:{source}", ["export", source, "-o", f"out/{stem}.onnx"], refused))
        cases.append(Case(f"fold-checkpoint:{source}", ["fold-checkpoint", source, "-o", f"folded_{stem}"], refused))
    for plan in plans:
        cases.append(Case(f"triton:{plan}", ["triton", "--engine", f"models/{plan}", "--plugin", "models/plugin.so",
                                             "--io", "in:x:fp32:-1,32", "--io", "out:y:fp32:-1,32", "-o", "out/plan_repo"]))
        cases.append(Case(f"compare --engine:{plan}", ["compare", good, good, "--engine", f"models/{plan}",
                                                       "--backend", "tensorrt-rtx"], statuses=(2, 3)))
    for special in specials:
        target = f"out/{special}"
        lines = {
            "inspect --report": ["inspect", good, "--report", target],
            "compare --report": ["compare", good, good, "--report", target],
            "optimize -o": ["optimize", good, "-o", target],
            "build -o": ["build", good, "-o", target, "--backend", "tensorrt-rtx"],
            "build --timing-cache": ["build", good, "-o", "out/ok.plan", "--timing-cache", target],
            "export -o": ["export", "hf_good", "-o", target],
            "triton -o": ["triton", "--onnx", good, "--triton-backend", "python", "-o", target],
            "fold-checkpoint -o": ["fold-checkpoint", "hf_good", "-o", target],
            "demo -o": ["demo", "--exported", good, "-o", target],
        }
        cases += [Case(f"{what}:{special}", argv, target) for what, argv in lines.items()]
    return cases


# ---------------------------------------------------------------------------------------------
# The driver: one process, every case in turn


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root` but its temporary folder: a regular file by size and content hash
    (sparse and oversized files by size, inode and mtime), anything else by its type, inode and
    device numbers (so a replaced device node or FIFO shows)."""
    state: dict[str, tuple] = {}
    for folder, folders, files in os.walk(root):
        if Path(folder) == root:
            folders[:] = [f for f in folders if f != "tmp"]
        for name in folders + files:
            path = Path(folder) / name
            info = os.lstat(path)
            key = path.relative_to(root).as_posix()
            if stat.S_ISREG(info.st_mode) and info.st_size <= 1 << 20:
                state[key] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
            elif stat.S_ISREG(info.st_mode):
                state[key] = ("file", info.st_size, info.st_ino, info.st_mtime_ns)
            elif stat.S_ISLNK(info.st_mode):
                state[key] = ("link", os.readlink(path))
            elif not stat.S_ISDIR(info.st_mode):
                state[key] = ("special", stat.S_IFMT(info.st_mode), info.st_ino, info.st_rdev)
    return state


class CaseTimeout(BaseException):
    """The case ran past CASE_SECONDS (raised in the main thread by SIGALRM)."""


def _alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout()


@contextlib.contextmanager
def _replaced_once_read(target: Path, replacement: Path):
    """Replace `target` by `replacement` (os.replace: a new inode at the same path) as soon as
    the command, its path guard passed, has opened `target` or read from it through one of
    Python's openers (open, os.open, numpy.fromfile): the writer of issue 47 that swaps a model's
    .data while a command reads it, made deterministic. Whatever the command reads after that
    moment through a new open is the new file."""
    import builtins

    from flashnorm import cli

    resolved = os.path.realpath(target)
    state = {"armed": False, "done": False}
    real = {"open": builtins.open, "os.open": os.open, "fromfile": np.fromfile, "guard": cli._check_paths}

    def swap(path: Any) -> None:
        if state["armed"] and not state["done"] and isinstance(path, (str, bytes, os.PathLike)) and \
                os.path.realpath(os.fsdecode(path)) == resolved:
            state["done"] = True
            os.replace(replacement, target)

    def after(function: Callable) -> Callable:
        def call(path, *args, **kwargs):
            result = function(path, *args, **kwargs)
            swap(path)
            return result
        return call

    def guard(*args, **kwargs):
        real["guard"](*args, **kwargs)
        state["armed"] = True

    builtins.open = io.open = after(real["open"])
    os.open, np.fromfile, cli._check_paths = after(real["os.open"]), after(real["fromfile"]), guard
    try:
        yield state
    finally:
        builtins.open = io.open = real["open"]
        os.open, np.fromfile, cli._check_paths = real["os.open"], real["fromfile"], real["guard"]


@contextlib.contextmanager
def _captured(folder: Path):
    """What the case writes to stdout and stderr, Python's and native code's (descriptors 1 and
    2), as two strings in the yielded dict once the block ends."""
    text: dict[str, str] = {}
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: open(folder / f"captured.{fd}", "w+b") for fd in (1, 2)}
    python = {1: io.StringIO(), 2: io.StringIO()}
    streams = sys.stdout, sys.stderr
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, handle in files.items():
            os.dup2(handle.fileno(), fd)
        sys.stdout, sys.stderr = python[1], python[2]
        yield text
    finally:
        sys.stdout, sys.stderr = streams
        for fd in (1, 2):
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
            files[fd].seek(0)
            native = files[fd].read().decode(errors="backslashreplace")
            files[fd].close()
            os.unlink(folder / f"captured.{fd}")
            text["stdout" if fd == 1 else "stderr"] = python[fd].getvalue() + native


def run_case(root: Path, case: Case, main: Callable[[list[str]], int]) -> dict[str, Any]:
    """Run one case in this process (cwd `root/work`) and measure what the test asserts."""
    before = snapshot(root)
    logs_before = set((root / "tmp").glob("flashnorm-bug-*"))
    race: Any = contextlib.nullcontext({"done": False})
    if case.race:
        data = root / "work" / case.race
        race = _replaced_once_read(data, data.with_suffix("").with_suffix(".replacement"))
    status: int | str = "not run"
    swapped = {"done": False}
    started = time.monotonic()
    signal.signal(signal.SIGALRM, _alarm)
    with _captured(root / "tmp") as output:
        signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
        try:
            with race as swapped:
                status = main([*case.argv, "-q"])
        except CaseTimeout:
            status = "timeout"
        except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
            status = f"raised {type(exc).__name__}: {exc}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.monotonic() - started
    after = snapshot(root)
    changed = sorted(key for key in set(before) | set(after) if before.get(key) != after.get(key))
    replaced_specials = sorted(key for key, value in before.items() if value[0] == "special" and after.get(key) != value)
    temporaries = sorted(key for key in after if Path(key).name.startswith(TEMPORARY[0])
                         or Path(key).name.endswith(TEMPORARY[1:]))
    bug_logs = sorted(p.name for p in set((root / "tmp").glob("flashnorm-bug-*")) - logs_before)
    return {"id": case.id, "status": status, "stdout": output["stdout"], "stderr": output["stderr"],
            "seconds": round(seconds, 3), "changed": changed, "replaced_specials": replaced_specials,
            "temporaries": temporaries, "bug_logs": bug_logs, "race_happened": swapped["done"]}


def _warm_up() -> None:
    """Import what the commands import, once, so that a case's time is its own."""
    for module in ("onnx", "onnxruntime", "polygraphy.comparator", "onnx_graphsurgeon", "torch", "transformers",
                   "safetensors", "tensorrt_rtx"):
        with contextlib.suppress(ImportError):
            __import__(module)
    with contextlib.suppress(ImportError, AttributeError):
        import transformers

        transformers.LlamaForCausalLM  # noqa: B018 - transformers imports a model's code when it is first named


def drive(root: Path, ids: list[str]) -> None:
    """Run the cases named by `ids`, one after another; for each, a `START id` line (so that the
    parent knows which case hangs) and a `RESULT {...}` line on the descriptor stdout had."""
    protocol = os.fdopen(os.dup(1), "w")
    everything = {fields["id"]: Case(**{**fields, "statuses": tuple(fields["statuses"])})
                  for fields in json.loads((root / "cases.json").read_text())}
    os.chdir(root / "work")
    _warm_up()
    from flashnorm import cli

    for case_id in ids:
        print("START " + json.dumps(case_id), file=protocol, flush=True)
        print("RESULT " + json.dumps(run_case(root, everything[case_id], cli.main)), file=protocol, flush=True)


if __name__ == "__main__":
    drive(Path(sys.argv[1]), [json.loads(arg) for arg in sys.argv[2:]])
