"""Hostile input files through the real command line (`flashnorm.cli.main`, in this process):
paths read from inside files (external-data locations, shard names), FIFOs and device nodes,
sparse and oversized files, truncated and oversized headers, and an input replaced while a
command runs. Each is refused with one line and exit 2, within a wall-time bound, and nothing
is written anywhere (the whole temporary tree is checksummed before and after).

The readers and their checks are in flashnorm/untrusted.py, modelio/, export/checks.py and
checkpoint/shards.py; docs/SECURITY.md lists the promises these tests prove."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import stat
import struct
import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from flashnorm import cli
from flashnorm.progress import Progress

HIDDEN = 64
SECONDS = 5.0
"""Wall-time bound of one refusal, in this process (imports of the command's module included)."""


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


class Blocked(Exception):
    """The command was still running when its deadline passed (a read that waits forever)."""


@contextlib.contextmanager
def deadline(seconds: float):
    def expire(signum, frame):
        raise Blocked(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def tree(root: Path) -> dict[str, str]:
    """Everything under `root` as {path: what it is}: a regular file's sha256 (a large one's
    size, inode and mtime: the sparse files), a symlink's target, another file's type. Never
    opens anything but regular files."""
    found = {}
    for folder, names, files in os.walk(root):
        for name in names + files:
            path = Path(folder) / name
            status = os.lstat(path)
            mode = status.st_mode
            if stat.S_ISREG(mode) and status.st_size > 1 << 24:
                found[str(path)] = f"{status.st_size} bytes, inode {status.st_ino}, mtime {status.st_mtime_ns}"
            elif stat.S_ISREG(mode):
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(mode):
                found[str(path)] = "-> " + os.readlink(path)
            else:
                found[str(path)] = oct(stat.S_IFMT(mode))
    return found


def refused(argv: list[str], capsys, root: Path, *fragments: str) -> str:
    """Run the command; assert exit 2, one line on stderr holding `fragments`, no traceback,
    nothing changed under `root`, and the time bound. Returns the line."""
    capsys.readouterr()
    before = tree(root)
    started = time.monotonic()
    with deadline(SECONDS * 4):
        code = cli.main([str(a) for a in argv])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (argv, code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert tree(root) == before, f"{argv[0]} changed files under {root}"
    assert elapsed < SECONDS, f"{argv} took {elapsed:.1f} s"
    return lines[0]


# --------------------------------------------------------------------------------------------
# ONNX models and their external data


def _model() -> onnx.ModelProto:
    """x → RMSNorm (decomposed) · gain → MatMul: one site every ONNX command accepts."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Div", ["x", "rms"], ["xn"]),
        helper.make_node("Mul", ["xn", "gain"], ["xg"]),
        helper.make_node("MatMul", ["xg", "w"], ["y"]),
    ]
    initializers = [
        numpy_helper.from_array((1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), "gain"),
        numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array(1e-5, dtype=np.float32), "eps"),
    ]
    graph = helper.make_graph(nodes, "untrusted", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", HIDDEN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", HIDDEN])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture
def onnx_case(tmp_path):
    """tmp/model/m.onnx with its weights in m.onnx.data, a folder beside it, an empty out/."""
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "out").mkdir()
    model = folder / "m.onnx"
    onnx.save(_model(), str(model), save_as_external_data=True, location="m.onnx.data", size_threshold=128)
    return model


def _relocate(model: Path, location: str, **entries: str) -> None:
    """Point every external tensor of `model` at `location` (and set other entries)."""
    proto = onnx.load(str(model), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
            elif entry.key in entries:
                entry.value = entries[entry.key]
    model.write_bytes(proto.SerializeToString())


def _replace_data(model: Path, make: Callable[[Path], None]) -> None:
    data = model.with_name("m.onnx.data")
    data.unlink()
    make(data)


def _symlink_out(model: Path) -> None:
    outside = model.parent.parent / "outside" / "real.data"
    os.replace(model.with_name("m.onnx.data"), outside)
    os.symlink("../outside/real.data", model.with_name("m.onnx.data"))


def _device(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root (os.mknod of a character device)")
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero's numbers: a read never ends


def _huge_tensor(model: Path) -> None:
    proto = onnx.load(str(model), load_external_data=False)
    weight = next(t for t in proto.graph.initializer if t.name == "w")
    del weight.dims[:]
    weight.dims.extend([1 << 40, 1 << 40])
    for entry in weight.external_data:
        if entry.key == "length":
            entry.value = str((1 << 80) * 4)
    model.write_bytes(proto.SerializeToString())


def _sparse(size: int):
    def make(model: Path) -> None:
        model.unlink()
        with open(model, "wb") as handle:
            handle.truncate(size)
    return make


# (what is done to the model, words the one line holds)
ONNX_CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "nul-location": (lambda m: _relocate(m, "m.onnx\x00.data"), ("NUL byte",)),
    "absolute-location": (lambda m: _relocate(m, str(m.with_name("m.onnx.data"))), ("is absolute",)),
    "traversing-location": (lambda m: (os.replace(m.with_name("m.onnx.data"), m.parent.parent / "outside" / "m.onnx.data"),
                                       _relocate(m, "../outside/m.onnx.data")), ("'..'",)),
    "symlink-out": (_symlink_out, ("through a symbolic link", "outside")),
    "fifo-data": (lambda m: _replace_data(m, os.mkfifo), ("is a FIFO, not a regular file",)),
    "device-data": (lambda m: _replace_data(m, _device), ("is a character device",)),
    "truncated-data": (lambda m: os.truncate(m.with_name("m.onnx.data"), 100), ("truncated",)),
    "offset-past-end": (lambda m: _relocate(m, "m.onnx.data", offset=str(1 << 62)), ("truncated",)),
    "huge-declared-tensor": (_huge_tensor, ("needs bytes 256..", "the file has 16640")),
    "sparse-3GiB-model": (_sparse(3 << 30), ("over protobuf's 2 GiB limit",)),
    "sparse-1GiB-model": (_sparse(1 << 30), ("not an ONNX model",)),
    "fifo-model": (lambda m: (m.unlink(), os.mkfifo(m)), ("m.onnx",)),
}


def _onnx_commands(model: Path, out: Path) -> dict[str, list]:
    return {
        "inspect": ["inspect", model],
        "optimize": ["optimize", model, "-o", out / "o.onnx"],
        "build": ["build", model, "-o", out / "e.plan"],
        "compare": ["compare", model, model],
        "triton": ["triton", "--onnx", model, "--triton-backend", "python", "-o", out / "repo"],
        "demo": ["demo", "--exported", model, "-o", out / "demo"],
    }


EVERY_COMMAND = ["inspect", "optimize", "build", "compare", "triton", "demo"]
# The cases through every ONNX-reading command; the others through the three that
# read a model's weights in three different ways (our lazy reader, our copy, TensorRT's parser).
ONNX_RUNS = [(case, command) for case in ONNX_CASES
             for command in (EVERY_COMMAND if case in ("nul-location", "fifo-data", "symlink-out", "fifo-model") else
                             ["inspect", "optimize", "build"])]


@pytest.mark.parametrize("case, command", ONNX_RUNS, ids=[f"{c}-{m}" for c, m in ONNX_RUNS])
def test_hostile_model_files_are_refused_with_one_line(onnx_case, capsys, case, command):
    make, fragments = ONNX_CASES[case]
    make(onnx_case)
    root = onnx_case.parent.parent
    refused(_onnx_commands(onnx_case, root / "out")[command], capsys, root, *fragments)


def _swap_data_while_optimizing(monkeypatch, model: Path, rewrite_in_place: bool) -> None:
    """Between `optimize`'s load and its save, a writer puts new weights in m.onnx.data: by a
    rename (a new file at the name), or by rewriting the same file (a new mtime)."""
    from flashnorm import passes

    real_run_passes = passes.run_passes
    data = model.with_name("m.onnx.data")

    def run_passes(graph, *args, **kwargs):
        result = real_run_passes(graph, *args, **kwargs)
        new = np.random.default_rng(1).standard_normal(data.stat().st_size // 4).astype(np.float32).tobytes()
        if rewrite_in_place:
            before = data.stat().st_mtime_ns
            with open(data, "r+b") as handle:
                handle.write(new)
            os.utime(data, ns=(before + 1, before + 1))  # whatever the clock's granularity
        else:
            data.with_name("new.data").write_bytes(new)
            os.replace(data.with_name("new.data"), data)
        return result

    monkeypatch.setattr(passes, "run_passes", run_passes)


@pytest.mark.parametrize("rewrite_in_place", [False, True], ids=["replaced", "rewritten"])
def test_data_changed_between_load_and_save_is_refused_and_nothing_written(onnx_case, capsys, monkeypatch,
                                                                           rewrite_in_place):
    _swap_data_while_optimizing(monkeypatch, onnx_case, rewrite_in_place)
    out = onnx_case.parent.parent / "out"
    capsys.readouterr()
    assert cli.main(["optimize", str(onnx_case), "-o", str(out / "o.onnx")]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "m.onnx.data changed while flashnorm was reading it" in line, line
    assert "nothing was written" in line and list(out.iterdir()) == []


def test_saving_over_an_earlier_output_keeps_one_data_file(onnx_case, capsys):
    """optimize twice to the same output: the second replaces the pair as one and leaves no
    stray data file; what it wrote runs."""
    out = onnx_case.parent.parent / "out" / "o.onnx"
    for _ in range(2):
        assert cli.main(["optimize", str(onnx_case), "-o", str(out), "-q"]) == 0
        assert len([p for p in out.parent.iterdir() if p.name.endswith(".data")]) == 1
    assert cli.main(["inspect", str(out), "-q"]) == 0


# --------------------------------------------------------------------------------------------
# Hugging Face directories (fold-checkpoint, export) and GGUF files


def _safetensors(path: Path, header_size: int | None = None) -> None:
    """A one-tensor safetensors file; `header_size` overrides its declared header length."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    size = len(header) if header_size is None else header_size
    path.write_bytes(struct.pack("<Q", size) + header + b"\0" * 8)


@pytest.fixture
def checkpoint_case(tmp_path):
    """tmp/ckpt: config.json, an index naming one shard, the shard; tmp/outside, tmp/out."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "out").mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    _index(folder, {"w": "model-00001-of-00001.safetensors"})
    _safetensors(folder / "model-00001-of-00001.safetensors")
    return folder


def _index(folder: Path, weight_map) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _evil_shard(folder: Path, name: str) -> None:
    _safetensors(folder.parent / "outside" / "evil.safetensors")
    _index(folder, {"w": name})


def _shard_symlink_out(folder: Path) -> None:
    shard = folder / "model-00001-of-00001.safetensors"
    os.replace(shard, folder.parent / "outside" / "real.safetensors")
    os.symlink("../outside/real.safetensors", shard)


def _deep_index(folder: Path) -> None:
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")


CHECKPOINT_CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "traversing-shard": (lambda f: _evil_shard(f, "../outside/evil.safetensors"), ("'..'",)),
    "absolute-shard": (lambda f: _evil_shard(f, str(f.parent / "outside" / "evil.safetensors")), ("is absolute",)),
    "nul-shard": (lambda f: _index(f, {"w": "model\x00.safetensors"}), ("NUL byte",)),
    "subfolder-shard": (lambda f: _index(f, {"w": "sub/model.safetensors"}), ("not a file name",)),
    "weight-map-list": (lambda f: _index(f, ["model-00001-of-00001.safetensors"]), ("'weight_map' must map",)),
    "weight-map-numbers": (lambda f: _index(f, {"w": 7}), ("'weight_map' must map",)),
    "index-nested-deeply": (_deep_index, ("nested too deeply",)),
    "index-not-json": (lambda f: (f / "model.safetensors.index.json").write_text("{"), ("not readable JSON",)),
    "missing-shard": (lambda f: (f / "model-00001-of-00001.safetensors").unlink(), ("does not exist",)),
    "shard-symlink-out": (_shard_symlink_out, ("through a symbolic link",)),
    "fifo-shard": (lambda f: ((f / "model-00001-of-00001.safetensors").unlink(),
                              os.mkfifo(f / "model-00001-of-00001.safetensors")), ("is a FIFO",)),
    "device-shard": (lambda f: ((f / "model-00001-of-00001.safetensors").unlink(),
                                _device(f / "model-00001-of-00001.safetensors")), ("is a character device",)),
    "fifo-config": (lambda f: ((f / "config.json").unlink(), os.mkfifo(f / "config.json")), ("is a FIFO",)),
    "fifo-tokenizer": (lambda f: os.mkfifo(f / "tokenizer.json"), ("tokenizer.json", "is a FIFO")),
    "file-symlink-out": (lambda f: os.symlink("/etc/hostname", f / "notes.txt"), ("through a symbolic link",)),
}
# Read by our own header reader once the source is accepted (fold-checkpoint only).
HEADER_CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "header-past-the-end": (lambda f: _safetensors(f / "model-00001-of-00001.safetensors", header_size=1 << 20),
                            ("a header of 1048576 bytes",)),
    "header-of-2**63": (lambda f: _safetensors(f / "model-00001-of-00001.safetensors", header_size=1 << 63),
                        ("not a safetensors file",)),
}


@pytest.mark.parametrize("command", ["fold-checkpoint", "export"])
@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_hostile_checkpoint_directories_are_refused_with_one_line(checkpoint_case, capsys, case, command):
    make, fragments = CHECKPOINT_CASES[case]
    make(checkpoint_case)
    root = checkpoint_case.parent
    out = root / "out" / ("folded" if command == "fold-checkpoint" else "m.onnx")
    refused([command, checkpoint_case, "-o", out], capsys, root, *fragments)
    assert not (root / "evil.safetensors").exists() and not (root.parent / "evil.safetensors").exists()


@pytest.mark.parametrize("case", HEADER_CASES)
def test_hostile_safetensors_headers_are_refused_with_one_line(checkpoint_case, capsys, case):
    pytest.importorskip("transformers")
    make, fragments = HEADER_CASES[case]
    make(checkpoint_case)
    root = checkpoint_case.parent
    refused(["fold-checkpoint", checkpoint_case, "-o", root / "out" / "folded"], capsys, root, *fragments)


def _gguf(path: Path, tensors: int = 0, values: int = 1, key_length: int = 4, magic: bytes = b"GGUF") -> None:
    """A GGUF header: one string-valued key ('name' = 'x') with `key_length` declared."""
    body = struct.pack("<Q", key_length) + b"name" + struct.pack("<I", 8) + struct.pack("<Q", 1) + b"x"
    path.write_bytes(magic + struct.pack("<IQQ", 3, tensors, values) + body)


GGUF_CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "bad-magic": (lambda p: _gguf(p, magic=b"GGML"), ("does not start with 'GGUF'",)),
    "counts-of-2**63": (lambda p: _gguf(p, tensors=1 << 63, values=1 << 63), ("cannot fit",)),
    "string-past-the-end": (lambda p: _gguf(p, key_length=1 << 62), ("runs past the end",)),
    "truncated": (lambda p: p.write_bytes(b"GGUF\x03\x00"), ("is not a GGUF file",)),
    "fifo": (os.mkfifo, ("is a FIFO",)),
}


@pytest.mark.parametrize("command", ["fold-checkpoint", "export"])
@pytest.mark.parametrize("case", GGUF_CASES)
def test_hostile_gguf_files_are_refused_with_one_line(tmp_path, capsys, case, command):
    make, fragments = GGUF_CASES[case]
    make(tmp_path / "m.gguf")
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / ("folded" if command == "fold-checkpoint" else "m.onnx")
    refused([command, tmp_path / "m.gguf", "-o", out], capsys, tmp_path, *fragments)


def test_a_shard_replaced_while_folding_is_refused_and_nothing_written(tmp_path, capsys, monkeypatch):
    """fold-checkpoint reads each shard through the descriptor it opened first; a shard
    replaced after the fold planned its output is refused before the output folder appears."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models.test_hf_architectures import CASES

    from flashnorm.checkpoint import fold

    torch.manual_seed(0)
    source, out = tmp_path / "src", tmp_path / "folded"
    next(c for c in CASES if c.name == "llama").build().eval().save_pretrained(source, max_shard_size="60KB")
    shard = sorted(source.glob("*.safetensors"))[0]
    real_plan = fold._plan

    def plan(*args, **kwargs):
        planned = real_plan(*args, **kwargs)
        shard.with_name("new").write_bytes(shard.read_bytes())  # the same bytes, another file
        os.replace(shard.with_name("new"), shard)
        return planned

    monkeypatch.setattr(fold, "_plan", plan)
    capsys.readouterr()
    assert cli.main(["fold-checkpoint", str(source), "-o", str(out)]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and f"{shard.name} changed while flashnorm was reading it" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("gguf, why", [("../evil.gguf", "not a file name"), ("..", "not a file name"),
                                       ("m.gguf", "is a FIFO")])
def test_the_tokenizer_a_model_names_is_checked_as_a_command_line_source(onnx_case, gguf, why):
    """compare without --tokenizer reads the tokenizer the model's metadata names (export
    records its source there): names from inside a file, checked before anything reads them."""
    from flashnorm.errors import FlashNormError
    from flashnorm.validate.inputs import tokenizer_for

    os.mkfifo(onnx_case.parent / "m.gguf")
    proto = onnx.load(str(onnx_case), load_external_data=False)
    helper.set_model_props(proto, {"flashnorm.source_dir": str(onnx_case.parent), "flashnorm.gguf_file": gguf})
    onnx_case.write_bytes(proto.SerializeToString())
    with deadline(SECONDS), pytest.raises(FlashNormError) as excinfo:
        tokenizer_for(onnx_case)
    assert why in str(excinfo.value) and "\n" not in str(excinfo.value)
