"""Configuration of model registration and of the canary rollout."""

from __future__ import annotations

import itertools
import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra.redact import find_credential

# the smallest request body around a prompt ({"prompt":""}): a prompt whose body cannot fit in serve.max_request_bytes
# gets the body's 413 before serve.max_prompt_bytes is ever looked at
PROMPT_ENVELOPE_BYTES = len(b'{"prompt":""}')
# what a registered model name may not hold: MLflow's own refusals (/ :), its filter strings' quotes and escape
# (' " ` \\) and a models:/ URI's query mark (?)
_MODEL_NAME_REFUSED = ("'", '"', "`", "\\", "/", ":", "?")


class RegistryConfig(BaseModel):
    """Where runs and models are tracked, and the registered model's name."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    model_name: str = Field(
        "shardline-gpt",
        min_length=1,
        description="Registered model name in MLflow; no quotes, backquote, backslash, '/', ':' or '?'.",
    )
    tracking_uri: str = Field(
        "",
        description="MLflow tracking server; empty uses $MLFLOW_TRACKING_URI, else SQLite in $SHARDLINE_HOME.",
    )
    experiment: str = Field("shardline", min_length=1, description="MLflow experiment holding the run tree.")

    @field_validator("model_name")
    @classmethod
    def _a_name_filters_and_uris_carry(cls, name: str) -> str:
        """A name MLflow registers but its filter strings (`name = '...'`, quoted with ' " or `) or a
        `models:/<name>/<version>` URI (split at '/', a '?' starts its query) cannot carry would register the model,
        then fail every promotion; ':' and '/' MLflow itself refuses (utils.validation._validate_model_name), as it
        does a name that is a path of its own ('.', '..'). Refused at load, with the field named."""
        bad = sorted({c for c in name if c in _MODEL_NAME_REFUSED or not c.isprintable()})
        if bad or name.strip() != name or name in (".", ".."):
            raise ValueError(  # the caller's message names the field and quotes the value
                f"not a registered model name MLflow's filter strings and models:/ URIs carry: no "
                f"{' '.join(_MODEL_NAME_REFUSED)}, control characters or surrounding spaces"
            )
        return name

    @field_validator("tracking_uri")
    @classmethod
    def _a_uri_that_parses(cls, uri: str) -> str:
        """An http(s) server address MLflow would fail to parse deep in a run (`http://[::1:5000`, a port out of
        range), refused at load with the field named. The message quotes nothing of the value (the caller's message
        quotes it masked), and a URI holding a credential is left to the credential check, whose refusal says so
        (urlsplit reads a password's text before a '/' as the port)."""
        if uri.lower().startswith(("http://", "https://")) and find_credential(uri) is None:
            try:
                urlsplit(uri).port  # noqa: B018 - parsing the port checks the host's brackets and the port's range
            except ValueError:
                raise ValueError(
                    "not a server address MLflow can reach: its host or port does not parse (an IPv6 host is written "
                    "in brackets, a port is a number up to 65535)"
                ) from None
        return uri


class Autoscaling(BaseModel):
    """Ray Serve autoscaling of one kind of deployment: replicas follow the requests in flight."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (0 lets an idle deployment scale to zero).")
    max_replicas: int = Field(4, ge=1, description="Most replicas.")
    target_ongoing_requests: float = Field(
        2.0,
        gt=0,
        description="Requests in flight per replica that autoscaling aims for.",
    )

    @model_validator(mode="after")
    def _min_within_max(self) -> Autoscaling:
        """Refused at config load, before anything trains or registers (Serve would refuse it at deploy)."""
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} < min_replicas {self.min_replicas}")
        return self

    def serve_options(self) -> dict:
        return {
            "autoscaling_config": {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        }


class ServeConfig(BaseModel):
    """The live endpoint: one gateway per route prefix in front of one Ray Serve application per registered model,
    each serving the registry's `champion`; a request's `model` picks the model."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    enabled: bool = Field(
        True,
        description="The pipeline's last stage keeps the live endpoint serving the champion. false: the run "
        "ends at the registry and starts or changes no endpoint (the model is served elsewhere); "
        "canary.enabled must then be false.",
    )
    host: str = Field(
        "127.0.0.1", description="Address Ray Serve's HTTP proxy binds to; 127.0.0.1 unless you mean otherwise."
    )
    port: int = Field(8000, ge=0, le=65535, description="Port of Ray Serve's HTTP proxy (one per cluster).")
    public_url: str = Field(
        "",
        description="URL clients (and the canary's probe traffic) use when it differs from http://host:port, "
        "e.g. a remote cluster's load balancer.",
    )
    route_prefix: str = Field(
        "/",
        description="Route prefix of the stack's gateway, which serves every model ('/' serves /v1/...).",
    )
    default_model: str = Field(
        "",
        description="Model a request naming none goes to; empty: the only model served (several: a 400).",
    )
    app_name: str = Field(
        "",
        description="Serve application of this model (behind the gateway); empty derives "
        "'shardline-<registry.model_name>' (characters Serve refuses replaced, and a hash of the name added when any "
        "were). A name not starting with 'shardline-' is refused.",
    )
    gateway_replicas: int = Field(1, ge=1, description="Replicas of the gateway (the HTTP ingress of every model).")
    max_queued_requests: int = Field(
        512,
        ge=1,
        description="Requests a gateway replica holds beyond the 256 it forwards at once; more get a fast 503 "
        "(OpenAI's error object, Retry-After: 1).",
    )
    max_request_bytes: int = Field(
        65536, ge=256, description="Largest request body accepted; bigger ones get 413 before the body is read."
    )
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A request body not received whole within this gets 408 (a trickling client).",
    )
    max_prompt_bytes: int = Field(
        4096,
        ge=1,
        description="Largest prompt or scored text, in UTF-8 bytes; at least 14 under serve.max_request_bytes.",
    )
    max_tokens_cap: int = Field(256, ge=1, description="Largest max_tokens a completion request may ask for.")
    chat_template: str = Field(
        "",
        description="Jinja chat template (Hugging Face's dialect: messages, add_generation_prompt, raise_exception) "
        "that turns /v1/chat/completions messages into this model's prompt, for every version (it overrides the "
        "template a version's tokenizer carries, as vLLM's --chat-template does); '' = each version's own (a "
        "version without one answers chat with a 400 that says so).",
    )
    replica_cpus: float = Field(0.2, gt=0, description="Logical CPUs reserved per model replica.")
    router_cpus: float = Field(
        0.05,
        gt=0,
        description="Logical CPUs reserved per gateway, router and evidence replica. They forward requests and "
        "wait (asyncio), the model replicas compute: a stack serving many models keeps its CPUs for training.",
    )
    model_replicas: int = Field(1, ge=1, description="Replicas per served model version (without autoscaling).")
    router_replicas: int = Field(
        1,
        ge=1,
        description="Replicas of each model's router (without router_autoscaling); every replica adds to "
        "the same canary evidence.",
    )
    autoscaling: Autoscaling | None = Field(
        None,
        description="Autoscale each served version's deployment (replaces model_replicas).",
    )
    router_autoscaling: Autoscaling | None = Field(
        None,
        description="Autoscale each model's router (replaces router_replicas).",
    )
    model_threads: int = Field(1, ge=1, description="torch intra-op threads per model replica.")
    auth_token_env: str = Field(
        "SHARDLINE_SERVE_TOKEN",
        description="Environment variable holding the API's bearer token; unset (and no secret block) = no auth.",
    )
    auth_secret_block: str = Field("", description="Prefect Secret block holding the bearer token instead.")
    drain_timeout_s: float = Field(
        30.0, gt=0, description="How long a removed version's replicas may finish requests in flight."
    )

    @field_validator("auth_token_env")
    @classmethod
    def _a_variable_name(cls, name: str) -> str:
        # the token itself pasted here would reach Prefect's parameters and MLflow, and the endpoint would serve
        # without auth (no variable has that name); the message does not echo it
        if name and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):  # "" reads no variable: no auth
            raise ValueError("the name of an environment variable (e.g. SHARDLINE_SERVE_TOKEN), not the token itself")
        return name

    @field_validator("app_name")
    @classmethod
    def _shardline_app_name(cls, name: str) -> str:
        if name and not name.startswith("shardline-"):
            raise ValueError(
                f"serve.app_name must start with 'shardline-' (the gateway serves only shardline's "
                f"applications), got {name!r}"
            )
        return name

    @field_validator("chat_template")
    @classmethod
    def _chat_template_parses(cls, source: str) -> str:
        if source:
            from training.chat_template import compile_template

            compile_template(source)  # a syntax error is one line at config load, not a 400 on every chat request
        return source

    @field_validator("route_prefix")
    @classmethod
    def _route_prefix(cls, prefix: str) -> str:
        if not prefix.startswith("/") or (len(prefix) > 1 and prefix.endswith("/")):
            raise ValueError(f"serve.route_prefix must start with '/' and not end with one, got {prefix!r}")
        return prefix

    @model_validator(mode="after")
    def _prompt_limit_fits_the_body_limit(self) -> ServeConfig:
        # a prompt one byte over max_prompt_bytes must still arrive in a body the gateway reads, or its 400 (which
        # says which limit) never answers: every prompt past the body limit is a bare 413 instead
        most = self.max_request_bytes - PROMPT_ENVELOPE_BYTES - 1
        if self.max_prompt_bytes > most:
            raise ValueError(
                f"serve.max_prompt_bytes={self.max_prompt_bytes} does not fit in serve.max_request_bytes="
                f"{self.max_request_bytes}: a longer prompt gets the body's 413, never its own 400; set "
                f"serve.max_prompt_bytes to at most {most} or raise serve.max_request_bytes"
            )
        return self


class PromQLGate(BaseModel):
    """A canary gate on a Prometheus query, read at the end of every step."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    name: str = Field(min_length=1, description="Names the gate in reasons, logs and metrics (step<p>.promql.<name>).")
    query: str = Field(
        min_length=1,
        description="PromQL instant query returning one sample; $model, $champion and $challenger "
        "are replaced by the model's name and the two versions.",
    )
    max: float | None = Field(None, description="The step fails when the value is above this.")
    min: float | None = Field(None, description="The step fails when the value is below this.")
    critical: bool = Field(
        True,
        description="true: a breach fails the step (no sample: inconclusive). false: report-only, logged "
        "with the step and never deciding.",
    )

    @model_validator(mode="after")
    def _a_threshold(self) -> PromQLGate:
        if self.max is None and self.min is None:
            raise ValueError(f"canary.promql_gates[{self.name}]: give max, min or both")
        return self


class CanaryConfig(BaseModel):
    """How the challenger is ramped against the champion on the live endpoint, and the gates it must pass."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    enabled: bool = Field(True, description="Run the canary when a champion exists.")
    steps: list[int] = Field(
        [10, 50, 100], description="Percent of traffic sent to the challenger at each ramp step, ascending."
    )
    min_requests: int = Field(
        20, ge=1, description="Challenger-served requests a step needs before it is judged (live plus probe)."
    )
    bake_seconds: float = Field(5.0, ge=0, description="Least time a step runs before it is judged.")
    step_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A step that has not seen min_requests (and min_paired pairs) by then fails (too little evidence).",
    )
    probe_rps: float = Field(
        0.0,
        ge=0,
        description="Probe requests per second from held-out text topping up thin live traffic "
        "(0 = off); labelled source=probe in metrics and reports.",
    )
    warmup_requests: int = Field(
        8,
        ge=0,
        le=1000,
        description="Requests sent to the challenger alone (x-shardline-variant, never evidence) once its replicas "
        "are up and before the first step counts, half /v1/score and half /v1/completions: its first calls pay "
        "one-time costs that would otherwise be judged as its latency (0 = off).",
    )
    shadow_share: float = Field(
        1.0, gt=0, le=1, description="Share of challenger-served requests also scored by the champion (paired)."
    )
    min_paired: int = Field(10, ge=2, description="Paired requests a step waits for; fewer cannot pass.")
    confidence: float = Field(
        0.95, gt=0.5, lt=1, description="One-sided confidence of the paired bootstrap bound on the bpb regression."
    )
    max_error_rate_increase: float = Field(
        0.0, ge=0, description="Fail when challenger error rate exceeds champion's by more than this."
    )
    max_p95_latency_ratio: float = Field(
        3.0, gt=0, description="Fail when challenger p95 latency exceeds champion's by more than this factor."
    )
    max_p99_latency_ratio: float = Field(
        5.0, gt=0, description="Fail when challenger p99 latency exceeds champion's by more than this factor."
    )
    max_bpb_regression: float = Field(
        0.05,
        ge=0,
        description="Fail unless the upper confidence bound of challenger minus champion bits/byte "
        "on the same requests is at most this.",
    )
    latency_floor_ms: float = Field(
        5.0,
        ge=0,
        description="Latencies below this count as this in the latency gates (sub-ms noise is no regression).",
    )
    lease_s: float = Field(
        20.0,
        ge=2,
        description="Dead man's switch: without a lease renewal for this long the router sends all "
        "traffic to the champion by itself.",
    )
    max_probe_bytes: int = Field(1024, ge=16, description="Held-out text per probe request is cut to this.")
    seed: int = Field(0, description="Seed of routing, probe order and the bootstrap.")
    lock_timeout_s: float = Field(
        7200.0,
        gt=0,
        description="How long a run waits for the model's release lock (another run's canary). The default outlasts "
        "a manual approval's default wait (canary.approval_timeout_s, 3600) with its steps, so a run queued behind "
        "a canary nobody approves gets the lock once that canary rolls back, rather than failing just before.",
    )
    mode: Literal["canary", "shadow"] = Field(
        "canary",
        description="canary: each step's share of requests is answered by the challenger. shadow: that "
        "share is mirrored to the challenger, whose answers are scored as evidence but never returned (the "
        "champion answers every client).",
    )
    approval: Literal["auto", "manual"] = Field(
        "auto",
        description="auto: promote once every step passed. manual: hold the last step below 100% in state "
        "'awaiting-approval' until `shardline canary promote` (or abort); needs a step below 100.",
    )
    approval_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="How long a manual approval is awaited; then the canary rolls back (verdict 'aborted').",
    )
    pause_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="How long an operator's pause may hold a step; then the canary rolls back (verdict "
        "'aborted'), so a forgotten pause does not hold the model's release lock for ever: below "
        "canary.lock_timeout_s, a run queued behind it still gets the lock.",
    )
    on_inconclusive: Literal["rollback", "extend"] = Field(
        "rollback",
        description="A step with too little evidence is inconclusive, not failed. rollback: the canary "
        "ends 'inconclusive' (the champion stays; the version is not marked rejected). extend: the step runs again, "
        "up to canary.max_extensions more times.",
    )
    max_extensions: int = Field(2, ge=0, description="Re-runs of an inconclusive step when on_inconclusive='extend'.")
    control_poll_s: float = Field(
        1.0,
        gt=0,
        description="How often the driver reads operator commands (pause, resume, promote, abort).",
    )
    prometheus_url: str = Field("", description="Prometheus server (its HTTP API) that canary.promql_gates query.")
    promql_gates: list[PromQLGate] = Field(
        [],
        description="Gates on PromQL queries, besides the built-in ones; critical ones decide, report-only ones "
        "are logged.",
    )

    @field_validator("steps")
    @classmethod
    def _ascending_percentages(cls, steps: list[int]) -> list[int]:
        # strictly: a repeated step would bake the same share twice (on_inconclusive="extend" is the way to hold it)
        if not steps or any(not 0 < s <= 100 for s in steps) or any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(f"canary.steps must be strictly ascending percentages in (0, 100], got {steps}")
        return steps

    @model_validator(mode="after")
    def _manual_needs_a_step_to_hold(self) -> CanaryConfig:
        if self.approval == "manual" and not any(s < 100 for s in self.steps):
            raise ValueError(
                f"canary.approval='manual' holds the last step below 100% until approved, but "
                f"canary.steps={self.steps} has none"
            )
        if self.promql_gates and not self.prometheus_url:
            raise ValueError("canary.promql_gates need canary.prometheus_url (the Prometheus server they query)")
        return self
