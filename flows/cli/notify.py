"""`shardline notify-dataset SOURCE`: tell the Prefect server that a corpus changed, so `on-new-data` retrains."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

EVENT = "shardline.dataset.updated"
REMOTE_SCHEMES = ("s3://", "az://", "abfs://", "abfss://", "gs://")


def resolve_source(source: str) -> str:
    """The source as a worker will read it: remote URIs as given, local paths absolute and existing.

    Raises:
        ValueError: empty source, a local path that does not exist, or a remote one with a credential in it (one
            line naming it).
    """
    source = source.strip()
    if not source:
        raise ValueError("SOURCE is empty; name the corpus location (a path, s3://..., az://...)")
    from infra.redact import find_credential, redact

    if source == "stdlib" or source.startswith(REMOTE_SCHEMES):
        found = find_credential(source)
        if found:  # the event, and the run it starts, would carry it: credentials come from the environment
            raise ValueError(f"SOURCE {redact(source)!r} carries {found}; give the location only")
        return source
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise ValueError(f"{redact(source)}: no such file or directory")  # a mistyped https://user:pw@... too
    return str(path)


def dataset_resource(source: str) -> dict[str, str]:
    """The event's resource: a stable id per source, and the source itself (what the automation passes on)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return {
        "prefect.resource.id": f"shardline.dataset.{digest}",
        "prefect.resource.name": source,
        "shardline.source": source,
    }


async def _emit(resource: dict[str, str], config: dict) -> str:
    from prefect.events import Event
    from prefect.events.clients import get_events_client

    event = Event(event=EVENT, resource=resource, payload={"config": config} if config else {})
    async with get_events_client() as client:
        await client.emit(event)
    return str(event.id)


def _cmd_notify(args: argparse.Namespace) -> int:
    from flows.cli._utilities import exit_with_error, prepare_environment
    from flows.config import ConfigError, load_config, read_raw

    try:
        source = resolve_source(args.source)
        load_config(args.config, args.set, probe_endpoint=True)  # refuse a bad config here, not in a run started later
        overrides, _ = read_raw(args.config, args.set)
        overrides.pop("stack", None)  # `shardline up`'s table, not a run's
    except (ValueError, ConfigError) as e:
        return exit_with_error(str(e), 2)  # masked: the value quoted may be a URI with a password
    prepare_environment()
    if not os.environ.get("PREFECT_API_URL"):
        print(
            "shardline: no Prefect server to notify: start one with `shardline up` or set PREFECT_API_URL",
            file=sys.stderr,
        )
        return 2
    from prefect.utilities.asyncutils import run_coro_as_sync

    from flows import log_hygiene

    log_hygiene.install()  # Prefect's own lines name the server's URL (a refused websocket): masked like any log

    try:
        event_id = run_coro_as_sync(_emit(dataset_resource(source), overrides))
    except Exception as e:  # noqa: BLE001 - unreachable server, refused websocket: one line, not a traceback
        return exit_with_error(f"could not emit {EVENT} to {os.environ['PREFECT_API_URL']}: {e}")
    print(f"emitted {EVENT} for {source} (event {event_id})", flush=True)
    return 0


def add_notify_command(sub: argparse._SubParsersAction) -> None:
    """Register `notify-dataset` on the `shardline` parser."""
    p = sub.add_parser("notify-dataset", help=f"emit {EVENT} so the on-new-data deployment retrains on SOURCE")
    p.add_argument("source", metavar="SOURCE", help="corpus location: a local path, s3://bucket/prefix, az://...")
    p.add_argument("--config", metavar="FILE.toml", help="config the started run uses (its data.source is SOURCE)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value of the started run (repeatable)",
    )
    p.set_defaults(func=_cmd_notify)
