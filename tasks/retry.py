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


# Upper bound of one attempt of each stage (seconds): a hung stage fails, and is retried where its policy allows,
# instead of holding a worker slot and the model's release lock forever. Generous: a real training takes hours.
TIMEOUT_S = {
    "shard_dataset": 6 * 3600,
    "provision_cluster": 30 * 60,
    "train_fsdp": 48 * 3600,
    "validate_checkpoint": 4 * 3600,
    "promote_model": 15 * 60,
    "canary_deploy": 6 * 3600,
}
