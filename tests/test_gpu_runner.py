"""One runner for the GPU tests, selecting them by marker: plugins/flashnorm/tests/run_gpu.sh runs
`pytest -m gpu` over tests/ (and `-m gpu -k race` against the join-dropping mutant) and names no
test file, so a GPU test added anywhere is run without editing it; no other script runs pytest
on the GPU machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "plugins" / "flashnorm" / "tests" / "run_gpu.sh"


def _pytest_commands(script: Path) -> list[str]:
    """Each `python3 -m pytest ...` command of a shell script, continuation lines joined."""
    text = script.read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if re.search(r"-m pytest\b", line) and not line.lstrip().startswith("#")]


def test_the_runner_selects_gpu_tests_by_marker():
    commands = _pytest_commands(RUNNER)
    assert len(commands) == 2, commands  # the normal build, then the mutant's race tests
    for command in commands:
        assert re.search(r"-m gpu\b", command) and re.search(r"\btests\b", command), command
        assert not re.search(r"tests/\S+\.py", command), f"names a test file instead of the marker: {command}"
    assert '-k "race"' in commands[1]


def test_no_other_script_runs_pytest():
    """Other than CI's own (.ci/run runs README's test command)."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.sh"], capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    scripts = [ROOT / name for name in listed.stdout.split() if not name.startswith(".ci/")]
    assert RUNNER in scripts
    assert not [str(p.relative_to(ROOT)) for p in scripts if p != RUNNER and _pytest_commands(p)]
