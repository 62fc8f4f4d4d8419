"""benchmarks/kernel_benchmark.py on CPU (--smoke): every column is timed and checked, the one-output column
included, for an RMSNorm and a LayerNorm site alike, and the targets are judged for the per-split and
the one-output `auto` alike."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kernel_benchmark  # noqa: E402


def test_smoke_run_times_and_checks_the_one_output_column(tmp_path: Path) -> None:
    assert kernel_benchmark.main(["--smoke", "--out", str(tmp_path), "--m", "1", "64", "--replays", "1"]) == 0
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert len(rows) == 6
    assert [row["norm"] for row in rows] == ["rms"] * 4 + ["layer"] * 2
    for row in rows:
        assert set(row["times_us"]) == set(kernel_benchmark.COLUMNS)
        assert row["times_us"][kernel_benchmark.ONE_OUTPUT] > 0
        assert row["check_relative_error"][kernel_benchmark.ONE_OUTPUT] < kernel_benchmark.CHECK_TOLERANCE
        assert row["one_output_over_compile"] > 0
        expected = {"auto<=gemm", "norm+gemm>=1.30*auto"} if row["m"] <= 16 else set()
        assert set(row["targets"]) == set(row["targets_one_output"]) == expected
    table = (tmp_path / "kernels.md").read_text()
    assert "auto, one output (picks)" in table and "Missed (one output)" in table
    assert "F.layer_norm + GEMM" in table and "(LayerNorm mode, with the projection's bias)" in table


def test_layer_norm_sites_alone_with_their_own_rows(tmp_path: Path) -> None:
    """--norm layer times the LayerNorm sites only; on the CPU their rows are capped at 64."""
    assert kernel_benchmark.main(["--smoke", "--out", str(tmp_path), "--norm", "layer", "--replays", "1"]) == 0
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert {row["norm"] for row in rows} == {"layer"} and {row["m"] for row in rows} == {1, 64}


def test_the_fold_of_layer_norm_is_exact_in_float64() -> None:
    """W_c, c* of fold_layer_norm reproduce F.layer_norm then the projection (the check's reference)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=generator, dtype=torch.float64) + 7
    gain, shift = torch.randn(16, generator=generator), torch.randn(16, generator=generator)
    w, bias = torch.randn(16, 12, generator=generator), torch.randn(12, generator=generator)
    centred, folded_bias = kernel_benchmark.fold_layer_norm(gain, shift, w, bias)
    got = kernel_benchmark.reference_flashnorm(x, centred, 1e-5, "variance", folded_bias)
    wanted = kernel_benchmark.unfused_layer_norm_linear(x, gain.double(), shift.double(), w.double(), bias.double(), 1e-5)
    assert torch.allclose(got.double(), wanted, rtol=1e-4, atol=1e-4)


def test_targets_judge_the_given_auto_time() -> None:
    times = {"gemm": 4.0, "norm+gemm": 8.0}
    assert kernel_benchmark.targets(1, 3.0, times) == {"auto<=gemm": True, "norm+gemm>=1.30*auto": True}
    assert kernel_benchmark.targets(1, 7.0, times) == {"auto<=gemm": False, "norm+gemm>=1.30*auto": False}
    assert kernel_benchmark.targets(1024, 8.5, times) == {"auto<=norm+gemm": False}
    assert kernel_benchmark.targets(64, 3.0, times) == {}
    assert kernel_benchmark.targets(1, None, times) == {}


def test_floor_forbids_the_speedup_only_below_1_30_floors() -> None:
    """Llama-3.1-8B gate|up at M = 1 (2026-12-04): F.rms_norm + GEMM 65.3 µs, floor 54.6 µs, so the
    1.30× check would need auto at 50.2 µs, below the floor; Llama-3.2-1B gate|up (23.6 against 15.6)
    leaves room. Prefill rows are never judged by it."""
    assert kernel_benchmark.floor_forbids_speedup(1, {"norm+gemm": 65.3}, 54.6)
    assert not kernel_benchmark.floor_forbids_speedup(1, {"norm+gemm": 23.6}, 15.6)
    assert not kernel_benchmark.floor_forbids_speedup(1024, {"norm+gemm": 65.3}, 54.6)
    assert not kernel_benchmark.floor_forbids_speedup(1, {"norm+gemm": None}, 54.6)


def test_a_shape_of_ones_own_is_timed_alone_or_beside_the_chosen_sites(tmp_path: Path) -> None:
    assert kernel_benchmark.main(["--smoke", "--out", str(tmp_path), "--m", "4", "--replays", "1",
                                  "--shape", "256:128,64"]) == 0
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert [(row["site"], row["k"], row["splits"]) for row in rows] == [("256:128,64", 32, [16, 8])]
    assert kernel_benchmark.main(["--smoke", "--out", str(tmp_path), "--m", "4", "--replays", "1",
                                  "--sites", "SmolLM2-135M qkv", "--shape", "256:128,64"]) == 0
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert [row["site"] for row in rows] == ["qkv", "256:128,64"]


@pytest.mark.parametrize("text", ["3072", "3072:", "a:1,2", "3072:1024,0", "-8:64"])
def test_a_malformed_shape_is_refused_with_its_form(text: str) -> None:
    with pytest.raises(SystemExit) as refused:
        kernel_benchmark.main(["--smoke", "--shape", text])
    assert refused.value.code == 2
