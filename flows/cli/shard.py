"""`shardline shard`: the data stage alone (what nanoGPT's prepare is to its train), logged to MLflow as the
pipeline's stage is: a parent run tagged shardline.stage=shard with the shard_dataset child run under it."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from flows.cli._utilities import exit_codes
from flows.config import ConfigError, load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the `shard` subcommand to the `shardline` parser."""
    shard = sub.add_parser("shard", help="run the data stage alone: shard, validate and publish the corpus")
    shard.add_argument(
        "--config",
        metavar="FILE.toml",
        help="pipeline config (only [data], [tokenizer], [cluster], [registry] are used; default: built-in defaults)",
    )
    shard.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set data.workers=4 (repeatable)",
    )
    shard.add_argument("--json", action="store_true", help="print the shard set as one JSON object, last on stdout")
    shard.set_defaults(func=cmd_shard)


def cmd_shard(args: argparse.Namespace) -> int:
    """Exit 0 with the shard set; 2 for a config mistake, 1 when the stage failed (one line each, no traceback)."""
    from flows.cli._utilities import prepare_environment
    from training import tokenizer as tk
    from training.data import DataError
    from training.data.build import check_locations

    try:
        config = load_config(args.config, args.set)
        check_locations(config.data)  # a bad location is a config mistake, and must fail before anything logs it
        _check_local_source(config.data)
        prepare_environment()  # the stack's Prefect (its storage Secret blocks) before a tokenizer on a store is read
        if config.tokenizer.kind == "file":  # a missing or broken tokenizer file too, before the stage's run opens
            tk.load(config.tokenizer.path)
    except (ConfigError, DataError, tk.TokenizerError) as e:
        print(f"shardline: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("shardline").setLevel(logging.INFO)
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    return _run_stage(config, args.json)


def _check_local_source(data: Any) -> None:
    """DataError when the corpus is a local path this process reads (engine local) and it does not exist: a typo
    in data.source is a config mistake, refused before the stage's MLflow run starts (remote stores are read by
    the stage, which reports a missing prefix itself)."""
    from pathlib import Path

    from infra import storage
    from training.data import DataError

    if data.reader or data.engine != "local" or data.source in ("", "stdlib"):
        return
    loc = storage.parse(data.source)
    if loc.scheme == "file" and not Path(loc.key).expanduser().exists():
        raise DataError(f"data.source: {data.source}: no such file or directory")


@exit_codes("shard")
def _run_stage(config: Any, as_json: bool) -> int:
    """The stage and its report (a failure is one line and exit 1: the stage's MLflow run holds the details)."""
    from flows.cli._utilities import table

    start = time.monotonic()
    out = _shard(config)
    out["wall_seconds"] = round(time.monotonic() - start, 3)
    rows = [
        ("dataset digest", out["dataset_digest"]),
        ("records", f"{out['num_train']} train / {out['num_val']} val"),
        (
            "shards",
            f"{len(out['train_shards'])} train / {len(out['val_shards'])} val, {out['total_bytes'] / 1e6:.1f} MB",
        ),
        (
            "token ids",
            f"tokenizer {out['tokenizer_sha256'][:12]}, {out['vocab_size']} ids, {out['token_dtype']}"
            if out["tokenizer_sha256"]
            else "none (bytes)",
        ),
        ("skipped", ", ".join(f"{k}={v}" for k, v in out["skipped"].items()) or "none"),
        (
            "published",
            "yes"
            if not out["cache_hit"]
            else "cache hit (already published)"
            if out["chunks"]
            else "cache hit (listing unchanged: the corpus was not read)",
        ),
        ("manifest", out["manifest_uri"]),
        ("chunks", f"{out['chunks']} on {out['engine']}, {out['workers']} workers"),
        ("wall seconds", f"{out['wall_seconds']:.1f}"),
        ("MLflow run", out["parent_run_id"]),
    ]
    print(table(rows), file=sys.stderr if as_json else sys.stdout, flush=True)
    if as_json:
        print(json.dumps(out), flush=True)
    return 0


def _shard(config) -> dict:
    """Run shard_dataset under a fresh parent run (and, for data.engine='ray', a cluster per [cluster]).

    There is no Prefect flow run: the stage's plain function runs here, and the parent run is keyed and tagged
    `shard`, so it is not taken for a pipeline run.
    """
    from flows.run_context import shardline_run
    from infra.cluster import provision
    from tasks.data import shard_dataset

    with shardline_run(config, "shard", origin="config", uses_ray=config.data.engine == "ray", serves=False) as run:
        if config.data.engine == "ray":
            run.cluster = provision(config.cluster)
        shards = shard_dataset.fn(config.data, run.lineage, run.cluster, config.tokenizer)
    return {**shards.model_dump(), "parent_run_id": run.lineage.parent_run_id, "engine": config.data.engine}
