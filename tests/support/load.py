"""A bounded load generator for the live endpoint: loopback only, a fixed rate, a hard stop in count and time."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from itertools import cycle


@dataclass
class Answer:
    t: float
    status: int
    version: str
    endpoint: str


@dataclass
class Load:
    """Sends POST /v1/score and /v1/completions alternately to `url` at `rps` until stopped (or the limits)."""

    url: str
    texts: list[str]
    rps: float = 8.0
    max_requests: int = 3000
    max_seconds: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # the request's `model` field (None: the gateway's default)
    answers: list[Answer] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.url.startswith(("http://127.0.0.1:", "http://localhost:")), "load tests stay on loopback"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        import httpx

        start = time.monotonic()
        bodies = cycle(self.texts)
        with httpx.Client(timeout=60) as http:
            for i in range(self.max_requests):
                if self._stop.is_set() or time.monotonic() - start > self.max_seconds:
                    return
                t0 = time.monotonic()
                text = next(bodies)
                endpoint, body = (
                    ("score", {"text": text})
                    if i % 2 == 0
                    else ("completions", {"prompt": text[:200], "max_tokens": 4, "temperature": 0})
                )
                if self.model is not None:
                    body["model"] = self.model
                try:
                    r = http.post(f"{self.url}/v1/{endpoint}", json=body, headers=self.headers)
                    self.answers.append(
                        Answer(time.time(), r.status_code, r.headers.get("x-shardline-model-version", ""), endpoint)
                    )
                except httpx.HTTPError:
                    self.answers.append(Answer(time.time(), 0, "", endpoint))
                self._stop.wait(max(0.0, 1.0 / self.rps - (time.monotonic() - t0)))

    @property
    def failed(self) -> list[Answer]:
        return [a for a in self.answers if a.status != 200]
