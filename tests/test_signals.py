"""SIGINT and SIGTERM stop a command in the middle of a staged write: exit 130/143, one line,
no temporary left, an existing output as it was; a TensorRT build is cancelled through its
progress monitor, which TensorRT lets return False."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import types

import pytest

from flashnorm import signals
from flashnorm.engine.progress import make_progress_monitor

# A `probe` command that stages out.bin, says it is ready and waits: the signal lands mid-write.
SCRIPT = textwrap.dedent("""
    import sys, time, types
    from flashnorm import cli, files

    module = types.ModuleType("flashnorm.tools.probe")
    def add_arguments(parser):
        pass
    def run(args):
        with files.atomic_write("out.bin") as handle:
            handle.write(b"new")
            print("ready", flush=True)
            time.sleep(60)
        return {}
    module.add_arguments, module.run = add_arguments, run
    sys.modules["flashnorm.tools.probe"] = module
    cli.COMMANDS["probe"] = ("probe", "test command")
    sys.exit(cli.main(["probe"]))
""")


@pytest.mark.parametrize("signum, status, name", [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_mid_write_stops_cleanly(tmp_path, signum, status, name):
    (tmp_path / "out.bin").write_bytes(b"old")
    process = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == status, err
    assert err == f"flashnorm probe: stopped by {name}; temporary files removed, existing outputs left as they were\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
    assert (tmp_path / "out.bin").read_bytes() == b"old"


def test_the_build_monitor_cancels_once_a_stop_arrived(monkeypatch):
    class IProgressMonitor:
        def __init__(self) -> None:
            pass

    trt = types.SimpleNamespace(IProgressMonitor=IProgressMonitor)
    monkeypatch.setattr(signals, "_received", [])
    for shown in (True, False):  # -q has no bar, and still a monitor that cancels
        monitor = make_progress_monitor(trt, enabled=shown)
        monitor.phase_start("Building engine", None, 4)
        assert monitor.step_complete("Building engine", 0) is True
        signals._received.append(signal.SIGINT)
        assert monitor.step_complete("Building engine", 1) is False
        monitor.phase_finish("Building engine")
        signals._received.clear()


def test_stops_raise_the_signal_s_exception_and_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with signals.handling_stops():
        with pytest.raises(signals.Terminated):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next statement
        assert signals.stop_requested() and signals.exit_status() == 143
    assert signal.getsignal(signal.SIGTERM) is before
