"""The exception classes are bound when the native module loads: a class missing from
``cumempool.errors`` fails the import, and a class gone later never replaces the error raised;
a reload of ``cumempool.errors`` keeps its classes, so every name for a class is one class. No
GPU needed."""

from __future__ import annotations

import textwrap

from conftest import run_in_new_process

# Loads `cumempool/errors.py` without importing the package, drops `{missing}` from it, and
# stands the result in for `cumempool.errors` before the package is imported.
_ERRORS_WITHOUT = """
import importlib.util, os, sys, types
package = importlib.util.find_spec("cumempool")
path = os.path.join(package.submodule_search_locations[0], "errors.py")
errors = types.ModuleType("cumempool.errors")
errors.__file__ = path
exec(compile(open(path).read(), path, "exec"), errors.__dict__)
del errors.{missing}
sys.modules["cumempool.errors"] = errors
"""


def test_a_class_missing_from_errors_py_fails_the_import_and_names_the_class():
    code = _ERRORS_WITHOUT.format(missing="StreamCapturingError") + textwrap.dedent(
        """
        try:
            import cumempool
        except ImportError as error:
            print("refused:", error)
        else:
            print("imported")
        """
    )
    out = run_in_new_process(code)
    assert out.startswith("refused:"), out
    assert "StreamCapturingError" in out and "reinstall cumempool" in out, out


def test_a_class_removed_after_the_import_still_raises_with_its_message():
    code = textwrap.dedent(
        """
        import cumempool as cm
        import cumempool.errors as errors
        InvalidRouteError = errors.InvalidRouteError
        del errors.InvalidRouteError
        try:
            cm.Route(cm.Location.unspecified(), cm.AllocationType.PINNED)
        except InvalidRouteError as error:
            print(type(error).__name__, "|", error)
        except Exception as error:
            print("replaced by", type(error).__name__, "|", error)
        """
    )
    out = run_in_new_process(code)
    assert out.startswith("InvalidRouteError |"), out
    assert "managed memory only" in out, out


def test_after_a_reload_of_errors_py_a_raised_error_is_its_new_class_and_pickles():
    # `importlib.reload` (IPython's autoreload after a reinstall) makes new classes in the same
    # module: `except cumempool.errors.X` and pickle (which checks that the class is the one
    # its module names) must see the error raised as the new class, not the one bound at import.
    code = textwrap.dedent(
        """
        import importlib, pickle
        import cumempool as cm
        import cumempool.errors as errors
        importlib.reload(errors)
        try:
            cm.Route(cm.Location.unspecified(), cm.AllocationType.PINNED)
        except errors.InvalidRouteError as error:
            again = pickle.loads(pickle.dumps(error))
            print("matched", type(again) is errors.InvalidRouteError, str(again) == str(error))
        except Exception as error:
            print("missed", type(error).__name__, type(error) is errors.InvalidRouteError)
        """
    )
    assert run_in_new_process(code).split() == ["matched", "True", "True"]


def test_after_a_reload_every_name_of_a_class_is_the_class_raised():
    # The package, the plug-ins and user code hold the classes by other names
    # (`cumempool.CumempoolError`, `cumempool.cupy`'s out-of-memory class's bases): a reload that
    # made new classes would leave `except cm.CumempoolError` missing what is raised.
    code = textwrap.dedent(
        """
        import importlib
        import cumempool as cm
        import cumempool.errors as errors
        before = cm.InvalidRouteError
        importlib.reload(errors)
        try:
            cm.Route(cm.Location.unspecified(), cm.AllocationType.PINNED)
        except cm.CumempoolError as error:
            print("caught", type(error) is before, errors.InvalidRouteError is cm.InvalidRouteError)
        except Exception as error:
            print("missed", type(error).__name__)
        """
    )
    assert run_in_new_process(code).split() == ["caught", "True", "True"]


def test_a_raised_error_pickles_with_its_class_message_and_fields():
    # A `multiprocessing` worker sends its exception to the parent pickled.
    code = textwrap.dedent(
        """
        import pickle
        import cumempool as cm
        try:
            cm.Route(cm.Location.unspecified(), cm.AllocationType.PINNED)
        except cm.errors.InvalidRouteError as error:
            again = pickle.loads(pickle.dumps(error))
            print(type(again).__name__, str(again) == str(error), vars(again) == vars(error))
        """
    )
    assert run_in_new_process(code).split() == ["InvalidRouteError", "True", "True"]
