"""The exceptions cumempool raises: one class per error of the Rust crates.

Every class derives from :class:`CumempoolError`. Where a built-in exception says the same
thing, the class derives from it too, so ``except MemoryError`` catches a pool that ran out and
``except ValueError`` catches a route that cannot exist. Messages are the Rust errors' text,
with their causes, and with advice that names a Rust call given as the Python call. Errors the driver reported carry ``code`` (the ``CUresult``), ``name``
(such as ``CUDA_ERROR_INVALID_VALUE``) and ``function`` (the entry point); others carry
``None`` there. :class:`InvalidArgumentError` and :class:`NotShareableError` raised for the
core crate's refusals carry ``reason``, the name of the Rust reason a program can match (such
as ``"ZeroSize"`` or ``"DescriptorNotOpen"``); other errors carry ``None``.
"""

from __future__ import annotations

# What this module held before this run of its code: a reload (`importlib.reload`, IPython's
# autoreload) runs it again in the same namespace, and the classes made before are put back at
# the end, so `cumempool.X`, the plug-ins' subclasses, pickles and `except` clauses keep naming
# the classes errors are raised as. A class an edit added before the reload is new.
_before_reload = dict(globals())


class CumempoolError(Exception):
    """Base of every cumempool error."""

    code: int | None = None
    name: str | None = None
    function: str | None = None
    reason: str | None = None


class LoadError(CumempoolError):
    """The CUDA driver library, or one of its entry points, could not be loaded."""


class ForkedChildError(CumempoolError):
    """CUDA used in a child forked after the parent initialised it (start it with spawn)."""


class DriverError(CumempoolError):
    """A driver call failed; ``code``, ``name`` and ``function`` say which and how."""


class OutOfMemoryError(CumempoolError, MemoryError):
    """The pool, the device or a limit could not supply the memory."""


class LimitExceededError(OutOfMemoryError):
    """A :class:`cumempool.Limit` refused an allocation that would pass its limit."""


class DriverTooOldError(CumempoolError):
    """The running driver is older than the feature needs (a CUDA 13.2 attribute on 13.0, say)."""


class InvalidDeviceError(CumempoolError, ValueError):
    """A device ordinal or locality domain this machine does not have."""


class InvalidRouteError(CumempoolError, ValueError):
    """A location or (location, allocation type) pair that cannot name a pool."""


class RouteRefusedError(CumempoolError):
    """The driver refused a route (it has no pool there, or not on this machine)."""


class ForeignCurrentPoolError(CumempoolError):
    """The route's current pool was made current by other code; use current_pool_handle."""


class PoolRouteMismatchError(CumempoolError, ValueError):
    """A pool given for a route it cannot serve."""


class PoolInUseError(CumempoolError):
    """A pool still held by buffers, routes or handles cannot be destroyed yet."""


class UnsafeToDestroyError(CumempoolError):
    """A pool the driver cannot destroy safely; it stays alive for the rest of the process."""


class PoolWasCurrentError(CumempoolError):
    """A pool that was a route's current pool cannot be given away (its raw handle taken):
    another thread may still allocate from it through the route. It was retired instead."""


class PoolCreationError(CumempoolError):
    """The driver refused to create a pool, with the likeliest reason."""


class NotHostAccessibleError(CumempoolError):
    """Host code asked for memory the host cannot touch."""


class DoesNotFitError(CumempoolError, ValueError):
    """More bytes than a buffer holds."""


class OverlappingCopyError(CumempoolError, ValueError):
    """A copy whose source and destination overlap (a buffer copied into itself, say): the
    driver's copies are undefined there. Copy through a separate buffer."""


class AccessNotGrantableError(CumempoolError):
    """An access a device cannot be given to a pool."""


class StreamNotBorrowableError(CumempoolError, ValueError):
    """A stream handle that cannot be borrowed safely (one of a context cumempool cannot find, say)."""


class SharingError(CumempoolError):
    """Base of the errors of sharing pools and allocations between processes."""


class ImportedPoolAllocationError(SharingError):
    """Allocating from a pool imported from another process (only the exporter may)."""


class NotShareableError(SharingError):
    """A pool or allocation that cannot be shared as asked."""


class SharingRefusedError(SharingError):
    """The driver refused to export or import a pool or an allocation."""


class MalformedMessageError(SharingError):
    """Bytes from a peer that are not what the sharing protocol sends."""


class AlreadyImportedError(SharingError):
    """An allocation already imported by a live buffer."""


class SharedLengthMismatchError(SharingError):
    """Export data whose length is more than the driver mapped."""


class CumempoolOSError(CumempoolError, OSError):
    """An operating-system call failed (sockets, descriptors)."""


class UnknownValueError(CumempoolError):
    """The driver returned a value this version of cumempool does not know."""


class InvalidArgumentError(CumempoolError, ValueError):
    """A request that cannot be served as asked."""


class AlignmentError(CumempoolError, ValueError):
    """An alignment a resource cannot give."""


class KindMismatchError(CumempoolError, ValueError):
    """A pool whose memory is not the kind a resource promises."""


class LanesUnreachableError(CumempoolError):
    """A cache could not take back the blocks threads keep in their lanes."""


class StreamCapturingError(CumempoolError):
    """An operation refused because its stream is capturing into a CUDA graph (torch.cuda.graph,
    CuPy or cuda.core graph capture, say); the capture was left intact. Do it before the capture
    begins or after it ends."""


class CaptureRefusedError(CumempoolError):
    """The driver refused a capture or graph operation (a ``CUDA_ERROR_STREAM_CAPTURE_*``
    answer); ``code`` and ``name`` say which."""


class MappingsHeldError(CumempoolError):
    """An arena that cannot be let go of while mappings of its memory are still held."""


class ClosedError(CumempoolError, ValueError):
    """A pool, buffer, stream or resource used after ``close()``."""


def _keep_classes_made_before(before: dict) -> None:
    for name, value in before.items():
        if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == __name__:
            globals()[name] = value


_keep_classes_made_before(_before_reload)
del _before_reload, _keep_classes_made_before

__all__ = [name for name, value in globals().items() if isinstance(value, type) and issubclass(value, CumempoolError)]
