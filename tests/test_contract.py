"""flashnorm.contract and the C/C++ side state the FlashNormMatMul contract once each: these
tests read the headers and sources and check that both say the same thing."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from flashnorm import contract
from flashnorm.passes import run_passes
from synthetic import build_norm_model

PLUGINS = Path(__file__).resolve().parents[1] / "plugins" / "flashnorm"


def _read(relative: str) -> str:
    return (PLUGINS / relative).read_text()


def _string_constant(source: str, name: str) -> str:
    match = re.search(rf'constexpr char const\* {name} = "([^"]*)";', source)
    assert match, f"{name} not found"
    return match.group(1)


def test_plugin_identity_matches():
    header = _read("trt/flashnorm_matmul_plugin.h")
    assert _string_constant(header, "kPluginNamePrefix") == contract.OP_TYPE_PREFIX
    assert _string_constant(header, "kPluginVersion") == contract.PLUGIN_VERSION
    assert _string_constant(header, "kPluginNamespace") == contract.PLUGIN_NAMESPACE


def test_one_plugin_name_per_output_count():
    names = re.search(r"kNames\[FLASHNORM_MAX_OUTPUTS\] = \{([^}]*)\}", _read("trt/flashnorm_matmul_plugin.cpp"))
    assert names, "the plugin's name table was not found"
    assert re.findall(r'"([^"]+)"', names.group(1)) == [contract.op_type(n) for n in range(1, contract.MAX_OUTPUTS + 1)]


def test_limits_strategy_and_statistics_match_the_c_abi():
    abi = _read("include/flashnorm/flashnorm.h")
    assert int(re.search(r"#define FLASHNORM_MAX_OUTPUTS (\d+)", abi).group(1)) == contract.MAX_OUTPUTS
    assert int(re.search(r"FLASHNORM_STRATEGY_AUTO = (\d+)", abi).group(1)) == contract.STRATEGY_AUTO
    assert int(re.search(r"FLASHNORM_STATISTIC_RMS = (\d+)", abi).group(1)) == contract.STATISTIC_RMS
    assert int(re.search(r"FLASHNORM_STATISTIC_VARIANCE = (\d+)", abi).group(1)) == contract.STATISTIC_VARIANCE
    # The bias the C ABI takes (float const*) is the node's third input's type.
    assert re.search(r"void const\* w, float const\* bias,", abi) and contract.BIAS_DTYPE == "float32"


@pytest.mark.parametrize("op, count", [("FlashNormMatMul1", 1), ("FlashNormMatMul8", 8), ("FlashNormMatMul9", None),
                                       ("FlashNormMatMul", None), ("FlashNormMatMul02", None), ("MatMul", None)])
def test_output_count(op, count):
    assert contract.output_count(op) == count


def test_legacy_encoding_is_named():
    assert contract.legacy_encoding([("FlashNormMatMul3", "flashnorm")], [("FlashNormMatMul3", "flashnorm", "")]) is None
    reason = contract.legacy_encoding([("FlashNormMatMul", "flashnorm")] * 2, [("FlashNormMatMul", "flashnorm", "outputs3")])
    assert "2 'FlashNormMatMul' nodes" in reason and "flashnorm optimize" in reason


def test_plugin_fields_match_the_creator():
    declared = dict(re.findall(r'emplace_back\(\s*"(\w+)"\s*,\s*[^,]+,\s*nvinfer1::PluginFieldType::(k\w+)',
                               _read("trt/flashnorm_matmul_creator.cpp")))
    assert declared == contract.PLUGIN_FIELDS


def test_plans_hold_the_node_fields_and_the_recorded_ones():
    """What the plugin serializes into a plan (getFieldsToSerialize) is every node field and the
    fields a build records, each read back by the creator's createPlugin; none of the latter is a
    node field (the creator declares and the defer pass writes only PLUGIN_FIELDS)."""
    serialized = dict(re.findall(r'\{\s*"(\w+)"\s*,\s*[^,{}]+,\s*nvinfer1::PluginFieldType::(k\w+)',
                                 _read("trt/flashnorm_matmul_plugin.cpp")))
    assert serialized == {**contract.PLUGIN_FIELDS, **contract.PLAN_ONLY_FIELDS}
    assert not set(contract.PLAN_ONLY_FIELDS) & set(contract.PLUGIN_FIELDS)
    read = set(re.findall(r'fieldName == "(\w+)"', _read("trt/flashnorm_matmul_creator.cpp")))
    assert read == set(serialized)


def test_deferred_nodes_and_reference_functions_follow_the_contract():
    graph, _ = run_passes(gs.import_onnx(build_norm_model("legacy_torch", np.random.default_rng(0))), ["fold", "defer"])
    model = gs.export_onnx(graph)
    nodes = [n for n in model.graph.node if contract.is_deferred_node(n.op_type, n.domain)]
    assert nodes
    for node in nodes:
        attributes = {a.name: a for a in node.attribute}
        assert attributes["plugin_version"].s.decode() == contract.PLUGIN_VERSION
        assert attributes["plugin_namespace"].s.decode() == contract.PLUGIN_NAMESPACE
        assert set(attributes) - {"plugin_version", "plugin_namespace"} == set(contract.PLUGIN_FIELDS)
        assert attributes["eps"].type == onnx.AttributeProto.FLOAT
        assert attributes["splits"].type == onnx.AttributeProto.INTS
        assert attributes["strategy"].i == contract.STRATEGY_AUTO
        assert attributes["statistic"].type == onnx.AttributeProto.INT
        assert attributes["statistic"].i == contract.STATISTIC_RMS  # an RMSNorm model
        assert node.op_type == contract.op_type(len(node.output))
        # x, W and the bias (zeros where no projection has one), one signature per name.
        assert len(node.input) == 3
        bias = next(t for t in model.graph.initializer if t.name == node.input[2])
        assert onnx.helper.tensor_dtype_to_np_dtype(bias.data_type) == np.dtype(contract.BIAS_DTYPE)
        assert list(bias.dims) == [sum(attributes["splits"].ints)]
    functions = {f.name: f for f in model.functions if f.domain == contract.DOMAIN}
    assert set(functions) == {n.op_type for n in nodes}
    assert model.ir_version >= contract.MIN_IR_VERSION
    assert {o.domain: o.version for o in model.opset_import}[contract.DOMAIN] == contract.DOMAIN_VERSION


# --- The C ABI (flashnorm.h) and its ctypes mirror (flashnorm.cuda_ops.abi) ---------------------
#
# The header is compiled with the host compiler, with a one-line stand-in for
# <cuda_runtime_api.h> (the header takes only cudaStream_t from it), into a program that prints
# what the compiler made of every enum constant, of the problem struct's fields and of each
# function's parameters; the names to print are read from the header's text.

HEADER = PLUGINS / "include" / "flashnorm" / "flashnorm.h"
ABI_SOURCE = Path(__file__).resolve().parents[1] / "exporter" / "flashnorm" / "cuda_ops" / "abi.py"
# __builtin_classify_type's classes (GCC and Clang): integer, char, enum, bool | pointer | real.
_TYPE_CLASSES = {1: "integer", 2: "integer", 3: "integer", 4: "integer", 5: "pointer", 8: "float"}


@functools.cache
def _abi():
    """flashnorm.cuda_ops.abi, loaded from its file: it needs only the standard library, while
    importing the cuda_ops package loads torch and registers the ops."""
    spec = importlib.util.spec_from_file_location("flashnorm_cuda_ops_abi_under_test", ABI_SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _without_comments(source: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", source, flags=re.S))


def _type_and_name(declaration: str) -> tuple[str, str, str]:
    """`int64_t split_sizes[8]` → ("int64_t", "split_sizes", "[8]"); `void* const* outputs` →
    ("void* const*", "outputs", "")."""
    match = re.fullmatch(r"\s*(.*?)\s*\b(\w+)\s*(\[[^\]]*\])?\s*", declaration, flags=re.S)
    assert match, f"cannot read the declaration {declaration!r}"
    return match.group(1), match.group(2), match.group(3) or ""


def parse_header(source: str) -> dict:
    """The header's enums (typedef name → constant names, in order), the problem struct's fields
    ((name, type, array suffix), in order) and the exported functions (name → (return type,
    parameter types))."""
    text = _without_comments(source)
    enums = {match.group(3): [part.split("=")[0].strip() for part in match.group(2).split(",") if part.strip()]
             for match in re.finditer(r"typedef\s+enum\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S)}
    struct = re.search(r"typedef\s+struct\s+flashnorm_problem\s*\{(.*?)\}\s*flashnorm_problem\s*;", text, flags=re.S)
    assert struct, "typedef struct flashnorm_problem { ... } flashnorm_problem; not found"
    fields = [_type_and_name(part) for part in struct.group(1).split(";") if part.strip()]
    functions = {}
    for match in re.finditer(r"FLASHNORM_API\s+([^;{]*?)\b(flashnorm_\w+)\s*\(([^)]*)\)\s*;", text, flags=re.S):
        parameters = match.group(3).strip()
        types = [] if parameters in ("", "void") else [_type_and_name(p)[0] for p in parameters.split(",")]
        functions[match.group(2)] = (" ".join(match.group(1).split()), types)
    return {"enums": enums, "fields": fields, "functions": functions}


def _probe_program(declared: dict) -> str:
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "flashnorm/flashnorm.h"',
             "static flashnorm_problem p;", "int main(void) {"]
    for constants in declared["enums"].values():
        lines += [f'  printf("enum {name} %lld\\n", (long long){name});' for name in constants]
    lines.append('  printf("struct %zu\\n", sizeof(flashnorm_problem));')
    for _, name, array in declared["fields"]:
        element = f"p.{name}[0]" if array else f"p.{name}"
        lines.append(f'  printf("field {name} %zu %zu %zu %d\\n", offsetof(flashnorm_problem, {name}), '
                     f"sizeof(p.{name}), sizeof(p.{name}) / sizeof({element}), __builtin_classify_type({element}));")
    for function, (returned, parameters) in declared["functions"].items():
        if returned != "void":
            lines.append(f'  printf("return {function} %zu %d\\n", sizeof({returned}), '
                         f"__builtin_classify_type(({returned})0));")
        for index, parameter in enumerate(parameters):
            lines.append(f'  printf("parameter {function} {index} %zu %d\\n", sizeof({parameter}), '
                         f"__builtin_classify_type(({parameter})0));")
    return "\n".join(lines + ["  return 0;", "}", ""])


@pytest.fixture(scope="module")
def compiled_abi(tmp_path_factory) -> dict:
    """What the host compiler says of the header: enum values, the struct's size and fields
    (offset, size, elements, type class), each function's return and parameter sizes and classes."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no host C compiler (cc, gcc or clang): the C ABI cannot be compiled and compared")
    declared = parse_header(HEADER.read_text())
    folder = tmp_path_factory.mktemp("abi")
    (folder / "cuda_runtime_api.h").write_text("typedef struct CUstream_st* cudaStream_t;\n")
    (folder / "probe.c").write_text(_probe_program(declared))
    built = subprocess.run([compiler, "-std=c11", "-I", str(folder), "-I", str(HEADER.parents[1]),
                            str(folder / "probe.c"), "-o", str(folder / "probe")], capture_output=True, text=True)
    assert built.returncode == 0, f"the probe of flashnorm.h ({folder / 'probe.c'}) did not compile:\n{built.stderr}"
    output = subprocess.run([str(folder / "probe")], check=True, capture_output=True, text=True).stdout
    compiled = {"declared": declared, "enum": {}, "field": [], "return": {}, "parameter": {}}
    for line in output.splitlines():
        kind, *rest = line.split()
        if kind == "enum":
            compiled["enum"][rest[0]] = int(rest[1])
        elif kind == "struct":
            compiled["struct"] = int(rest[0])
        elif kind == "field":
            name, offset, size, count, klass = rest
            compiled["field"].append((name, int(offset), int(size), int(count), _TYPE_CLASSES.get(int(klass), klass)))
        elif kind == "return":
            compiled["return"][rest[0]] = (int(rest[1]), _TYPE_CLASSES.get(int(rest[2]), rest[2]))
        else:
            compiled["parameter"].setdefault(rest[0], []).append((int(rest[2]), _TYPE_CLASSES.get(int(rest[3]), rest[3])))
    return compiled


def _ctypes_class(ctype) -> str:
    if isinstance(ctype, type) and (issubclass(ctype, ctypes._Pointer) or ctype in (ctypes.c_void_p, ctypes.c_char_p,
                                                                                    ctypes.c_wchar_p)):
        return "pointer"
    return "float" if ctype in (ctypes.c_float, ctypes.c_double) else "integer"


def test_header_parser_reads_every_declaration():
    """The parser the ABI checks stand on: every enum, every field, every exported function."""
    declared = parse_header(HEADER.read_text())
    assert set(declared["enums"]) == {"flashnorm_dtype", "flashnorm_strategy", "flashnorm_statistic", "flashnorm_status"}
    assert [name for _, name, _ in declared["fields"]][-1] == "statistic"  # appended: older callers zero it
    assert [name for _, name, _ in declared["fields"]][:3] == ["m", "k", "n"]
    assert declared["functions"]["flashnorm_matmul"][1][:2] == ["flashnorm_context*", "flashnorm_problem const*"]
    assert declared["functions"]["flashnorm_testing_join_dropped"] == ("int", [])
    assert len(declared["functions"]) == len(re.findall(r"^FLASHNORM_API ", HEADER.read_text(), flags=re.M))


def test_every_c_enum_is_mirrored_name_for_name_and_value_for_value(compiled_abi):
    abi = _abi()
    declared = compiled_abi["declared"]["enums"]
    assert set(abi.C_ENUMS) == set(declared), "a C enum without a mirror in flashnorm.cuda_ops.abi, or the reverse"
    for typedef, (mirror, prefix) in abi.C_ENUMS.items():
        in_c = {name: compiled_abi["enum"][name] for name in declared[typedef]}
        in_python = {prefix + member.name: member.value for member in mirror}
        assert in_python == in_c, typedef


def test_problem_struct_is_mirrored_field_for_field(compiled_abi):
    """Names and order, then each field's offset, size, element count and type class (integer or
    float), then the whole struct's size (which also covers padding at the end)."""
    problem = _abi().Problem
    mirrored = []
    for name, ctype in problem._fields_:
        element, count = (ctype._type_, ctype._length_) if issubclass(ctype, ctypes.Array) else (ctype, 1)
        mirrored.append((name, getattr(problem, name).offset, ctypes.sizeof(ctype), count, _ctypes_class(element)))
    assert [field[0] for field in mirrored] == [field[0] for field in compiled_abi["field"]]
    assert mirrored == compiled_abi["field"]
    assert ctypes.sizeof(problem) == compiled_abi["struct"]


def test_every_prototype_the_binding_sets_matches_the_header(compiled_abi):
    """Each function the binding calls is declared FLASHNORM_API in the header, with as many
    parameters as its argtypes, each of the same size and class (integer, float, pointer), and a
    return of the same size and class (void: restype None)."""
    prototypes = _abi().PROTOTYPES
    declared = compiled_abi["declared"]["functions"]
    assert sorted(set(prototypes) - set(declared)) == [], "called by the binding but not declared in flashnorm.h"
    for name, (restype, argtypes) in prototypes.items():
        returned, parameters = declared[name]
        assert len(argtypes) == len(parameters), f"{name}: {len(argtypes)} argtypes for {parameters}"
        in_c = compiled_abi["parameter"].get(name, [])
        assert [(ctypes.sizeof(a), _ctypes_class(a)) for a in argtypes] == in_c, f"{name}: parameters {parameters}"
        if returned == "void":
            assert restype is None, f"{name} returns void"
        else:
            assert restype is not None, f"{name} returns {returned}"
            assert (ctypes.sizeof(restype), _ctypes_class(restype)) == compiled_abi["return"][name], f"{name}: {returned}"


def _exported_symbols(library: Path) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found: the built library's dynamic symbols cannot be listed")
    listing = subprocess.run([nm, "-D", "--defined-only", str(library)], check=True, capture_output=True, text=True)
    return {fields[-1] for fields in (line.split() for line in listing.stdout.splitlines())
            if len(fields) >= 2 and fields[-2] in ("T", "t", "W", "i")}


def test_built_library_exports_every_declared_function():
    """Where a libflashnorm.so is found (FLASHNORM_LIBRARY or the default build path, as the
    binding looks): it exports every FLASHNORM_API function of the header, hence every one the
    binding calls."""
    library = _abi().library_path()
    if not library.is_file():
        pytest.skip(f"no built kernel library at {library} (build it, or set FLASHNORM_LIBRARY): "
                    "its exported symbols are not checked")
    exported = _exported_symbols(library)
    declared = parse_header(HEADER.read_text())["functions"]
    assert sorted(set(declared) - exported) == [], f"declared in flashnorm.h but not exported by {library}"
    assert sorted(set(_abi().PROTOTYPES) - exported) == []
