"""benchmarks/ncu_kernels.py summarize: Nsight Compute's raw CSV and the manifest → one table."""

import csv
import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ncu_kernels  # noqa: E402

COLUMNS = ["ID", "Kernel Name", *ncu_kernels.METRICS.values()]


def _write(tmp_path: Path, kernels: list[tuple[str, float, float]], labels: list[str]) -> tuple[Path, Path]:
    """An ncu raw CSV (log lines, header, units row, one row per kernel: name, ns, DRAM %) and a manifest."""
    text = io.StringIO()
    writer = csv.writer(text, quoting=csv.QUOTE_ALL)
    writer.writerow(COLUMNS)
    writer.writerow(["", "", "nsecond", "%", "", "", "register/thread"])
    for index, (name, nanoseconds, dram) in enumerate(kernels):
        writer.writerow([str(index), name, f"{nanoseconds:,.0f}", f"{dram}", "1,024", "128", "96"])
    csv_path = tmp_path / "ncu.csv"
    csv_path.write_text("==PROF== Connected to process 1\n" + text.getvalue())
    manifest = tmp_path / "calls.txt"
    manifest.write_text("".join(f"{label}\n" for label in labels))
    return csv_path, manifest


def _rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_kernels_are_grouped_by_marker_and_summarized_by_median(tmp_path: Path) -> None:
    spin = "cuda::<unnamed>::spin_kernel(long)"
    gemm = "nvjet_sm90_tst_64x8_NNT"
    kernels = [
        ("setup_kernel_before_any_marker", 1, 0),
        (spin, 1, 0), ("randn_setup", 9_999, 0), ("first_call_extra", 9_999, 0),
        (spin, 1, 0), (gemm, 4_000, 10),
        (spin, 1, 0), ("void flashnorm::<unnamed>::inv_rms_kernel<__nv_bfloat16>(const T1 *, long)", 2_000, 1), (gemm, 4_200, 12),
        (spin, 1, 0), (gemm, 5_000, 30),
        (spin, 1, 0), ("void flashnorm::<unnamed>::inv_rms_kernel<__nv_bfloat16>(const T1 *, long)", 3_000, 2), (gemm, 4_400, 14),
        (spin, 1, 0), (gemm, 6_000, 20),
        (spin, 1, 0), ("void flashnorm::<unnamed>::inv_rms_kernel<__nv_bfloat16>(const T1 *, long)", 2_500, 3), (gemm, 4_300, 13),
    ]
    labels = ["S qkv\t1\twarm-up"] + ["S qkv\t1\tgemm", "S qkv\t1\ttwo_stream"] * 3
    table = ncu_kernels.summarize(*_write(tmp_path, kernels, labels))
    assert "randn_setup" not in table and "first_call_extra" not in table and "setup_kernel" not in table
    assert _rows(table) == [
        ["S qkv", "1", "gemm", f"`{gemm}`", "5.00", "20", "1024 × 128", "96"],
        ["S qkv", "1", "gemm", "**all kernels**", "**5.00**", "", "", ""],
        ["S qkv", "1", "two_stream", "`flashnorm::inv_rms_kernel`", "2.50", "2", "1024 × 128", "96"],
        ["S qkv", "1", "two_stream", f"`{gemm}`", "4.30", "13", "1024 × 128", "96"],
        ["S qkv", "1", "two_stream", "**all kernels**", "**6.80**", "", "", ""],
    ]


def test_a_manifest_that_does_not_match_the_markers_is_refused(tmp_path: Path) -> None:
    kernels = [("cuda::spin_kernel(long)", 1, 0), ("k", 1_000, 1)]
    with pytest.raises(SystemExit, match="1 marked calls .* but 2"):
        ncu_kernels.summarize(*_write(tmp_path, kernels, ["a\t1\tgemm", "a\t1\tfused"]))


def test_repeats_with_different_kernels_are_refused(tmp_path: Path) -> None:
    spin = "cuda::spin_kernel(long)"
    kernels = [(spin, 1, 0), ("k", 1_000, 1), (spin, 1, 0), ("k", 1_000, 1), ("k", 1_000, 1)]
    with pytest.raises(SystemExit, match="different kernel counts"):
        ncu_kernels.summarize(*_write(tmp_path, kernels, ["a\t1\tgemm", "a\t1\tgemm"]))


def test_a_csv_without_the_metrics_is_refused_in_one_line(tmp_path: Path) -> None:
    csv_path, manifest = _write(tmp_path, [("cuda::spin_kernel(long)", 1, 0)], ["a\t1\tgemm"])
    csv_path.write_text(csv_path.read_text().replace("dram__throughput", "dram__bytes"))
    with pytest.raises(SystemExit, match="missing dram__throughput.avg.pct_of_peak_sustained_elapsed"):
        ncu_kernels.summarize(csv_path, manifest)
    csv_path.write_text("==PROF== no kernels were profiled\n")
    with pytest.raises(SystemExit, match="no kernel rows"):
        ncu_kernels.summarize(csv_path, manifest)
    with pytest.raises(SystemExit, match="cannot read .*absent.csv: No such file"):
        ncu_kernels.summarize(tmp_path / "absent.csv", manifest)
