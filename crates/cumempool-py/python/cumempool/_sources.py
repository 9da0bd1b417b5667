"""What the plug-ins accept as a source: a :class:`MemPool`, served through a
:class:`PoolResource`, or any :class:`Resource` as it is."""

from __future__ import annotations

from ._native import MemPool, PoolResource, Resource


def resource_of(source: MemPool | Resource) -> Resource:
    """The resource a plug-in allocates from for ``source``. Anything else is passed on as it is,
    so the call that uses it raises the error it would raise for that object."""
    return PoolResource(source) if isinstance(source, MemPool) else source
