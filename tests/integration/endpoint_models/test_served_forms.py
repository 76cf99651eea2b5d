"""Served forms behind the gateway: a model torch.export cannot capture, served eagerly from its factory and
weights, and a version that carries its tokenizer's chat template."""

from __future__ import annotations

import httpx
import openai
import pytest
from support.serve_support import log_model, register

from deployments import endpoint

pytestmark = pytest.mark.slow


def test_a_model_export_cannot_capture_is_served_eagerly_behind_the_gateway(world):
    """A byte-level GRU (torch.export specialises its sequence length): validation's log_servable_model logs it in
    its eager form, and the replicas rebuild it from its factory and weights. It completes and scores through the
    gateway, with the numbers the trained model gives."""
    import mlflow
    from support.train_support import build_byte_gru, ray_runtime_env

    from training.config import TrainConfig
    from training.evaluate import bits_per_byte
    from training.servable import eager_spec, log_servable_model

    cfg = TrainConfig(seq_len=32, d_model=16, model_factory="support.train_support:build_byte_gru")
    model = build_byte_gru(cfg).eval().requires_grad_(False)
    client, name, serve = world["client"], "gru-bytes", world["serve"]
    train_run = client.create_run(world["exp"], run_name="train-gru").info.run_id
    with mlflow.start_run(experiment_id=world["exp"], run_name="validate-gru"):
        uri = log_servable_model(model, 32, factory=cfg.model_factory, train_config=cfg.model_dump(mode="json"))
    assert eager_spec(uri) is not None
    assert register(client, train_run, uri, name).decision == "first-champion"
    try:
        # the factory's code reaches the replicas like the rest of the code: here, tests/ on their PYTHONPATH
        url = endpoint.reconcile(serve, name, world["uri"], runtime_env=ray_runtime_env()).url
        with httpx.Client(timeout=60) as http:
            body = {"model": name, "prompt": "def f():", "max_tokens": 5, "temperature": 0}
            r = http.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name and r.json()["usage"]["completion_tokens"] == 5
            s = http.post(f"{url}/v1/score", json={"model": name, "text": "import sys"})
            assert s.status_code == 200, s.text
        assert s.json()["bits_per_byte"] == pytest.approx(bits_per_byte(model, [b"import sys"], 32), rel=1e-4)
    finally:
        endpoint.remove(serve, name)


def test_a_version_answers_chat_in_the_template_its_tokenizer_carries(world):
    """A version logged with its tokenizer's chat template (metadata["chat_template"], as validation logs it)
    answers /v1/chat/completions with no serve.chat_template: the chat answer is the completion of the messages as
    that template renders them. serve.chat_template, when set, overrides it (vLLM's --chat-template)."""
    from training.servable import served_chat_template

    own = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    client, name, serve = world["client"], "chat-bytes", world["serve"]
    train_run, uri = log_model(world["tables"]["weak"], "chat-own", world["exp"], client, chat_template=own)
    assert register(client, train_run, uri, name).decision == "first-champion"
    assert served_chat_template(f"models:/{name}/1") == own
    try:
        url = endpoint.reconcile(serve, name, world["uri"]).url
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "def"}]

        def both(rendered: str) -> tuple[str, str]:
            chat = oai.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0)
            plain = oai.completions.create(model=name, prompt=rendered, max_tokens=6, temperature=0)
            assert chat.usage.prompt_tokens == len(rendered.encode())  # the prompt that template rendered
            return str(chat.choices[0].message.content), plain.choices[0].text

        chat, plain = both("<user>def<assistant>")
        assert chat == plain
        # a conversation goes on as clients keep it: the reply message appended as the client got it (refusal: null)
        reply = oai.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0)
        turns = [*messages, reply.choices[0].message, {"role": "user", "content": "and"}]
        again = oai.chat.completions.create(model=name, messages=turns, max_tokens=2, temperature=0, store=False)
        rendered = f"<user>def<assistant>{chat}<user>and<assistant>"
        assert again.usage.prompt_tokens == len(rendered.encode()) and again.choices[0].finish_reason == "length"
        parts = list(
            oai.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0, stream=True)
        )
        assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat
        # the operator's template wins over the version's own
        override = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
        endpoint.reconcile(serve.model_copy(update={"chat_template": override}), name, world["uri"])
        chat, plain = both("user: def\nassistant:")
        assert chat == plain
    finally:
        endpoint.remove(serve, name)
