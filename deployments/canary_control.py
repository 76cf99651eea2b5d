"""Operator control of a live canary: the channel between `shardline canary ...` and the running rollout driver.

The channel is MLflow registered-model-version tags on the challenger version. The driver and the operator may be
on different machines (the driver in a Prefect worker's flow run, the operator on a laptop); the MLflow server is
the one thing both already talk to (the release lock may be a file lock on one machine, and Ray may not be
reachable from the laptop), and the challenger version is where the canary's outcome is recorded anyway.
- `shardline.canary_state` (JSON, written by the driver at every state change and with every lease renewal):
  canary_id, state (running, paused, awaiting-approval; deciding while a verdict is applied, when no command is
  taken any more; none once decided, with the verdict), step, percent, the approval's or the pause's deadline,
  lease_expires_at, the id of the last command it acted on (`ack`). A state not renewed for a whole lease past
  its expiry is read as `none`: the driver died, and the router went back to the champion by itself when the
  lease ran out (the lease, not this tag, is the dead man's switch; the extra lease of slack keeps a renewal that
  is merely late on a loaded machine from reading as a dead canary).
- `shardline.canary_command` (JSON OperatorCommand, written by the CLI): the latest command, addressed to one
  canary_id. The driver reads it every canary.control_poll_s and acts once per command id; another canary's
  command (a stale one) is ignored. Last writer wins: of two commands given within one poll the driver sees the
  later, which is what the operator asked for last.
The `challenger` alias names the version under canary (the driver sets it when it starts and removes it once
decided). Each command is also logged as an artifact `canary_commands/*.json` on the canary stage's MLflow run,
found by its `shardline.canary_id` tag, and the driver lists the commands it acted on in the decision artifact.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import time
import uuid
from typing import Any

from pydantic import BaseModel

from deployments.canary_records import CanaryState, OperatorCommand
from deployments.config import CanaryConfig
from deployments.registry import CHALLENGER, CHAMPION, TAG_CANARY_COMMAND, TAG_CANARY_ID, TAG_CANARY_STATE, read_aliases
from deployments.rollout_policy import command_error
from infra.redact import first_line

log = logging.getLogger(__name__)
USER_ENV = "SHARDLINE_USER"  # who gives a command, when the login name is not it (a shared service account)


class CommandRefused(RuntimeError):
    """The command does not apply to the canary's state (or no canary is running); one line."""


class CanaryStatus(BaseModel):
    """What `shardline canary status --json` prints."""

    model: str
    state: CanaryState
    champion_version: str | None
    challenger_version: str | None
    step: int | None = None  # 1-based position of `percent` in canary.steps
    steps: int | None = None
    percent: int = 0
    attempt: int = 0
    mode: str | None = None
    approval: str | None = None
    canary_id: str | None = None
    updated_at: float | None = None
    lease_expires_at: float | None = None
    approval_deadline: float | None = None
    pause_deadline: float | None = None  # while paused: when the canary rolls back unless resumed
    ack: str | None = None  # the last command the driver acted on
    last_verdict: str | None = None  # of this version's canary, once decided
    last_reason: str | None = None


def current_user() -> str:
    return os.environ.get(USER_ENV) or getpass.getuser()


def status_of(model: str, aliases: dict[str, str], state: dict[str, Any] | None, now: float) -> CanaryStatus:
    """The canary's status from the registry's aliases and the challenger's state tag (pure)."""
    champion, challenger = aliases.get(CHAMPION), aliases.get(CHALLENGER)
    base = CanaryStatus(model=model, state="none", champion_version=champion, challenger_version=None)
    if challenger is None or not state:
        return base
    alive = (
        state.get("state") in ("running", "paused", "awaiting-approval", "deciding")
        and float(state.get("lease_expires_at") or 0) + float(state.get("lease_s") or 0) > now
    )
    fields = {
        k: state.get(k)
        for k in (
            "step",
            "steps",
            "mode",
            "approval",
            "canary_id",
            "updated_at",
            "lease_expires_at",
            "approval_deadline",
            "pause_deadline",
            "ack",
        )
    }
    if not alive:  # decided, or its driver died (then the router went back to the champion when the lease ran out)
        return base.model_copy(
            update={
                "challenger_version": challenger,
                "canary_id": state.get("canary_id"),
                "last_verdict": state.get("verdict") or "abandoned",
                "last_reason": state.get("reason") or "the driver stopped renewing its lease",
            }
        )
    return base.model_copy(
        update={
            "state": state["state"],
            "challenger_version": challenger,
            "percent": int(state.get("percent") or 0),
            "attempt": int(state.get("attempt") or 0),
            **fields,
        }
    )


def read_state(client: Any, name: str, version: str) -> dict[str, Any] | None:
    raw = (client.get_model_version(name, version).tags or {}).get(TAG_CANARY_STATE)
    return json.loads(raw) if raw else None


def read_status(client: Any, name: str) -> CanaryStatus:
    aliases = read_aliases(client, name)
    challenger = aliases.get(CHALLENGER)
    state = read_state(client, name, challenger) if challenger else None
    return status_of(name, aliases, state, time.time())


def publish_state(client: Any, name: str, version: str, state: dict[str, Any]) -> None:
    """The driver's side: its state, renewed with the lease."""
    client.set_model_version_tag(name, version, TAG_CANARY_STATE, json.dumps({**state, "updated_at": time.time()}))


def read_command(client: Any, name: str, version: str) -> OperatorCommand | None:
    """The driver's side: the latest command on the version (any canary's; the caller checks canary_id)."""
    raw = (client.get_model_version(name, version).tags or {}).get(TAG_CANARY_COMMAND)
    return OperatorCommand.model_validate_json(raw) if raw else None


def send_command(
    client: Any, name: str, action: str, reason: str = "", user: str = "", wait_s: float = 30.0
) -> tuple[OperatorCommand, CanaryStatus]:
    """Give `action` to `name`'s running canary; returns the command and the status once the driver acted on it
    (for promote and abort: once the decision was applied, or `wait_s` passed).

    Raises:
        CommandRefused: no canary is running, or it is in a state the action does not apply to; or the driver
            did not act on the command within `wait_s` (the command stays; a live driver acts on it later).
    """
    status = read_status(client, name)
    error = command_error(status.state, action, name)
    if error:
        raise CommandRefused(error)
    assert status.challenger_version is not None and status.canary_id is not None
    command = OperatorCommand(
        id=uuid.uuid4().hex,
        canary_id=status.canary_id,
        action=action,
        user=user or current_user(),
        reason=reason,
        at=time.time(),
    )
    version = status.challenger_version
    client.set_model_version_tag(name, version, TAG_CANARY_COMMAND, command.model_dump_json())
    try:  # the command is sent (the driver reads the tag); its audit copy on the canary's run is a record of it
        record_command(client, command)
    except Exception as e:  # noqa: BLE001 - e.g. no write access to the artifact store from this machine
        log.warning("%s was sent, but its record on the canary's run was not logged: %s", action, first_line(e))
    deadline = time.monotonic() + wait_s
    while True:
        state = read_state(client, name, version) or {}
        acted = state.get("ack") == command.id
        if acted and (action in ("pause", "resume") or state.get("state") == "none"):
            return command, status_of(name, read_aliases(client, name), state, time.time())
        if time.monotonic() > deadline:
            what = "acted on" if not acted else "finished applying"
            raise CommandRefused(
                f"{action} was written for canary {command.canary_id} of {name} v{version}, but the "
                f"driver has not {what} it within {wait_s:g} s; `shardline canary status` shows "
                "when it does"
            )
        time.sleep(0.5)


def canary_run_id(client: Any, canary_id: str) -> str | None:
    """The MLflow run of the canary stage that ran canary `canary_id` (its `shardline.canary_id` tag)."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = (
        client.search_runs(experiments, filter_string=f"tags.`{TAG_CANARY_ID}` = '{canary_id}'", max_results=1)
        if experiments
        else []
    )
    return runs[0].info.run_id if runs else None


def record_command(client: Any, command: OperatorCommand) -> str | None:
    """Log the command (time, user, reason) on the canary stage's run; its run id, or None without one."""
    run_id = canary_run_id(client, command.canary_id)
    if run_id is not None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(command.at))
        client.log_dict(
            run_id, command.model_dump(mode="json"), f"canary_commands/{stamp}-{command.action}-{command.id[:8]}.json"
        )
        client.set_tag(
            run_id,
            "shardline.canary_last_command",
            f"{command.action} by {command.user} at {stamp}Z: {command.reason}"[:5000],
        )
    return run_id


class DriverControl:
    """The driver's end of the operator channel: publishes the canary's state, acts on each command once."""

    def __init__(self, client: Any, cfg: CanaryConfig, model_name: str, challenger: str, canary_id: str):
        self.client, self.cfg, self.name, self.version, self.canary_id = client, cfg, model_name, challenger, canary_id
        self.state: CanaryState = "running"
        self.applied: list[OperatorCommand] = []
        self.seen = {c.id for c in [self._read()] if c is not None}  # written before this canary: not for it
        self.next_poll = 0.0
        self.approval_deadline: float | None = None
        self.pause_deadline: float | None = None

    def _read(self) -> OperatorCommand | None:
        try:
            return read_command(self.client, self.name, self.version)
        except Exception as e:  # noqa: BLE001 - MLflow unreachable for a moment: the canary goes on, asks again
            log.warning("reading operator commands: %s: %s", type(e).__name__, e)
            return None

    def publish(self, percent: int, epoch_lease: float, attempt: int = 0, **final: Any) -> None:
        steps = self.cfg.steps
        state = {
            "canary_id": self.canary_id,
            "state": final.pop("state", self.state),
            "percent": percent,
            "step": steps.index(percent) + 1 if percent in steps else 0,
            "steps": len(steps),
            "attempt": attempt,
            "mode": self.cfg.mode,
            "approval": self.cfg.approval,
            "lease_expires_at": epoch_lease,
            "lease_s": self.cfg.lease_s,
            "approval_deadline": self.approval_deadline,
            "pause_deadline": self.pause_deadline,
            "ack": self.applied[-1].id if self.applied else None,
            **final,
        }
        try:
            publish_state(self.client, self.name, self.version, state)
        except Exception as e:  # noqa: BLE001 - status goes stale for a moment; the lease is what the router obeys
            log.warning("publishing the canary's state: %s: %s", type(e).__name__, e)

    def poll(self, percent: int) -> OperatorCommand | None:
        """A new command for this canary that applies to its state (at most every canary.control_poll_s)."""
        if time.monotonic() < self.next_poll:
            return None
        self.next_poll = time.monotonic() + self.cfg.control_poll_s
        command = self._read()
        if command is None or command.id in self.seen:
            return None
        self.seen.add(command.id)
        if command.canary_id != self.canary_id:
            log.warning(
                "ignoring %s by %s: it was given to canary %s, this is %s",
                command.action,
                command.user,
                command.canary_id,
                self.canary_id,
            )
            return None
        error = command_error(self.state, command.action, self.name)
        if error:
            log.warning("ignoring %s by %s: %s", command.action, command.user, error)
            return None
        command = command.model_copy(update={"applied_at": time.time(), "percent": percent, "state": self.state})
        self.applied.append(command)
        log.info(
            "operator %s by %s at %d%% (%s): %s",
            command.action,
            command.user,
            percent,
            self.state,
            command.reason or "no reason given",
        )
        if command.action == "pause":
            self.state = "paused"
            self.pause_deadline = time.time() + self.cfg.pause_timeout_s
        elif command.action == "resume":
            self.state = "running"
            self.pause_deadline = None
        return command
