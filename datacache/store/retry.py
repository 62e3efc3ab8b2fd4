"""Bounded retries and error classification for :mod:`datacache.store.storage` (no fsspec import here).

Backend exceptions are classified by walking their ``__cause__``/``__context__`` chain and looking
at what they carry, never by importing the backend: a botocore-style ``.response`` dict (S3 error
code and HTTP status), well-known class names from aiohttp/botocore/urllib3/fsspec anywhere in the
MRO, then the builtin ``OSError`` family::

    throttled   the store asks for a lower request rate: 429, 503, SlowDown, Throttling,
                RequestLimitExceeded, TooManyRequests... (retried; the node backs off together,
                see :mod:`datacache.store.congestion`; exhausted: ``ThrottledError``)
    transient   other 5xx, 408, RequestTimeout/InternalError, connection refused/reset/aborted/
                closed, timeouts, incomplete reads and payload errors, short reads (retried;
                exhausted: ``TransientStorageError``)
    not_found   404, NoSuchKey, NoSuchBucket, FileNotFoundError
    permission  403, AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, expired tokens,
                PermissionError
    permanent   every other error (other 4xx, local OSErrors, bugs): not retried

Transient errors are retried with exponential backoff and full jitter
(``sleep = uniform(0, min(max_delay, base_delay * 2**(attempt-1)))``); throttling errors are
retried without an own sleep: the node-wide congestion gate spaces the next attempt. Both are
bounded by ``RetryConfig.deadline`` (and ``RetryConfig.attempts`` when it is set), except that a
store that has never answered (``retry_call(unanswered=...)``) and refuses the connection or whose
name does not resolve is given up on after ``RetryConfig.connect_deadline``: ``UnreachableError``
names the endpoint and the cause. Everything here is stateless or guarded by the caller and
therefore thread-safe.
"""
from __future__ import annotations

import logging
import os
import random
import re
import socket
import threading
import time
from typing import Any, Callable, Iterator, Literal, TypeVar

from ..config import RetryConfig
from ..errors import (
    DatacacheError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    ThrottledError,
    TransientStorageError,
    UnreachableError,
)

__all__ = ["Kind", "ShortReadError", "NodeBackoff", "RETRYABLE", "classify", "backoff_delay", "retry_call",
           "translate", "check_name", "secret_values", "answered", "plain_cause", "unreachable_cause"]

log = logging.getLogger("datacache.store.storage")
_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "sas", "signature")

T = TypeVar("T")
Kind = Literal["throttled", "transient", "not_found", "permission", "permanent"]
RETRYABLE = ("throttled", "transient")

NOT_FOUND_HINT = "Check the bucket name and that the prefix holds a datacache dataset (manifest.json)"
PERMISSION_HINT = (
    "Check credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or storage_options key/secret "
    "(and token), and that they may read this bucket"
)
PERMANENT_HINT = "This error is not retried; check the URL, the object name and storage_options"
TRANSIENT_HINT = (
    "The store is unavailable or the network is failing; retry later or raise RetryConfig.deadline"
)
UNREACHABLE_HINT = (
    "Check the endpoint (a typo? AWS_ENDPOINT_URL or storage_options client_kwargs.endpoint_url) and "
    "that the store is running; RetryConfig.connect_deadline sets how long a store that never answered "
    "is waited for"
)
THROTTLED_HINT = (
    "The store is throttling this prefix (it asks for fewer requests per second): set "
    "TransferConfig(max_requests_per_s=...) below its limit, read it from fewer nodes or workers, "
    "spread the dataset over more prefixes, or raise RetryConfig.deadline"
)

_NOT_FOUND_CODES = {"404", "NoSuchKey", "NoSuchBucket", "NotFound", "NoSuchVersion", "NoSuchUpload"}
_PERMISSION_CODES = {
    "403", "AccessDenied", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "InvalidClientTokenId",
    "UnrecognizedClientException", "AuthorizationHeaderMalformed", "MissingSecurityHeader",
}
# Throttling codes: botocore's throttling detector's list (retryhandler / retries.standard).
_THROTTLED_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequests", "TooManyRequestsException", "RequestLimitExceeded",
    "BandwidthLimitExceeded", "LimitExceededException", "ProvisionedThroughputExceededException",
    "TransactionInProgressException", "PriorRequestNotComplete", "EC2ThrottledException",
    "ServiceUnavailable", "503", "429",
}
_TRANSIENT_CODES = {
    "RequestTimeout", "RequestTimeoutException", "InternalError", "OperationAborted",
    "XAmzContentSHA256Mismatch", "IncompleteBody", "500", "502", "504", "408",
}
# Class names (anywhere in an exception's MRO) that mean "the transfer failed, try again".
_TRANSIENT_NAMES = {
    # aiohttp
    "ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "ClientOSError",
    "ServerTimeoutError", "ClientConnectorError", "ConnectionTimeoutError", "SocketTimeoutError",
    "ContentLengthError", "TransferEncodingError",
    # botocore / aiobotocore (HTTPClientError is the base of the connection/timeout errors)
    "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "IncompleteReadError", "ResponseStreamingError", "ResponseParserError",
    # urllib3 / http.client / fsspec
    "ProtocolError", "IncompleteRead", "RemoteDisconnected", "FSTimeoutError",
    "ShortReadError",
}
_CREDENTIAL_NAMES = {"NoCredentialsError", "PartialCredentialsError"}  # botocore: nothing was sent


def _secret_set(obj: Any, under_secret: bool = False) -> set[str]:
    """String values stored under credential-like keys of (nested) storage options."""
    found: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            found |= _secret_set(v, under_secret or any(w in str(k).lower() for w in _SECRET_WORDS))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            found |= _secret_set(v, under_secret)
    elif under_secret and isinstance(obj, str) and len(obj) >= 4:
        found.add(obj)
    return found


def secret_values(storage_options: dict | None) -> list[str]:
    """Credential strings in ``storage_options`` (longest first), to scrub from every message."""
    return sorted(_secret_set(storage_options or {}), key=len, reverse=True)


def check_name(name: str) -> str:
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or any(p in (".", "..") for p in parts):
        raise ValueError(f"object name must be relative with no '.' or '..' parts, got {name!r}")
    return name


class ShortReadError(OSError):
    """A GET returned fewer bytes than the range asked for (transient: the transfer was cut)."""


class NodeBackoff(OSError):
    """The node's congestion gate would hold a request past its operation's deadline (throttled)."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 16:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _response_of(exc: BaseException) -> tuple[str, int] | None:
    resp = getattr(exc, "response", None)
    if not isinstance(resp, dict):
        return None
    code = str((resp.get("Error") or {}).get("Code") or "")
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
    try:
        status = int(status)
    except (TypeError, ValueError):
        status = 0
    if not code and not status:
        return None
    return code, status


def _classify_one(exc: BaseException) -> Kind | None:
    resp = _response_of(exc)
    if resp is not None:
        code, status = resp
        if code in _NOT_FOUND_CODES or status == 404:
            return "not_found"
        if code in _PERMISSION_CODES or status == 403:
            return "permission"
        if code in _THROTTLED_CODES or status in (429, 503):
            return "throttled"
        if code in _TRANSIENT_CODES or status >= 500 or status == 408:
            return "transient"
        return "permanent"
    if isinstance(exc, NodeBackoff):
        return "throttled"
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _CREDENTIAL_NAMES:
        return "permission"
    if names & _TRANSIENT_NAMES:
        return "transient"
    if isinstance(exc, FileNotFoundError):
        return "not_found"
    if isinstance(exc, PermissionError):
        return "permission"
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return "transient"
    return None


def classify(exc: BaseException) -> Kind:
    """Which kind of failure ``exc`` (or an exception it chains to) is."""
    for e in _chain(exc):
        kind = _classify_one(e)
        if kind is not None:
            return kind
    return "permanent"


def error_code(exc: BaseException) -> str | None:
    """The S3 error code carried anywhere in the chain (``"NoSuchBucket"``...), if any."""
    for e in _chain(exc):
        resp = _response_of(e)
        if resp is not None and resp[0]:
            return resp[0]
    return None


def unreachable_cause(exc: BaseException) -> str | None:
    """``"name not resolved"`` or ``"connection refused"`` when the chain of ``exc`` says the
    endpoint could not be reached at all (no store ever answered), else None."""
    for e in _chain(exc):
        if isinstance(e, socket.gaierror) or type(e).__name__ == "ClientConnectorDNSError":
            return "name not resolved"
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
    return None


def _no_credentials(exc: BaseException) -> bool:
    return any(type(e).__name__ in _CREDENTIAL_NAMES for e in _chain(exc))


def answered(exc: BaseException) -> bool:
    """True when a failed call still had an answer from the store (an HTTP status, a missing
    object, a refused access) or failed on our side after one (a datacache error)."""
    if isinstance(exc, DatacacheError) or any(_response_of(e) is not None for e in _chain(exc)):
        return True
    return classify(exc) in ("not_found", "permission") and not _no_credentials(exc)


def plain_cause(exc: BaseException, redact: Callable[[str], str] = lambda s: s) -> str:
    """The cause of a failed request in a few plain words, for warnings: ``"connection refused"``,
    ``"name not resolved"``, ``"HTTP 503 SlowDown"``, ``"connection reset"``, ``"timed out"``, or
    ``describe(exc)``."""
    reason = unreachable_cause(exc)
    if reason is not None:
        return reason
    for e in _chain(exc):
        resp = _response_of(e)
        if resp is not None:
            return f"HTTP {resp[1]} {resp[0]}".strip() if resp[1] else resp[0]
        names = {cls.__name__ for cls in type(e).__mro__}
        if isinstance(e, ConnectionResetError) or names & {"ServerDisconnectedError", "ConnectionClosedError",
                                                           "RemoteDisconnected"}:
            return "connection reset"
        if isinstance(e, TimeoutError) or any("Timeout" in n for n in names):
            return "timed out"
    return describe(exc, redact)


def describe(exc: BaseException, redact: Callable[[str], str] = lambda s: s) -> str:
    """``"ClassName: message"`` of the most informative exception in the chain (the one carrying an
    S3 response if there is one), shortened and passed through ``redact``."""
    best = exc
    for e in _chain(exc):
        if _response_of(e) is not None:
            best = e
            break
    text = re.sub(r" \(reached max retries: \d+\)", "", str(best).strip() or repr(best))
    if len(text) > 300:
        text = text[:297] + "..."
    return redact(f"{type(best).__name__}: {text}")


def translate(exc: BaseException, kind: Kind, *, url: str, op: str,
              attempts: int, elapsed: float, redact: Callable[[str], str]) -> DatacacheError:
    """A datacache error for a backend exception: names the URL, the cause and what to do."""
    cause = describe(exc, redact)
    if kind == "not_found":
        code = error_code(exc)
        what = "the bucket does not exist" if code == "NoSuchBucket" else "no such object or prefix"
        err = NotFoundError(f"{op}: {what} ({cause})", url=url, hint=NOT_FOUND_HINT)
        err.code = code  # the store's own error code, for callers above the store (load_manifest)
        return err
    if kind == "permission":
        what = "no credentials found" if _no_credentials(exc) else "access denied"
        return PermissionDeniedError(f"{op}: {what} ({cause})", url=url, hint=PERMISSION_HINT)
    tries = f"{attempts} attempt{'s' if attempts != 1 else ''} over {elapsed:.1f}s"
    if kind == "throttled":
        return ThrottledError(f"{op}: the store is throttling requests, still throttled after {tries} "
                              f"({cause})", url=url, hint=THROTTLED_HINT)
    if kind == "transient":
        return TransientStorageError(f"{op}: still failing after {tries} ({cause})", url=url,
                                     hint=TRANSIENT_HINT)
    return StorageError(f"{op} failed ({cause})", url=url, hint=PERMANENT_HINT)


_rng = random.Random()
_rng_lock = threading.Lock()


def _after_fork_in_child() -> None:  # another thread of the parent may have held it at the fork
    global _rng_lock
    _rng_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
_WARN_EVERY = 10.0  # seconds: a long outage is reported (once per process per period), never silent
_last_warning = [float("-inf")]


def _warn_long_outage(op: str, url: str, kind: Kind, elapsed: float, deadline: float, endpoint: str,
                      cause: str) -> None:
    now = time.monotonic()
    with _rng_lock:
        if elapsed < _WARN_EVERY or now - _last_warning[0] < _WARN_EVERY:
            return
        _last_warning[0] = now
    what = "throttling requests" if kind == "throttled" else "unavailable"
    log.warning("%s %s: the store at %s has been %s for %.0f s (%s); still retrying, up to "
                "RetryConfig.deadline=%.0f s", op, url, endpoint, what, elapsed, cause, deadline)


def unreachable(op: str, url: str, endpoint: str, reason: str, attempts: int, elapsed: float) -> UnreachableError:
    """The error of a store that never answered: ``reason`` (``unreachable_cause``) and ``endpoint``."""
    tries = f"{attempts} attempt{'s' if attempts != 1 else ''} over {elapsed:.1f}s"
    return UnreachableError(f"{op}: cannot reach the store at {endpoint}: {reason} ({tries}; it has never "
                            f"answered)", url=url, hint=UNREACHABLE_HINT)


def backoff_delay(attempt: int, policy: RetryConfig) -> float:
    """Full-jitter exponential backoff before retry number ``attempt`` (1-based)."""
    cap = min(policy.max_delay, policy.base_delay * (2 ** min(attempt - 1, 30)))
    with _rng_lock:
        return _rng.uniform(0.0, max(0.0, cap))


def retry_call(
    fn: Callable[[], T],
    policy: RetryConfig,
    *,
    url: str,
    op: str,
    redact: Callable[[str], str],
    started: float | None = None,
    on_attempt: Callable[[], None] | None = None,
    on_error: Callable[[str, bool], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    endpoint: str = "its endpoint",
    unanswered: Callable[[], bool] | None = None,
) -> T:
    """Call ``fn`` until it succeeds, a non-transient error occurs, or the policy is exhausted.

    ``started`` (a ``time.monotonic()`` value) lets several calls share one operation's deadline.
    ``on_attempt()`` runs before each attempt, ``on_error(error_class_name, will_retry)`` after each
    failure. ``DatacacheError`` raised by ``fn`` passes through untouched. ``endpoint`` names the
    store in warnings and errors; while ``unanswered()`` is true (the store never answered), a
    refused connection or an unresolved name is retried only until ``policy.connect_deadline``
    (then ``UnreachableError``). Thread-safe.
    """
    t0 = time.monotonic() if started is None else started
    attempts = max(1, policy.attempts) if policy.attempts is not None else None
    attempt, last, throttled = 0, None, None  # the last failure, and the last throttling answer
    while True:
        attempt += 1
        if on_attempt is not None:
            on_attempt()
        try:
            return fn()
        except DatacacheError as exc:
            if on_error is not None:
                on_error(type(exc).__name__, False)
            raise
        except Exception as exc:
            kind = classify(exc)
            elapsed = time.monotonic() - t0
            # Throttled: no sleep of our own, the node's congestion gate (inside fn) spaces attempts.
            delay = backoff_delay(attempt, policy) if kind == "transient" else 0.0
            gated = isinstance(exc, NodeBackoff)  # fn could not even start before the deadline
            # a store that never answered and cannot be reached at all: a typo, or it is not running
            reason = unreachable_cause(exc) if unanswered is not None and unanswered() else None
            limit = policy.deadline if reason is None else min(policy.deadline, policy.connect_deadline)
            retry = (kind in RETRYABLE and not gated and (attempts is None or attempt < attempts)
                     and elapsed + delay < limit and not (cancelled is not None and cancelled()))
            cause = exc  # gated: the store's own answer, if any; the throttling one where there was one
            if gated:
                cause = throttled if throttled is not None else last if last is not None else exc
            err = translate(cause, kind, url=url, op=op, attempts=max(1, attempt - gated), elapsed=elapsed,
                            redact=redact) if reason is None else unreachable(op, url, endpoint, reason, attempt,
                                                                              elapsed)
            if on_error is not None:
                on_error(type(err).__name__, retry)
            if not retry:
                raise err from cause
            _warn_long_outage(op, url, kind, elapsed, policy.deadline, endpoint, plain_cause(exc, redact))
            last = exc
            if kind == "throttled" and not gated:
                throttled = exc
            log.debug("%s %s: attempt %d failed (%s); retrying in %.2fs", op, url, attempt,
                      describe(exc, redact), delay)
        sleep(delay)
