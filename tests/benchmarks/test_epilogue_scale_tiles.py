"""benchmarks/epilogue_scale_tiles.py's table on CPU (its timings need the GPU, where the script is
run by hand: docs/BENCHMARKS.md): every forced configuration gets a column, untimed ones a dash,
and the fastest forced one is named."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import epilogue_scale_tiles  # noqa: E402


def test_table_names_the_fastest_forced_configuration() -> None:
    tiles = ["one_wave_128x128", "one_wave_128x192", "row_sums_64x32"]
    row = dict(
        model="Llama-3.2-1B",
        site="qkv",
        m=1024,
        auto_resolves_to="two_stream",
        times_us={
            "gemm": 19.7, "compile": 23.4, "two_stream": 26.8, "prenorm": 27.7, "auto": 26.8,
            "epilogue_scale": 29.4, "one_wave_128x128": 29.5, "one_wave_128x192": 21.0, "row_sums_64x32": None,
        },
    )
    table = epilogue_scale_tiles.markdown_table([row], tiles).splitlines()
    assert table[0].split(" | ")[2:9] == ["gemm", "compile", "two_stream", "prenorm", "auto", "automatic", *tiles[:1]]
    cells = [cell.strip() for cell in table[2].strip("|").split("|")]
    assert len(cells) == len(table[0].strip("|").split("|"))
    assert cells[6] == "26.80 (two_stream)"
    assert cells[-2] == "—"
    assert cells[-1] == "one_wave_128x192"
