"""Retry policy shared by the stage tasks: retry transient failures, never a decision or a user error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def retry_unless(*final: type[BaseException]) -> Callable[[Any, Any, Any], bool]:
    """A Prefect `retry_condition_fn` that refuses to retry when the task failed with one of `final`, or with what
    no stage retries: missing credentials, or a storage error the storage layer judged final (denied, not found, a
    bad URI; it already retried the transient ones). Both are OSErrors, which a stage otherwise retries."""
    from infra.credentials import CredentialsError
    from infra.storage_retry import StorageError

    def should_retry(task: Any, task_run: Any, state: Any) -> bool:
        exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
        if isinstance(exc, CredentialsError) or (isinstance(exc, StorageError) and not exc.transient):
            return False
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


def flow_timeout_s(*stages: str, opened_s: int = 0) -> int:
    """A flow's own bound: one attempt of each stage it runs (TIMEOUT_S) plus `opened_s` of its own steps, with a
    quarter more for the work between stages; a retry beyond that is bounded by the flow. A fixed flow bound below a
    stage's (release-from-shards' 12 h against train_fsdp's 48 h) killed a long training the pipeline would allow."""
    return int(1.25 * (sum(TIMEOUT_S[stage] for stage in stages) + opened_s))
