"""The ``datacache`` command line's argument types: each parses one value or raises
``argparse.ArgumentTypeError`` with a line saying what was expected (argparse prints it as a
usage error, exit code 2). Pure functions."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from .config import parse_size
from .storage import check_url

__all__ = ["size", "nonneg_int", "pos_int", "fraction", "url"]

_N = TypeVar("_N", int, float)


def size(text: str) -> int:
    """A byte size such as ``64MB`` or ``1.5GiB`` (``datacache.config.parse_size``)."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert value is not None
    return value


def _number(text: str, kind: Callable[[str], _N], what: str, ok: Callable[[_N], bool], rule: str) -> _N:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
    return value


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    return _number(text, int, "an integer", lambda v: v >= 0, ">= 0")


def pos_int(text: str) -> int:
    """An integer >= 1."""
    return _number(text, int, "an integer", lambda v: v >= 1, ">= 1")


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    return _number(text, float, "a number in (0, 1]", lambda v: 0 < v <= 1, "in (0, 1]")


def url(text: str) -> str:
    """A URL or local path datacache can open (``datacache.storage.check_url``: not ``s3:/bucket``)."""
    try:
        return check_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
