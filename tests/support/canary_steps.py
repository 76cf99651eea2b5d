"""Canary observations as the router records them (deployments/router_evidence), for the policy's tests."""

from __future__ import annotations

from deployments.config import CanaryConfig
from deployments.rollout_gates import summarize_step

CFG = CanaryConfig(
    min_paired=4,
    max_error_rate_increase=0.0,
    max_p95_latency_ratio=3.0,
    max_p99_latency_ratio=5.0,
    max_bpb_regression=0.05,
    latency_floor_ms=5.0,
    confidence=0.95,
)


def call(version, bpb=2.0, nbytes=100, ms=10.0, ok=True):
    """A model call as Router._record slims it."""
    if not ok:
        return {
            "version": version,
            "ok": False,
            "bits": None,
            "bytes": None,
            "latency_ms": None,
            "error": "RuntimeError: boom",
        }
    return {"version": version, "ok": True, "bits": bpb * nbytes, "bytes": nbytes, "latency_ms": ms, "error": None}


def ob(op, role, challenger=None, champion=None, shadow=None, fallback=False, client_ok=True, probe=False):
    return {
        "seq": 0,
        "canary_id": "c",
        "epoch": 1,
        "t": 0.0,
        "endpoint": "score" if op == "score" else "completions",
        "probe": probe,
        "op": op,
        "role": role,
        "challenger": challenger,
        "champion": champion,
        "shadow": shadow,
        "fallback": fallback,
        "client_ok": client_ok,
        "total_ms": 12.0,
    }


def to_challenger(ch_bpb=2.0, base_bpb=2.0, nbytes=100, ch_ms=10.0, base_ms=10.0, op="score", shadow=True, probe=False):
    """A request the challenger answered, scored again by the champion (shadow) unless shadow=False."""
    return ob(
        op,
        "challenger",
        challenger=call("2", ch_bpb, nbytes, ch_ms),
        shadow=call("1", base_bpb, nbytes, base_ms) if shadow else None,
        probe=probe,
    )


def challenger_failed():
    """A completion the challenger failed; the champion answered the client instead (a fallback)."""
    return ob(
        "complete", "challenger", challenger=call("2", ok=False), champion=call("1"), shadow=call("1"), fallback=True
    )


def to_champion(bpb=2.0, ms=10.0, ok=True):
    return ob("score", "champion", champion=call("1", bpb, 100, ms, ok), client_ok=ok)


def step_of(percent, observations, cfg=CFG, earlier=(), **kw):
    return summarize_step(percent, observations, "1", "2", cfg, earlier, **kw)


def noisy(n, ch, base, spread=0.01):
    """n paired requests around ch vs base bits/byte, alternating +-spread (deterministic)."""
    return [to_challenger(ch + (spread if i % 2 else -spread), base) for i in range(n)]
