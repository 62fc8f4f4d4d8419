"""`flashnorm triton`: write a Triton Inference Server model repository.

Two kinds:
- `--engine model.plan --plugin libflashnorm_plugin.so -o REPO`: a `tensorrt_plan` model,
  the plugin copied into the repository, a README with the exact start command. Inputs and
  outputs are read from the engine where `tensorrt` is importable; elsewhere give the ONNX the
  engine was built from (`--onnx`) or `--io` specs.
  `--check-requests` puts a Python-backend model in front of the engine (an ensemble) that
  refuses what the config cannot state: token ids outside the vocabulary, lengths that
  disagree, shapes outside the profile.
- `--onnx model.onnx --triton-backend python -o REPO`: a Python-backend model serving the ONNX with
  ONNX Runtime (no GPU needed); it checks requests itself.
- `--onnx model.onnx --triton-backend onnxruntime -o REPO`: an `onnxruntime_onnx` model for
  Triton's ONNX Runtime backend (a folded or deferred file runs as it is: FlashNormMatMul nodes
  through their model-local functions); `--check-requests` puts the Python-backend checks in
  front (an ensemble).

Embedding models (an encoder exported by `flashnorm export`: pixel_values, input_ids +
attention_mask or input_features → last_hidden_state and a pooled output) are served like
language models: `--outputs` picks the pooled output and/or the last hidden state, token ids are
checked against the embedding table, pixels and features must be finite.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from flashnorm.errors import FlashNormError, require_file
from flashnorm.paths import Input, Output
from flashnorm.tools.options import (
    FOLDER_OUTPUT,
    INT32_LIMIT,
    INT64_LIMIT,
    DeprecatedAlias,
    add_plugin_option,
    add_shapes_option,
    at_least,
    file_inputs,
    onnx_inputs,
)

TRITON_BACKENDS = ("tensorrt", "python", "onnxruntime")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("model")
    source.add_argument("--triton-backend", choices=TRITON_BACKENDS, default="tensorrt",
                        help="the Triton backend that serves the model: tensorrt serves --engine; python serves "
                             "--onnx with ONNX Runtime from a Python model; onnxruntime writes --onnx for Triton's "
                             "ONNX Runtime backend (default: tensorrt)")
    source.add_argument("--backend", dest="triton_backend", choices=TRITON_BACKENDS, action=DeprecatedAlias,
                        replacement="--triton-backend",
                        why="--backend names the TensorRT flavour in build and compare",
                        help="deprecated spelling of --triton-backend")
    source.add_argument("--engine", metavar="PLAN", help="TensorRT engine (.plan) built with the FlashNorm plugin")
    add_plugin_option(source, "; --triton-backend tensorrt: the one library the engine was built with, copied into REPO")
    source.add_argument("--onnx", metavar="MODEL", help="ONNX model: served by --triton-backend python, or the I/O "
                        "source for --engine where TensorRT is not importable (the ONNX the engine was built from)")
    source.add_argument("--io", action="append", default=[], metavar="in|out:NAME:TYPE:DIMS",
                        help="declare one engine input/output by hand, full shape, -1 = variable "
                        "(e.g. in:input_ids:int64:-1,-1); repeat for each tensor")
    add_shapes_option(source, "--triton-backend tensorrt: the optimization profile the engine was built with (as "
                              "given to `flashnorm build --shapes`), checked against --max-batch-size and the dims; "
                              "read from the engine instead where TensorRT is importable")
    parser.add_argument("-o", "--output", required=True, metavar="REPO", help="model repository folder to write" + FOLDER_OUTPUT)
    parser.add_argument("--force", action="store_true", help="replace REPO if it exists and is not empty")
    config = parser.add_argument_group("config.pbtxt")
    config.add_argument("--name", help="model name (default: the model file's name without extension)")
    config.add_argument("--max-batch-size", type=at_least(0, highest=INT32_LIMIT), default=8,
                        help="Triton max_batch_size; 0 serves the model unbatched (default: 8)")
    config.add_argument("--max-queue-delay-us", type=at_least(0, highest=INT64_LIMIT), default=0,
                        help="dynamic batching: how long a request may wait for others (default: 0)")
    config.add_argument("--instances", type=at_least(1, highest=INT32_LIMIT), default=1,
                        help="model instances (default: 1)")
    config.add_argument("--cuda-graphs", action="store_true",
                        help="tensorrt: add optimization { cuda { graphs: true } }")
    config.add_argument("--check-requests", action="store_true",
                        help="tensorrt, onnxruntime: serve NAME as an ensemble whose first step, a Python-backend "
                        "model (numpy only), refuses bad requests (token ids outside the vocabulary, lengths that "
                        "disagree, non-finite pixels or features, shapes outside --shapes) with HTTP 400 before "
                        "the model runs")
    config.add_argument("--outputs", nargs="+", metavar="NAME",
                        help="python, onnxruntime: serve only these ONNX outputs (e.g. logits; an encoder's "
                             "pooler_output, image_embeds or text_embeds, and/or last_hidden_state)")
    config.add_argument("--threads", type=at_least(0, highest=INT32_LIMIT), default=0,
                        help="python: ONNX Runtime intra-op threads per instance (default: 0 = its choice)")
    config.add_argument("--providers", default="CPUExecutionProvider",
                        help="python: comma-separated ONNX Runtime providers; onnxruntime: GPU instances where "
                             "one is not CPUExecutionProvider (default: CPUExecutionProvider)")


def paths(args: argparse.Namespace) -> tuple[list[Input], list[Output]]:
    read = onnx_inputs("model", args.onnx) + file_inputs("engine", [args.engine])
    read += file_inputs("plugin library", args.plugin)
    return read, [Output("repository", Path(args.output), folder=True)]


TENSORRT_RTX_PLAN_MAGIC = b"vtrt"
"""The first bytes of a TensorRT-RTX plan (every plan TensorRT-RTX 1.7.1 built here); a TensorRT plan
starts with b"ftrt" (what torch-tensorrt checks for). Triton's TensorRT backend cannot load the former."""


def _tensorrt_rtx_plan(path: str) -> bool:
    with open(path, "rb") as plan:
        return plan.read(len(TENSORRT_RTX_PLAN_MAGIC)) == TENSORRT_RTX_PLAN_MAGIC


def _default_name(path: str) -> str:
    stem = Path(path).name.split(".")[0]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", stem).lstrip(".-")
    return name or "flashnorm"


def _engine_signature(args: argparse.Namespace):
    import dataclasses

    from flashnorm.engine.shapes import parse_shape_specs
    from flashnorm.serve import signature_from_engine, signature_from_io_specs, signature_from_onnx

    if args.io and args.onnx:
        raise FlashNormError("give either --onnx or --io as the engine's I/O source, not both")
    shapes = parse_shape_specs(args.shapes)
    if args.io:
        signature = signature_from_io_specs(args.io)
    elif args.onnx:
        signature = signature_from_onnx(args.onnx)
    else:
        signature = signature_from_engine(args.engine, args.plugin)
        if shapes and shapes != dict(signature.profile):
            read = {name: shape_range.describe() for name, shape_range in signature.profile.items()}
            raise FlashNormError(f"--shapes differs from the engine's own profile {read}; leave --shapes out")
    return dataclasses.replace(signature, profile=shapes) if shapes else signature


def run(args: argparse.Namespace) -> dict:
    from flashnorm.serve import (
        signature_from_onnx,
        write_engine_repository,
        write_onnx_python_repository,
        write_onnxruntime_repository,
    )

    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    if args.triton_backend == "onnxruntime":
        if not args.onnx:
            raise FlashNormError("--triton-backend onnxruntime needs --onnx MODEL.onnx")
        for flag, value in (("--engine", args.engine), ("--plugin", args.plugin), ("--io", args.io),
                            ("--cuda-graphs", args.cuda_graphs), ("--shapes", args.shapes), ("--threads", args.threads)):
            if value:
                raise FlashNormError(f"{flag} does not apply to --triton-backend onnxruntime")
        signature = signature_from_onnx(args.onnx).select_outputs(args.outputs)
        result = write_onnxruntime_repository(
            args.onnx, signature, args.output,
            name=args.name or _default_name(args.onnx), max_batch_size=args.max_batch_size,
            instances=args.instances, max_queue_delay_us=args.max_queue_delay_us,
            gpu=any(provider != "CPUExecutionProvider" for provider in providers),
            check_requests=args.check_requests, force=args.force,
        )
    elif args.triton_backend == "python":
        if not args.onnx:
            raise FlashNormError("--triton-backend python needs --onnx MODEL.onnx")
        for flag, value in (("--engine", args.engine), ("--plugin", args.plugin), ("--io", args.io),
                            ("--cuda-graphs", args.cuda_graphs), ("--shapes", args.shapes),
                            ("--check-requests", args.check_requests)):
            if value:
                raise FlashNormError(f"{flag} applies to --triton-backend tensorrt, not python")
        signature = signature_from_onnx(args.onnx).select_outputs(args.outputs)
        result = write_onnx_python_repository(
            args.onnx, signature, args.output,
            name=args.name or _default_name(args.onnx), max_batch_size=args.max_batch_size,
            instances=args.instances, max_queue_delay_us=args.max_queue_delay_us,
            intra_op_threads=args.threads, providers=providers, force=args.force,
        )
    else:
        if not args.engine:
            raise FlashNormError("--triton-backend tensorrt needs --engine MODEL.plan and --plugin LIB.so")
        require_file("engine", args.engine)
        if _tensorrt_rtx_plan(args.engine):
            raise FlashNormError(f"{args.engine} is a TensorRT-RTX plan, which Triton's TensorRT backend cannot load (it "
                                 "runs TensorRT plans only, and TensorRT-RTX has no plugin layers): build the engine with "
                                 "`flashnorm build --backend tensorrt --plugin LIB.so`, or serve the ONNX with "
                                 "--triton-backend python")
        if not args.plugin:
            raise FlashNormError("--plugin LIB.so is missing: --triton-backend tensorrt copies the FlashNorm plugin "
                                 "library the engine was built with into the repository")
        if len(args.plugin) > 1:
            raise FlashNormError(f"--triton-backend tensorrt copies one plugin library into the repository, got {len(args.plugin)}")
        plugin = args.plugin[0]
        if args.outputs:
            raise FlashNormError("--outputs applies to --triton-backend python; a TensorRT config declares every engine output")
        require_file("plugin library", plugin)
        signature = _engine_signature(args)
        result = write_engine_repository(
            args.engine, plugin, signature, args.output,
            name=args.name or _default_name(args.engine), max_batch_size=args.max_batch_size,
            instances=args.instances, max_queue_delay_us=args.max_queue_delay_us,
            cuda_graphs=args.cuda_graphs, check_requests=args.check_requests, force=args.force,
        )
    report = {
        "passed": True,
        "backend": args.triton_backend,
        "io_source": signature.source,
        "inputs": [{"name": s.name, "data_type": s.data_type, "shape": list(s.shape)} for s in signature.inputs],
        "outputs": [{"name": s.name, "data_type": s.data_type, "shape": list(s.shape)} for s in signature.outputs],
        "config_validated": True,
        "vocabulary": signature.vocabulary or None,
        **result.to_dict(),
    }
    if args.triton_backend == "tensorrt":
        report["profile"] = {name: shape_range.describe() for name, shape_range in signature.profile.items()}
    if args.triton_backend == "tensorrt" and signature.source != "tensorrt":
        report["note"] = (
            f"inputs and outputs declared from {'the ONNX model' if signature.source == 'onnx' else '--io'}, "
            "not read from the engine (TensorRT not used); they must match the engine's tensors"
        )
    return report
