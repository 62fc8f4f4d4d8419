"""Write a Triton model repository: a TensorRT plan with the FlashNorm plugin, or an ONNX
model served by ONNX Runtime from Triton's Python backend.

Layout (REPO/NAME is the model; Triton treats every top-level folder of REPO as a model, so
the plugin sits inside the model folder, where Triton ignores non-numeric folders):

    REPO/README.md                          how to start the server, exactly
    REPO/NAME/config.pbtxt                  validated against Triton's ModelConfig schema
    REPO/NAME/1/model.plan                  (TensorRT)   or  model.py + model.onnx (Python)
    REPO/NAME/plugins/libflashnorm_plugin.so  (TensorRT)

The repository is assembled in a temporary folder beside REPO and renamed into place only
when complete, so a failure never leaves half a repository.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from flashnorm.errors import FlashNormError
from flashnorm.serve.config import ModelConfigOptions, validated_model_config
from flashnorm.serve.tensors import ModelSignature

_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_PYTHON_MODEL_TEMPLATE = Path(__file__).with_name("onnxruntime_model.py")


@dataclasses.dataclass
class RepositoryResult:
    """What was written; `files` are relative to the repository."""

    repository: Path
    model_name: str
    config_text: str
    start_command: str
    files: list[str]

    def to_dict(self) -> dict:
        return {
            "repository": str(self.repository),
            "model": self.model_name,
            "start_command": self.start_command,
            "files": self.files,
        }


def check_model_name(name: str) -> str:
    if not _MODEL_NAME.match(name):
        raise FlashNormError(
            f"model name {name!r} must be letters, digits, '_', '.', '-' and not start with '.' or '-'"
        )
    return name


@contextlib.contextmanager
def staged_directory(target: Path, force: bool) -> Iterator[Path]:
    """Yield an empty folder beside `target`; on success it replaces `target`, on failure it vanishes.

    `target` may be missing or an empty folder; a non-empty one is replaced only with `force`.
    """
    target = target.absolute()
    if target.exists() and not target.is_dir():
        raise FlashNormError(f"output {target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise FlashNormError(f"output directory {target} is not empty (pass --force to replace it)")
    if not target.parent.is_dir():
        raise FlashNormError(f"cannot write {target}: directory {target.parent} does not exist")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield staging
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.replace(target, retired / target.name)
            os.replace(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _copy_file(source: Path, destination: Path, what: str) -> None:
    if not source.is_file():
        raise FlashNormError(f"{what} {source} does not exist")
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, destination)


def _external_data_files(onnx_path: Path) -> list[str]:
    """Relative paths of the external-data files an ONNX model refers to (weights stay unread)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    locations: set[str] = set()

    def visit_tensor(tensor) -> None:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    locations.add(entry.value)

    def visit_graph(graph) -> None:
        for tensor in graph.initializer:
            visit_tensor(tensor)
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    visit_tensor(attribute.t)
                for tensor in attribute.tensors:
                    visit_tensor(tensor)
                if attribute.HasField("g"):
                    visit_graph(attribute.g)
                for subgraph in attribute.graphs:
                    visit_graph(subgraph)

    visit_graph(model.graph)
    for location in locations:
        if os.path.isabs(location) or ".." in Path(location).parts:
            raise FlashNormError(
                f"{onnx_path} refers to external data {location!r} outside its folder; Triton needs it beside the model"
            )
    return sorted(locations)


def _readme(title: str, body: str) -> str:
    return f"# {title}\n\n{body.strip()}\n"


def start_command(repository: Path, *options: str) -> str:
    """The `tritonserver` command line that serves `repository`, with any extra `options`."""
    return shlex.join(["tritonserver", f"--model-repository={repository}", *options])


def write_engine_repository(
    engine: str | os.PathLike[str],
    plugin: str | os.PathLike[str],
    signature: ModelSignature,
    output: str | os.PathLike[str],
    *,
    name: str = "flashnorm",
    max_batch_size: int = 8,
    instances: int = 1,
    max_queue_delay_us: int = 0,
    cuda_graphs: bool = False,
    force: bool = False,
) -> RepositoryResult:
    """A `tensorrt_plan` model with the FlashNorm plugin library copied into the repository."""
    engine, plugin = Path(engine), Path(plugin)
    check_model_name(name)
    if not engine.is_file():
        raise FlashNormError(f"engine {engine} does not exist")
    if not plugin.is_file():
        raise FlashNormError(f"plugin library {plugin} does not exist")
    options = ModelConfigOptions(
        name=name, platform="tensorrt_plan", max_batch_size=max_batch_size,
        max_queue_delay_us=max_queue_delay_us, instance_count=instances,
        instance_kind="KIND_GPU", cuda_graphs=cuda_graphs,
    )
    config_text = validated_model_config(signature, options)
    target = Path(output).absolute()
    plugin_relative = Path(name) / "plugins" / plugin.name
    command = start_command(target, f"--backend-config=tensorrt,plugins={target / plugin_relative}")
    preload = start_command(target)
    readme = _readme(
        f"Triton model repository: {name} (TensorRT + FlashNorm plugin)",
        f"""
Written by `flashnorm triton`. Inputs and outputs were read from: {signature.source}.

Start the server (the TensorRT backend loads the plugin once per process, for every model):

```
{command}
```

Or preload the plugin instead of `--backend-config`:

```
LD_PRELOAD={shlex.quote(str(target / plugin_relative))} {preload}
```

The plan only runs on the GPU model and TensorRT version it was built with, and the plugin
library must come from the same build. The plugin lives inside the model folder because
Triton treats every top-level folder of a repository as a model.
""",
    )
    with staged_directory(target, force) as staging:
        model_dir = staging / name
        _copy_file(engine, model_dir / "1" / "model.plan", "engine")
        _copy_file(plugin, staging / plugin_relative, "plugin library")
        (model_dir / "config.pbtxt").write_text(config_text)
        (staging / "README.md").write_text(readme)
        files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
    return RepositoryResult(target, name, config_text, command, files)


def write_onnx_python_repository(
    onnx_model: str | os.PathLike[str],
    signature: ModelSignature,
    output: str | os.PathLike[str],
    *,
    name: str = "flashnorm",
    max_batch_size: int = 8,
    instances: int = 1,
    max_queue_delay_us: int = 0,
    intra_op_threads: int = 0,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    force: bool = False,
) -> RepositoryResult:
    """A Python-backend model that runs the ONNX file (and its external data) with ONNX Runtime."""
    onnx_model = Path(onnx_model)
    check_model_name(name)
    if not onnx_model.is_file():
        raise FlashNormError(f"ONNX model {onnx_model} does not exist")
    bf16 = [spec.name for spec in signature.inputs + signature.outputs if spec.data_type == "TYPE_BF16"]
    if bf16:
        raise FlashNormError(f"bf16 tensors {bf16} cannot cross the Python backend as numpy arrays; export fp32 or fp16")
    if intra_op_threads < 0:
        raise FlashNormError(f"--threads must be >= 0, got {intra_op_threads}")
    external = _external_data_files(onnx_model)
    gpu = any(provider != "CPUExecutionProvider" for provider in providers)
    options = ModelConfigOptions(
        name=name, backend="python", max_batch_size=max_batch_size,
        max_queue_delay_us=max_queue_delay_us, instance_count=instances,
        instance_kind="KIND_GPU" if gpu else "KIND_CPU",
        parameters=(
            ("onnx_file", "model.onnx"),
            ("providers", ",".join(providers)),
            ("intra_op_num_threads", str(intra_op_threads)),
        ),
    )
    config_text = validated_model_config(signature, options)
    target = Path(output).absolute()
    command = start_command(target)
    readme = _readme(
        f"Triton model repository: {name} (Python backend, ONNX Runtime)",
        f"""
Written by `flashnorm triton --backend python`. `{name}/1/model.py` serves `{name}/1/model.onnx`
with ONNX Runtime ({", ".join(providers)}); no GPU and no FlashNorm install are needed.

Start the server:

```
{command}
```

The Python that runs Triton's Python-backend stub must have `numpy` and `onnxruntime`
(`pip install onnxruntime` in the Triton container). With the `tritonserver` bundled in
`nvidia-pytriton`, kept in its own venv, `flashnorm.serve.bundled_server.BundledTritonServer`
runs it: it puts the stub for the venv's Python version into a backend folder, adds PyTriton's
libraries and the venv Python's `libpython` folder to `LD_LIBRARY_PATH`, and puts the venv's
`bin/` first on `PATH` (the stub ignores `PYTHONPATH`; it finds its site-packages through the
`python3` on `PATH`).
""",
    )
    with staged_directory(target, force) as staging:
        version_dir = staging / name / "1"
        _copy_file(onnx_model, version_dir / "model.onnx", "ONNX model")
        for location in external:
            _copy_file(onnx_model.parent / location, version_dir / location, "external data file")
        shutil.copyfile(_PYTHON_MODEL_TEMPLATE, version_dir / "model.py")
        (staging / name / "config.pbtxt").write_text(config_text)
        (staging / "README.md").write_text(readme)
        files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
    return RepositoryResult(target, name, config_text, command, files)
