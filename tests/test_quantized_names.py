""""Is this consumer quantized, and how" has one answer: flashnorm/match/quantized.py. No other
module of the package names a quantized op in its code (a string such as "MatMulNBits" compared
with node.op, or put in a message): it asks the recogniser, reads the op's name off the node, or
takes the table's row. A dequantizer chain walk has to name the dequantizer, so it cannot hide
elsewhere either. Docstrings (bare string statements, field docstrings included) and comments may
name ops: they document, they do not decide. No module is exempt: the format modules under
passes/quantized/ read the op's name off the node for their messages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import flashnorm
from flashnorm.match.quantized import QUANTIZED_OPS

PACKAGE = Path(flashnorm.__file__).parent
RECOGNISER = PACKAGE / "match" / "quantized.py"
NAMES = re.compile(r"\b(" + "|".join(sorted(QUANTIZED_OPS, key=len, reverse=True)) + r")\b")


def _docstrings(tree: ast.AST) -> set[int]:
    """Bare string statements: module, class and function docstrings, and the ones under fields."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def code_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal in code, f-string parts included, docstrings left out."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_the_scan_sees_code_strings_and_skips_docstrings():
    source = '"""MatMulNBits docs."""\ndef f(node):\n    """DequantizeLinear docs."""\n' \
             '    # QGemm in a comment\n    return node.op == "MatMulNBits" or f"{node} QuantizeLinear"\n'
    assert [NAMES.findall(text) for _, text in code_strings(source) if NAMES.search(text)] == [
        ["MatMulNBits"], ["QuantizeLinear"]]


def test_no_quantized_op_name_outside_the_recogniser():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == RECOGNISER:
            continue
        for line, text in code_strings(path.read_text()):
            for name in NAMES.findall(text):
                found.append(f"{path.relative_to(PACKAGE)}:{line}: {name}")
    assert found == []
