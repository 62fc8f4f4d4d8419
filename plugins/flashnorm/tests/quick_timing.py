"""First timing of the strategies against cuBLAS at decode sizes (bf16) and, with --prefill, of
prenorm against two-stream and F.rms_norm + cuBLAS at large M (every dtype), used to set AUTO's
thresholds; the full benchmark is benchmarks/kernel_benchmark.py. Median µs per call from CUDA-graph
replays of 20 back-to-back calls on one input set (launch gaps removed, like the baselines in
BRIEF.md; W* may sit in L2 for the small shapes)."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from flashnorm import cuda_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from shapes import SITES  # noqa: E402

SHAPES = [(576, [576, 192, 192]), (576, [1536, 1536]), (2048, [3072]), (2048, [16384]), (4096, [6144]), (4096, [28672])]
# The other dtypes on two shapes, to place AUTO's thresholds for them.
OTHER_DTYPES = [(torch.float16, [1, 8, 16, 32]), (torch.float32, [1, 2, 4, 8, 16])]
OTHER_SHAPES = [(2048, [3072]), (4096, [6144])]
CALLS_PER_GRAPH = 20


def time_us(function) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            function()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(CALLS_PER_GRAPH):
                function()
        samples = []
        for _ in range(15):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1000.0 / CALLS_PER_GRAPH)
    return statistics.median(samples)


def fused_table(rows) -> None:
    """The fused kernel alone (bf16) under every forced strip width and cluster size, then the
    automatic choice (cuda_ops.set_fused_tuning)."""
    settings = [(strip, size) for strip in (128, 32) for size in (1, 2, 4, 8)] + [(0, 0)]
    for k, splits in SHAPES:
        n = sum(splits)
        w = (torch.randn(k, n, device="cuda") / k**0.5).bfloat16()
        xs = [torch.randn(m, k, device="cuda").bfloat16() for m in rows]
        outs = [[torch.empty(m, width, device="cuda", dtype=torch.bfloat16) for width in splits] for m in rows]
        for strip, size in settings:
            cuda_ops.set_fused_tuning(strip, size)
            cells = [
                f"{time_us(lambda: cuda_ops.flashnorm_matmul(x, w, 1e-5, splits, 'fused', out)):7.1f}"
                for x, out in zip(xs, outs)
            ]
            label = f"strip={strip} cluster={size}" if strip else "auto"
            print(f"{label:>20} {f'{k}×{n}':>12} fused µs at M={rows}: {' '.join(cells)}", flush=True)
        cuda_ops.set_fused_tuning(0, 0)


def timed_baselines(dtype: torch.dtype, shapes, rows, eps: float):
    """Per (K, splits) × M: fresh x, W*, the split outputs, and the two baselines' µs (cuBLAS
    alone, F.rms_norm + cuBLAS), yielded as (m, k, splits, x, w, outs, gemm_us, baseline_us)."""
    for k, splits in shapes:
        n = sum(splits)
        w = (torch.randn(k, n, device="cuda") / k**0.5).to(dtype)
        for m in rows:
            x = torch.randn(m, k, device="cuda").to(dtype)
            outs = [torch.empty(m, width, device="cuda", dtype=dtype) for width in splits]
            gemm = time_us(lambda: torch.matmul(x, w))
            baseline = time_us(lambda: torch.matmul(F.rms_norm(x, (k,), eps=eps), w))
            yield m, k, splits, x, w, outs, gemm, baseline


def table(dtype: torch.dtype, shapes, rows) -> None:
    eps = 1e-5
    size = torch.finfo(dtype).bits // 8
    print(f"{str(dtype):>15} {'M×K×N':>18} {'floor':>6} {'cuBLAS':>7} {'rms+GEMM':>8} {'fused':>7} {'2stream':>7} {'auto':>7} {'auto/GEMM':>9} {'rms+GEMM/auto':>13}")
    for m, k, splits, x, w, outs, gemm, baseline in timed_baselines(dtype, shapes, rows, eps):
        n = sum(splits)
        fused = time_us(lambda: cuda_ops.flashnorm_matmul(x, w, eps, splits, "fused", outs))
        two = time_us(lambda: cuda_ops.flashnorm_matmul(x, w, eps, splits, "two_stream", outs))
        auto = time_us(lambda: cuda_ops.flashnorm_matmul(x, w, eps, splits, "auto", outs))
        floor = (k * n + m * k + m * n) * size / 4.3e12 * 1e6
        print(
            f"{'':>15} {f'{m}×{k}×{n}':>18} {floor:6.1f} {gemm:7.1f} {baseline:8.1f} {fused:7.1f} {two:7.1f} {auto:7.1f}"
            f" {auto / gemm:9.2f} {baseline / auto:13.2f}",
            flush=True,
        )


def prefill_table(dtype: torch.dtype, shapes, rows) -> None:
    """prenorm vs two_stream vs F.rms_norm + cuBLAS vs cuBLAS alone; auto's pick in the last column."""
    eps = 1e-5
    print(
        f"{str(dtype):>15} {'M×K×N':>18} {'cuBLAS':>8} {'rms+GEMM':>8} {'2stream':>8} {'prenorm':>8} {'auto':>8}"
        f" {'prenorm/(rms+GEMM)':>18} {'2stream/(rms+GEMM)':>18} {'auto/(rms+GEMM)':>15}  picks"
    )
    for m, k, splits, x, w, outs, gemm, baseline in timed_baselines(dtype, shapes, rows, eps):
        n = sum(splits)
        two = time_us(lambda: cuda_ops.flashnorm_matmul(x, w, eps, splits, "two_stream", outs))
        prenorm = time_us(lambda: cuda_ops.flashnorm_matmul(x, w, eps, splits, "prenorm", outs))
        auto = time_us(lambda: cuda_ops.flashnorm_matmul(x, w, eps, splits, "auto", outs))
        print(
            f"{'':>15} {f'{m}×{k}×{n}':>18} {gemm:8.1f} {baseline:8.1f} {two:8.1f} {prenorm:8.1f} {auto:8.1f}"
            f" {prenorm / baseline:18.2f} {two / baseline:18.2f} {auto / baseline:15.2f}"
            f"  {cuda_ops.resolve_strategy(m, k, n, dtype, splits)}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("rows", nargs="*", type=int, default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--fused-only", action="store_true", help="only the fused kernel, bf16")
    parser.add_argument("--prefill", action="store_true", help="prenorm vs two_stream vs F.rms_norm + cuBLAS")
    args = parser.parse_args()
    cuda_ops.warm_up()
    if args.fused_only:
        fused_table(args.rows)
        return
    if args.prefill:  # the real sites, splits included: prenorm runs one GEMM per split
        sites = [(site.k, list(site.splits)) for site in SITES]
        prefill_table(torch.bfloat16, sites, args.rows)
        for dtype in (torch.float16, torch.float32):
            prefill_table(dtype, [sites[2], sites[4]], [m for m in args.rows if m <= 1024])
        return
    table(torch.bfloat16, SHAPES, args.rows)
    for dtype, rows in OTHER_DTYPES:
        table(dtype, OTHER_SHAPES, rows)


if __name__ == "__main__":
    main()
