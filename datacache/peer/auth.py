"""Request signatures: every peer request proves it knows the job's secret.

A request carries ``X-Datacache-Auth: <unix time>.<hex HMAC-SHA256(token, method \\n path \\n time)>``
(``path``: the URL path and query as sent). The server accepts it when the signature matches and
the time is within ``validity`` seconds of its own clock: a request without the header gets 401, one
with a wrong, malformed or stale signature 403, and neither gets a byte. Signatures are compared in
constant time (``hmac.compare_digest``). Replaying a captured request within the validity window
gets the same read-only answer again; the token itself never crosses the wire.

The token is never logged, put in an error or shown in a repr: ``Signer`` keeps it private.
Pure functions and an immutable class; thread-safe.
"""
from __future__ import annotations

import hashlib
import hmac
import time

__all__ = ["HEADER", "Signer", "check"]

HEADER = "X-Datacache-Auth"
_MAX_HEADER = 128  # a valid header is ~80 characters


class Signer:
    """Signs requests with a token (kept out of reprs)."""

    __slots__ = ("_key",)

    def __init__(self, token: str) -> None:
        self._key = token.encode()

    def __repr__(self) -> str:
        return "Signer(<token hidden>)"

    def sign(self, method: str, path: str, now: float | None = None) -> str:
        """The header value for ``method`` on ``path`` (path and query) at ``now`` (default: now)."""
        ts = int(time.time() if now is None else now)
        return f"{ts}.{self._mac(method, path, ts)}"

    def _mac(self, method: str, path: str, ts: int) -> str:
        return hmac.new(self._key, f"{method.upper()}\n{path}\n{ts}".encode(), hashlib.sha256).hexdigest()

    def verify(self, method: str, path: str, header: str | None, validity: float, now: float | None = None) -> int:
        """200 when ``header`` is a valid signature of ``method`` on ``path`` no older (or newer) than
        ``validity`` seconds; 401 when it is missing; 403 otherwise."""
        if not header:
            return 401
        if len(header) > _MAX_HEADER:
            return 403
        ts_text, sep, mac = header.partition(".")
        if not sep or not ts_text.isdigit():
            return 403
        ts = int(ts_text)
        if abs((time.time() if now is None else now) - ts) > validity:
            return 403
        return 200 if hmac.compare_digest(mac, self._mac(method, path, ts)) else 403


def check(signers: tuple[Signer, ...], method: str, path: str, header: str | None, validity: float) -> int:
    """``Signer.verify`` against each accepted token: 200 if one accepts, else 401 (no header) or 403."""
    codes = [s.verify(method, path, header, validity) for s in signers]
    return 200 if 200 in codes else (401 if not header else 403)
