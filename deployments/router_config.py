"""A model router's configuration (its Serve `user_config`), the request it routes, and the headers it reads.

RouterConfig is the desired routing state the control side (deployments/endpoint) writes with lightweight
`reconfigure()` updates; Job is one validated request. Plain data: importing this needs no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.openai_api import CompletionRequest, ScoreRequest

ROUTER = "router"  # the router deployment's name in every model application
VERSION_HEADER = "x-shardline-model-version"
PROBE_HEADER = "x-shardline-probe"
VARIANT_HEADER = "x-shardline-variant"  # challenger|champion: a tester reaches a version; never evidence
# set by the gateway on every request it forwards (a client's own value is replaced): a request the gateway resends
# after its router replica died carries the same id, so the Evidence deployment counts it once
REQUEST_ID_HEADER = "x-shardline-request-id"


class RouterConfig(BaseModel):
    """The router's user_config: the served versions, the challenger's weight and lease, the request limits."""

    model_config = ConfigDict(extra="forbid")

    model_name: str
    champion: str
    challenger: str | None = None
    challenger_percent: int = Field(0, ge=0, le=100)
    shadow_share: float = Field(1.0, ge=0, le=1)
    mode: Literal["canary", "shadow"] = "canary"  # shadow: the challenger's share is mirrored, never answered by it
    lease_expires_at: float | None = None  # epoch seconds; None with no challenger
    # the lease's length: a replica also ends it this long after it got it, by its own clock, so a driver whose
    # clock runs ahead of the replica's cannot stretch the dead man's switch (None: the epoch deadline alone)
    lease_s: float | None = Field(None, gt=0)
    canary_id: str = ""  # one per canary; observations are tagged with it and the step
    epoch: int = 0  # the canary step
    seed: int = 0
    max_request_bytes: int = 65536
    body_timeout_s: float = 10.0  # serve.body_timeout_s, for a body sent to the router's own route (KubeRay)
    max_prompt_bytes: int = 4096
    max_tokens_cap: int = 256
    chat_template: str = ""  # serve.chat_template, for every version: '' = each version's own (router: _render)
    token_sha256: str = ""  # sha256 of the bearer token; "" = no auth
    gateway: str = ""  # the gateway application (one per route prefix) that serves this model
    settings: str = ""  # endpoint.settings_version: code and deploy-time settings the application was built with

    def effective_percent(self, now: float, held_s: float = 0.0) -> int:
        """The challenger's weight now: 0 without a challenger or once its lease ran out (dead man's switch): at
        `lease_expires_at` (epoch `now`), or `lease_s` after this replica got the lease (`held_s`, its own
        monotonic clock), whichever comes first."""
        if self.challenger is None or self.lease_expires_at is None or now >= self.lease_expires_at:
            return 0
        if self.lease_s is not None and held_s >= self.lease_s:
            return 0
        return self.challenger_percent


@dataclass
class Job:
    """A validated request, ready to be routed."""

    endpoint: str
    req: CompletionRequest | ScoreRequest
    cfg: RouterConfig
    probe: bool
    variant: str  # "" = routed by weight
    # a chat request: its messages, and the completion each version runs them as once its template rendered them
    messages: list[dict[str, str]] | None = None
    rendered: dict[str, CompletionRequest] = field(default_factory=dict)
    request_id: str = ""  # the gateway's id of this request ("" when it did not come through the gateway)

    def at(self, version: str) -> Job:
        """The job as `version` answers it: a chat request with the prompt that version's template rendered."""
        return self if self.messages is None else replace(self, req=self.rendered[version])

    @property
    def text(self) -> bytes:
        return (self.req.prompt if isinstance(self.req, CompletionRequest) else self.req.text).encode("utf-8")

    def op_args(self) -> tuple[str, tuple[Any, ...]]:
        if isinstance(self.req, ScoreRequest):
            return "score", (self.text,)
        r = self.req
        params = {
            "max_tokens": r.max_tokens,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k,
            "seed": r.seed,
            "stop": r.stops(),
            "logprobs": r.logprobs,
            "echo": r.echo,
        }
        return "complete", (self.text, params)
