"""What reaches the logs: credentials are masked everywhere, and an expected failure is one line, not a traceback.

Expected failures are the user's to fix: bad input (DataError, a failed quality gate, a TokenizerError), a failed
validation gate (GateFailed), a rejected checkpoint (CheckpointError), a champion that does not load
(ChampionUnloadable), another release of the model still holding its lock (LockTimeout), a config mistake
(ConfigError), an unreachable or misconfigured store or cluster (CredentialsError, ClusterError). Prefect's engines
log a failed task or flow with its traceback; for these types the traceback is dropped and the one-line cause stays
(in the console and in the Prefect database). Every other exception keeps its traceback.
"""

from __future__ import annotations

import logging
from functools import cache

from infra.redact import RedactingFilter

ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


@cache
def expected_failures() -> tuple[type[BaseException], ...]:
    """The exception types that are reported as one line (imported lazily: torch and friends are heavy)."""
    from deployments.registry import ChampionUnloadable
    from deployments.release_lock import LockTimeout
    from flows.config import ConfigError
    from infra.cluster import ClusterError
    from infra.credentials import CredentialsError
    from infra.remote import RemoteConfigError
    from training.checkpoint import CheckpointError
    from training.data import DataError
    from training.evaluate import GateFailed
    from training.tokenizer import TokenizerError

    return (
        ConfigError,
        DataError,
        TokenizerError,
        GateFailed,
        CheckpointError,
        ChampionUnloadable,
        LockTimeout,
        CredentialsError,
        ClusterError,
        RemoteConfigError,
    )


def is_expected(exc: BaseException | None) -> bool:
    """True when `exc` (or what it was raised from) is an expected failure."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, expected_failures()):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, with credentials masked."""
    from infra.redact import redact

    first = (str(exc).strip().splitlines() or [""])[0]
    return redact(f"{type(exc).__name__}: {first}")


class ExpectedFailureFilter(logging.Filter):
    """Drops the traceback of a record whose exception is an expected failure; the message stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and is_expected(record.exc_info[1]):
            record.exc_info, record.exc_text = None, None
        return True


class ThreadTimeoutNotice(logging.Filter):
    """Drops Prefect's warning that a task's timeout cannot interrupt a worker thread, logged for every stage of
    every worker-run flow (the worker runs the flow off the main thread).

    Why the timeouts are as they are (tasks/retry.TIMEOUT_S): they are upper bounds for a hung stage, hours long,
    not latency targets. Prefect raises them at the stage's next Python-level point, and every long stage reaches
    one often: training polls its Ray Train run every few seconds (tasks/train.POLL_S), the canary's steps poll
    the router, the data stage waits on its workers chunk by chunk. A stage stuck inside one blocking call is
    bounded by that call's own timeout (HTTP clients, `ray.get` with timeouts, the release lock's wait).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(
            "Timeout of %s seconds configured for this task, but the task is running in a worker thread"
        )


def install() -> None:
    """Add the filters to Prefect's engine loggers and to every handler configured now (idempotent)."""
    redacting = RedactingFilter()
    for name in ENGINE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ExpectedFailureFilter) for f in logger.filters):
            logger.addFilter(ExpectedFailureFilter())
        if not any(isinstance(f, ThreadTimeoutNotice) for f in logger.filters):
            logger.addFilter(ThreadTimeoutNotice())
    handlers = [
        h for name in ("", "prefect", "prefect.extra", *ENGINE_LOGGERS) for h in logging.getLogger(name).handlers
    ]
    if logging.lastResort is not None:  # what prints a warning where no handler is configured (a CLI process)
        handlers.append(logging.lastResort)
    for handler in handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(redacting)
