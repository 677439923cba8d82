"""The Python examples of the README and the docs site run as written: every ```python block of a
page, in the page's order and in one namespace (a later block may use what an earlier one made), in
a fresh process from an empty folder. A block that cannot run here (downloaded weights, a file a
CLI command writes, pseudocode) says why in an HTML comment on the line before its fence, which
neither GitHub nor the docs site shows:

    <!-- example not run: needs Janus-Pro's weights -->

An example that stops working is a broken quick start for the first user who tries it."""
import glob
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT  # noqa: E402

SKIP = re.compile(r"<!--\s*example not run:\s*(.+?)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")


def examples(path: str):
    """[(line, source, skip reason or None)] of the page's ```python blocks, the fence's line 1-based."""
    lines = open(path).read().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if fence.group(1) in ("python", "py"):
            reason = SKIP.match(lines[i - 1]) if i else None
            found.append((i + 1, "\n".join(lines[i + 1:end]) + "\n", reason.group(1) if reason else None))
        i = end + 1
    return found


PAGES = sorted(os.path.relpath(p, ROOT) for p in [os.path.join(ROOT, "README.md")]
               + glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
RUNNABLE = [p for p in PAGES if any(skip is None for _, _, skip in examples(os.path.join(ROOT, p)))]

# Each block compiled under its page and line, so a traceback names where the example is.
RUNNER = """
import sys
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
