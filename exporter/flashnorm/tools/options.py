"""Command-line option groups several subcommands share, each defined once here (as Polygraphy
defines its argument groups once): what every command prints, which TensorRT backend and
plugin libraries to use, and what inputs to feed a model. Light to import: the CLI adds the
output options to every subcommand before it knows which one runs."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Iterable

from flashnorm.engine.loader import BACKENDS
from flashnorm.paths import Input, Output


FILE_OUTPUT = ("; a regular file there is replaced atomically, anything else (a folder, a device such as /dev/null, "
               "a FIFO) is refused, never replaced")
"""How a file output treats what is already there: the end of every -o help (flashnorm.paths)."""
FOLDER_OUTPUT = ("; it must be missing or empty, or with --force a folder flashnorm wrote; anything else is refused, "
                 "never replaced")
"""How a folder output treats what is already there."""


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """--report, -q, -v: every subcommand."""
    group = parser.add_argument_group("output")
    group.add_argument("--report", metavar="PATH",
                       help="also write the command's report as JSON to PATH. '-' or /dev/stdout prints the JSON "
                            "instead of the text report, /dev/stderr writes it there (written through, not "
                            "replaced)" + FILE_OUTPUT)
    group.add_argument("-q", "--quiet", action="store_true",
                       help="print nothing but errors and, for a failed check, its verdict line (no progress, no "
                            "report)")
    group.add_argument("-v", "--verbose", action="store_true",
                       help="more detail: every site in the text report, instead of skipped sites grouped by "
                            "reason (the JSON report always lists every site); build: TensorRT's verbose log")


def add_plugin_option(group: argparse._ActionsContainer, what: str = "") -> None:
    """--plugin LIB (repeatable): plugin libraries to register with TensorRT."""
    group.add_argument("--plugin", action="append", default=[], metavar="LIB",
                       help="plugin library, e.g. build/lib/libflashnorm_plugin.so (repeatable)" + what)


def add_tensorrt_options(parser: argparse.ArgumentParser, title: str = "TensorRT") -> argparse._ArgumentGroup:
    """--backend and --plugin: build and compare."""
    group = parser.add_argument_group(title)
    group.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="tensorrt: TensorRT 10.x/11.x, FlashNormMatMul nodes run the plugin; tensorrt-rtx: "
                            "TensorRT for RTX, nodes built from their reference functions, no plugin (runs only on "
                            "GPUs it supports); auto (default): tensorrt where importable, else tensorrt-rtx")
    add_plugin_option(group, "; registered first, TensorRT only")
    return group


def add_model_input_options(parser: argparse.ArgumentParser) -> None:
    """What to feed a model: token ids or text for a token model, seeded random tensors for
    any other (flashnorm.validate.feeds.FeedOptions, by flag name)."""
    from flashnorm.validate.feeds import DEFAULT_BATCH, DEFAULT_SEQUENCE
    from flashnorm.validate.inputs import DEFAULT_DYNAMIC_DIM, DEFAULT_INT_RANGE, DEFAULT_LEADING_DIM

    source = parser.add_argument_group(
        "inputs of token models (those with an input_ids input; default: seeded random token ids)"
    )
    given = source.add_mutually_exclusive_group()
    given.add_argument("--text", help="compare on this text, tokenized with the model's tokenizer")
    given.add_argument("--input-ids", metavar="IDS", help="compare on these token ids ('1,2,3')")
    from flashnorm.validate.likelihood import DEFAULT_SHIPPED_TEXT, SHIPPED_TEXTS

    given.add_argument("--shipped-text", nargs="?", const=DEFAULT_SHIPPED_TEXT, choices=[*SHIPPED_TEXTS, "all"],
                       metavar="NAME",
                       help="compare on public-domain text that ships with flashnorm, about 2 000 tokens each: "
                            + "; ".join(f"{name}: {kind}" for name, (_, kind) in SHIPPED_TEXTS.items())
                            + f" (NAME: one of them, or all, each its own feed; no NAME: {DEFAULT_SHIPPED_TEXT}; a "
                              "quantized pair under --budget takes all four unless told otherwise): the same "
                              "positions every run, so a budget's verdict does not vary with a draw")
    source.add_argument("--tokenizer", metavar="SOURCE",
                        help="tokenizer for --text: HF directory, .gguf file or model name "
                             "(default: the source recorded by flashnorm export)")
    source.add_argument("--batch", type=at_least(1), help=f"random inputs: batch size (default {DEFAULT_BATCH})")
    source.add_argument("--sequence", type=at_least(1), help=f"random inputs: sequence length (default {DEFAULT_SEQUENCE})")
    source.add_argument("--iterations", type=at_least(1), default=1,
                        help="random inputs, any model: how many feeds to compare on (default 1)")
    source.add_argument("--past-length", type=at_least(0), default=0,
                        help="KV-cache models: feed a past of this many tokens, produced by the reference "
                             "from a random prefix (default 0: empty past)")
    source.add_argument("--seed", type=seed,
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


def onnx_inputs(what: str, path: str | os.PathLike[str] | None) -> list[Input]:
    """An ONNX input and the external-data files it names (none if the file is missing: that is
    the command's own error); a file that is not ONNX is refused here, before any work."""
    if path is None or not os.path.isfile(path):
        return []
    from flashnorm.modelio import external_data_files

    return [Input(what, Path(path)), *(Input(f"{what}'s external data", data) for data in external_data_files(path))]


def file_inputs(what: str, paths: Iterable[str | os.PathLike[str] | None]) -> list[Input]:
    """Inputs that exist, as they are (plugin libraries, engines, checkpoints, tokenizers)."""
    return [Input(what, Path(p)) for p in paths if p and os.path.exists(p)]


def onnx_outputs(path: str | os.PathLike[str], what: str = "output model", make_parents: bool = False) -> list[Output]:
    """An ONNX output and the external-data file a save may write beside it (`<name>.data`)."""
    return [Output(what, Path(path), make_parents=make_parents),
            Output(f"{what}'s external data", Path(os.fspath(path) + ".data"), make_parents=make_parents)]


def add_model_source_options(parser: argparse.ArgumentParser) -> None:
    """SOURCE or --model NAME: where a Hugging Face model comes from (export, fold-checkpoint)."""
    from flashnorm.export.sources import KNOWN_MODELS

    parser.add_argument("source", nargs="?", help="Hugging Face model directory or .gguf file")
    parser.add_argument("--model", metavar="NAME",
                        help=f"a model already on this machine instead of SOURCE ({', '.join(sorted(KNOWN_MODELS))})")


def model_source(args: argparse.Namespace):
    """The `ModelSource` SOURCE or --model names; one line if neither or both are given."""
    from flashnorm.errors import FlashNormError
    from flashnorm.export.sources import resolve_source

    if args.source is None and args.model is None:
        raise FlashNormError("give a model directory or .gguf file, or --model NAME")
    return resolve_source(args.source, args.model)


def source_inputs(args: argparse.Namespace) -> list[Input]:
    """What SOURCE or --model reads: the model directory, or the GGUF file."""
    if args.source is None and args.model is None:
        return []
    source = model_source(args)
    path = source.directory / source.gguf_file if source.gguf_file else source.directory
    return file_inputs("model source", [path])


def _number(kind: type, text: str) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


INT32_LIMIT = 2**31 - 1
"""The largest value of an int32 field (Triton's config.pbtxt counts, ONNX Runtime's threads)."""
INT64_LIMIT = 2**63 - 1
"""The largest value of an int64 (TensorRT's sizes and dimensions)."""


def at_least(lowest: float | int, kind: type = int, highest: float | int | None = None):
    """An argparse type: a `kind` number (finite) that is at least `lowest` (and at most
    `highest`: where the value goes into a fixed-width field, a bound checked here instead of
    an overflow in a binding later)."""
    def parse(text: str) -> float | int:
        value = _number(kind, text)
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be at least {lowest}, got {text}")
        if highest is not None and value > highest:
            raise argparse.ArgumentTypeError(f"must be at most {highest}, got {text}")
        return value
    parse.__name__ = f"{kind.__name__} >= {lowest}"
    return parse


def positive(kind: type = float, highest: float | int | None = None):
    """An argparse type: a `kind` number (finite) greater than zero (and at most `highest`)."""
    def parse(text: str) -> float | int:
        value = _number(kind, text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        if highest is not None and value > highest:
            raise argparse.ArgumentTypeError(f"must be at most {highest}, got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


SEED_LIMIT = 2**63
"""Seeds are non-negative integers below 2**63 (NumPy's SeedSequence takes no negative one)."""


def seed(text: str) -> int:
    """An argparse type: a random seed, 0 <= seed < 2**63."""
    value = _number(int, text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63), got {text}")
    return value


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option: stores into the new option's `dest` and says, once per
    command line, which spelling replaces it (`flashnorm CMD: warning: ...` on stderr)."""

    def __init__(self, option_strings, dest, replacement: str, why: str = "", **kwargs) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)
        self.replacement, self.why = replacement, why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import sys

        print(f"{parser.prog}: warning: {option_string} is deprecated here, use {self.replacement}"
              + (f" ({self.why})" if self.why else ""), file=sys.stderr)
        if self.nargs == "+":
            values = [*(getattr(namespace, self.dest, None) or []), *values]
        setattr(namespace, self.dest, values)


SHAPES_HELP = "NAME:MIN,OPT,MAX"


def add_shapes_option(group: argparse._ActionsContainer, help_text: str, old_spelling: str | None = None) -> None:
    """--shapes NAME:MIN,OPT,MAX (repeatable): a TensorRT optimization profile, the one spelling
    build, compare and triton share (`old_spelling`: a deprecated alias of it)."""
    group.add_argument("--shapes", nargs="+", action="extend", default=[], metavar=SHAPES_HELP, help=help_text)
    if old_spelling:
        group.add_argument(old_spelling, nargs="+", dest="shapes", action=DeprecatedAlias, replacement="--shapes",
                           metavar=SHAPES_HELP, help="deprecated spelling of --shapes")


DTYPE_SPELLINGS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
"""The float types every --dtype takes, in both spellings: short (fp16) and torch's (float16)."""


def dtype_option(spelling: str, allow_auto: bool = False):
    """An argparse type for --dtype taking either spelling (and `auto` where allowed), returning
    the `spelling` ("short" or "long") the command works in."""
    short_of = {long: short for short, long in DTYPE_SPELLINGS.items()}

    def parse(text: str) -> str:
        key = text.lower()
        if allow_auto and key == "auto":
            return "auto"
        if key in DTYPE_SPELLINGS:
            return key if spelling == "short" else DTYPE_SPELLINGS[key]
        if key in short_of:
            return short_of[key] if spelling == "short" else key
        choices = [*DTYPE_SPELLINGS, *DTYPE_SPELLINGS.values(), *(["auto"] if allow_auto else [])]
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")

    parse.__name__ = "dtype"
    return parse


DTYPE_CHOICES = "fp32|float32, fp16|float16, bf16|bfloat16"


def add_quant_limit_option(parser: argparse.ArgumentParser) -> None:
    """--quant-limit RATIO (optimize, inspect): the largest requantization error a folded
    quantized site may have."""
    from flashnorm.passes.quantized import DEFAULT_QUANT_LIMIT

    parser.add_argument(
        "--quant-limit", metavar="RATIO", type=at_least(0.0, float), default=None,
        help="quantized weights: fold a site that must be requantized only if the error it adds is at most RATIO "
             "times the format's own quantization noise (finite, >= 0; default "
             f"{DEFAULT_QUANT_LIMIT:g}: at most 1.06x the noise power; 0 takes exact folds only). Every site's "
             "measured error is in the report")
