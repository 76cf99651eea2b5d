"""Canary gates on PromQL: an instant query against Prometheus's HTTP API (/api/v1/query), one value per gate.

Prometheus's own HTTP API over httpx: the official Python clients only expose metrics, they do not query.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from deployments.canary_records import GateReading
from deployments.config import CanaryConfig, PromQLGate
from deployments.rollout_gates import judge_promql

log = logging.getLogger(__name__)


class PromQLError(RuntimeError):
    """The query did not give one value; the message says why in one line."""


_UNQUOTABLE = ("\\", '"', "'", "`", "\n")


def render(query: str, model: str, champion: str, challenger: str) -> str:
    """The query with $model, $champion and $challenger replaced ($-placeholders: PromQL uses braces itself).

    Raises:
        PromQLError: a value with a quote, backslash or newline (MLflow allows them in a model name): it could end
            the string literal it stands in and rewrite the query, and its escape depends on that literal's quote.
    """
    for what, value in (("model", model), ("champion", champion), ("challenger", challenger)):
        if any(c in value for c in _UNQUOTABLE):
            raise PromQLError(f"{what} {value!r} has a quote, backslash or newline; it cannot stand in a PromQL string")
    return query.replace("$challenger", challenger).replace("$champion", champion).replace("$model", model)


def value_of(payload: dict[str, Any]) -> float | None:
    """The one value of an instant query's JSON answer; None for an empty vector.

    Raises:
        PromQLError: an error answer, or more than one series (aggregate the query to one).
    """
    if payload.get("status") != "success":
        raise PromQLError(f"{payload.get('errorType', 'error')}: {payload.get('error', payload)}")
    data = payload["data"]
    kind, result = data["resultType"], data["result"]
    if kind in ("scalar", "string"):
        return float(result[1])
    if kind != "vector":
        raise PromQLError(f"a {kind} result; a gate needs an instant vector or a scalar")
    if not result:
        return None
    if len(result) > 1:
        raise PromQLError(f"{len(result)} series; aggregate the query to one (e.g. sum(...) or max(...))")
    value = float(result[0]["value"][1])
    return None if math.isnan(value) else value


def instant_value(url: str, query: str, timeout_s: float = 10.0) -> float | None:
    """Run an instant query on the Prometheus server at `url`; its one value, or None without a sample."""
    import httpx

    try:
        r = httpx.get(f"{url.rstrip('/')}/api/v1/query", params={"query": query}, timeout=timeout_s)
        payload = r.json()
    except (httpx.HTTPError, ValueError) as e:
        raise PromQLError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return value_of(payload)


def read_gates(cfg: CanaryConfig, model: str, champion: str, challenger: str) -> list[GateReading]:
    """Every canary.promql_gates reading at this moment (a failed query reads as no data, with the reason)."""
    readings = []
    for gate in cfg.promql_gates:
        readings.append(read_gate(cfg.prometheus_url, gate, model, champion, challenger))
        level = logging.WARNING if readings[-1].verdict != "pass" else logging.INFO
        log.log(level, "%s", readings[-1].message)
    return readings


def read_gate(url: str, gate: PromQLGate, model: str, champion: str, challenger: str) -> GateReading:
    query = gate.query
    try:
        query = render(gate.query, model, champion, challenger)
        return judge_promql(gate, query, instant_value(url, query))
    except PromQLError as e:
        return judge_promql(gate, query, None, f"query failed: {e}")
