"""Command-line option groups several subcommands share, each defined once here (as Polygraphy
defines its argument groups once): what every command prints, which TensorRT backend and
plugin libraries to use, and what inputs to feed a model. Light to import: the CLI adds the
output options to every subcommand before it knows which one runs."""

from __future__ import annotations

import argparse

from flashnorm.engine.loader import BACKENDS


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """--report, -q, -v: every subcommand."""
    group = parser.add_argument_group("output")
    group.add_argument("--report", metavar="PATH",
                       help="also write the command's report as JSON to PATH ('-' prints JSON instead of text)")
    group.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
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
