"""The epilogue-scale GEMM under every tile configuration, forced, against what AUTO runs and the
peers, on the kernel benchmark's sites: the measurements behind epilogue_scale_tiles' dispatch and
AUTO's epilogue-scale rows (kernels/DESIGN.md).

    python benchmarks/epilogue_scale_tiles.py --out DIR [--sites 'Llama-3.2-1B qkv'] [--m 256 1024] [--tiles NAME ...]

Timed as benchmarks/kernel_benchmark.py times (its GraphTimer and input sets: median µs per call
under CUDA-graph replay, input sets rotated over 2× L2 so W comes from HBM), bf16, per-split
outputs. Columns: GEMM alone, torch.compile of the unfused module, two_stream, prenorm, auto (with
the strategy it resolves to), then epilogue_scale with each forced configuration (`--tiles`, default
all of `cuda_ops.epilogue_scale_tile_names()`) and with the automatic one. Every forced
configuration's output is checked against the fp32 folded math first (relative L2 error < 1e-2); a
configuration that fails the check is reported and not timed. Writes DIR/tiles.md and DIR/tiles.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_benchmark import (  # noqa: E402
    CHECK_TOLERANCE,
    GraphTimer,
    environment,
    make_sets,
    reference_flashnorm,
    relative_error,
    rotation_count,
    row_identity,
    unfused_norm_matmul,
)
from shapes import EPS, SITES, TOKEN_COUNTS, Site  # noqa: E402

STRATEGIES = ("two_stream", "prenorm", "auto", "epilogue_scale")
AUTOMATIC = "automatic"


def checked_error(cuda_ops, site: Site, m: int, dtype: torch.dtype) -> float:
    """Relative error of epilogue_scale (as currently forced) against the fp32 folded math."""
    x = torch.randn(m, site.k, device="cuda", dtype=dtype)
    w = (torch.randn(site.k, site.n, device="cuda") / site.k**0.5).to(dtype)
    outs = [torch.full((m, size), float("nan"), device="cuda", dtype=dtype) for size in site.splits]
    cuda_ops.flashnorm_matmul(x, w, EPS, splits=site.splits, strategy="epilogue_scale", out=outs)
    torch.cuda.synchronize()
    return relative_error(torch.cat(outs, dim=1), reference_flashnorm(x, w, EPS))


def measure(cuda_ops, site: Site, m: int, tiles: Sequence[str], timer: GraphTimer, cache_bytes: int) -> dict:
    dtype = torch.bfloat16
    count = rotation_count(site, m, cache_bytes)
    sets = make_sets(site, m, count, torch.device("cuda"), dtype)
    compiled = torch.compile(unfused_norm_matmul)
    compiled(sets[0].x, sets[0].gain, sets[0].w, EPS)  # compiles outside the capture

    def library(strategy: str):
        return lambda i: cuda_ops.flashnorm_matmul(
            sets[i].x, sets[i].w, EPS, splits=site.splits, strategy=strategy, out=sets[i].outs
        )

    times: dict[str, float | None] = {
        "gemm": timer(lambda i: torch.mm(sets[i].x, sets[i].w, out=sets[i].y), count),
        "compile": timer(lambda i: compiled(sets[i].x, sets[i].gain, sets[i].w, EPS), count),
    }
    times.update({strategy: timer(library(strategy), count) for strategy in STRATEGIES})
    errors: dict[str, float] = {}
    for name in tiles:
        cuda_ops.set_epilogue_scale_tiles(name)
        try:
            errors[name] = checked_error(cuda_ops, site, m, dtype)
            times[name] = timer(library("epilogue_scale"), count) if errors[name] < CHECK_TOLERANCE else None
        finally:
            cuda_ops.set_epilogue_scale_tiles(None)
    return dict(
        **row_identity(site, m, count),
        auto_resolves_to=cuda_ops.resolve_strategy(m, site.k, site.n, dtype, site.splits),
        times_us=times,
        check_relative_error=errors,
    )


def markdown_table(rows: list[dict], tiles: Sequence[str]) -> str:
    columns = ("gemm", "compile", "two_stream", "prenorm", "auto", "epilogue_scale", *tiles)
    head = "| site | M | " + " | ".join(AUTOMATIC if c == "epilogue_scale" else c for c in columns) + " | fastest forced |"
    lines = [head, "|" + "---|" * (len(columns) + 3)]
    for row in rows:
        times = row["times_us"]
        timed = {name: times[name] for name in tiles if times.get(name) is not None}
        fastest = min(timed, key=timed.get) if timed else "—"
        cells = []
        for column in columns:
            value = times.get(column)
            text = "—" if value is None else f"{value:.2f}"
            cells.append(f"{text} ({row['auto_resolves_to']})" if column == "auto" else text)
        lines.append(f"| {row['model']} {row['site']} | {row['m']} | " + " | ".join(cells) + f" | {fastest} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")), help="folder for tiles.md/json")
    parser.add_argument("--m", type=int, nargs="+", default=list(TOKEN_COUNTS), help="token counts M")
    parser.add_argument("--sites", nargs="+", default=None, help="site labels to keep, e.g. 'Llama-3.2-1B qkv'")
    parser.add_argument("--tiles", nargs="+", default=None, help="configurations to force (default: all)")
    parser.add_argument("--replays", type=int, default=25, help="timed graph replays per measurement")
    args = parser.parse_args(argv)

    from flashnorm import cuda_ops

    cuda_ops.warm_up()
    if not cuda_ops.strategy_available("epilogue_scale"):
        print("epilogue_scale is not in this library build or not on this device", file=sys.stderr)
        return 1
    names = cuda_ops.epilogue_scale_tile_names()
    tiles = args.tiles or names
    unknown = sorted(set(tiles) - set(names))
    if unknown:
        print(f"unknown tile configurations {unknown}; known: {names}", file=sys.stderr)
        return 2
    sites = [s for s in SITES if args.sites is None or s.label in args.sites]
    env = environment(torch.device("cuda"))
    env.update(library=str(cuda_ops.library_path()))
    print(json.dumps(env), flush=True)
    timer = GraphTimer(args.replays)
    cache_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    header = (
        f"Measured {env['date_utc']} on {env['gpu']} (driver {env.get('driver', '—')}), torch {env['torch']}, "
        f"CUDA {env['cuda']}; bf16, per-split outputs, median µs per call over {args.replays} CUDA-graph replays "
        "(W from HBM); forced epilogue-scale tile configurations after the automatic one."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for site in sites:
        torch._dynamo.reset()
        for m in args.m:
            rows.append(measure(cuda_ops, site, m, tiles, timer, cache_bytes))
            times = rows[-1]["times_us"]
            print(f"{site.label} M={m}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items() if v is not None), flush=True)
            # Written after every row, so a run cut short keeps what it measured.
            (args.out / "tiles.md").write_text(header + "\n\n" + markdown_table(rows, tiles) + "\n")
            (args.out / "tiles.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1) + "\n")
    print(markdown_table(rows, tiles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
