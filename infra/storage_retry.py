"""Retrying storage calls (infra/storage): which errors are transient, exponential backoff with jitter, and a read
stream that reopens an object at its current offset after a transient error. Final errors become one StorageError
whose message is one line naming the URI."""

from __future__ import annotations

import functools
import http.client
import io
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from infra.credentials import CredentialsError

T = TypeVar("T")

DEFAULT_RETRIES = 5
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0


class StorageError(OSError):
    """A storage call failed for good (not found, denied, or still failing after all retries). `transient` is True
    only when the calls kept failing for a reason worth retrying later (the endpoint down, throttling): a stage task
    retries those (tasks/retry.py), never a denial, a missing bucket or a bad URI, which fail the same way again."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient

    def __reduce__(self) -> tuple[Any, ...]:  # from a Ray worker to the task, `transient` included
        return (type(self), (str(self), self.transient))


def is_transient(err: BaseException) -> bool:
    """Endpoint down, timeouts, throttling and 5xx are worth retrying; not-found and denied are not."""
    try:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )
        from botocore.exceptions import ConnectionError as BotoConnectionError

        if isinstance(err, (BotoConnectionError, ReadTimeoutError)):
            return True
        if isinstance(err, ClientError):
            meta = err.response.get("ResponseMetadata", {})
            code = err.response.get("Error", {}).get("Code", "")
            return int(meta.get("HTTPStatusCode") or 0) >= 500 or code in (
                "SlowDown",
                "RequestTimeout",
                "Throttling",
                "InternalError",
                "ServiceUnavailable",
            )
        if isinstance(err, (ResponseStreamingError, IncompleteReadError)):  # connection lost mid-body
            return True
        if isinstance(err, BotoCoreError) and "Connect" in type(err).__name__:
            return True
    except ImportError:  # boto3 not installed: no S3 errors to classify
        pass
    try:
        from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError
        from azure.core.exceptions import IncompleteReadError as AzureIncompleteRead

        if isinstance(err, (ServiceRequestError, ServiceResponseError, AzureIncompleteRead)):
            return True
        if isinstance(err, HttpResponseError):
            return int(err.status_code or 0) >= 500 or err.status_code in (408, 429)
    except ImportError:
        pass
    try:
        from urllib3.exceptions import ProtocolError
        from urllib3.exceptions import ReadTimeoutError as Urllib3ReadTimeout

        if isinstance(err, (ProtocolError, Urllib3ReadTimeout)):
            return True
    except ImportError:
        pass
    return isinstance(err, (ConnectionError, TimeoutError, http.client.IncompleteRead))


def with_retries(fn: Callable[[], T], what: str, retries: int | None = None) -> T:
    """Call fn(), retrying transient errors with exponential backoff and jitter; StorageError when it gives up."""
    retries = DEFAULT_RETRIES if retries is None else retries
    for attempt in range(retries + 1):
        try:
            return fn()
        except (StorageError, CredentialsError):
            raise
        except Exception as err:  # classified below; anything not transient is final
            if not is_transient(err) or attempt == retries:
                reason = one_line(err)
                tail = f" after {attempt + 1} attempts" if attempt else ""
                raise StorageError(f"{what}: {reason}{tail}", transient=is_transient(err)) from err
            time.sleep(backoff_s(attempt) * (0.8 + 0.4 * random.random()))
    raise AssertionError("unreachable")


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def backoff_s(attempt: int) -> float:
    """Seconds to wait before retry number attempt + 1: doubling from BACKOFF_BASE_S, capped at BACKOFF_MAX_S."""
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt)


class ResumableReader(io.RawIOBase):
    """A read(n) stream over an object that reopens at the current offset after a transient error."""

    def __init__(
        self, uri: str, open_at: Callable[[int], tuple[Callable[[int], bytes], Callable[[], None]]], retries: int | None
    ) -> None:
        self.uri, self._open_at = uri, open_at
        self._retries = DEFAULT_RETRIES if retries is None else retries
        self._read, self._close = with_retries(lambda: open_at(0), uri, retries)
        self._received, self._pending = 0, b""

    def readable(self) -> bool:
        return True

    def _fetch(self, n: int) -> bytes:
        for attempt in range(self._retries + 1):
            try:
                data = self._read(n)
                self._received += len(data)
                return data
            except Exception as err:
                if not is_transient(err) or attempt == self._retries:
                    raise StorageError(
                        f"{self.uri}: {one_line(err)} at byte {self._received}", transient=is_transient(err)
                    ) from err
                time.sleep(backoff_s(attempt))
                try:
                    self._close()
                except Exception:  # the broken connection may not close cleanly; it is dropped either way
                    pass
                self._read, self._close = with_retries(
                    functools.partial(self._open_at, self._received), self.uri, self._retries
                )
        raise AssertionError("unreachable")

    def readinto(self, buf: Any) -> int:
        if not self._pending:
            self._pending = self._fetch(max(len(buf), 1 << 16))
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                self._close()
            finally:
                super().close()
