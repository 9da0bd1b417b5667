"""What `help()` shows a Python user: every public class, method, property and function of the
package has a docstring in Python's words, not the Rust code's. Host test: nothing here needs a
driver."""

import enum
import inspect
import re

import cumempool as cm
from cumempool import _native

# What a Rust path, type or receiver looks like in a docstring.
RUST_ISMS = re.compile(
    r"::|&self|&mut\b|\bSelf\b|Option<|Result<|PyResult|Vec<|Arc<|Py<|Some\(|cumempool_alloc"
    r"|\b(?:usize|isize|u8|u16|u32|u64|i8|i16|i32|i64|f32|f64)\b"
)


def _documented():
    """`(name, docstring)` of every public object of the package and of the native module
    (its private helpers for the plug-ins too), and of every method and property a class
    defines (`None` for a public one without a docstring)."""
    seen = set()
    names = [(f"cumempool.{n}", getattr(cm, n)) for n in cm.__all__]
    names += [(f"cumempool._native.{n}", v) for n, v in vars(_native).items() if not n.startswith("__")]
    for qualified, value in names:
        if id(value) in seen or not (inspect.isclass(value) or callable(value)):
            continue
        seen.add(id(value))
        yield qualified, value.__doc__
        # Enum classes come from the `enum` module: their members' docs are Python's own.
        if not inspect.isclass(value) or issubclass(value, enum.Enum):
            continue
        for member, attribute in vars(value).items():
            if not (
                inspect.isroutine(attribute)
                or inspect.isdatadescriptor(attribute)
                or isinstance(attribute, (staticmethod, classmethod))
            ):
                continue
            doc = getattr(attribute, "__doc__", None)
            if isinstance(doc, str) or not member.startswith("_"):
                yield f"{qualified}.{member}", doc


def test_the_scan_sees_the_native_classes_and_their_members():
    names = dict(_documented())
    for expected in (
        "cumempool.MemPool",
        "cumempool.MemPool.alloc",
        "cumempool.Buffer.to_bytes",
        "cumempool.Stream.handle",
        "cumempool.set_current_pool",
        "cumempool._native.torch_bind",
    ):
        assert names.get(expected), f"{expected} has no docstring"
    assert RUST_ISMS.search("Pool::alloc(&self, size: usize) -> Result<Buffer>")
    assert not RUST_ISMS.search("pool.alloc(1 << 20, stream) returns a Buffer; None: the legacy stream")


def test_every_public_member_has_a_docstring():
    undocumented = [name for name, doc in _documented() if not doc and not name.rsplit(".", 1)[1].startswith("_")]
    assert not undocumented, "help() shows nothing for:\n" + "\n".join(undocumented)


def test_docstrings_use_python_words_not_rust_ones():
    rusty = [
        f"{name}: {RUST_ISMS.search(doc).group()!r} in {doc!r}" for name, doc in _documented() if doc and RUST_ISMS.search(doc)
    ]
    assert not rusty, "docstrings speak Rust:\n" + "\n".join(rusty)
