"""Retry policy shared by the stage tasks: retry transient failures, never a decision or a user error."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def retry_unless(*final: type[BaseException]) -> Callable[[Any, Any, Any], bool]:
    """A Prefect `retry_condition_fn` that refuses to retry when the task failed with one of `final`."""

    def should_retry(task: Any, task_run: Any, state: Any) -> bool:
        exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
        return not isinstance(exc, final)

    return should_retry
