"""Prefect's per-stage warning about timeouts in worker threads is dropped (the reason is documented once)."""

from __future__ import annotations

import logging

from flows import log_hygiene


def test_the_worker_thread_timeout_warning_is_dropped_and_nothing_else(caplog):
    log_hygiene.install()
    logger = logging.getLogger("prefect.task_runs")
    with caplog.at_level(logging.INFO, logger="prefect.task_runs"):
        logger.warning(
            "Timeout of %s seconds configured for this task, but the task is running in a worker thread. "
            "Timeouts in worker threads cannot interrupt blocking operations",
            3600,
        )
        logger.warning("Task run failed with exception: %s", "boom")
    assert [r.getMessage() for r in caplog.records] == ["Task run failed with exception: boom"]
