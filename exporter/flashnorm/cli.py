"""`flashnorm` command line: thin. Each subcommand lives in `flashnorm.tools.<name>`, which
defines `add_arguments(parser)`, `run(args) -> dict` and optionally
`format_text(report, verbose) -> str`; option groups several commands share are defined once
in `flashnorm.tools.options`. This file parses, calls, prints the report, and turns a
FlashNormError into one line and a non-zero exit."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence

from flashnorm import __version__, signals
from flashnorm.errors import FlashNormError
from flashnorm.paths import Output, check_paths
from flashnorm.progress import Progress
from flashnorm.tools.options import add_output_options

# Subcommand name → (module under flashnorm.tools, one-line help). Modules are imported only
# when their command runs, so `flashnorm --help` needs none of torch/tensorrt/tritonclient.
COMMANDS: dict[str, tuple[str, str]] = {
    "export": ("export", "Hugging Face directory or GGUF file → ONNX (logits, optional KV cache)"),
    "inspect": ("inspect", "list every RMSNorm site and whether fold/cancel/defer apply"),
    "optimize": ("optimize", "fold gains, cancel redundant norms, defer into FlashNormMatMul"),
    "compare": ("compare", "compare two models (ONNX Runtime, or TensorRT where installed)"),
    "build": ("build", "build a TensorRT engine with the FlashNorm plugin"),
    "triton": ("triton", "write a Triton Inference Server model repository"),
    "demo": ("demo", "export SmolLM2-135M, optimize, compare and generate"),
    "fold-checkpoint": ("fold_checkpoint", "Hugging Face checkpoint or GGUF → Hugging Face checkpoint with weightless norms"),
}


def _tool(name: str):
    """The command's module. A missing optional dependency (torch for `export`, ...) becomes a
    one-line FlashNormError naming it, not a traceback."""
    module = f"flashnorm.tools.{COMMANDS[name][0]}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module or not exc.name.startswith("flashnorm")):
            missing = "is not available in this installation" if exc.name == module else f"needs the '{exc.name}' package"
            raise FlashNormError(f"command '{name}' {missing}") from None
        raise


class _UsageError(Exception):
    """A command line argparse refused: `main` prints it as one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line on stderr (exit 2) instead of the usage text
    followed by the error: every bad input gets one line."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flashnorm",
        description="FlashNorm: fold, cancel and defer RMSNorm in ONNX transformers; build TensorRT engines and Triton repositories.",
    )
    parser.add_argument("--version", action="version", version=f"flashnorm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    wanted = next((a for a in argv if a in COMMANDS), None)
    for name, (_, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        add_output_options(sub)
        if name == wanted:
            _tool(name).add_arguments(sub)
    return parser


def _flat(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return not any(isinstance(item, (dict, list)) for item in items)


def _text(value: dict | list, indent: str = "") -> list[str]:
    """A report as indented `key: value` lines (the default, human-readable output)."""
    lines: list[str] = []
    pairs = value.items() if isinstance(value, dict) else (("-", item) for item in value)
    for key, item in pairs:
        label = f"{indent}{key}" + (":" if isinstance(value, dict) else "")
        if isinstance(item, (dict, list)) and not _flat(item):
            lines.append(label)
            lines += _text(item, indent + "  ")
        elif isinstance(item, dict):
            lines.append(f"{label} " + ", ".join(f"{k}={v}" for k, v in item.items()))
        elif isinstance(item, list):
            lines.append(f"{label} " + ", ".join(str(v) for v in item))
        else:
            lines.append(f"{label} {item}")
    return lines


def _quiet_graphsurgeon() -> None:
    """onnx-graphsurgeon prints its warnings on stdout (one per bfloat16 tensor: "Could not
    convert BFLOAT16 to a NumPy type", although FlashNorm reads them through onnx), which
    would corrupt `--report -`: only its errors are shown."""
    if importlib.util.find_spec("onnx_graphsurgeon") is None:
        return
    from onnx_graphsurgeon.logger import G_LOGGER

    G_LOGGER.severity = max(G_LOGGER.severity, G_LOGGER.ERROR)


def _quiet_progress() -> None:
    """-q: no progress bar of ours, and none of a third party's (tqdm reads TQDM_DISABLE,
    Hugging Face's libraries HF_HUB_DISABLE_PROGRESS_BARS and TRANSFORMERS_VERBOSITY) in this
    process or any it starts."""
    Progress.enabled = False
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def _check_paths(tool: Any, args: argparse.Namespace) -> None:
    """The path guard (flashnorm.paths) over what the command declares it reads and writes,
    its --report included, before any work starts."""
    declared = getattr(tool, "paths", None)
    inputs, outputs = declared(args) if declared is not None else ([], [])
    if args.report and args.report != "-":
        outputs = [*outputs, Output("report", Path(args.report))]
    check_paths(inputs, outputs, force=getattr(args, "force", False))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in COMMANDS), "")
    try:
        parser = build_parser(argv)
    except FlashNormError as exc:
        print(f"flashnorm {command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(exc, file=sys.stderr)
        return FlashNormError.exit_code
    if args.quiet:
        _quiet_progress()
    _quiet_graphsurgeon()
    tool = _tool(args.command)
    with signals.handling_stops():
        try:
            _check_paths(tool, args)
            report = tool.run(args)
            if args.report and args.report != "-":
                from flashnorm.report import write_json_report

                write_json_report(args.report, report)
        except FlashNormError as exc:
            print(f"flashnorm {args.command}: {exc.label}: {exc}", file=sys.stderr)
            return exc.exit_code
        except OSError as exc:  # the disk or the file system said no: not a FlashNorm bug
            print(f"flashnorm {args.command}: error: {exc}", file=sys.stderr)
            return FlashNormError.exit_code
        except MemoryError:
            print(f"flashnorm {args.command}: error: out of memory (choose smaller sizes)", file=sys.stderr)
            return FlashNormError.exit_code
        except KeyboardInterrupt as exc:
            what = "SIGTERM" if isinstance(exc, signals.Terminated) else "SIGINT"
            print(f"flashnorm {args.command}: stopped by {what}; temporary files removed, existing outputs "
                  "left as they were", file=sys.stderr)
            return 143 if what == "SIGTERM" else 130
    from flashnorm.report import to_jsonable

    if args.report == "-":
        print(json.dumps(to_jsonable(report), indent=2))
    elif not args.quiet and report is not None:
        plain = to_jsonable(report)
        format_text = getattr(tool, "format_text", None)  # a tool may render its own table
        if format_text is not None:
            print(format_text(plain, verbose=args.verbose))
        else:
            print("\n".join(_text(plain)) if isinstance(plain, (dict, list)) else plain)
    failed = isinstance(report, dict) and report.get("passed") is False
    # A report may name its own code (compare --budget's inconclusive verdict: 4).
    code = report.get("exit_code") if isinstance(report, dict) else None
    return code if isinstance(code, int) else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
