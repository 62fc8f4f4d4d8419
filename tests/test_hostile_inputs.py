"""Every command against every hostile file (tests/hostile.py builds them): a traversing or
absolute name, a NUL byte, a FIFO, a device node, a sparse file, a truncated or oversized header,
a data file replaced while it is read, a special file where an output is named. Each is refused
with exactly one line on stderr and exit 2, no traceback and no bug (exit 70), nothing written
anywhere (a checksummed tree of the whole corpus, outside folder included, before and after), no
special file replaced, no temporary left, within CASE_SECONDS. (`compare --engine` of a plan
TensorRT cannot load may say instead that nothing was compared, exit 3, with TensorRT's reason.)

The cases run in one driver process, in-process through `flashnorm.cli.main`; a case that hangs
in native code past its time is killed with the driver, which starts again after it."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import hostile

ROOT_USER = os.geteuid() == 0
CASES = {case.id: case for case in hostile.cases(ROOT_USER, Path("/corpus"))}
WARM_UP_SECONDS = 120.0
"""The driver's imports (torch, transformers, ONNX Runtime, TensorRT-RTX) before its first case."""


def _run_driver(root: Path, ids: list[str]) -> dict[str, dict]:
    """Every case's result; a case without one within its time is 'hung' (the driver is killed and
    restarted after it)."""
    results: dict[str, dict] = {}
    pending = list(ids)
    env = {**os.environ, "HOME": str(root / "home"), "TMPDIR": str(root / "tmp"), "PYTHONUNBUFFERED": "1"}
    while pending:
        process = subprocess.Popen([sys.executable, hostile.__file__, str(root), *map(json.dumps, pending)],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        current, deadline = None, time.monotonic() + WARM_UP_SECONDS
        try:
            while True:
                ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
                line = process.stdout.readline() if ready else ""
                if not ready or not line:
                    break
                kind, _, payload = line.partition(" ")
                if kind == "START":
                    current, deadline = json.loads(payload), time.monotonic() + hostile.CASE_SECONDS + 10
                elif kind == "RESULT":
                    result = json.loads(payload)
                    results[result["id"]] = result
                    pending.remove(result["id"])
                    current = None
        finally:
            process.kill()
            process.wait()
        if current is None and pending:  # the driver died or stalled between cases
            current = pending[0]
        if current is not None:
            results[current] = {"id": current, "status": "hung: killed with its driver"}
            pending.remove(current)
    return results


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    skipped = hostile.build(root, np.random.default_rng(47))
    started = time.monotonic()
    results = _run_driver(root, list(CASES))
    print(f"\n{len(results)} hostile cases in {time.monotonic() - started:.1f} s; left out: {skipped or 'nothing'}")
    return root, results


@pytest.mark.parametrize("case_id", list(CASES))
def test_a_hostile_file_is_refused_in_one_line_and_changes_nothing(corpus, case_id):
    root, results = corpus
    case = next(c for c in hostile.cases(ROOT_USER, root) if c.id == case_id)
    result = results[case_id]
    command = case.argv[0]
    err = result.get("stderr", "")
    assert result["status"] in case.statuses, (case.argv, result)
    lines = err.splitlines()
    label = "error" if result["status"] == 2 else "not compared"
    assert len(lines) == 1 and lines[0].startswith(f"flashnorm {command}: {label}: "), (case.argv, err)
    assert "Traceback" not in err and not result["bug_logs"], (case.argv, err, result["bug_logs"])
    assert case.names in lines[0], (case.argv, f"the refusal should name {case.names!r}", err)
    # A race case's data file and its replacement are the test's own doing (tree paths are under root).
    raced = {f"work/{case.race}", f"work/{Path(case.race).with_suffix('').with_suffix('.replacement')}"} if case.race \
        else set()
    assert sorted(set(result["changed"]) - raced) == [], (case.argv, err, result["changed"])
    assert result["replaced_specials"] == [] and result["temporaries"] == [], (case.argv, result)
    assert result["seconds"] <= hostile.CASE_SECONDS, (case.argv, result["seconds"])
    if case.race:
        assert result["race_happened"], (case.argv, "the data file was never opened by Python: nothing was raced")


if not ROOT_USER:
    def test_device_node_cases_need_root():
        pytest.skip("not root: os.mknod cannot make the device-node inputs and outputs (as /dev/null, /dev/zero, "
                    "/dev/full), so those cases are left out of the corpus")
