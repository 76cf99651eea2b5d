"""The `shardline` command: `run` the pipeline from a TOML config, `shard` the corpus alone, or show a model's
`lineage`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

from flows.cli._utilities import (
    answer_quickly,
    config_or_none,
    exit_codes,
    exit_with_error,
    prepare_environment,
    table,
)
from flows.cli.notify import add_notify_command
from flows.cli.stack import add_stack_commands


@exit_codes("pipeline")
def _cmd_run(args: argparse.Namespace) -> int:
    config = config_or_none(args, probe_endpoint=True)
    if config is None:
        return 2
    from flows import log_hygiene
    from flows.pipeline import shardline_pipeline
    from infra.orphans import reap_orphans

    log_hygiene.install()
    reap_orphans()  # what a killed earlier run left behind, by its recorded PIDs
    summary = shardline_pipeline(config)
    rows = [
        ("model", f"{summary.model_name} v{summary.model_version}"),
        ("decision", summary.decision),
        ("reason", summary.reason),
        ("champion", f"v{summary.champion_version}"),
        ("val bits/byte", f"{summary.val_bits_per_byte:.4f}"),
        ("MLflow run", summary.parent_run_id),
        ("dataset digest", summary.dataset_digest),
        ("checkpoint", summary.checkpoint_uri),
        ("endpoint", summary.endpoint_url or "-"),
        ("stage seconds", ", ".join(f"{k} {v:.1f}" for k, v in summary.stage_seconds.items())),
    ]
    out = sys.stderr if args.json else sys.stdout
    print(table(rows), file=out, flush=True)
    print(_where_to_look(summary.model_name, summary.endpoint_url), file=out, flush=True)
    if args.json:
        print(json.dumps(summary.model_dump()), flush=True)
    return 0


def _where_to_look(model_name: str, endpoint_url: str = "") -> str:
    """The commands that show this run afterwards, for the state dir and tracking store actually used."""
    from infra.paths import shardline_home
    from infra.tracking import resolve_tracking_uri

    bin_dir = os.path.dirname(sys.executable)
    from infra.redact import redact

    tracking = redact(resolve_tracking_uri())
    # a tracking server (`shardline up` runs one) is already a UI: its URL; a file store needs `mlflow ui` on it
    lines = [
        f"  runs and registry:  {tracking}"
        if tracking.startswith(("http://", "https://"))
        else f"  runs and registry:  {bin_dir}/mlflow ui --backend-store-uri {tracking}"
    ]
    if not os.environ.get("PREFECT_API_URL"):
        lines.append(
            f"  flow runs:          PREFECT_HOME={shardline_home() / 'prefect'} {bin_dir}/prefect server start"
        )
    lines.append(f"  lineage:            {bin_dir}/shardline lineage --model {model_name} --alias champion")
    if endpoint_url:
        lines.append(
            f"  endpoint:           curl -s {endpoint_url}/v1/completions -H 'content-type: application/json' "
            '-d \'{"prompt": "def main():", "max_tokens": 32}\''
        )
        lines.append(f"  stop serving:       {bin_dir}/shardline serve --stop")
    return "\n".join(lines)


def _cmd_lineage(args: argparse.Namespace) -> int:
    prepare_environment()
    answer_quickly()
    from deployments.lineage import LineageError, describe_lineage

    try:
        chain = describe_lineage(args.model, args.version or args.alias, args.tracking_uri)
    except LineageError as e:
        return exit_with_error(str(e), 2)
    if args.json:
        print(json.dumps(chain), flush=True)
    else:
        print(table([(k, json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else v) for k, v in chain.items()]))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors mask credentials: a mistyped flag is echoed with its value
    (`unrecognized arguments: --tracking_uri http://u:pw@host`). Its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        from infra.redact import redact

        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {redact(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line; every pipeline setting lives in the TOML config, not in flags."""
    parser = _Parser(prog="shardline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the whole pipeline once")
    run.add_argument("--config", metavar="FILE.toml", help="pipeline config (default: built-in defaults)")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set train.steps=50 (repeatable)",
    )
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object, last on stdout")
    run.set_defaults(func=_cmd_run)

    lineage = sub.add_parser("lineage", help="show the chain from dataset digest to a registered model version")
    lineage.add_argument("--model", default="shardline-gpt", help="registered model name")
    lineage.add_argument("--version", default="", help="model version (default: the alias)")
    lineage.add_argument("--alias", default="champion", help="alias to resolve when no version is given")
    lineage.add_argument("--tracking-uri", default="", help="MLflow tracking URI (default as for `run`)")
    lineage.add_argument("--json", action="store_true", help="print one JSON object")
    lineage.set_defaults(func=_cmd_lineage)

    import flows.cli.canary as canary
    import flows.cli.cluster as cluster
    import flows.cli.serve as serve
    import flows.cli.shard as shard

    serve.add_parser(sub)
    canary.add_parser(sub)
    shard.add_parser(sub)
    cluster.add_parser(sub)
    add_stack_commands(sub)
    add_notify_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `shardline` console script."""
    args = build_parser().parse_args(argv)
    # every command's errors are one line with credentials masked, whatever the command itself catches: a command
    # that maps its own keeps its codes, and anything it lets through is `<command> failed: ...`, exit 1
    return exit_codes(args.command)(args.func)(args)


if __name__ == "__main__":
    sys.exit(main())
