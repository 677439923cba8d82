"""The README stays a product page that points only inside the repository (the docs site itself
is checked by `make docs`: mkdocs build --strict fails on a broken link or API reference)."""
import os
import re

from helpers import ROOT  # noqa: E402


def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_links_and_images_resolve_inside_the_repository():
    targets = re.findall(r"\]\(([^)\s]+)\)", _readme())
    assert targets, "the README links into the docs"
    for target in targets:
        if re.match(r"[a-z]+://", target):
            continue
        path = os.path.normpath(os.path.join(ROOT, target.split("#")[0]))
        assert path.startswith(ROOT + os.sep), f"README points outside the repository: {target}"
        assert os.path.exists(path), f"README links to a missing file: {target}"


def test_readme_is_a_product_page_not_a_lab_notebook():
    text = _readme()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text.split("\n## ")[0] and "make test" in text.split("\n## ")[0]
