"""The reference pages stay reference pages, and the links between the docs resolve.

docs/BENCHMARKS.md and plugins/flashnorm/kernels/DESIGN.md hold the current state only (dated runs
go to docs/history/), so each stays under MAX_LINES and dates its figures with an "as of" line.
Every relative markdown link in README.md, docs/*.md and DESIGN.md must name an existing file, and
a #fragment an existing heading of that file (GitHub's slug rules). docs/history/ is verbatim
record and is not checked: its links are those of the day it was written.

Code points at docs too: a comment or docstring that names a page by path ("docs/X.md",
"kernels/DESIGN.md") must name one that exists, and where it names a section ("docs/X.md#anchor",
'docs/X.md, "Heading"', "docs/X.md section 7", "(kernels/DESIGN.md, prenorm)") that section must
be a heading of that page, so that a section moved to docs/history/ takes its pointers with it.
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
REFERENCE_PAGES = [ROOT / "docs" / "BENCHMARKS.md", ROOT / "plugins" / "flashnorm" / "kernels" / "DESIGN.md"]
LINKING_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), REFERENCE_PAGES[1]]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lower case, punctuation dropped
    (letters, digits, '_', '-' and spaces kept), spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = text.replace("`", "").replace("\\", "")
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(path: Path):
    """(line number, target) of every relative link of a markdown file, outside code."""
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                continue
            yield number, target


def test_slug_rules():
    assert github_slug("One output: q|k|v as views of one [M, N] tensor (2026-12-02 05:36 and 05:38 UTC)") == (
        "one-output-qkv-as-views-of-one-m-n-tensor-2026-12-02-0536-and-0538-utc"
    )
    assert github_slug("AUTO under torch.compile") == "auto-under-torchcompile"
    assert github_slug("`two_stream` (`deferred_norm.cu`)") == "two_stream-deferred_normcu"
    assert github_slug("128×96 tiles in clusters of two") == "12896-tiles-in-clusters-of-two"


@pytest.mark.parametrize("page", REFERENCE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_reference_page_is_short_and_dated(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, (
        f"{page.relative_to(ROOT)} has {len(lines)} lines, over {MAX_LINES}: move superseded "
        "sections verbatim into docs/history/ and keep the current state here"
    )
    assert any(f"under {MAX_LINES} lines" in line for line in lines[:10]), "state the limit in the first lines"
    assert any(re.match(r"\s*as of ", line, re.IGNORECASE) for line in lines), "no 'As of <commit>, <date>' line"


@pytest.mark.parametrize("page", LINKING_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for number, target in relative_links(page):
        path_part, _, fragment = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not linked.exists():
            broken.append(f"{where} (no such file)")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


# ── pointers from code to docs ──────────────────────────────────────────────────────────────────

CODE_SUFFIXES = (".py", ".cu", ".cuh", ".h", ".cpp", ".sh", ".cmake", ".toml", "CMakeLists.txt")
# A page named by a path with at least one folder (docs/X.md, kernels/DESIGN.md), not a written
# file's name ($OUT/kernels.md) nor a placeholder (DIR/tiles.md, REPO/README.md); then the section:
# #anchor, a quoted heading, "section N", or one word after a comma closing the parentheses. This
# file's own examples are not pointers.
_POINTER = re.compile(
    r"(?<![\w$/{}.-])((?:[\w.-]+/)+[\w.-]+\.md)"
    r"(?:#(?P<anchor>[\w-]+)"
    r"|[ ,(]{1,3}\"(?P<quoted>[^\"\n]+)\""
    r"|,? section (?P<number>\d+)"
    r"|, (?P<word>\w+)\))?"
)


def _tracked_files() -> list[str]:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    return listed.stdout.split()


def _headings(path: Path) -> list[str]:
    return [m.group(2) for _, line in _prose_lines(path.read_text(encoding="utf-8")) if (m := _HEADING.match(line))]


def code_pointers():
    """(where, page path as written, the page it resolves to or None, the section part)."""
    tracked = _tracked_files()
    pages = [f for f in tracked if f.endswith(".md")]
    for name in tracked:
        if not name.endswith(CODE_SUFFIXES) or name.startswith("docs/history/") or name == "tests/test_docs.py":
            continue
        source = ROOT / name
        for number, line in enumerate(source.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for match in _POINTER.finditer(line):
                written = match.group(1)
                if written.split("/")[0].isupper():  # DIR/…, REPO/…: a placeholder
                    continue
                candidates = [ROOT / written, source.parent / written]
                candidates += [ROOT / page for page in pages if page.endswith("/" + written)]
                page = next((c for c in candidates if c.is_file()), None)
                yield f"{name}:{number}", written, page, match


def test_code_pointers_to_docs_resolve():
    broken, checked_sections = [], 0
    for where, written, page, match in code_pointers():
        if page is None:
            broken.append(f"{where}: {written} (no such page)")
            continue
        headings = _headings(page)
        anchor, quoted, number, word = (match.group(k) for k in ("anchor", "quoted", "number", "word"))
        if anchor and anchor not in anchors(page):
            broken.append(f"{where}: {written}#{anchor} (no heading with that anchor)")
        elif quoted and not any(h.startswith(quoted.rstrip("…. ")) for h in headings):
            broken.append(f"{where}: {written}, \"{quoted}\" (no heading starts so; moved to docs/history/?)")
        elif number and not any(re.match(rf"{number}\.? ", h) for h in headings):
            broken.append(f"{where}: {written} section {number} (no heading numbered so)")
        elif word and not any(word.lower() in h.lower() for h in headings):
            broken.append(f"{where}: {written}, {word} (no heading names it; moved to docs/history/?)")
        checked_sections += bool(anchor or quoted or number or word)
    assert not broken, "\n".join(broken)
    assert checked_sections >= 5, "the pattern no longer finds the code's section pointers"


def test_code_pointer_pattern():
    def parts(text):
        match = _POINTER.search(text)
        return match.group(1), {k: v for k, v in match.groupdict().items() if v}

    assert parts('// (kernels/DESIGN.md, "Launch-level variants").') == (
        "kernels/DESIGN.md", {"quoted": "Launch-level variants"})
    assert parts("see docs/TENSORRT.md section 7).") == ("docs/TENSORRT.md", {"number": "7"})
    assert parts("idle (kernels/DESIGN.md, prenorm): the") == ("kernels/DESIGN.md", {"word": "prenorm"})
    assert parts("docs/QUANTIZATION.md#the-budget") == ("docs/QUANTIZATION.md", {"anchor": "the-budget"})
    assert _POINTER.search('(args.out / "kernels.md")') is None and _POINTER.search('"$OUT/kernels.md"') is None
