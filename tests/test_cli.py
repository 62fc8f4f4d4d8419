"""The `flashnorm` command-line framework: bad input ends in one line and a non-zero exit,
reports come out as text or JSON, and `--help` stays free of heavy imports."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import pytest

from flashnorm import cli
from flashnorm.errors import EXIT_BROKEN_PIPE, EXIT_BUG, FlashNormError
from flashnorm.progress import Progress


@pytest.fixture
def tool(monkeypatch):
    """Registers a command `probe` whose behaviour each test sets through `tool.action`."""
    module = types.ModuleType("flashnorm.tools.probe")

    def add_arguments(parser):
        parser.add_argument("value", type=float)

    def run(args):
        return module.action(args)

    module.add_arguments, module.run = add_arguments, run
    monkeypatch.setitem(sys.modules, "flashnorm.tools.probe", module)
    monkeypatch.setitem(cli.COMMANDS, "probe", ("probe", "test command"))
    monkeypatch.setattr(Progress, "enabled", True)
    return module


def _raise(exc):
    def action(args):
        raise exc
    return action


def test_flashnorm_error_is_one_line_and_exit_2(tool, capsys):
    tool.action = _raise(FlashNormError("model file x.onnx does not exist"))
    assert cli.main(["probe", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "flashnorm probe: error: model file x.onnx does not exist\n"
    assert captured.out == ""


def test_os_error_is_one_line(tool, capsys):
    tool.action = _raise(OSError(28, "No space left on device", "out.onnx.data"))
    assert cli.main(["probe", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err


def test_interrupt_exits_130(tool, capsys):
    tool.action = _raise(KeyboardInterrupt())
    assert cli.main(["probe", "1"]) == 130
    assert capsys.readouterr().err.startswith("flashnorm probe: stopped by SIGINT;")


def test_a_bug_is_one_line_exit_70_and_its_traceback_goes_to_a_new_log(tool, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "unrelated.log").write_text("kept")
    tool.action = _raise(ZeroDivisionError("a bug"))
    assert cli.main(["probe", "1"]) == EXIT_BUG
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    match = re.fullmatch(r"flashnorm probe: internal error: ZeroDivisionError: a bug\. This is a bug in flashnorm; "
                         r"the traceback is in (\S+); please report it\n", captured.err)
    assert match, captured.err
    log = Path(match.group(1))
    assert log.parent == tmp_path and log.name.startswith("flashnorm-bug-probe-")
    assert "Traceback" in log.read_text() and "ZeroDivisionError: a bug" in log.read_text()
    assert "flashnorm probe 1" in log.read_text()
    assert (log.stat().st_mode & 0o777) == 0o600
    assert cli.main(["probe", "1"]) == EXIT_BUG  # a second bug, a second file: none is overwritten
    assert len(list(tmp_path.glob("flashnorm-bug-probe-*.log"))) == 2
    assert (tmp_path / "unrelated.log").read_text() == "kept"


def test_a_failed_check_ends_with_its_verdict_line_even_when_quiet(tool, capsys):
    tool.action = lambda args: {"passed": False, "seed": 7}
    tool.verdict = lambda report: f"logits differ; seed {report['seed']}"
    for quiet in ([], ["-q"]):
        assert cli.main(["probe", "1", *quiet]) == 1
        captured = capsys.readouterr()
        assert captured.err == "flashnorm probe: failed: logits differ; seed 7\n"
        assert (captured.out == "") == bool(quiet)


def test_reports_to_standard_streams_are_written_through(tool, capsys, tmp_path):
    tool.action = lambda args: {"passed": True, "value": args.value}
    for name in ("/dev/stdout", "-"):
        assert cli.main(["probe", "2", "--report", name]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out) == {"passed": True, "value": 2.0} and captured.err == ""
    assert cli.main(["probe", "2", "--report", "/dev/stderr"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.err) == {"passed": True, "value": 2.0} and "value: 2.0" in captured.out


def test_a_special_file_is_never_replaced_by_a_report(tool, capsys, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    tool.action = lambda args: pytest.fail("must not run")
    for target in ("/dev/null", "/dev/full", str(tmp_path / "fifo")):
        before = os.stat(target)
        assert cli.main(["probe", "1", "--report", target]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not a regular file; flashnorm replaces only regular files" in err, err
        after = os.stat(target)
        assert (after.st_ino, after.st_mode, after.st_rdev) == (before.st_ino, before.st_mode, before.st_rdev)


# A `probe` command printing non-ASCII text, as inspect and optimize do ("→", "…", "×").
PROBE = textwrap.dedent("""
    import sys, types
    from flashnorm import cli

    module = types.ModuleType("flashnorm.tools.probe")
    module.add_arguments = lambda parser: parser.add_argument("lines", type=int)
    module.run = lambda args: {"passed": True}
    module.format_text = lambda report, verbose: "\\n".join(f"{i} → {i + 1} × …" for i in range(REPEAT))
    sys.modules["flashnorm.tools.probe"] = module
    cli.COMMANDS["probe"] = ("probe", "test command")
    sys.exit(cli.main(["probe", "1"]))
""")


def _probe(lines: int, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE.replace("REPEAT", str(lines))], **kwargs)


def test_stdout_closed_early_ends_quietly_with_141():
    # The reader is gone before the first write (what `| head -c 10` does at some point): every run.
    read, write = os.pipe()
    os.close(read)
    try:
        result = _probe(100_000, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert result.returncode == EXIT_BROKEN_PIPE and result.stderr == "", result.stderr


def test_a_full_stdout_is_one_line_and_exit_2():
    with open("/dev/full", "w") as full:
        result = _probe(10, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == "flashnorm probe: error: cannot write to standard output: No space left on device\n"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["inspect", "--help"]])
def test_help_and_version_to_a_full_stdout_fail(argv):
    # argparse itself drops a failed write of these silently (exit 0, nothing printed).
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "flashnorm.cli", *argv], stdout=full, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    command = "flashnorm inspect" if argv[0] == "inspect" else "flashnorm"
    assert result.returncode == 2
    assert result.stderr == f"{command}: error: cannot write to standard output: No space left on device\n"


def test_an_ascii_only_stdout_gets_escapes_instead_of_a_crash():
    result = _probe(2, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout == "0 \\u2192 1 \\xd7 \\u2026\n1 \\u2192 2 \\xd7 \\u2026\n"


@pytest.mark.parametrize("argv", [[], ["no-such-command"], ["probe"], ["probe", "not-a-number"], ["probe", "1", "--bogus"]])
def test_bad_arguments_exit_2_with_one_line(tool, capsys, argv):
    tool.action = lambda args: pytest.fail("must not run")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashnorm") and "error:" in err and err.count("\n") == 1, err


def test_report_as_text_json_and_file(tool, capsys, tmp_path, rng):
    value = float(rng.uniform(1, 2))
    capsys.readouterr()  # drop the fixture's seed line
    tool.action = lambda args: {"passed": True, "value": args.value, "counts": {"folded": 3}, "sites": ["a", "b"]}
    assert cli.main(["probe", str(value)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text == ["passed: True", f"value: {value}", "counts: folded=3", "sites: a, b"]

    assert cli.main(["probe", str(value), "--report", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["value"] == value

    path = tmp_path / "report.json"
    assert cli.main(["probe", str(value), "--report", str(path), "-q"]) == 0
    assert capsys.readouterr().out == ""
    assert json.loads(path.read_text())["counts"] == {"folded": 3}


def test_quiet_silences_progress(tool, capsys):
    def action(args):
        Progress("work", total=1, interval=0.0).finish()
        return {"passed": True}

    tool.action = action
    assert cli.main(["probe", "1"]) == 0
    assert "work: 0/1" in capsys.readouterr().err
    assert cli.main(["probe", "1", "-q"]) == 0
    assert capsys.readouterr() == ("", "")


def test_failed_report_exits_1(tool, capsys):
    tool.action = lambda args: {"passed": False, "reason": "logits differ"}
    assert cli.main(["probe", "1"]) == 1
    assert "passed: False" in capsys.readouterr().out


def test_report_into_missing_directory(tool, capsys, tmp_path):
    tool.action = lambda args: {"passed": True}
    assert cli.main(["probe", "1", "--report", str(tmp_path / "missing" / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashnorm probe: error: cannot write") and err.count("\n") == 1


def test_missing_optional_dependency_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "needs-missing", ("needs_missing", "test command"))
    real_import = importlib.import_module

    def import_module(name, *args):
        if name == "flashnorm.tools.needs_missing":  # as if its top does `import tensorrt_absent`
            raise ModuleNotFoundError("No module named 'tensorrt_absent'", name="tensorrt_absent")
        return real_import(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    assert cli.main(["needs-missing"]) == 2
    assert capsys.readouterr().err == (
        "flashnorm needs-missing: error: command 'needs-missing' needs the 'tensorrt_absent' package\n"
    )


def test_unwritten_command_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "unwritten", ("no_such_tool_module", "test command"))
    assert cli.main(["unwritten"]) == 2
    assert capsys.readouterr().err == "flashnorm unwritten: error: command 'unwritten' is not available in this installation\n"


def test_help_imports_no_heavy_dependency():
    code = (
        "import sys\n"
        "from flashnorm import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = [m for m in ('torch', 'transformers', 'onnxruntime', 'tensorrt', 'tritonclient') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    for command in cli.COMMANDS:
        assert command in out


@pytest.mark.parametrize("command", ["inspect", "optimize"])
def test_model_commands_reject_missing_model(command, tmp_path):
    """The real commands that read a model: a missing file is one line on stderr, exit 2."""
    if importlib.util.find_spec(f"flashnorm.tools.{command}") is None:
        pytest.skip(f"flashnorm.tools.{command} is not written yet")
    missing = tmp_path / "missing.onnx"
    argv = [command, str(missing)] + (["-o", str(tmp_path / "out.onnx")] if command == "optimize" else [])
    result = subprocess.run([sys.executable, "-m", "flashnorm.cli", *argv], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "missing.onnx" in result.stderr, result.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_command_formats_its_own_text(tool, capsys):
    tool.action = lambda args: {"passed": True, "norm_sites": 61}
    tool.format_text = lambda report, verbose: f"{report['norm_sites']} RMSNorm sites{' (every one)' * verbose}"
    assert cli.main(["probe", "1"]) == 0
    assert capsys.readouterr().out.endswith("61 RMSNorm sites\n")
    assert cli.main(["probe", "1", "-v"]) == 0
    assert capsys.readouterr().out.endswith("61 RMSNorm sites (every one)\n")


@pytest.mark.parametrize("content, message", [(b"\x08\x07 not a protobuf \xff\xfe" * 30, "not an ONNX model"),
                                              (b"", "not an ONNX model")])
def test_optimize_rejects_a_file_that_is_not_onnx(tmp_path, content, message):
    if importlib.util.find_spec("flashnorm.tools.optimize") is None:
        pytest.skip("flashnorm.tools.optimize is not written yet")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(content)
    result = subprocess.run([sys.executable, "-m", "flashnorm.cli", "optimize", str(junk), "-o", str(tmp_path / "o.onnx")],
                            capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.onnx"]


@pytest.mark.parametrize("argv", [
    ["inspect", "{missing}"],
    ["optimize", "{missing}", "-o", "{tmp}/out.onnx"],
    ["compare", "{missing}", "{missing}"],
    ["build", "{missing}", "-o", "{tmp}/out.plan"],
    ["triton", "--onnx", "{missing}", "--triton-backend", "python", "-o", "{tmp}/repo"],
], ids=lambda argv: argv[0])
def test_a_missing_model_is_worded_the_same_by_every_command(argv, tmp_path, capsys):
    missing = tmp_path / "absent.onnx"
    code = cli.main([a.format(missing=missing, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"flashnorm {argv[0]}: error: model {missing} does not exist or is not a file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
