"""Regenerates AUTO's golden table, tests/plugins/golden/auto_dispatch.csv: compiles dispatch.cpp and
golden_table.cpp with the host C++ compiler (no CUDA) and writes what the program prints.

    python plugins/flashnorm/dispatch/write_golden.py            # rewrite the committed table
    python plugins/flashnorm/dispatch/write_golden.py -o x.csv   # write it elsewhere

After editing a boundary in dispatch.cpp, rewrite the table and review `git diff tests/plugins/golden/`:
every row range whose pick, tiles or workspace moved. tests/plugins/test_dispatch_golden.py checks
that the table matches the code. The compiler is $CXX, else the first of c++, g++ and clang++ found.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
GOLDEN = REPO / "tests" / "plugins" / "golden" / "auto_dispatch.csv"
SOURCES = (HERE / "dispatch.cpp", HERE / "golden_table.cpp")


def find_compiler() -> str | None:
    """The host C++ compiler to use, or None where there is none."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((found for name in candidates if (found := shutil.which(name))), None)


def generate(compiler: str) -> str:
    """The golden table for the sources as they are now. Raises RuntimeError with the compiler's or
    the program's message where either fails (the program checks every row's workspace too)."""
    with tempfile.TemporaryDirectory(prefix="flashnorm-golden-") as work:
        program = Path(work) / "golden_table"
        command = [compiler, "-std=c++20", "-O2", f"-I{HERE.parent}", *map(str, SOURCES), "-o", str(program)]
        built = subprocess.run(command, capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{built.stderr[-4000:]}")
        ran = subprocess.run([str(program)], capture_output=True, text=True)
        if ran.returncode != 0:
            raise RuntimeError(f"golden_table failed its checks:\n{ran.stderr[-4000:]}")
        return ran.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=GOLDEN, help=f"where to write it (default {GOLDEN})")
    args = parser.parse_args(argv)
    compiler = find_compiler()
    if compiler is None:
        print("no host C++ compiler found (set CXX, or install c++/g++/clang++)", file=sys.stderr)
        return 1
    try:
        table = generate(compiler)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table)
    print(f"{args.output}: {table.count(chr(10)) - 1} runs of rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
