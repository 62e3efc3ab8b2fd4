"""``bytes`` objects written in place before anyone else sees them (CPython).

Data that ends up in a ``bytes`` object (a ranged GET's body, a value read from another process)
is usually read into a ``bytearray`` first, which the allocator zero-fills, and then copied into
the ``bytes``: two passes over every byte more than the read itself. ``fresh(n)`` makes a new,
uninitialised ``bytes`` of ``n`` bytes and a writable view of its storage, for the one read that
fills it. The caller must fill it completely, and must neither hash it, compare it, nor hand it
to anyone before it has (a ``bytes`` is immutable from then on); a failed read drops both.

Thread-safe (each call makes its own object).
"""
from __future__ import annotations

import ctypes

__all__ = ["fresh", "new", "data_address"]

_new = ctypes.pythonapi.PyBytes_FromStringAndSize  # with NULL: a new object of that size, to fill
_new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_new.restype = ctypes.py_object
_DATA = bytes.__basicsize__ - 1  # where a bytes object's data lies from its address


def data_address(b: bytes) -> int:
    """The address of ``b``'s first byte."""
    return id(b) + _DATA


def new(n: int) -> bytes:
    """A new ``bytes`` of ``n`` bytes, unfilled, for a caller that fills it at ``data_address``
    (see the module docstring); never a shared object where ``n`` > 0."""
    return _new(None, n) if n else b""


def fresh(n: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` of ``n`` bytes, unfilled, and a writable view of them (see the module
    docstring), valid while the caller holds the ``bytes``. Never a shared object: CPython shares
    only the empty ``bytes`` (nothing to write) and, made from data, one-byte ones."""
    if n == 0:
        return b"", memoryview(bytearray(0))
    b = new(n)
    return b, memoryview((ctypes.c_char * n).from_address(id(b) + _DATA)).cast("B")
