"""`flashnorm compare REFERENCE.onnx CANDIDATE.onnx`: run both on identical inputs with
Polygraphy on ONNX Runtime; report max/mean absolute and relative error and relative L2 per
output, and fail (exit 1) beyond `--atol/--rtol/--max-rel-l2`. A token model (one with an
`input_ids` input) gets seeded random token ids, `--input-ids`, or `--text` through the model's
tokenizer, and `--generate N` also compares N greedy tokens. Any other model gets seeded random
tensors for every input, from its declared dtypes and shapes (`--input-shapes`, `--val-range`)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from flashnorm.errors import FlashNormError
from flashnorm.validate.comparison import DEFAULT_ATOL, DEFAULT_MAX_REL_L2, DEFAULT_RTOL
from flashnorm.validate.inputs import DEFAULT_DYNAMIC_DIM, DEFAULT_INT_RANGE, DEFAULT_LEADING_DIM
from flashnorm.validate.runners import OPTIMIZATION_LEVELS

DEFAULT_BATCH, DEFAULT_SEQUENCE = 2, 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", help="the reference model (e.g. the exported original)")
    parser.add_argument("candidate", help="the model under test (e.g. the FlashNorm-optimized one)")
    source = parser.add_argument_group(
        "inputs of token models (those with an input_ids input; default: seeded random token ids)"
    )
    given = source.add_mutually_exclusive_group()
    given.add_argument("--text", help="compare on this text, tokenized with the model's tokenizer")
    given.add_argument("--input-ids", metavar="IDS", help="compare on these token ids ('1,2,3')")
    source.add_argument("--tokenizer", metavar="SOURCE",
                        help="tokenizer for --text: HF directory, .gguf file or model name "
                             "(default: the source recorded by flashnorm export)")
    source.add_argument("--batch", type=int, help=f"random inputs: batch size (default {DEFAULT_BATCH})")
    source.add_argument("--sequence", type=int, help=f"random inputs: sequence length (default {DEFAULT_SEQUENCE})")
    source.add_argument("--iterations", type=int, default=1,
                        help="random inputs, any model: how many feeds to compare on (default 1)")
    source.add_argument("--past-length", type=int, default=0,
                        help="KV-cache models: feed a past of this many tokens, produced by the reference "
                             "from a random prefix (default 0: empty past)")
    source.add_argument("--seed", type=int,
                        help="seed for random inputs, any model (default: fresh, printed in the report)")
    generic = parser.add_argument_group(
        "inputs of any other model (seeded random tensors for every input, from its declared dtype and shape: "
        f"floats standard normal, integers in [{DEFAULT_INT_RANGE[0]}, {DEFAULT_INT_RANGE[1]}), bools True/False)"
    )
    generic.add_argument("--input-shapes", nargs="+", action="extend", default=[], metavar="NAME:D1xD2x...",
                         help="the shape to feed input NAME, e.g. x:2x16x576 (repeatable); its named dynamic axes "
                              "also size every other input that shares them. Dynamic axes still unresolved get "
                              f"{DEFAULT_LEADING_DIM} as the first axis of an input of rank >= 2 (batch-like) "
                              f"and {DEFAULT_DYNAMIC_DIM} otherwise")
    generic.add_argument("--val-range", nargs="+", action="extend", default=[], metavar="[NAME:]LO,HI",
                         help="random values of input NAME (without NAME: of every input), as in Polygraphy "
                              "(brackets optional): integer inputs uniform in [LO, HI) "
                              f"(default [{DEFAULT_INT_RANGE[0]}, {DEFAULT_INT_RANGE[1]})), float inputs uniform in "
                              "[LO, HI) instead of standard normal; bool inputs take no range")
    limits = parser.add_argument_group("pass/fail")
    limits.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                        help=f"absolute tolerance, elementwise (default {DEFAULT_ATOL:g})")
    limits.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                        help=f"relative tolerance, elementwise; an element fails only beyond both (default {DEFAULT_RTOL:g})")
    limits.add_argument("--max-rel-l2", type=float, default=DEFAULT_MAX_REL_L2,
                        help=f"largest allowed ‖a−b‖₂/‖ref‖₂ per output (default {DEFAULT_MAX_REL_L2:g})")
    limits.add_argument("--generate", type=int, default=0, metavar="N",
                        help="also generate N tokens greedily from both models on ONNX Runtime (even with "
                             "--trt/--engine: the engine is not run in a generation loop); fail if any differs")
    runtime = parser.add_argument_group("ONNX Runtime")
    runtime.add_argument("--providers", default="CPUExecutionProvider",
                         help="comma-separated execution providers (default CPUExecutionProvider)")
    runtime.add_argument("--optimization-level", choices=OPTIMIZATION_LEVELS, default="all",
                         help="ONNX Runtime graph optimization level for both models (default all)")
    tensorrt = parser.add_argument_group("TensorRT (the candidate runs on TensorRT through Polygraphy; needs `tensorrt`)")
    tensorrt.add_argument("--trt", action="store_true",
                          help="build the candidate ONNX into a TensorRT engine in memory and run it there")
    tensorrt.add_argument("--engine", metavar="PLAN",
                          help="run this prebuilt engine as the candidate (implies --trt; the candidate ONNX "
                               "still gives the input and output names)")
    tensorrt.add_argument("--plugin", action="append", default=[], metavar="LIB",
                          help="plugin library to register first, e.g. libflashnorm_plugin.so (repeatable)")
    tensorrt.add_argument("--trt-shapes", nargs="+", action="extend", default=[], metavar="NAME:MIN,OPT,MAX",
                          help="optimization profile for --trt (default: exactly the shapes of the inputs fed)")


def build_inputs(args: argparse.Namespace) -> tuple[list[dict[str, np.ndarray]], dict[str, Any], np.ndarray | None]:
    """The feed dicts, their description for the report, and the token ids of the first (None
    for a model without input_ids)."""
    from flashnorm.validate.inputs import (
        describe_ids, language_model_feeds, parse_input_ids, prefill_past, random_token_ids, read_signature, tokenize,
        tokenizer_for,
    )
    from flashnorm.validate.runners import make_session

    signature = read_signature(args.reference)
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    if "input_ids" not in signature.input_names:
        feeds, description = random_tensor_inputs(args, signature, seed, rng)
        return feeds, description, None
    if args.input_shapes or args.val_range:
        raise FlashNormError(
            f"--input-shapes/--val-range are for models without input_ids; {args.reference} is a token model: "
            "use --batch/--sequence/--input-ids/--text"
        )
    batch = DEFAULT_BATCH if args.batch is None else args.batch
    sequence = DEFAULT_SEQUENCE if args.sequence is None else args.sequence
    description: dict[str, Any] = {"seed": seed}
    if args.text is not None or args.input_ids is not None:
        if args.text is not None:
            ids = tokenize(args.text, tokenizer_for(args.reference, args.tokenizer))
            description["text"] = args.text
        else:
            ids = parse_input_ids(args.input_ids)
        description["input_ids"] = describe_ids(ids)
        id_batches = [ids]
    else:
        for name, value in (("batch", batch), ("sequence", sequence), ("iterations", args.iterations)):
            if value < 1:
                raise FlashNormError(f"--{name} must be at least 1")
        vocab = signature.vocab_size
        if vocab is None:
            raise FlashNormError("cannot draw random token ids: the logits output has no fixed vocabulary size")
        id_batches = [random_token_ids(vocab, batch, sequence, rng) for _ in range(args.iterations)]
        description["random_token_ids"] = f"{args.iterations} × [{batch}, {sequence}] in [0, {vocab})"
    if args.past_length < 0:
        raise FlashNormError("--past-length must be at least 0")
    if not args.past_length:
        return [language_model_feeds(signature, ids) for ids in id_batches], description, id_batches[0]
    if not signature.past_inputs or signature.vocab_size is None:
        raise FlashNormError("--past-length needs a model with KV-cache inputs (flashnorm export --kv-cache)")
    # The past both models get is the one the reference itself produces for a random prefix:
    # random tensors as keys/values would be far outside anything the model ever sees.
    session = make_session(args.reference)
    feeds = []
    for ids in id_batches:
        prefix = random_token_ids(signature.vocab_size, ids.shape[0], args.past_length, rng)
        feeds.append(language_model_feeds(signature, ids, past=prefill_past(session, prefix)))
    description["past"] = f"{args.past_length} tokens, prefilled by the reference from random token ids"
    return feeds, description, id_batches[0]


def random_tensor_inputs(
    args: argparse.Namespace, signature: Any, seed: int, rng: np.random.Generator
) -> tuple[list[dict[str, np.ndarray]], dict[str, Any]]:
    """Feeds for a model without input_ids: seeded random tensors for every input of the
    reference, which the candidate must take by the same names, dtypes and shapes."""
    from flashnorm.validate.inputs import (
        describe_random_feeds, dtype_name, format_shape, parse_input_shapes, parse_value_ranges, random_feeds,
        read_signature, resolve_input_shapes,
    )

    token_options = [flag for flag, given in (
        ("--text", args.text is not None), ("--input-ids", args.input_ids is not None),
        ("--tokenizer", args.tokenizer is not None), ("--batch", args.batch is not None),
        ("--sequence", args.sequence is not None), ("--past-length", args.past_length != 0),
        ("--generate", args.generate != 0),
    ) if given]
    if token_options:
        raise FlashNormError(
            f"{'/'.join(token_options)}: only for token models, and {args.reference} has no input_ids input "
            f"(inputs: {signature.input_names}); use --input-shapes/--val-range"
        )
    if args.iterations < 1:
        raise FlashNormError("--iterations must be at least 1")
    candidate = read_signature(args.candidate)
    if set(signature.input_names) != set(candidate.input_names):
        raise FlashNormError(
            f"the models take different inputs: reference {sorted(signature.input_names)} "
            f"vs candidate {sorted(candidate.input_names)}"
        )
    shapes = resolve_input_shapes(signature.inputs, parse_input_shapes(args.input_shapes))
    for spec in signature.inputs:
        other = candidate.input(spec.name)
        if dtype_name(spec.dtype) != dtype_name(other.dtype):
            raise FlashNormError(
                f"input {spec.name} is {dtype_name(spec.dtype)} in the reference but {dtype_name(other.dtype)} "
                "in the candidate; both models get the same feeds"
            )
        fed = shapes[spec.name]
        if not other.has_shape or len(other.shape) != len(fed) or any(
            isinstance(declared, int) and declared != size for declared, size in zip(other.shape, fed)
        ):
            declared = format_shape(other.shape) if other.has_shape else "no shape"
            raise FlashNormError(
                f"input {spec.name}: the candidate declares {declared} and cannot take the shape {list(fed)} "
                "fed to the reference; set it with --input-shapes"
            )
    ranges = parse_value_ranges(args.val_range)
    drawn = describe_random_feeds(signature.inputs, shapes, ranges)
    bfloat16 = [spec.name for spec in signature.inputs if dtype_name(spec.dtype) == "bfloat16"]
    if bfloat16:
        raise FlashNormError(
            f"bfloat16 input(s) {bfloat16}: ONNX Runtime's Python API (the reference runner) takes no bfloat16 arrays"
        )
    feeds = [random_feeds(signature.inputs, shapes, rng, ranges) for _ in range(args.iterations)]
    description: dict[str, Any] = {"seed": seed, "iterations": args.iterations}
    description.update({f"input {name}": text for name, text in drawn.items()})
    return feeds, description


def run(args: argparse.Namespace) -> dict[str, Any]:
    from flashnorm.validate.comparison import compare_models
    from flashnorm.validate.generate import compare_generation
    from flashnorm.validate.runners import make_session, onnxrt_runner_factory

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    feeds, description, first_ids = build_inputs(args)
    factory = onnxrt_runner_factory(providers=providers, optimization_level=args.optimization_level)
    candidate_factory = tensorrt_candidate(args, feeds) or factory
    report = compare_models(
        args.reference, args.candidate, feeds, runners=(factory, candidate_factory),
        atol=args.atol, rtol=args.rtol, max_rel_l2=args.max_rel_l2, inputs_description=description,
    ).to_dict()
    if args.generate:
        generation = compare_generation(
            args.reference, args.candidate, first_ids[0], args.generate,
            session_factory=lambda path: make_session(path, providers=providers, optimization_level=args.optimization_level),
        )
        # Both models generate on ONNX Runtime whatever ran the candidate above: said in the report.
        report["generation"] = {**generation.to_dict(), "runner": f"onnxruntime ({', '.join(providers)})"}
        report["passed"] = report["passed"] and generation.passed
    return report


def tensorrt_candidate(args: argparse.Namespace, feeds: list[dict[str, np.ndarray]]):
    """The TensorRT runner factory for the candidate when --trt or --engine is given, else
    None. TensorRT is imported here, so a missing installation is reported before any run."""
    if not (args.trt or args.engine):
        return None
    from flashnorm.engine import import_tensorrt, shape_ranges_from_feeds, trt_runner_factory
    from flashnorm.engine.shapes import parse_shape_specs

    import_tensorrt()
    shapes = parse_shape_specs(args.trt_shapes) or shape_ranges_from_feeds(feeds)
    return trt_runner_factory(plugins=args.plugin, shapes=shapes, engine_path=args.engine)


def format_text(report: dict[str, Any]) -> str:
    from flashnorm.validate.comparison import ComparisonReport, OutputError, format_report

    fields = {k: v for k, v in report.items() if k in ComparisonReport.__dataclass_fields__}
    fields["outputs"] = [OutputError(**o) for o in report["outputs"]]
    text = format_report(ComparisonReport(**fields))
    generation = report.get("generation")
    if generation:
        n = len(generation["reference_tokens"])
        label = f"generation on {generation['runner']}"
        if generation["identical"]:
            text += f"\n{label}: {n} greedy tokens identical"
        else:
            text += f"\n{label}: FAILED, tokens differ from position {generation['first_divergence']} of {n}"
        text += f"\n  reference: {generation['reference_tokens']}\n  candidate: {generation['candidate_tokens']}"
        if not generation["identical"]:
            text += "\nFAILED"
    return text
