"""The Python examples of the README and the docs site run as written: every ```python block of a
page, in the page's order and in one namespace (a later block may use what an earlier one made), in
a fresh process from an empty folder. A block that cannot run here (downloaded weights, a file a
CLI command writes, pseudocode) says why in an HTML comment on the line before its fence, which
neither GitHub nor the docs site shows:

    <!-- example not run: needs Janus-Pro's weights -->

An example that stops working is a broken quick start for the first user who tries it. The shell
blocks' `specdec ...` commands (and `-m specdec.cli` under python or torchrun) are parsed by the CLI's
own parser: a flag renamed or removed fails here, not on a user's first command."""
import contextlib
import glob
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT  # noqa: E402

SKIP = re.compile(r"<!--\s*example not run:\s*(.+?)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")


def blocks(path: str):
    """[(line, language, source, skip reason or None)] of the page's fenced blocks, the fence's
    line 1-based (the reason: an `example not run` comment on the line before the fence)."""
    with open(path) as f:
        lines = f.read().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        reason = SKIP.match(lines[i - 1]) if i else None
        found.append((i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n", reason.group(1) if reason else None))
        i = end + 1
    return found


def examples(path: str):
    """[(line, source, skip reason or None)] of the page's ```python blocks."""
    return [(line, src, skip) for line, lang, src, skip in blocks(path) if lang in ("python", "py")]


PAGES = sorted(os.path.relpath(p, ROOT) for p in [os.path.join(ROOT, "README.md")]
               + glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
RUNNABLE = [p for p in PAGES if any(skip is None for _, _, skip in examples(os.path.join(ROOT, p)))]

# Each block compiled under its page and line, so a traceback names where the example is.
RUNNER = """
for name, source in BLOCKS:
    exec(compile(source, name, "exec"), NAMESPACE)
"""


@pytest.mark.parametrize("page", RUNNABLE)
def test_the_python_examples_of_a_page_run(page, tmp_path):
    blocks = [(f"{page}:{line}", src) for line, src, skip in examples(os.path.join(ROOT, page)) if skip is None]
    script = f"BLOCKS = {blocks!r}\nNAMESPACE = {{'__name__': '__main__'}}\n" + RUNNER
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"an example of {page} fails:\n{done.stderr[-3000:]}"


def test_every_skipped_example_says_why_and_the_runnable_pages_include_the_quick_starts():
    skipped = [(p, line, why) for p in PAGES for line, _, why in examples(os.path.join(ROOT, p)) if why is not None]
    assert all(len(why) > 10 for _, _, why in skipped), skipped
    assert {"README.md", "docs/quickstart.md", "docs/decoders.md"} <= set(RUNNABLE)


def test_the_extraction_reads_fences_skips_and_languages(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\na = 1\n```\n<!-- example not run: needs weights here -->\n```python\n"
                    "b = 2\n```\n```bash\nls\n```\n```py\nc = a\n```\n")
    assert examples(str(page)) == [(2, "a = 1\n", None), (6, "b = 2\n", "needs weights here"), (12, "c = a\n", None)]


def cli_commands(path: str):
    """The `specdec` command lines of a page's shell blocks, as argument lists after `specdec`
    (backslash continuations joined, comments dropped; a line with an upper-case placeholder
    such as `--class C` is left out)."""
    found = []
    for _, lang, source, _ in blocks(path):
        if lang not in ("bash", "sh", "console"):
            continue
        for line in re.sub(r"\\\n\s*", " ", source).splitlines():
            try:
                words = shlex.split(line.strip().removeprefix("$ "), comments=True)
            except ValueError:      # (a quote spanning lines: a `python -c` program, not a command)
                continue
            if "specdec.cli" in words:
                words = ["specdec"] + words[words.index("specdec.cli") + 1:]
            if words[:1] == ["specdec"] and not any(re.fullmatch(r"[A-Z]+", w) for w in words):
                found.append(words[1:])
    return found


def test_the_specdec_commands_of_the_readme_and_docs_parse():
    from specdec.cli import build_parser

    commands = [(p, c) for p in PAGES for c in cli_commands(os.path.join(ROOT, p))]
    assert len(commands) > 20 and {c[0] for _, c in commands} >= {"generate", "compare", "sample", "serve"}
    for page, words in commands:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                build_parser().parse_args(words)
            except SystemExit:
                raise AssertionError(f"{page}: `specdec {' '.join(words)}` does not parse: {err.getvalue()}")
