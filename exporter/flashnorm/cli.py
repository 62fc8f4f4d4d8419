"""`flashnorm` command line: thin. Each subcommand lives in `flashnorm.tools.<name>`, which
defines `add_arguments(parser)`, `run(args) -> dict` and optionally
`format_text(report, verbose) -> str`; option groups several commands share are defined once
in `flashnorm.tools.options`. This file parses, calls, prints the report, and turns every
way a command can end into one line and an exit status: a FlashNormError or a refusal of the
system (exit 2), a failed check (1, the tool's `verdict(report)` line), an inconclusive one
(4: compare --budget's interval spans its line, the same line), a signal (130, 143),
a closed standard output (141, silently), and anything unexpected, a bug (70, the traceback in
a log file the line names). No traceback reaches the terminal."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import os
import select
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence

from flashnorm import __version__, signals
from flashnorm.errors import (EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_BUG, EXIT_FAILED_CHECK, EXIT_INCONCLUSIVE, FlashNormError,
                              write_bug_log)
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

    def _print_message(self, message: str, file: Any = None) -> None:
        # argparse drops a failed write of --help or --version silently (exit 0 with nothing
        # printed, e.g. to /dev/full); here it fails the command as any other write does.
        if message:
            stream = file or sys.stdout
            try:
                stream.write(message)
            except OSError as exc:
                raise _StreamFailed(stream, exc) from None


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


REPORT_STREAMS = {"-": "stdout", "/dev/stdout": "stdout", "/dev/fd/1": "stdout",
                  "/dev/stderr": "stderr", "/dev/fd/2": "stderr"}
"""--report values written through to a standard stream instead of to a file: `-` and the
stdout names print the JSON instead of the text report, the stderr names write it there."""


def _check_paths(tool: Any, args: argparse.Namespace) -> None:
    """The path guard (flashnorm.paths) over what the command declares it reads and writes,
    its --report included, before any work starts."""
    declared = getattr(tool, "paths", None)
    inputs, outputs = declared(args) if declared is not None else ([], [])
    if args.report and args.report not in REPORT_STREAMS:
        outputs = [*outputs, Output("report", Path(args.report))]
    check_paths(inputs, outputs, force=getattr(args, "force", False))


class _StreamFailed(Exception):
    """Writing to a standard stream failed (`error`): not a bug, and reported on its own line."""

    def __init__(self, stream: Any, error: OSError) -> None:
        name = "standard error" if stream is sys.stderr else "standard output"
        super().__init__(f"cannot write to {name}: {error.strerror or error}")
        self.stream, self.error = stream, error


def _write(stream: Any, text: str) -> None:
    """`text` and a newline on `stream`, flushed now: a closed or full standard output fails
    here, inside `main`, not in the interpreter's flush at exit."""
    try:
        stream.write(text + "\n")
    except OSError as exc:
        raise _StreamFailed(stream, exc) from None
    _flush(stream)


def _flush(stream: Any) -> None:
    try:
        stream.flush()
    except OSError as exc:
        raise _StreamFailed(stream, exc) from None


def _readable_encoding() -> None:
    """Text that the standard streams' encoding cannot hold (PYTHONIOENCODING=ascii, a C locale)
    is written as backslash escapes instead of failing the command."""
    for stream in (sys.stdout, sys.stderr):
        try:
            "→…×".encode(stream.encoding or "utf-8")
        except (UnicodeEncodeError, LookupError):
            with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
                stream.reconfigure(errors="backslashreplace")
        except AttributeError:
            pass


def _closed_streams() -> list[Any]:
    """The standard streams whose reader is gone (a pipe closed by `head`): POLLERR on Linux."""
    poller, streams = select.poll(), {}
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError, io.UnsupportedOperation):
            streams[stream.fileno()] = stream
            poller.register(stream.fileno(), select.POLLOUT)
    return [streams[fd] for fd, events in poller.poll(0) if events & select.POLLERR]


def _discard(stream: Any) -> None:
    """Point `stream`'s descriptor at /dev/null, so that the interpreter's flush at exit writes
    what is left in its buffer nowhere instead of failing again."""
    with contextlib.suppress(AttributeError, ValueError, OSError, io.UnsupportedOperation):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def _say(command: str, label: str, message: str) -> None:
    """The one line of a command that did not succeed, on stderr (nothing if stderr is gone)."""
    with contextlib.suppress(OSError):
        print(f"{' '.join(filter(None, ('flashnorm', command)))}: {label}: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command line; returns the exit status (README, "Exit status"): 0, 1 a failed
    check, 2 a refused input or option, 3 not compared, 4 inconclusive, 70 a bug (its traceback in a log file
    the line names), 130/143 stopped by SIGINT/SIGTERM, 141 standard output closed early."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in COMMANDS), "")
    _readable_encoding()
    try:
        with signals.handling_stops():
            return _main(argv)
    except KeyboardInterrupt as exc:
        what = "SIGTERM" if isinstance(exc, signals.Terminated) else "SIGINT"
        status = 143 if what == "SIGTERM" else 130
        with contextlib.suppress(OSError):
            print(f"flashnorm {command}: stopped by {what}; temporary files removed, existing outputs left as they "
                  "were", file=sys.stderr, flush=True)
        if signals.abandoned_work():  # native work still running in a thread: leave without waiting for it
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
            os._exit(status)
        return status
    except _UsageError as exc:
        with contextlib.suppress(OSError):
            print(exc, file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except FlashNormError as exc:
        _say(command, exc.label, str(exc))
        return exc.exit_code
    except (_StreamFailed, OSError) as exc:
        error = exc.error if isinstance(exc, _StreamFailed) else exc
        closed = _closed_streams()
        for stream in closed:
            _discard(stream)
        if isinstance(error, BrokenPipeError) and closed:  # `| head`: stop quietly, as `cat` does
            return EXIT_BROKEN_PIPE
        if isinstance(exc, _StreamFailed):
            _discard(exc.stream)
            _say(command, "error", str(exc))
        else:  # the disk or the file system said no: not a FlashNorm bug
            _say(command, "error", str(error))
        return EXIT_BAD_INPUT
    except MemoryError:
        _say(command, "error", "out of memory (choose smaller sizes)")
        return EXIT_BAD_INPUT
    except Exception as exc:  # anything else is a bug: one line, the traceback in a file
        try:
            where = f"the traceback is in {write_bug_log(command, argv, exc)}"
        except OSError as log_error:
            where = f"its traceback could not be written ({log_error.strerror})"
        _say(command, "internal error", f"{type(exc).__name__}: {_first_line(exc)}. This is a bug in flashnorm; "
                                        f"{where}; please report it")
        return EXIT_BUG


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else "(no message)"


def _main(argv: list[str]) -> int:
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # --help, --version: what they printed must reach stdout, or fail here
        _flush(sys.stdout)
        raise
    if args.quiet:
        _quiet_progress()
    _quiet_graphsurgeon()
    tool = _tool(args.command)
    _check_paths(tool, args)
    report = tool.run(args)
    stream = REPORT_STREAMS.get(args.report or "")
    if args.report and stream is None:
        from flashnorm.report import write_json_report

        write_json_report(args.report, report)
    from flashnorm.report import to_jsonable

    plain = to_jsonable(report)
    if stream is not None:
        _write(sys.stdout if stream == "stdout" else sys.stderr, json.dumps(plain, indent=2))
    if stream != "stdout" and not args.quiet and report is not None:
        format_text = getattr(tool, "format_text", None)  # a tool may render its own table
        if format_text is not None:
            _write(sys.stdout, format_text(plain, verbose=args.verbose))
        else:
            _write(sys.stdout, "\n".join(_text(plain)) if isinstance(plain, (dict, list)) else str(plain))
    verdict = getattr(tool, "verdict", None)
    if isinstance(report, dict) and report.get("exit_code") == EXIT_INCONCLUSIVE:
        _say(args.command, "inconclusive", verdict(plain) if verdict is not None else "the check is inconclusive")
        return EXIT_INCONCLUSIVE
    if isinstance(report, dict) and report.get("passed") is False:
        _say(args.command, "failed", verdict(plain) if verdict is not None else "the check failed (see the report)")
        return EXIT_FAILED_CHECK
    return 0


if __name__ == "__main__":
    sys.exit(main())
