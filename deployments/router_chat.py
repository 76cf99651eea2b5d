"""The router's chat requests: a version's chat template, and the messages rendered in each answering version's
format.

A mixin of deployments.serve_app.Router, which owns the versions' handles (`_handle`) and asks `_render` for a chat
job once `_choose` has picked who answers. Each version's own format comes from its replica once (`templates`:
versions never change); serve.chat_template, when set, takes the place of every version's template and keeps its
tokenizer's special tokens. Rendering runs off the event loop, within training.chat_template's RENDER_BUDGET_S.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from deployments.openai_api import ApiError, CompletionRequest
from deployments.openai_chat import render_prompt
from deployments.router_config import Job
from training.chat_template import ChatFormat

log = logging.getLogger(__name__)


class RouterChat:
    """Chat templates and rendering; see the module docstring for what the router provides."""

    templates: dict[str, ChatFormat]
    _handle: Callable[[str], Any]

    async def _version_template(self, version: str) -> ChatFormat | None:
        """The chat format `version`'s tokenizer carries (false for none), asked of its replica once; None when the
        replica cannot answer."""
        if version not in self.templates:
            try:
                held = await self._handle(version).chat_template.remote()
                self.templates[version] = ChatFormat.of(str(held.get("template") or ""), held)
            except Exception as e:  # noqa: BLE001 - a replica failure: the caller decides who answers instead
                log.warning(
                    "model version %s did not say its chat template: %s", version, f"{type(e).__name__}: {e}"[:300]
                )
                return None
        return self.templates[version]

    @staticmethod
    def _override(override: str, own: ChatFormat | None) -> ChatFormat | None:
        """A version's chat format with serve.chat_template (`override`), when set, in place of its template, its
        tokenizer's special tokens kept (as vLLM's --chat-template keeps them)."""
        if not override or own is None:  # None: its replica does not answer (the caller decides who does)
            return own
        return ChatFormat.of(override, own.tokens())

    async def _render(self, job: Job, to_challenger: bool, paired: bool) -> tuple[Job, bool, bool]:
        """A chat job's messages rendered by the template of each version that may answer it (the champion, and
        the challenger when chosen): serve.chat_template when set, else the version's own.

        A challenger that cannot take the request in its own format (it has no template, its template refuses the
        messages or makes them too long, or its replica does not say) is not asked: the champion answers, and no
        evidence is recorded for it. A version that must answer (the champion, or a tester's variant) and cannot is
        a 400 that says why (a 503 when its replica does not answer). When the two formats render different
        prompts, the request is not paired: the champion would be scored on a prompt in the challenger's format.

        Returns:
            (the job with `rendered` filled, to the challenger, paired), the last two as `_choose` gave them or
            turned off.
        """
        cfg, challenger = job.cfg, str(job.cfg.challenger)
        assert job.messages is not None and isinstance(job.req, CompletionRequest)
        versions = [cfg.champion, *([challenger] if to_challenger else [])]
        templates = {v: self._override(cfg.chat_template, await self._version_template(v)) for v in versions}
        rendered: dict[str, CompletionRequest] = {}
        refusals: dict[str, ApiError] = {}
        for v, template in templates.items():
            if not template:
                continue
            try:
                # off the event loop: a template slow on these messages holds no other request (its budget ends it)
                prompt = await asyncio.to_thread(render_prompt, template, job.messages, cfg.max_prompt_bytes)
            except ApiError as e:
                refusals[v] = e
                continue
            rendered[v] = job.req.model_copy(update={"prompt": prompt})
        if to_challenger and challenger not in rendered and not job.variant:
            to_challenger = paired = False
        shadowing = to_challenger and cfg.mode == "shadow" and not job.variant  # the champion answers the client
        target = challenger if to_challenger and not shadowing else cfg.champion
        if target in refusals:
            raise refusals[target]
        if templates[target] is None:
            raise ApiError(503, f"model version {target} is not answering", kind="server_error", retry_after=1)
        if not templates[target]:
            raise ApiError(
                400,
                f"{cfg.model_name} version {target} has no chat template (its tokenizer carries none and "
                "serve.chat_template is not set): use /v1/completions",
                code="no_chat_template",
            )
        if paired and (cfg.champion not in rendered or rendered[cfg.champion].prompt != rendered[challenger].prompt):
            paired = False
        return replace(job, rendered=rendered), to_challenger, paired
