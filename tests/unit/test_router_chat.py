"""Which template renders a chat request: the router picks the version, then renders with that version's own
template (its tokenizer's), unless serve.chat_template overrides every version's. Each version's template is what
its replica said once (Router.templates); here it is given, so no replica runs."""

from __future__ import annotations

import asyncio

import pytest

from deployments.openai_api import ApiError
from deployments.openai_chat import parse_chat
from deployments.router_config import Job, RouterConfig
from deployments.serve_app import Router
from training.chat_template import ChatFormat

OWN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
OTHER = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
MESSAGES = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _render(templates: dict[str, str | ChatFormat], to_challenger: bool, variant: str = "", **cfg: object):
    router = Router("shardline-m", {})
    router.templates = {v: ChatFormat.given(t) for v, t in templates.items()}
    config = RouterConfig(model_name="m", champion="1", challenger="2", challenger_percent=50, **cfg)
    req, messages = parse_chat(MESSAGES, config.max_tokens_cap)
    job = Job("chat", req, config, False, variant, messages)
    return asyncio.run(router._render(job, to_challenger, to_challenger))


def test_each_version_answers_in_its_own_format():
    job, to_challenger, paired = _render({"1": OWN, "2": OTHER}, True)
    # not paired: the champion would be scored on a prompt in the challenger's format
    assert (to_challenger, paired) == (True, False)
    assert job.at("1").req.prompt == "<user>hi<assistant>" and job.at("2").req.prompt == "user: hi\nassistant:"
    assert job.at("2").req.max_tokens == 4 and job.req.prompt == "?"  # the placeholder until a version is picked
    job, to_challenger, _ = _render({"1": OWN, "2": OTHER}, False)
    assert not to_challenger and set(job.rendered) == {"1"}  # the challenger's is not rendered when not asked


def test_serve_chat_template_overrides_every_versions_own():
    job, to_challenger, paired = _render({"1": OWN, "2": ""}, True, chat_template=OTHER)
    assert job.at("1").req.prompt == job.at("2").req.prompt == "user: hi\nassistant:"
    assert (to_challenger, paired) == (True, True)  # one format: the champion is scored on the same prompt
    assert _render({"1": OWN, "2": OWN}, True)[1:] == (True, True)


def test_a_template_sees_its_own_tokenizers_special_tokens_and_an_override_keeps_them():
    """As transformers passes a tokenizer's bos_token and eos_token to its template: each version's own."""
    llama = "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{{ eos_token }}{% endfor %}"
    one = ChatFormat(llama, bos_token="<s>", eos_token="</s>")
    two = ChatFormat(llama, eos_token="<|endoftext|>")
    job, to_challenger, paired = _render({"1": one, "2": two}, True)
    assert job.at("1").req.prompt == "<s>[hi]</s>" and job.at("2").req.prompt == "[hi]<|endoftext|>"
    assert (to_challenger, paired) == (True, False)  # one template, other tokens: another prompt, not paired
    # other tokens a template never writes: the same prompt, paired (a version logged before tokens were carried)
    assert _render({"1": ChatFormat(OWN), "2": ChatFormat(OWN, eos_token="</s>")}, True)[1:] == (True, True)
    job, _, paired = _render({"1": one, "2": one}, True, chat_template="{{ bos_token }}{{ messages[0].content }}")
    assert job.at("1").req.prompt == job.at("2").req.prompt == "<s>hi" and paired
    # a version without a template of its own still carries its tokens: an override renders with them
    job, _, _ = _render({"1": ChatFormat("", bos_token="<s>"), "2": ""}, False, chat_template="{{ bos_token }}x")
    assert job.at("1").req.prompt == "<s>x"


def test_a_challenger_without_a_template_is_not_asked_chat():
    job, to_challenger, paired = _render({"1": OWN, "2": ""}, True)
    assert (to_challenger, paired) == (False, False) and set(job.rendered) == {"1"}
    with pytest.raises(ApiError) as err:  # a tester who asks for it gets the reason
        _render({"1": OWN, "2": ""}, True, variant="challenger")
    assert err.value.status == 400 and err.value.code == "no_chat_template"
    assert err.value.message.startswith("m version 2 has no chat template")


def test_a_champion_without_one_answers_chat_only_through_a_challenger_that_has_one():
    with pytest.raises(ApiError, match=r"^m version 1 has no chat template \(its tokenizer carries none and"):
        _render({"1": "", "2": OWN}, False)
    job, to_challenger, _ = _render({"1": "", "2": OWN}, True)
    assert to_challenger and set(job.rendered) == {"2"}  # if it fails, no champion can answer in its place


def test_in_shadow_mode_the_champion_answers_and_the_challenger_gets_its_own_rendering():
    job, to_challenger, _ = _render({"1": OWN, "2": OTHER}, True, mode="shadow")
    assert to_challenger and set(job.rendered) == {"1", "2"}
    with pytest.raises(ApiError, match="m version 1 has no chat template"):  # the client is the champion's
        _render({"1": "", "2": OWN}, True, mode="shadow")


def test_a_template_that_refuses_the_answering_versions_messages_is_a_400():
    refusing = "{{ raise_exception('no user turns here') }}"
    with pytest.raises(ApiError, match="chat template refused them: no user turns here"):
        _render({"1": refusing, "2": OWN}, False)
    job, to_challenger, _ = _render({"1": refusing, "2": OWN}, True)  # the challenger answers; no fallback format
    assert to_challenger and set(job.rendered) == {"2"}
    # a challenger whose template refuses what the champion's accepts is not asked: the champion answers
    job, to_challenger, paired = _render({"1": OWN, "2": refusing}, True)
    assert (to_challenger, paired) == (False, False) and set(job.rendered) == {"1"}
    with pytest.raises(ApiError, match="no user turns here"):  # a tester who asks for it gets the reason
        _render({"1": OWN, "2": refusing}, True, variant="challenger")
