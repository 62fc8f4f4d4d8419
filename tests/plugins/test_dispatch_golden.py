"""AUTO's policy (plugins/flashnorm/dispatch/) against its golden table, with the host C++ compiler
alone (no nvcc, no GPU, as in CI): the table the sources produce now equals the committed one,
tests/plugins/golden/auto_dispatch.csv. An intended change to a boundary rewrites the table
(plugins/flashnorm/dispatch/write_golden.py) and shows its effect in the diff.

The program that prints the table also checks, on every row, that AUTO's workspace covers the
strategy it picks there and at every smaller row (the TensorRT plugin sizes one workspace for its
largest M); it fails otherwise."""

from __future__ import annotations

import csv
import difflib
import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WRITER = REPO / "plugins" / "flashnorm" / "dispatch" / "write_golden.py"
GOLDEN = Path(__file__).resolve().parent / "golden" / "auto_dispatch.csv"


def _writer():
    spec = importlib.util.spec_from_file_location("flashnorm_write_golden", WRITER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated() -> str:
    writer = _writer()
    compiler = writer.find_compiler()
    if compiler is None:
        reason = "no host C++ compiler (c++, g++, clang++ or $CXX): the dispatch unit cannot be compiled"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI must check AUTO's golden table)")
        pytest.skip(reason)
    return writer.generate(compiler)


def test_golden_table_matches_the_dispatch_unit(generated):
    committed = GOLDEN.read_text()
    if generated == committed:
        return
    diff = list(difflib.unified_diff(committed.splitlines(), generated.splitlines(), "committed", "dispatch.cpp now",
                                     lineterm="", n=0))
    shown = "\n".join(diff[:120]) + (f"\n... {len(diff) - 120} more diff lines" if len(diff) > 120 else "")
    pytest.fail("AUTO's picks differ from tests/plugins/golden/auto_dispatch.csv; if intended, run "
                f"`python plugins/flashnorm/dispatch/write_golden.py` and commit the table:\n{shown}")


def test_golden_table_covers_every_site_and_row():
    """Each (site, dtype, multiprocessors, build) block starts at row 1 and ends at the last row, its
    runs in order, each a different pick from the one before: the table leaves no row of the grid out."""
    with GOLDEN.open(newline="") as file:
        rows = list(csv.DictReader(file))
    blocks: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["site"], row["dtype"], row["multiprocessors"], row["epilogue_scale_built"], row["statistic"])
        blocks.setdefault(key, []).append(row)
    assert len({key[0] for key in blocks}) >= 17
    assert {key[1] for key in blocks} == {"f32", "f16", "bf16"}
    assert {"132", "114", "78"} <= {key[2] for key in blocks}
    assert {key[4] for key in blocks} == {"rms", "variance"}
    last = max(int(row["m_to"]) for row in rows)
    for key, runs in blocks.items():
        assert int(runs[0]["m_from"]) == 1, key
        assert int(runs[-1]["m_to"]) == last, key
        for before, after in zip(runs, runs[1:]):
            assert int(before["m_to"]) < int(after["m_from"]), key
            pick = ("strategy", "tiles", "workspace")
            assert [before[c] for c in pick] != [after[c] for c in pick], key


def _strategy_runs(runs: list[dict]) -> list[tuple[int, int, str]]:
    """A block's runs merged where only the tiles or the workspace change: (m_from, m_to, strategy)."""
    merged: list[list] = []
    for run in runs:
        if merged and merged[-1][2] == run["strategy"]:
            merged[-1][1] = int(run["m_to"])
        else:
            merged.append([int(run["m_from"]), int(run["m_to"]), run["strategy"]])
    return [tuple(run) for run in merged]


def test_auto_picks_for_the_multiprocessors_it_is_given():
    """Only AUTO's epilogue-scale region counts multiprocessors (where its tiles run in one wave): with
    the CUTLASS kernel, 114 and 78 multiprocessors move some rows into or out of it against the 132
    its boundaries were measured on, and every row they move has epilogue_scale on one side; without
    it, every block is the 132 one's, row for row and byte for byte."""
    with GOLDEN.open(newline="") as file:
        rows = list(csv.DictReader(file))
    blocks: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["site"], row["statistic"], row["dtype"], row["epilogue_scale_built"], row["multiprocessors"])
        blocks.setdefault(key, []).append(row)
    moved = {"114": 0, "78": 0}
    for (site, statistic, dtype, built, count), runs in blocks.items():
        if count == "132":
            continue
        measured = blocks[(site, statistic, dtype, built, "132")]
        if built == "0":
            drop_count = [{**run, "multiprocessors": "132"} for run in runs]
            assert drop_count == measured, (site, dtype, count)
            continue
        here, there = _strategy_runs(runs), _strategy_runs(measured)
        if here == there:
            continue
        moved[count] += 1
        edges = {m for m_from, m_to, _ in here + there for m in (m_from, m_to)}
        for m in edges:
            picks = {next(s for m_from, m_to, s in block if m_from <= m <= m_to) for block in (here, there)}
            assert len(picks) == 1 or "epilogue_scale" in picks, (site, dtype, count, m, picks)
    assert moved["114"] > 0 and moved["78"] > 0, moved


def test_auto_picks_alike_for_both_statistics():
    """The LayerNorm sites (ViT-B/16 and Whisper-small's q|k|v and fc1, CLIP ViT-L/14's) are listed
    under both statistics: the variance's picks, tiles and workspace are the RMS's, row for row, in
    every dtype, multiprocessor count and build (every strategy computes the variance in the pass that
    computes the RMS; a call's bias is no part of the problem). A boundary that one day depends on
    the statistic shows here first."""
    with GOLDEN.open(newline="") as file:
        rows = list(csv.DictReader(file))
    by_statistic: dict[str, dict[tuple, list[tuple]]] = {"rms": {}, "variance": {}}
    for row in rows:
        key = (row["site"], row["dtype"], row["multiprocessors"], row["epilogue_scale_built"])
        pick = tuple(row[column] for column in ("m_from", "m_to", "strategy", "tiles", "workspace",
                                                "workspace_bytes_at_m_to"))
        by_statistic[row["statistic"]].setdefault(key, []).append(pick)
    layer_norm = by_statistic["variance"]
    assert {key[0] for key in layer_norm} == {"ViT-B/16 q|k|v", "ViT-B/16 fc1", "CLIP ViT-L/14 q|k|v",
                                             "CLIP ViT-L/14 fc1"}
    for key, runs in layer_norm.items():
        assert runs == by_statistic["rms"][key], key
    strategies = {pick[2] for runs in layer_norm.values() for pick in runs}
    assert {"fused", "epilogue_scale", "prenorm", "two_stream"} <= strategies
