"""Every Python code block of the README and docs/*.md runs, each in a new process (they change
process-wide routes), on the GPU; without one they skip like the other GPU tests. A block whose
fence reads ```python fragment is a piece of a larger program (two processes' halves) and is only
checked to parse."""

import ast
import pathlib
import re

import pytest

from conftest import library, run_in_new_process

ROOT = pathlib.Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            yield pytest.param(match.group(1).split(), match.group(2), id=f"{page.name}:{line}")


@pytest.mark.parametrize("attributes, code", list(_blocks()))
def test_the_example_parses(attributes, code):
    ast.parse(code)


@pytest.mark.parametrize("attributes, code", list(_blocks()))
def test_the_example_runs(attributes, code, gpu, routing):
    if "fragment" in attributes:
        pytest.skip("a fragment of a larger program")
    for name in ("torch", "cupy", "cuda.core"):
        if re.search(rf"^\s*(import|from) .*\b{re.escape(name)}\b", code, re.MULTILINE):
            library(name)
    run_in_new_process(code)


def test_every_page_with_python_has_its_blocks_found():
    assert any(True for _ in _blocks()), "the README shows Python: its blocks must be found"
