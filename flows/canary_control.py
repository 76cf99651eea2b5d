"""The Prefect side of `shardline canary`: the same actions on a model's live canary, from the Prefect UI."""

from __future__ import annotations

from typing import Annotated

from prefect import flow
from pydantic import Field

from flows.config import ConfigError, PipelineConfig
from flows.run_context import shardline_run

ACTIONS = ("status", "pause", "resume", "promote", "abort")
# a choice in the UI form (the JSON schema's enum); a plain string to Python, so the credential guard reads it
# before it is checked against the choices
Action = Annotated[str, Field(json_schema_extra={"enum": list(ACTIONS)})]


@flow(name="canary-control", log_prints=True, timeout_seconds=900)
def canary_control(action: Action, reason: str = "", config: PipelineConfig = PipelineConfig()) -> dict:  # noqa: B008 - Prefect's form default; never mutated
    """Show, pause, resume, promote or abort the live canary of `config.registry.model_name`.

    Args:
        action: status (the canary's state), pause (hold the current step), resume, promote (skip the remaining
            steps, promote now) or abort (roll back now).
        reason: why; recorded with the user and the time on the canary's MLflow run and decision.
        config: the pipeline config; its `registry` section names the model and the tracking server.
    """
    from deployments.canary_control import CommandRefused, current_user, read_status, send_command
    from deployments.registry import client_for

    with shardline_run(config, "canary-control", uses_ray=False, serves=False, action=action, reason=reason) as run:
        if action not in ACTIONS:
            raise ConfigError(f"action: {action!r} is not one of {', '.join(ACTIONS)}")
        client, name = client_for(run.tracking_uri), config.registry.model_name
        if action == "status":
            status = read_status(client, name)
            run.logger.info("%s: %s", name, status.model_dump_json())
            return status.model_dump(mode="json")
        from prefect.runtime import flow_run

        user = f"{current_user()} (Prefect flow run {flow_run.name})"
        try:
            command, status = send_command(client, name, action, reason, user)
        except CommandRefused as e:  # the operator's to fix: one line, no traceback
            raise ConfigError(f"canary {action}: {e}") from None
        run.logger.info("%s the canary %s of %s: %s", action, command.canary_id, name, status.model_dump_json())
        return {"command": command.model_dump(mode="json"), "status": status.model_dump(mode="json")}
