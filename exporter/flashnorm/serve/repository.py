"""Write a Triton model repository: a TensorRT plan with the FlashNorm plugin, or an ONNX
model served by ONNX Runtime from Triton's Python backend.

Layout (REPO/NAME is the model; Triton treats every top-level folder of REPO as a model, so
the plugin sits inside the model folder, where Triton ignores non-numeric folders):

    REPO/README.md                          how to start the server, exactly
    REPO/NAME/config.pbtxt                  validated against Triton's ModelConfig schema
    REPO/NAME/1/model.plan                  (TensorRT)   or  model.py + model.onnx (Python)
    REPO/NAME/plugins/libflashnorm_plugin.so  (TensorRT)

TensorRT with request checks (`check_requests`): REPO/NAME is an ensemble (config.pbtxt and
an empty 1/), REPO/NAME_checks/1/model.py checks each request, REPO/NAME_engine holds the plan
and the plugin.

The repository is assembled in a temporary folder beside REPO and renamed into place only
when complete (`flashnorm.files.staged_directory`), so a failure never leaves half a repository.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Sequence

from flashnorm.errors import FlashNormError, require_file
from flashnorm.files import MARKER, staged_directory
from flashnorm.serve.config import EnsembleStep, ModelConfigOptions, validated_model_config
from flashnorm.serve.engine_profile import check_engine_signature
from flashnorm.serve.tensors import TritonSignature

_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_PYTHON_MODEL_TEMPLATE = Path(__file__).with_name("onnxruntime_model.py")
CHECKED_PREFIX = "checked_"  # the names NAME_checks gives the inputs it passes on (onnxruntime_model.py)
_FLOAT_TYPES = frozenset({"TYPE_FP32", "TYPE_FP16", "TYPE_BF16", "TYPE_FP64"})


@dataclasses.dataclass
class RepositoryResult:
    """What was written; `files` are relative to the repository. `unchecked_by_config`: what
    Triton's config could not state, so Triton does not refuse requests that break it."""

    repository: Path
    model_name: str
    config_text: str
    start_command: str
    files: list[str]
    unchecked_by_config: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "repository": str(self.repository),
            "model": self.model_name,
            "start_command": self.start_command,
            "files": self.files,
            "unchecked_by_config": self.unchecked_by_config,
        }


def check_model_name(name: str) -> str:
    if not _MODEL_NAME.match(name):
        raise FlashNormError(
            f"model name {name!r} must be letters, digits, '_', '.', '-' and not start with '.' or '-'"
        )
    return name


def _copy_file(source: Path, destination: Path, what: str) -> None:
    require_file(what, source)
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
    signature: TritonSignature,
    output: str | os.PathLike[str],
    *,
    name: str = "flashnorm",
    max_batch_size: int = 8,
    instances: int = 1,
    max_queue_delay_us: int = 0,
    cuda_graphs: bool = False,
    check_requests: bool = False,
    force: bool = False,
) -> RepositoryResult:
    """A `tensorrt_plan` model with the FlashNorm plugin library copied into the repository.

    The signature is checked against what the config can state (`engine_profile`): TensorRT
    data types, and with `signature.profile` the engine's shape ranges against the dims and
    `max_batch_size`; dims the profile fixes are written as numbers. With `check_requests`,
    NAME is an ensemble: NAME_checks (Python backend, the request checks of
    `onnxruntime_model.py` and the profile's ranges) hands good requests to NAME_engine."""
    engine, plugin = Path(engine), Path(plugin)
    check_model_name(name)
    require_file("engine", engine)
    require_file("plugin library", plugin)
    checked = check_engine_signature(signature, signature.profile, max_batch_size)
    signature = checked.signature
    engine_name = f"{name}_engine" if check_requests else name
    engine_options = ModelConfigOptions(
        name=engine_name, platform="tensorrt_plan", max_batch_size=max_batch_size,
        max_queue_delay_us=max_queue_delay_us, instance_count=instances,
        instance_kind="KIND_GPU", cuda_graphs=cuda_graphs,
    )
    configs = {engine_name: validated_model_config(signature, engine_options)}
    if check_requests:
        configs.update(_request_check_configs(name, engine_name, signature, max_batch_size, max_queue_delay_us))
        unchecked = _unchecked_by_request_checks(signature, checked.profile_checked)
    else:
        unchecked = _unchecked_by_engine_config(signature, checked.profile_checked, checked.unexpressed_ranges)
    target = Path(output).absolute()
    unchecked_text = "\n".join(f"- {item}" for item in unchecked) or (
        "- nothing: types and shapes by Triton, the profile's ranges and token ids by the checks"
        if check_requests else "- nothing: every input's dims are fixed")
    plugin_relative = Path(engine_name) / "plugins" / plugin.name
    command = start_command(target, f"--backend-config=tensorrt,plugins={target / plugin_relative}")
    preload = start_command(target)
    checks = (
        f"Clients call `{name}`, an ensemble: `{name}_checks` (Triton's Python backend, numpy only)\n"
        "refuses bad requests with HTTP 400 and a one-line reason and hands the others to\n"
        f"`{engine_name}`. Not checked, so such requests reach the engine:\n\n{unchecked_text}\n"
        if check_requests else
        "Triton checks each request's data types and shapes against `config.pbtxt` before the engine\n"
        f"runs. What that config cannot state, and so what Triton does not refuse on its own:\n\n{unchecked_text}\n\n"
        "Validate those before this model: in the client, or with `flashnorm triton --check-requests`,\n"
        "which puts a Python-backend model that checks them in front of the engine (an ensemble).\n"
    )
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

{checks}""",
    )
    with staged_directory(target, force) as staging:
        _copy_file(engine, staging / engine_name / "1" / "model.plan", "engine")
        _copy_file(plugin, staging / plugin_relative, "plugin library")
        if check_requests:
            (staging / name / "1").mkdir(parents=True)  # an ensemble has a version folder, empty
            (staging / f"{name}_checks" / "1").mkdir(parents=True)
            shutil.copyfile(_PYTHON_MODEL_TEMPLATE, staging / f"{name}_checks" / "1" / "model.py")
        for model, text in configs.items():
            (staging / model / "config.pbtxt").write_text(text)
        (staging / "README.md").write_text(readme)
        files = _model_files(staging)
    return RepositoryResult(target, name, configs[name], command, files, unchecked)


def _request_check_configs(name: str, engine_name: str, signature: TritonSignature,
                           max_batch_size: int, max_queue_delay_us: int) -> dict[str, str]:
    """config.pbtxt of NAME_checks (inputs → checked_<input>) and of the ensemble NAME."""
    checked_outputs = tuple(
        dataclasses.replace(spec, name=CHECKED_PREFIX + spec.name, is_input=False) for spec in signature.inputs
    )
    ranges = {input_name: [list(shape_range.minimum), list(shape_range.maximum)]
              for input_name, shape_range in signature.profile.items()}
    checks_options = ModelConfigOptions(
        name=f"{name}_checks", backend="python", max_batch_size=max_batch_size,
        max_queue_delay_us=max_queue_delay_us, instance_kind="KIND_CPU",
        parameters=(("role", "check"), ("vocabulary", str(signature.vocabulary)),
                    ("input_ranges", json.dumps(ranges, separators=(",", ":")))),
    )
    steps = (
        EnsembleStep(f"{name}_checks", tuple((spec.name, spec.name) for spec in signature.inputs),
                     tuple((spec.name, spec.name) for spec in checked_outputs)),
        EnsembleStep(engine_name, tuple((spec.name, CHECKED_PREFIX + spec.name) for spec in signature.inputs),
                     tuple((spec.name, spec.name) for spec in signature.outputs)),
    )
    ensemble_options = ModelConfigOptions(name=name, platform="ensemble", max_batch_size=max_batch_size,
                                          ensemble_steps=steps)
    return {
        f"{name}_checks": validated_model_config(
            dataclasses.replace(signature, outputs=checked_outputs), checks_options),
        name: validated_model_config(signature, ensemble_options),
    }


def _unchecked_by_engine_config(signature: TritonSignature, profile_checked: bool,
                                unexpressed_ranges: tuple[str, ...]) -> list[str]:
    """What a tensorrt_plan config cannot make Triton check, for this signature."""
    unchecked = []
    if not profile_checked:
        unchecked.append("the engine's optimization profile (not known: give --shapes as built, or read the "
                         "engine with TensorRT); requests outside it reach the engine")
    unchecked += [f"{item} (the config says -1)" for item in unexpressed_ranges]
    names = {spec.name for spec in signature.inputs}
    if "input_ids" in names:
        unchecked.append("token ids in [0, vocabulary): a config states types and shapes, never values")
    floats = [spec.name for spec in signature.inputs if spec.data_type in _FLOAT_TYPES]
    if floats:
        unchecked.append(f"finite values of {', '.join(floats)} (NaN and infinity pass Triton's checks)")
    if "input_ids" in names and len(names) > 1:
        unchecked.append("lengths that must agree between inputs (attention_mask as long as past + input_ids)")
    return unchecked


def _unchecked_by_request_checks(signature: TritonSignature, profile_checked: bool) -> list[str]:
    """What NAME_checks does not check, for this signature."""
    unchecked = []
    if not profile_checked:
        unchecked.append("the engine's optimization profile (not known: give --shapes as built, or read the "
                         "engine with TensorRT); requests outside it reach the engine")
    if any(spec.name == "input_ids" for spec in signature.inputs) and signature.vocabulary <= 0:
        unchecked.append("token ids below the vocabulary size (no logits output with a fixed last dimension "
                         "or embedding table to read it from); negative ids are refused")
    return unchecked


def write_onnx_python_repository(
    onnx_model: str | os.PathLike[str],
    signature: TritonSignature,
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
    require_file("model", onnx_model)
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
            ("vocabulary", str(signature.vocabulary)),
        ),
    )
    config_text = validated_model_config(signature, options)
    target = Path(output).absolute()
    command = start_command(target)
    readme = _readme(
        f"Triton model repository: {name} (Python backend, ONNX Runtime)",
        f"""
Written by `flashnorm triton --triton-backend python`. `{name}/1/model.py` serves `{name}/1/model.onnx`
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
        files = _model_files(staging)
    return RepositoryResult(target, name, config_text, command, files)


def write_onnxruntime_repository(
    onnx_model: str | os.PathLike[str],
    signature: TritonSignature,
    output: str | os.PathLike[str],
    *,
    name: str = "flashnorm",
    max_batch_size: int = 8,
    instances: int = 1,
    max_queue_delay_us: int = 0,
    gpu: bool = False,
    check_requests: bool = False,
    force: bool = False,
) -> RepositoryResult:
    """An `onnxruntime_onnx` model: Triton's ONNX Runtime backend serves the file (a deferred
    file's FlashNormMatMul<N> nodes run through their model-local functions). With
    `check_requests`, NAME is an ensemble whose first step, NAME_checks (Python backend, numpy
    only), refuses what the config cannot state (token ids outside the vocabulary, lengths that
    disagree, non-finite floats) before NAME_model runs."""
    onnx_model = Path(onnx_model)
    check_model_name(name)
    require_file("model", onnx_model)
    external = _external_data_files(onnx_model)
    model_name = f"{name}_model" if check_requests else name
    options = ModelConfigOptions(
        name=model_name, platform="onnxruntime_onnx", max_batch_size=max_batch_size,
        max_queue_delay_us=max_queue_delay_us, instance_count=instances,
        instance_kind="KIND_GPU" if gpu else "KIND_CPU",
    )
    configs = {model_name: validated_model_config(signature, options)}
    if check_requests:
        configs.update(_request_check_configs(name, model_name, signature, max_batch_size, max_queue_delay_us))
        unchecked = _unchecked_by_request_checks(signature, profile_checked=True)
    else:
        unchecked = _unchecked_by_engine_config(signature, True, ())
    target = Path(output).absolute()
    command = start_command(target)
    unchecked_text = "\n".join(f"- {item}" for item in unchecked) or "- nothing"
    checks = (
        f"Clients call `{name}`, an ensemble: `{name}_checks` (Python backend, numpy only) refuses bad\n"
        f"requests with HTTP 400 and a one-line reason and hands the others to `{model_name}`. Not\n"
        f"checked:\n\n{unchecked_text}\n"
        if check_requests else
        "Triton checks each request's data types, shapes and batch size against `config.pbtxt`. What that\n"
        f"config cannot state, and so what Triton does not refuse on its own:\n\n{unchecked_text}\n\n"
        "`flashnorm triton --check-requests` puts a Python-backend model that checks them in front (an ensemble).\n"
    )
    readme = _readme(
        f"Triton model repository: {name} (ONNX Runtime backend)",
        f"""
Written by `flashnorm triton --triton-backend onnxruntime`. Triton's ONNX Runtime backend serves
`{model_name}/1/model.onnx` ({"GPU" if gpu else "CPU"} instances); FlashNormMatMul nodes run through the
model-local functions the file carries, so no plugin is needed.

Start the server:

```
{command}
```

{checks}""",
    )
    with staged_directory(target, force) as staging:
        version_dir = staging / model_name / "1"
        _copy_file(onnx_model, version_dir / "model.onnx", "ONNX model")
        for location in external:
            _copy_file(onnx_model.parent / location, version_dir / location, "external data file")
        if check_requests:
            (staging / name / "1").mkdir(parents=True)  # an ensemble has a version folder, empty
            (staging / f"{name}_checks" / "1").mkdir(parents=True)
            shutil.copyfile(_PYTHON_MODEL_TEMPLATE, staging / f"{name}_checks" / "1" / "model.py")
        for model, text in configs.items():
            (staging / model / "config.pbtxt").write_text(text)
        (staging / "README.md").write_text(readme)
        files = _model_files(staging)
    return RepositoryResult(target, name, configs[name], command, files, unchecked)


def _model_files(staging: Path) -> list[str]:
    """The repository's files, as the report lists them: all but flashnorm's own marker."""
    return sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file() and p.name != MARKER)
