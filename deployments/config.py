"""Configuration of model registration and of the canary rollout."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class RegistryConfig(BaseModel):
    """Where runs and models are tracked, and the registered model's name."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("shardline-gpt", min_length=1, description="Registered model name in MLflow.")
    tracking_uri: str = Field(
        "",
        description="MLflow tracking server; empty uses $MLFLOW_TRACKING_URI, else SQLite in $SHARDLINE_HOME.",
    )
    experiment: str = Field("shardline", min_length=1, description="MLflow experiment holding the run tree.")


class CanaryConfig(BaseModel):
    """How the challenger is ramped against the champion, and the gates it must pass."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Run the canary when a champion exists.")
    steps: list[int] = Field(
        [10, 50, 100], description="Percent of traffic sent to the challenger at each ramp step, ascending."
    )
    requests_per_step: int = Field(30, ge=1, description="HTTP requests sent at each ramp step.")
    max_error_rate_increase: float = Field(
        0.0, ge=0, description="Fail when challenger error rate exceeds champion's by more than this."
    )
    max_p95_latency_ratio: float = Field(
        3.0, gt=0, description="Fail when challenger p95 latency exceeds champion's by more than this factor."
    )
    max_bpb_regression: float = Field(
        0.05, ge=0, description="Fail when challenger bits/byte exceeds champion's on the same requests by more."
    )
    latency_floor_ms: float = Field(
        5.0,
        ge=0,
        description="p95 latencies below this count as this in the latency gate (sub-ms noise is no regression).",
    )
    max_request_bytes: int = Field(2048, ge=16, description="Held-out text per request is cut to this many bytes.")
    host: str = Field("127.0.0.1", description="Address Ray Serve's HTTP proxy binds to.")
    port: int = Field(0, ge=0, le=65535, description="Port of Ray Serve's HTTP proxy; 0 picks a free one.")
    seed: int = Field(0, description="Seed of request order and routing.")

    @field_validator("steps")
    @classmethod
    def _ascending_percentages(cls, steps: list[int]) -> list[int]:
        if not steps or any(not 0 < s <= 100 for s in steps) or steps != sorted(steps):
            raise ValueError(f"canary.steps must be ascending percentages in (0, 100], got {steps}")
        return steps
