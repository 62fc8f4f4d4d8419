"""The shape of flashnorm's imports: one direction (no cycle), each module importing only what its
row of docs/ARCHITECTURE.md's module table allows, and leaf modules that stay leaves."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flashnorm

PACKAGE_DIR = Path(flashnorm.__file__).parent
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"
# Open to every module, whatever its row says (docs/ARCHITECTURE.md, above the table).
ALWAYS_ALLOWED = {"flashnorm", "flashnorm.errors"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The flashnorm modules an AST imports, at module level or inside functions (lazy imports
    are edges too); imports under `if TYPE_CHECKING:` never run and are left out."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flashnorm":
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "flashnorm":
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    found.add(submodule if submodule in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(ast.parse(path.read_text()), modules) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_the_walker_sees_real_edges():
    graph = import_graph()
    assert "flashnorm.modelio.values" in graph["flashnorm.passes.fold"]
    assert "flashnorm.passes.defer" in graph["flashnorm.passes.dry_run"]  # a lazy import inside a function
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    assert _cycle(import_graph()) is None


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    reachable, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in reachable:
            reachable.add(name)
            todo += graph[name]
    return reachable


def test_data_flows_one_way():
    """Saving a model knows no pass; no library stage reaches the passes or the command line
    it feeds."""
    graph = import_graph()
    for stage in ["flashnorm.modelio", "flashnorm.match", "flashnorm.engine", "flashnorm.serve",
                  "flashnorm.validate", "flashnorm.export"]:
        later = {name for name in _reachable(graph, stage)
                 if name.startswith(("flashnorm.passes", "flashnorm.tools", "flashnorm.cli"))}
        assert not later, f"{stage} reaches {sorted(later)}"


def test_leaf_modules_import_only_the_standard_library():
    """Writing a report or a plan must not load onnx, onnx-graphsurgeon or protobuf."""
    leaves = ["flashnorm.report", "flashnorm.files", "flashnorm.contract", "flashnorm.untrusted"]
    script = (
        "import json, sys\n"
        "started = set(sys.modules)\n"  # what the interpreter loads on its own (site hooks)
        f"for name in {leaves!r}: __import__(name)\n"
        "print(json.dumps(sorted(set(sys.modules) - started)))\n"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                       check=True).stdout)
    outside = [name for name in loaded
               if name.split(".")[0] not in sys.stdlib_module_names and name.split(".")[0] != "flashnorm"]
    assert outside == []
    ours = {name for name in loaded if name.split(".")[0] == "flashnorm"}
    assert ours <= {"flashnorm", "flashnorm.errors", *leaves}


def test_the_cuda_ops_abi_needs_only_the_standard_library():
    """flashnorm.cuda_ops.abi (flashnorm.h in ctypes) loads without torch: tests/test_contract.py
    loads it from its file to check it against the header, also where torch is not installed."""
    script = (
        "import importlib.util, json, sys\n"
        "started = set(sys.modules)\n"
        f"spec = importlib.util.spec_from_file_location('abi', {str(PACKAGE_DIR / 'cuda_ops' / 'abi.py')!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(json.dumps(sorted(set(sys.modules) - started)))\n"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                       check=True).stdout)
    outside = [name for name in loaded if name.split(".")[0] not in sys.stdlib_module_names]
    assert set(outside) <= {"flashnorm", "flashnorm.contract", "flashnorm.errors"}

def test_loading_a_model_loads_no_onnx_exporter():
    """Finding and loading a model (`flashnorm.export.sources`) must not load the ONNX exporter,
    onnx, onnx-graphsurgeon or protobuf: the GPU test machine, which lacks onnx-graphsurgeon, loads
    the real SmolLM2-135M through it (tests/kernels/test_long_generation.py)."""
    script = (
        "import json, sys\n"
        "import flashnorm.export.sources\n"
        "print(json.dumps(sorted(name for name in sys.modules\n"
        "                        if name.split('.')[0] in ('onnx', 'onnx_graphsurgeon', 'google')\n"
        "                        or name == 'flashnorm.export.onnx_export')))\n"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                       check=True).stdout)
    assert loaded == []


# --- docs/ARCHITECTURE.md's module table, enforced --------------------------------------------


def module_table(text: str) -> list[tuple[list[str], list[str]]]:
    """The `| module | one job | imports |` table: per row, the backticked names of its module cell
    and of its imports cell (a job may contain `|`: the first and last cells are the ones read)."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines)
                   if re.fullmatch(r"\|\s*module\s*\|\s*one job\s*\|\s*imports\s*\|\s*", line)), None)
    assert header is not None, "docs/ARCHITECTURE.md has no | module | one job | imports | table"
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = line.strip().strip("|").split("|")
        rows.append((re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([^`]+)`", cells[-1])))
    return rows


def _spelled(name: str, modules: dict[str, Path]) -> tuple[str, bool]:
    """A table name as (module, whole package?): `x/` → (flashnorm.x, True), `x.py` or `x` or
    `x.y` → (flashnorm.x[.y], False); a name that is no module, `x/` that is no package and
    `x.py` that is one fail."""
    package = name.endswith("/")
    module = "flashnorm." + name.rstrip("/").removesuffix(".py")
    assert module in modules, f"docs/ARCHITECTURE.md's module table names `{name}`, which is no flashnorm module"
    is_package = modules[module].name == "__init__.py"
    assert is_package or not package, f"`{name}` is no package"
    assert not (is_package and name.endswith(".py")), f"`{name}` is a package, written `{name.removesuffix('.py')}/`"
    return module, package


def _covers(spelled: tuple[str, bool], module: str) -> bool:
    name, package = spelled
    return module == name or (package and module.startswith(name + "."))


def allowed_imports(text: str, modules: dict[str, Path]) -> dict[str, tuple[list, list | None]]:
    """Per flashnorm module: (its row's module names, the names it may import; None for `*`)."""
    owners: dict[str, tuple[list, list | None]] = {}
    for module_names, import_names in module_table(text):
        own = [_spelled(name, modules) for name in module_names]
        allowed = None if "*" in import_names else [_spelled(name, modules) for name in import_names]
        for module in modules:
            if any(_covers(spelled, module) for spelled in own):
                assert module not in owners, f"{module} has two rows in docs/ARCHITECTURE.md's module table"
                owners[module] = (own, allowed)
    return owners


def import_violations(graph: dict[str, set[str]], owners: dict[str, tuple[list, list | None]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        own, allowed = owners.get(module, ([], []))  # the package root has no row: it imports nothing
        for target in sorted(targets - ALWAYS_ALLOWED):
            if allowed is None or any(_covers(spelled, target) for spelled in own + allowed):
                continue
            found.append(f"{module} imports {target}")
    return found


def test_every_module_has_one_row_in_the_architecture_table():
    modules = _modules()
    owners = allowed_imports(ARCHITECTURE.read_text(), modules)
    assert sorted(set(modules) - set(owners) - {"flashnorm"}) == []


def test_every_module_imports_only_what_its_row_allows():
    """docs/ARCHITECTURE.md's imports column, as its paragraph above the table defines it."""
    owners = allowed_imports(ARCHITECTURE.read_text(), _modules())
    assert import_violations(import_graph(), owners) == []


def test_the_table_reader_tells_a_package_from_its_api():
    """`engine` allows the package's __init__ only, `engine/` everything in it; own row, errors
    and the package root always; a name that is no module fails the table."""
    modules = {name: Path(f"{name.replace('.', '/')}{'/__init__.py' if name.count('.') < 2 else '.py'}")
               for name in ["flashnorm", "flashnorm.errors", "flashnorm.engine", "flashnorm.engine.shapes",
                            "flashnorm.serve", "flashnorm.serve.tensors", "flashnorm.tools", "flashnorm.tools.build"]}
    modules["flashnorm.errors"] = Path("flashnorm/errors.py")
    table = ("| module | one job | imports |\n|---|---|---|\n| `engine/` | a | x |\n"
             "| `serve/` | b | `engine` (read_interface) |\n| `errors` | e | x |\n| `tools/` | c | the library: `*` |\n")
    owners = allowed_imports(table, modules)
    graph = {"flashnorm.serve.tensors": {"flashnorm.engine", "flashnorm.errors", "flashnorm.serve"},
             "flashnorm.tools.build": {"flashnorm.engine.shapes", "flashnorm.serve.tensors"}}
    assert import_violations(graph, owners) == []
    graph["flashnorm.serve.tensors"].add("flashnorm.engine.shapes")
    assert import_violations(graph, owners) == ["flashnorm.serve.tensors imports flashnorm.engine.shapes"]
    with pytest.raises(AssertionError, match="`engine.loader`, which is no flashnorm module"):
        allowed_imports(table.replace("`engine` (", "`engine.loader` ("), modules)
