"""Per-kernel Nsight Compute figures for the calls the kernel benchmark times: which kernels each
call launches, how long each runs and how much of the HBM bandwidth it uses.

Profile (on the GPU machine; caches flushed before each kernel, as the benchmark's L2-cold runs):

    ncu --clock-control none --cache-control all --csv --page raw --print-units base \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
launch__grid_size,launch__block_size,launch__registers_per_thread \
        --log-file ncu.csv python3 benchmarks/ncu_kernels.py profile --m 1 16 --manifest calls.txt

then summarize on any machine: ``python3 benchmarks/ncu_kernels.py summarize ncu.csv calls.txt``.

Every call is preceded by a marker kernel (``torch.cuda._sleep``), so the summary can tell which
kernels belong to which call; the manifest lists the calls in launch order. Needs the kernel
library (FLASHNORM_LIBRARY or build/) and PYTHONPATH=exporter for ``profile``; ``summarize``
needs neither.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from shapes import EPS, SITES

METHODS = ("gemm", "rms_gemm", "fused", "two_stream", "prenorm", "epilogue_scale")
MARKER = "spin"  # PyTorch's torch.cuda._sleep kernel
WARM_UP = "warm-up"
METRICS = {
    "time": "gpu__time_duration.sum",
    "dram": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "regs": "launch__registers_per_thread",
}


def profile(token_counts: list[int], site_indices: list[int], methods: list[str], repeats: int, manifest: Path) -> None:
    import torch
    import torch.nn.functional as F

    from flashnorm import cuda_ops

    torch.manual_seed(0)
    cuda_ops.warm_up()
    labels: list[str] = []
    for index in site_indices:
        site = SITES[index]
        for m in token_counts:
            # Setting up and the first call of each method (cuBLASLt's first use of an algorithm
            # launches more) run under one marker of their own, left out of the summary.
            torch.cuda._sleep(1)
            labels.append(f"{site.label}\t{m}\t{WARM_UP}")
            x = torch.randn(m, site.k, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(site.k, site.n, device="cuda") / site.k**0.5).bfloat16()
            gain = torch.rand(site.k, device="cuda", dtype=torch.bfloat16) + 0.5
            outs = [torch.empty(m, size, device="cuda", dtype=torch.bfloat16) for size in site.splits]
            calls: dict[str, Callable[[], object]] = {
                "gemm": lambda: torch.mm(x, w),
                "rms_gemm": lambda: torch.mm(F.rms_norm(x, (site.k,), gain, EPS), w),
            }
            for strategy in ("fused", "two_stream", "prenorm", "epilogue_scale"):
                calls[strategy] = lambda s=strategy: cuda_ops.flashnorm_matmul(x, w, EPS, site.splits, s, out=outs)
            for method in methods:
                calls[method]()
            for _ in range(repeats):
                for method in methods:
                    torch.cuda._sleep(1)
                    calls[method]()
                    labels.append(f"{site.label}\t{m}\t{method}")
    torch.cuda.synchronize()
    manifest.write_text("\n".join(labels) + "\n")


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _short_name(kernel: str) -> str:
    """`void flashnorm::<unnamed>::fused_mma_kernel<__nv_bfloat16, 1, ...>(...)` → `flashnorm::fused_mma_kernel`."""
    name = kernel.removeprefix("void ").replace("<unnamed>::", "").replace("(anonymous namespace)::", "")
    for end in "<(":
        name = name.split(end)[0]
    return name


def summarize(csv_path: Path, manifest: Path) -> str:
    """A markdown table: per call (site, M, method), its kernels in launch order with the median
    over the repeats of duration (µs), DRAM throughput (% of peak), grid, block and registers."""
    try:
        lines = [line for line in csv_path.read_text().splitlines() if line.startswith('"')]
        labels = manifest.read_text().splitlines()
    except OSError as error:
        raise SystemExit(f"cannot read {error.filename}: {error.strerror}") from None
    rows = [row for row in csv.DictReader(lines) if row.get("ID", "").strip().isdigit()]
    missing = [column for column in ("Kernel Name", *METRICS.values()) if rows and column not in rows[0]]
    if not rows or missing:
        raise SystemExit(
            f"{csv_path} is not ncu's raw CSV with the metrics of this script's docstring "
            f"({'no kernel rows' if not rows else 'missing ' + ', '.join(missing)})"
        )
    groups: list[list[dict[str, str]]] = []
    for row in rows:
        if MARKER in row["Kernel Name"]:
            groups.append([])
        elif groups:
            groups[-1].append(row)
    if len(groups) != len(labels):
        raise SystemExit(f"{len(groups)} marked calls in {csv_path} but {len(labels)} in {manifest}")
    by_call: dict[str, list[list[dict[str, str]]]] = {}
    for label, kernels in zip(labels, groups):
        if label.endswith(f"\t{WARM_UP}"):
            continue
        by_call.setdefault(label, []).append(kernels)
    out = [
        "| site | M | call | kernel | µs (median) | DRAM % | grid × block | regs |",
        "|---|---:|---|---|---:|---:|---|---:|",
    ]
    for label, repeats in by_call.items():
        site, m, method = label.split("\t")
        shapes = {len(kernels) for kernels in repeats}
        if len(shapes) != 1:
            raise SystemExit(f"{label}: the repeats launched different kernel counts {sorted(shapes)}")
        total = statistics.median(sum(_number(k[METRICS["time"]]) for k in kernels) / 1e3 for kernels in repeats)
        for position in range(shapes.pop()):
            launches = [kernels[position] for kernels in repeats]
            first = launches[0]
            name = _short_name(first["Kernel Name"])
            time = statistics.median(_number(k[METRICS["time"]]) / 1e3 for k in launches)
            dram = statistics.median(_number(k[METRICS["dram"]]) for k in launches)
            geometry = f"{int(_number(first[METRICS['grid']]))} × {int(_number(first[METRICS['block']]))}"
            out.append(
                f"| {site} | {m} | {method} | `{name}` | {time:.2f} | {dram:.0f} | {geometry} | "
                f"{int(_number(first[METRICS['regs']]))} |"
            )
        out.append(f"| {site} | {m} | {method} | **all kernels** | **{total:.2f}** | | | |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("profile", help="launch the calls (under ncu)")
    run.add_argument("--m", type=int, nargs="+", default=[1], help="token counts")
    run.add_argument("--sites", type=int, nargs="+", default=list(range(len(SITES))), help="indices into shapes.SITES")
    run.add_argument("--methods", nargs="+", choices=METHODS, default=["gemm", "rms_gemm", "fused", "two_stream"])
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--manifest", type=Path, required=True, help="where to write the calls in launch order")
    table = commands.add_parser("summarize", help="ncu's CSV and the manifest → markdown table")
    table.add_argument("csv", type=Path)
    table.add_argument("manifest", type=Path)
    args = parser.parse_args()
    if args.command == "profile":
        profile(args.m, args.sites, args.methods, args.repeats, args.manifest)
    else:
        sys.stdout.write(summarize(args.csv, args.manifest))


if __name__ == "__main__":
    main()
