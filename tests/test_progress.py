"""flashnorm.progress: a tqdm bar on a terminal, plain lines in a log, nothing with -q."""

from __future__ import annotations

import pytest

from flashnorm import progress
from flashnorm.progress import ByteProgress, Progress


@pytest.fixture(autouse=True)
def shown(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", True)


def _work(total: int = 3) -> None:
    bar = Progress("work", total=total, interval=0.0)
    for _ in range(total):
        bar.step()
    bar.finish()


def test_a_terminal_gets_a_live_bar(monkeypatch, capsys):
    monkeypatch.setattr(progress, "_terminal", lambda: True)
    _work()
    err = capsys.readouterr().err
    assert "\r" in err and "work: 100%" in err and "3/3" in err


def test_a_log_gets_plain_lines(capsys):
    _work()
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("work: ") and "\r" not in line for line in lines)
    assert lines[-1].startswith("work: 3/3 (")


def test_bytes_are_shown_in_mib_in_a_log(capsys):
    bar = ByteProgress("saving m.onnx", 3 << 20)
    bar.interval = 0.0
    bar.step(3 << 20)
    bar.finish()
    assert capsys.readouterr().err.splitlines()[-1].startswith("saving m.onnx (MiB): 3/3 (")


@pytest.mark.parametrize("terminal", [True, False])
def test_quiet_shows_nothing(monkeypatch, capsys, terminal):
    monkeypatch.setattr(progress, "_terminal", lambda: terminal)
    monkeypatch.setattr(Progress, "enabled", False)
    _work()
    assert capsys.readouterr() == ("", "")
