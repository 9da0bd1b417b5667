"""Adversarial review (issue 20), host part: defects that show without a GPU."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
CORE_ERRORS = ROOT / "crates" / "cumempool" / "src" / "error.rs"
BINDING_ERRORS = ROOT / "crates" / "cumempool-py" / "src" / "errors.rs"


def _variants(source: str, enum: str) -> list[str]:
    body = source.split(f"pub enum {enum} {{", 1)[1]
    depth, end = 1, 0
    for end, char in enumerate(body):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            break
    body = re.sub(r"#\[error\((?:[^()]|\([^()]*\))*\)\]", "", body[:end])
    return re.findall(r"^    ([A-Z][A-Za-z]+)\b", body, flags=re.MULTILINE)


def test_review_every_core_error_variant_has_its_own_python_class():
    # DEFECT (poor error): errors.rs `core_class` sends StreamCapturing and CaptureRefused (added
    # with capture support) to the catch-all `_ => "CumempoolError"`, so a pool.alloc on a stream
    # torch or CuPy is capturing raises a bare CumempoolError that no `except` can tell apart.
    if not (CORE_ERRORS.is_file() and BINDING_ERRORS.is_file()):
        pytest.skip("needs the Rust sources (a source checkout)")
    variants = _variants(CORE_ERRORS.read_text(), "Error")
    assert "OutOfMemory" in variants and "Driver" in variants
    mapping = BINDING_ERRORS.read_text().split("fn core_class", 1)[1].split("fn alloc_class", 1)[0]
    unmapped = [v for v in variants if not re.search(rf"E::{v}\b", mapping)]
    assert unmapped == [], f"cumempool::Error variants without a Python class: {unmapped}"
