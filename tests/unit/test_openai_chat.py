"""/v1/chat/completions before any model runs: messages rendered by the served model's chat template into the
completion they run as, every parameter the endpoint cannot honour a 400 that names it, OpenAI's chat objects."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.config import ServeConfig
from deployments.openai_api import ApiError
from deployments.openai_chat import chat_chunk, chat_completion, render, validate_chat

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ONLY_USER = (
    "{% for m in messages %}{% if m.role != 'user' %}{{ raise_exception('only user turns') }}{% endif %}{% endfor %}x"
)
HI = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_messages_become_the_prompt_the_template_renders_and_run_as_a_completion():
    assert (
        render(CHATML, HI)
        == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    req = validate_chat({"model": "m", "messages": HI, "temperature": 0, "stop": ["<|im_end|>"]}, CHATML, 4096, 64)
    assert req.prompt == render(CHATML, HI) and req.temperature == 0 and req.stops() == ["<|im_end|>"]
    assert req.max_tokens == 64  # no max_tokens: the answer may run to serve.max_tokens_cap
    assert validate_chat({"messages": HI, "max_completion_tokens": 5}, CHATML, 4096, 64).max_tokens == 5
    streamed = validate_chat(
        {"messages": HI, "stream": True, "stream_options": {"include_usage": True}}, CHATML, 4096, 64
    )
    assert streamed.stream and streamed.stream_options is not None and streamed.stream_options.include_usage
    # an explicit null is the parameter's default, as in OpenAI's API (a message's name included)
    nulls = dict.fromkeys(["max_tokens", "max_completion_tokens", "temperature", "seed", "stop", "logprobs", "tools"])
    named = [{**HI[0], "name": None}, HI[1]]
    assert validate_chat({"messages": named, **nulls}, CHATML, 4096, 64) == validate_chat(
        {"messages": HI}, CHATML, 4096, 64
    )


def test_a_chat_top_k_of_minus_one_is_vllms_disabled():
    assert validate_chat({"messages": HI, "top_k": -1}, CHATML, 4096, 64).top_k == -1
    with pytest.raises(ApiError) as err:
        validate_chat({"messages": HI, "top_k": -2}, CHATML, 4096, 64)
    assert err.value.status == 400 and err.value.param == "top_k"


def test_a_conversation_that_sends_the_endpoints_own_reply_back_renders():
    """Clients append the assistant message they got (with `refusal: null`, and from other servers `tool_calls: []`
    or `content: null`) and send the conversation again; and they send OpenAI's neutral parameters explicitly."""
    reply = {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": [], "annotations": []}
    turns = [*HI, reply, {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    neutral = {"store": False, "service_tier": "auto", "tool_choice": "none", "modalities": ["text"]}
    neutral |= {
        "parallel_tool_calls": True,
        "metadata": {"app": "x"},
        "prompt_cache_key": "k",
        "safety_identifier": "s",
    }
    req = validate_chat({"messages": turns, **neutral, "top_p": 0, "seed": -1}, CHATML, 4096, 64)
    plain = [*HI, {"role": "assistant", "content": "hello"}, {"role": "assistant", "content": ""}, turns[-1]]
    assert req.prompt == render(CHATML, plain)
    assert (req.top_p, req.seed) == (0.0, -1)  # OpenAI's ranges, as on /v1/completions


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"messages": HI, "n": 2}, "n: only 1 is supported, got 2", "n"),
        ({"messages": HI, "logprobs": True}, "logprobs: only False is supported, got True", "logprobs"),
        ({"messages": HI, "tools": [{"type": "function"}]}, "tools: only None is supported", "tools"),
        ({"messages": HI, "functions": [{"name": "f"}]}, "functions: only None is supported", "functions"),
        ({"messages": HI, "functionz": []}, "functionz: unsupported parameter", "functionz"),
        (
            {"messages": [{"role": "user", "content": "x", "dict": 1}]},
            "messages[0].dict: unsupported parameter",  # a key that reads like a union member's label is named
            "messages[0].dict",
        ),
        ({"messages": HI, "tools": ["t" * 5000]}, f"tools: only None is supported, got ['{'t' * 55}...", "tools"),
        ({"messages": HI, "store": True}, "store: only False is supported, got True", "store"),
        ({"messages": HI, "reasoning_effort": "low"}, "reasoning_effort: only None is supported", "reasoning_effort"),
        ({"messages": [{"role": "user"}]}, "messages[0].content: required for a user message", "messages[0].content"),
        (
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
            "messages[0].tool_calls: only null or empty is supported",
            "messages[0].tool_calls",
        ),
        ({"messages": []}, "messages: List should have at least 1 item", "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role: Input should be", "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            'messages[0].content: only a string or text parts ({"type": "text", "text": ...})',
            "messages[0].content",
        ),
        ({"messages": HI, "max_tokens": 65}, "max_tokens: 65 > serve.max_tokens_cap=64", "max_tokens"),
        (
            {"messages": HI, "max_completion_tokens": 99},
            "max_completion_tokens: 99 > serve.max_tokens_cap=64",
            "max_completion_tokens",
        ),
        ({"messages": HI, "response_format": {"type": "json_object"}}, "response_format: only None", "response_format"),
        ({"messages": HI, "max_tokens": 2, "max_completion_tokens": 2}, "give one", "max_completion_tokens"),
        # an empty value of a parameter that is not a list of things is not its neutral value (OpenAI refuses it)
        ({"messages": HI, "response_format": {}}, "response_format: only None is supported, got {}", "response_format"),
        ({"messages": HI, "tool_choice": ""}, "tool_choice: only None is supported, got ''", "tool_choice"),
        (
            {"messages": [{"role": "user", "content": []}]},
            "messages[0].content: only a string or text parts",
            "messages[0].content",
        ),
        ({"messages": HI, "stop": {}}, "stop: a string or a list of at most 4 strings, got {}", "stop"),
        (
            {"messages": HI, "stream_options": {"include_usage": True}},
            "stream_options: only allowed with stream: true",
            "stream_options",
        ),
        (
            {"messages": [{"role": "user", "content": "y" * 90}]},
            "messages: the rendered prompt has more than serve.max_prompt_bytes=100 bytes",
            "messages",
        ),
    ],
)  # fmt: skip
def test_a_chat_parameter_the_endpoint_cannot_honour_is_a_400_that_names_it(body, message, param):
    with pytest.raises(ApiError) as err:
        validate_chat(body, CHATML, 100, 64)
    assert err.value.status == 400 and message in err.value.message and err.value.param == param, err.value.message


def test_a_template_that_refuses_the_messages_is_a_400_with_its_reason_in_one_line():
    with pytest.raises(ApiError, match="the model's chat template refused them: only user turns") as err:
        validate_chat({"messages": HI}, ONLY_USER, 4096, 64)
    assert err.value.param == "messages"
    assert validate_chat({"messages": HI[1:]}, ONLY_USER, 4096, 64).prompt == "x"
    for broken, cause in [
        ("{{ raise_exception('first\\nsecond') }}", "refused them: first"),
        ("{{ (messages|length) // 0 }}", "refused them: ZeroDivisionError: integer division or modulo by zero"),
    ]:
        with pytest.raises(ApiError) as err:
            validate_chat({"messages": HI}, broken, 4096, 64)
        assert err.value.status == 400 and err.value.message.endswith(cause) and "\n" not in err.value.message


def test_what_common_clients_send_renders_as_transformers_renders_it():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    req = validate_chat({"messages": parts, "response_format": {"type": "text"}}, CHATML, 4096, 64)
    assert req.prompt == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"  # text parts joined
    loops = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content | tojson }}{% endfor %}"
    assert render(loops, [{"role": "user", "content": "é<b>"}, {"role": "user", "content": "never"}]) == '"é<b>"'
    assert render("{{ strftime_now('%Y') }}", HI).isdigit()


def test_the_template_runs_in_jinjas_sandbox():
    with pytest.raises(ApiError, match="refused them"):  # no reaching out of the sandbox through the messages
        render("{{ messages.__class__.__mro__[1].__subclasses__() }}", HI)


def test_a_template_that_does_not_parse_is_one_line_at_config_load():
    with pytest.raises(ValidationError) as err:
        ServeConfig(chat_template="{% for m in messages %}{{ m.content }}")
    (problem,) = err.value.errors()
    assert (
        problem["loc"] == ("chat_template",)
        and "not a Jinja template: line 1: Unexpected end of template" in problem["msg"]
    )
    assert ServeConfig(chat_template=CHATML).chat_template == CHATML


def test_the_chat_objects_are_openais():
    done = chat_completion("chatcmpl-1", "m", "3", "hello", "stop", 12, 5, 2.5)
    assert done["object"] == "chat.completion" and done["model_version"] == "3"
    assert done["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hello", "refusal": None},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]
    assert done["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    piece = chat_chunk("chatcmpl-1", "m", "3", {"content": "he"}, None)
    assert piece["object"] == "chat.completion.chunk" and piece["choices"][0]["delta"] == {"content": "he"}


def test_a_tokenizers_chat_template_is_read_from_a_hugging_face_directory_or_named_file(tmp_path):
    """The template a version will carry: `tokenizer.chat_template` (a .jinja file, or a tokenizer_config.json's
    "chat_template"), else, for a tokenizer.json, the one beside it as transformers saves a tokenizer directory
    (chat_template.jinja first). A named one that is not a usable template is one line naming the file."""
    import json

    from flows.config import ConfigError, PipelineConfig, chat_template_of
    from training import chat_template

    hf = tmp_path / "hf-tokenizer"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")
    tok = {"kind": "file", "path": str(hf / "tokenizer.json")}

    def of(**section: str) -> str:
        return chat_template_of(PipelineConfig.model_validate({"tokenizer": section})).template

    assert of(**tok) == ""  # a directory without a template: none, not an error
    (hf / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    assert of(**tok) == ""  # a tokenizer_config.json without one is just that
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    assert of(**tok) == CHATML
    (hf / "chat_template.jinja").write_text(ONLY_USER)
    assert of(**tok) == ONLY_USER  # transformers >= 4.47 saves it as its own file, which wins
    assert of(**tok, chat_template=str(hf / "tokenizer_config.json")) == CHATML  # named explicitly
    assert of(chat_template=str(hf / "chat_template.jinja")) == ONLY_USER  # any tokenizer kind, bytes included
    assert of() == ""
    assert chat_template.fingerprint(CHATML) == chat_template.fingerprint(
        of(**tok, chat_template=str(hf / "tokenizer_config.json"))
    )

    # one merely found there that is not usable is left out with one warning: a directory that trained still trains
    (hf / "chat_template.jinja").write_text("{% for m in messages %}")
    warnings: list[str] = []
    found = chat_template_of(PipelineConfig.model_validate({"tokenizer": tok}), warn=warnings.append)
    assert not found and warnings == [
        f"tokenizer.path: the chat template beside it is not used: {hf / 'chat_template.jinja'}: not a Jinja "
        "template: line 1: Unexpected end of template. Jinja was looking for the following tags: 'endfor' or "
        "'else'. The innermost block that needs to be closed is 'for'."
    ]
    # named, it must be usable: one line naming the file
    with pytest.raises(ConfigError) as err:
        of(chat_template=str(hf / "chat_template.jinja"))
    assert str(err.value).startswith(
        f"config: tokenizer.chat_template: {hf / 'chat_template.jinja'}: not a Jinja template: line 1: "
    )
    # transformers' list of named templates: the one named 'default', as apply_chat_template picks it
    listed = tmp_path / "listed.json"
    listed.write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]})
    )
    assert of(chat_template=str(listed)) == CHATML
    listed.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]}))
    with pytest.raises(ConfigError, match=r"listed.json: has no chat_template \(a string, or a list of named ones"):
        of(chat_template=str(listed))
    with pytest.raises(ConfigError, match="missing.jinja: cannot be read"):
        of(chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "latin1.jinja").write_bytes(b"caf\xe9")
    with pytest.raises(ConfigError, match=r"latin1.jinja: not UTF-8 text \(byte 3\)"):
        of(chat_template=str(tmp_path / "latin1.jinja"))


def test_a_template_carries_the_special_tokens_its_tokenizer_config_names(tmp_path):
    """bos_token and eos_token as transformers gives them to a template: from the tokenizer_config.json named as
    the template, else the one beside tokenizer.path (a string, or an AddedToken's content); none otherwise."""
    import json

    from flows.config import PipelineConfig, chat_template_of
    from training.chat_template import ChatFormat

    hf = tmp_path / "llama-tokenizer"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")
    (hf / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}")
    tok = {"kind": "file", "path": str(hf / "tokenizer.json")}

    def of(**section: str) -> ChatFormat:
        return chat_template_of(PipelineConfig.model_validate({"tokenizer": section}))

    assert of(**tok).tokens() == {}  # a directory without a tokenizer_config.json names none
    (hf / "chat_template.jinja").rename(hf / "kept.jinja")
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert not of(**tok) and of(**tok).tokens() == {"eos_token": "</s>"}  # no template: tokens for an override
    (hf / "kept.jinja").rename(hf / "chat_template.jinja")
    (hf / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>", "pad_token": None})
    )
    assert of(**tok) == ChatFormat(of(**tok).template, bos_token="<s>", eos_token="</s>")
    named = tmp_path / "other_config.json"
    named.write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    assert of(**tok, chat_template=str(named)) == ChatFormat(CHATML, eos_token="<|im_end|>")
    assert of(chat_template=str(hf / "chat_template.jinja")).tokens() == {}  # bytes: no tokenizer to name them
    # an older directory keeps them in special_tokens_map.json: as transformers 5 reads it, its tokens override the
    # tokenizer_config.json's, and it is not read when that file has an added_tokens_decoder
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (hf / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<eos>"}))
    assert of(**tok).tokens() == {"bos_token": "<s>", "eos_token": "<eos>"}
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "added_tokens_decoder": {}}))
    assert of(**tok).tokens() == {"eos_token": "</s>"}
    # one directory, as transformers loads one: a named config's map is the one beside it, not tokenizer.path's
    assert of(**tok, chat_template=str(named)).tokens() == {"eos_token": "<|im_end|>"}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert of(**tok, chat_template=str(named)).tokens() == {"eos_token": "<|endoftext|>"}
    # one that cannot be read is one warning line, and its tokens are not used
    (hf / "tokenizer_config.json").write_text("{not json")
    warnings: list[str] = []
    found = chat_template_of(PipelineConfig.model_validate({"tokenizer": tok}), warn=warnings.append)
    assert found.tokens() == {"bos_token": "<s>", "eos_token": "<eos>"}
    assert warnings == [
        f"tokenizer: the special tokens of the chat template are not used: {hf / 'tokenizer_config.json'}: not JSON"
    ]


@pytest.mark.parametrize(
    "config, tokens_map",
    [
        ({"eos_token": "</s>"}, {"bos_token": "<s>", "eos_token": "<eos>"}),  # the map overrides
        ({"eos_token": "</s>", "added_tokens_decoder": {}}, {"bos_token": "<s>", "eos_token": "<eos>"}),  # not read
        ({"bos_token": {"content": "<s>", "__type": "AddedToken"}}, None),
        ({}, {"eos_token": {"content": "<eos>", "special": True}}),
        ({"eos_token": "</s>", "bos_token": "<s>"}, {"eos_token": None}),  # the map's null clears the config's
    ],
)
def test_the_special_tokens_are_the_ones_transformers_loads(tmp_path, config, tokens_map):
    """The bos_token and eos_token shardline reads from a tokenizer directory are the ones AutoTokenizer loads
    from it (transformers, from the local directory: nothing is fetched)."""
    import json
    import logging

    from transformers import AutoTokenizer

    from flows.config import PipelineConfig, chat_template_of
    from training import tokenizer as tk

    (tmp_path / "tokenizer.json").write_text(tk.train_bpe([b"def main():\n    return 0\n" * 20], 270).to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if tokens_map is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(tokens_map))
    ours = chat_template_of(
        PipelineConfig.model_validate({"tokenizer": {"kind": "file", "path": str(tmp_path / "tokenizer.json")}})
    )
    logging.getLogger("transformers").setLevel(logging.ERROR)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    expected = {k: getattr(theirs, k) for k in ("bos_token", "eos_token") if getattr(theirs, k)}
    assert ours.tokens() == expected and expected  # every case names at least one


def test_rendering_stops_at_the_prompt_limit_and_at_its_time_budget():
    from training.chat_template import PromptTooLong, TemplateRefused
    from training.chat_template import render as render_bounded

    # 10^10 pieces of output without the limit: rendering stops just past serve.max_prompt_bytes
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    with pytest.raises(ApiError, match="more than serve.max_prompt_bytes=4096 bytes") as err:
        validate_chat({"messages": HI}, endless, 4096, 64)
    assert err.value.status == 400 and err.value.param == "messages"
    # a template that writes nothing while it loops over the messages is stopped by its budget (8*10^9 reads
    # of m.content without it)
    many = [{"role": "user", "content": "x"}] * 2000
    silent = "{% for a in messages %}{% for b in messages %}{% for c in messages %}{% if c.content == 'y' %}y"
    silent += "{% endif %}{% endfor %}{% endfor %}{% endfor %}done"
    with pytest.raises(TemplateRefused, match=r"^rendering took more than 0\.05 s of CPU time$"):
        render_bounded(silent, many, budget_s=0.05)
    # loops that read and write nothing, or whose output Jinja collects whole (a macro, a set or filter block),
    # are held to the budget at every iteration
    hidden = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    for template in [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% macro m() %}" + hidden + "{% endmacro %}{{ m() }}",
        "{% set s %}" + hidden + "{% endset %}{{ s }}",
        "{% filter trim %}" + hidden + "{% endfilter %}",
    ]:
        with pytest.raises(TemplateRefused, match="rendering took more than 0.05 s"):
            render_bounded(template, HI, max_bytes=4096, budget_s=0.05)
    # what the loop guard must leave as it was: Jinja's loop variable, filters on the loop, else, recursion
    loops = (
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{% if loop.last %}!{% endif %};{% endfor %}"
        "{% for x in range(3)|reverse %}{{ x }}{% endfor %}{% for m in messages if m.role == 'user' %}u{% endfor %}"
        "{% for x in [] %}{% else %}none{% endfor %}"
        "{% for m in messages recursive %}{{ m.role }}{% if m.parts %}({{ loop(m.parts) }}){% endif %}{% endfor %}"
    )
    nested = [{"role": "system", "content": ""}, {"role": "user", "content": "", "parts": [{"role": "a"}]}]
    assert render_bounded(loops, nested) == "1/2;2/2!;210unonesystemuser(a)"
    assert render_bounded(silent, many[:20], budget_s=5.0) == "done"
    with pytest.raises(PromptTooLong):
        render_bounded("{{ messages[0].content }}", [{"role": "user", "content": "é" * 3}], max_bytes=5)
    assert render_bounded("{{ messages[0].content }}", [{"role": "user", "content": "é" * 3}], max_bytes=6) == "ééé"


def test_empty_tools_mean_none_and_half_a_surrogate_pair_is_refused_where_it_is():
    from deployments.openai_api import parse_json

    validate_chat({"messages": HI, "tools": [], "functions": [], "logit_bias": {}}, CHATML, 4096, 64)
    with pytest.raises(ApiError) as err:
        parse_json(b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\\udc00"}]}')
    assert (err.value.status, err.value.param) == (400, "messages[1].content"), err.value.message
