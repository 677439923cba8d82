"""Every repository path that a comment or docstring names exists: a pointer to a file that was
renamed or removed misleads the next reader. Scanned: the comments and docstrings of specdec/,
triton_kernels/, benchmarks/ and tests/ (Python), the comments of csrc/ (C++ and CUDA) and of the
shell scripts. A path is a word that starts at one of the repository's top folders and runs
through slashes (specdec/ops/pooling.py, csrc/cuda/, docs/design.md); a glob or template
(bench_*.py, <method>.png, {a,b}.py) is not one. In csrc/, a path is also looked up where the
compiler finds its includes, csrc/include/."""
import ast
import io
import os
import re
import tokenize

from helpers import ROOT

TOPS = ("specdec", "triton_kernels", "csrc", "benchmarks", "tests", "docs", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:%s)/(?:[\w.-]+/)*[\w.-]*)" % "|".join(re.escape(t) for t in TOPS))
NOT_A_PATH_AFTER = set("*<{")
SCANNED = ("specdec", "triton_kernels", "csrc", "benchmarks", "tests")


def paths_in(text: str):
    """The repository paths named in `text` (templates and globs left out)."""
    for m in PATH.finditer(text):
        end = m.end()
        if end < len(text) and text[end] in NOT_A_PATH_AFTER:
            continue
        yield m.group(1).rstrip(".,;:")


def python_prose(source: str):
    """The comments and docstrings of a Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc


def c_prose(source: str):
    """The // and /* */ comments of a C++ or CUDA source."""
    yield from re.findall(r"//[^\n]*|/\*.*?\*/", source, flags=re.S)


def shell_prose(source: str):
    yield from (line.split("#", 1)[1] for line in source.splitlines() if "#" in line)


PROSE = {".py": python_prose, ".cpp": c_prose, ".h": c_prose, ".cu": c_prose, ".cuh": c_prose,
         ".sh": shell_prose}


def prose_of_files():
    """(file, comment or docstring) over the scanned folders."""
    for top in SCANNED:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "results")]
            for f in files:
                prose = PROSE.get(os.path.splitext(f)[1])
                if prose is None:
                    continue
                full = os.path.join(folder, f)
                with open(full, encoding="utf-8") as fh:
                    for text in prose(fh.read()):
                        yield os.path.relpath(full, ROOT), text


def named_paths():
    """{(file, path named in it)} over the scanned folders."""
    return {(where, p) for where, text in prose_of_files() for p in paths_in(text)}


def exists(path: str, named_in: str) -> bool:
    if os.path.exists(os.path.join(ROOT, path)):
        return True
    return named_in.startswith("csrc") and os.path.exists(os.path.join(ROOT, "csrc", "include", path))


def test_the_finder_takes_paths_and_leaves_globs_and_dotted_names():
    text = ("see specdec/ops/pooling.py, csrc/cuda/ (all) and docs/design.md; not benchmarks/bench_*.py, "
            "out/x.png, specdec.ops.pooling, results/<kind>.json or triton_kernels/{a,b}.py")
    assert list(paths_in(text)) == ["specdec/ops/pooling.py", "csrc/cuda/", "docs/design.md"]
    assert list(paths_in("moved: specdec/_library.py.")) == ["specdec/_library.py"]
    assert not exists("specdec/_library.py", "csrc/bindings.cpp")
    assert exists("specdec/verify_math.h", "csrc/cuda/sample_residual.cu")


def test_every_path_named_in_a_comment_or_docstring_exists():
    named = named_paths()
    # Not vacuous: the scan sees the pointers that are known to be there.
    assert ("triton_kernels/verification.py", "csrc/include/specdec/verify_math.h") in named
    assert len({p for _, p in named}) > 40
    missing = sorted(f"{where}: {path}" for where, path in named if not exists(path, where))
    assert missing == []


def test_no_comment_or_docstring_names_an_issue_number():
    """An issue number sends the reader to a tracker the repository does not carry: comments say
    what and why in their own words."""
    issue = re.compile(r"\b[Ii]ssues? #?\d+")
    found = sorted(f"{where}: {m.group(0)}" for where, text in prose_of_files() for m in issue.finditer(text))
    assert found == []
