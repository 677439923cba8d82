"""The house rules that code review alone would let slip, read from the sources with `ast`: no
import cycle in specdec/ or triton_kernels/, models/ never imports decoding/, triton_kernels/
imports nothing of specdec, no Python module over 500 lines anywhere in the repository (400 in
specdec/decoding, whose functions stay within 60 lines), and no public function of specdec.decoding
or specdec.ops with more than 10 parameters."""
import ast
import os

import pytest

from helpers import ROOT  # noqa: E402


def modules():
    """{dotted name: path} of every Python file of the package (triton_kernels/ is installed as
    specdec.triton_kernels)."""
    found = {}
    for top, prefix in (("specdec", "specdec"), ("triton_kernels", "specdec.triton_kernels")):
        base = os.path.join(ROOT, top)
        for folder, _, files in os.walk(base):
            for f in files:
                if f.endswith((".so", ".pyd")):     # a compiled module (specdec._C): a module, not a name
                    found[f"{prefix}.{f.split('.')[0]}"] = None
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, f), base)[:-3].replace(os.sep, ".")
                name = prefix if rel == "__init__" else f"{prefix}.{rel.removesuffix('.__init__')}"
                found[name] = os.path.join(folder, f)
    return found


def imports(name: str, path: str, known) -> set:
    """The modules of the package that `name` imports anywhere in its file (module level or inside
    a function): `import a.b`, `from a import b` (b a module or a name of a), relative imports."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def graph():
    known = modules()
    return {name: imports(name, path, known) if path else set() for name, path in known.items()}


def cycles(edges) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_models_never_import_decoding():
    bad = {(m, d) for m, deps in graph().items() if m.startswith("specdec.models")
           for d in deps if d.startswith("specdec.decoding")}
    assert bad == set()


def test_triton_kernels_import_nothing_of_specdec():
    bad = {(m, d) for m, deps in graph().items() if m.startswith("specdec.triton_kernels")
           for d in deps if not d.startswith("specdec.triton_kernels")}
    assert bad == set()


def python_files():
    """Every Python file of the repository's own folders (package, kernels, benchmarks, tests)."""
    for top in ("specdec", "triton_kernels", "benchmarks", "tests"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def test_no_module_over_500_lines():
    files = list(python_files())
    assert any(f.endswith(os.path.join("triton_kernels", "pooling.py")) for f in files)
    long = {os.path.relpath(f, ROOT): n for f in files if (n := sum(1 for _ in open(f))) > 500}
    assert long == {}


@pytest.mark.parametrize("package", ["specdec.decoding", "specdec.ops"])
def test_public_functions_take_at_most_10_parameters(package):
    wide = []
    for name, path in modules().items():
        if not path or (name != package and not name.startswith(package + ".")):
            continue
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg)
                if n > 10:
                    wide.append(f"{name}.{node.name} ({n})")
    assert wide == []


#: The modules of the decoding methods (one per method: specdec.decoding.api's table).
METHOD_MODULES = [f"specdec.decoding.{m}" for m in ("ar", "sd", "lantern", "sjd", "zipar", "mulo", "ssd")]


def long_functions(path: str, limit: int) -> list:
    """Every function (methods and nested functions included) of the file longer than `limit`
    lines, as 'name (lines)'."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                found.append(f"{node.name} ({n})")
    return found


def test_no_function_of_a_method_module_over_60_lines():
    """A method is a policy over the engine's round state: its loop reads in one screen."""
    known = modules()
    assert set(METHOD_MODULES) <= set(known)
    long = {name: found for name in METHOD_MODULES if (found := long_functions(known[name], 60))}
    assert long == {}


def test_the_decoding_layer_stays_small():
    """The decoders' package reads module by module: none over 400 lines, no function over 60."""
    known = {name: path for name, path in modules().items()
             if path and (name == "specdec.decoding" or name.startswith("specdec.decoding."))}
    assert "specdec.decoding.scheduler" in known
    big = {name: n for name, path in known.items() if (n := sum(1 for _ in open(path))) > 400}
    long = {name: found for name, path in known.items() if (found := long_functions(path, 60))}
    assert (big, long) == ({}, {})


def test_the_length_check_sees_a_long_method(tmp_path):
    body = "\n".join(f"        x = {i}" for i in range(60))
    path = tmp_path / "m.py"
    path.write_text(f"class A:\n    def f(self):\n{body}\n")
    assert long_functions(str(path), 60) == ["f (61)"]
