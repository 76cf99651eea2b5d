"""Entrypoint of the training job on a remote cluster: `python -m training.job_entry <inputs.json URI>`.

It runs on the cluster (the job server starts it with the project's code as working directory) and runs the same
Ray Train code as a local run (training.trainer.run_training). Its inputs are plain JSON written by the submitting
stage (infra.jobs.submit); no pickle crosses. It writes the TrainResult as JSON to the inputs' `result_uri`.
Exit status: 0 trained, 2 a config problem (one line on stderr), 1 anything else (with its traceback).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    """Train as the inputs file says and write the result; the exit status as above."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m training.job_entry <inputs.json URI>", file=sys.stderr)
        return 2
    from infra import storage
    from infra.credentials import adopt_worker_secrets
    from infra.paths import quiet_telemetry
    from training.config import TrainConfig
    from training.data import ShardSet

    quiet_telemetry()
    adopt_worker_secrets()  # cluster.job_secrets_file, when the cluster's nodes keep credentials in a file
    inputs = json.loads(storage.read_bytes(args[0]))
    cfg = TrainConfig.model_validate(inputs["train"])
    shards = ShardSet.model_validate(inputs["shards"])
    import ray

    from training.trainer import run_training

    ray.init(log_to_driver=True)  # the job's own cluster; worker output goes into the job's log
    try:
        result = run_training(
            cfg,
            shards,
            inputs["tracking_uri"],
            inputs["train_run_id"],
            inputs["run_name"],
            inputs.get("init_checkpoint", ""),
            inputs.get("worker_env") or None,
        )
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    storage.write_bytes(inputs["result_uri"], result.model_dump_json().encode())
    print(f"trained {result.step} steps: checkpoint {result.checkpoint_uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
