"""`flashnorm compare REFERENCE.onnx CANDIDATE.onnx`: run both on identical inputs (seeded
random token ids, `--input-ids`, or `--text` through the model's tokenizer) with Polygraphy
on ONNX Runtime; report max/mean absolute and relative error and relative L2 per output, and
fail (exit 1) beyond `--atol/--rtol/--max-rel-l2`. `--generate N` also compares N greedy
tokens."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from flashnorm.errors import FlashNormError
from flashnorm.validate.comparison import DEFAULT_ATOL, DEFAULT_MAX_REL_L2, DEFAULT_RTOL
from flashnorm.validate.runners import OPTIMIZATION_LEVELS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", help="the reference model (e.g. the exported original)")
    parser.add_argument("candidate", help="the model under test (e.g. the FlashNorm-optimized one)")
    source = parser.add_argument_group("inputs (default: seeded random token ids)")
    given = source.add_mutually_exclusive_group()
    given.add_argument("--text", help="compare on this text, tokenized with the model's tokenizer")
    given.add_argument("--input-ids", metavar="IDS", help="compare on these token ids ('1,2,3')")
    source.add_argument("--tokenizer", metavar="SOURCE",
                        help="tokenizer for --text: HF directory, .gguf file or model name "
                             "(default: the source recorded by flashnorm export)")
    source.add_argument("--batch", type=int, default=2, help="random inputs: batch size (default 2)")
    source.add_argument("--sequence", type=int, default=16, help="random inputs: sequence length (default 16)")
    source.add_argument("--iterations", type=int, default=1, help="random inputs: how many batches (default 1)")
    source.add_argument("--past-length", type=int, default=0,
                        help="KV-cache models: feed a past of this many tokens, produced by the reference "
                             "from a random prefix (default 0: empty past)")
    source.add_argument("--seed", type=int, help="seed for random inputs (default: fresh, printed in the report)")
    limits = parser.add_argument_group("pass/fail")
    limits.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                        help=f"absolute tolerance, elementwise (default {DEFAULT_ATOL:g})")
    limits.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                        help=f"relative tolerance, elementwise; an element fails only beyond both (default {DEFAULT_RTOL:g})")
    limits.add_argument("--max-rel-l2", type=float, default=DEFAULT_MAX_REL_L2,
                        help=f"largest allowed ‖a−b‖₂/‖ref‖₂ per output (default {DEFAULT_MAX_REL_L2:g})")
    limits.add_argument("--generate", type=int, default=0, metavar="N",
                        help="also generate N tokens greedily from both models; fail if any differs")
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


def build_inputs(args: argparse.Namespace) -> tuple[list[dict[str, np.ndarray]], dict[str, Any], np.ndarray]:
    """The feed dicts, their description for the report, and the token ids of the first."""
    from flashnorm.validate.inputs import (
        describe_ids, language_model_feeds, parse_input_ids, prefill_past, random_token_ids, read_signature, tokenize,
        tokenizer_for,
    )
    from flashnorm.validate.runners import make_session

    signature = read_signature(args.reference)
    if "input_ids" not in signature.input_names:
        raise FlashNormError(f"{args.reference} has no input_ids input; inputs: {signature.input_names}")
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
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
        for name in ("batch", "sequence", "iterations"):
            if getattr(args, name) < 1:
                raise FlashNormError(f"--{name} must be at least 1")
        vocab = signature.vocab_size
        if vocab is None:
            raise FlashNormError("cannot draw random token ids: the logits output has no fixed vocabulary size")
        id_batches = [random_token_ids(vocab, args.batch, args.sequence, rng) for _ in range(args.iterations)]
        description["random_token_ids"] = f"{args.iterations} × [{args.batch}, {args.sequence}] in [0, {vocab})"
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
        report["generation"] = generation.to_dict()
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
        if generation["identical"]:
            text += f"\ngeneration: {n} greedy tokens identical"
        else:
            text += f"\ngeneration: FAILED, tokens differ from position {generation['first_divergence']} of {n}"
        text += f"\n  reference: {generation['reference_tokens']}\n  candidate: {generation['candidate_tokens']}"
        if not generation["identical"]:
            text += "\nFAILED"
    return text
