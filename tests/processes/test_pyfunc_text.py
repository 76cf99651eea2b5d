"""A registered version is text in, text out for anyone with MLflow: `mlflow.pyfunc.load_model("models:/NAME@champion")`
in a plain Python process outside the checkout, where shardline cannot be imported, generates the completion the
trained model's own greedy decoding gives. One model of each kind: the built-in GPT over a BPE trained here (a pt2
program), a transformers Llama over bytes and one over the BPE (MLflow's transformers flavor: a text-generation
pipeline, transformers' own params), and a GRU export cannot capture (rebuilt from its code_paths)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support.train_support import TINY_LLAMA, build_byte_gru

from training import tokenizer as tk
from training.config import TrainConfig, load_object
from training.servable import eager_spec, log_servable_model

# Runs in a child process, cwd outside the checkout, with the editable install's finder taken away first: any import
# of shardline's packages that is not from the model's own code_paths fails there.
CHILD = textwrap.dedent(
    """
    import json, sys
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path = [p for p in sys.path if p not in ("", ".", sys.argv[1])]
    import mlflow
    model = mlflow.pyfunc.load_model(sys.argv[2])
    texts = model.predict(["def main():", "import os"], params=json.loads(sys.argv[3]))
    ours = {m: getattr(sys.modules[m], "__file__", None) for m in ("training", "infra", "deployments", "flows", "tasks")
            if m in sys.modules}
    print(json.dumps({"texts": texts, "ours": ours}))
    """
)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids) :]


def _models():
    torch.manual_seed(0)
    tok = tk.train_bpe([b"def main():\n    return 0\n" * 30, b"import os\nimport sys\n" * 30], 300)
    gpt_cfg = TrainConfig(seq_len=32, d_model=32, n_layer=1, n_head=2, vocab_size=tok.get_vocab_size())
    gpt = load_object(gpt_cfg.model_factory, "train.model_factory")(gpt_cfg)
    llama_cfg = TrainConfig(seq_len=32, hf_config=TINY_LLAMA)
    llama = load_object(llama_cfg.model_factory, "train.model_factory")(llama_cfg)
    # an embedding padded past the tokenizer's 300 ids: the pipeline must never pick one of the 20 extra rows
    bpe_cfg = TrainConfig(seq_len=32, hf_config={**TINY_LLAMA, "vocab_size": 320}, vocab_size=tok.get_vocab_size())
    llama_bpe = load_object(bpe_cfg.model_factory, "train.model_factory")(bpe_cfg)
    gru_cfg = TrainConfig(seq_len=32, d_model=16, model_factory="support.train_support:build_byte_gru")
    gru = build_byte_gru(gru_cfg)
    return [
        ("gpt-bpe", gpt, gpt_cfg, tok),
        ("llama", llama, llama_cfg, None),
        ("llama-bpe", llama_bpe, bpe_cfg, tok),
        ("gru", gru, gru_cfg, None),
    ]


@pytest.mark.parametrize("kind", ["gpt-bpe", "llama", "llama-bpe", "gru"])
def test_a_registered_version_predicts_text_from_a_process_that_cannot_import_shardline(kind, mlflow_store, tmp_path):
    import mlflow

    ((_, model, cfg, tok),) = [m for m in _models() if m[0] == kind]
    model = model.eval().requires_grad_(False)
    with mlflow.start_run(experiment_id=mlflow_store[1]):
        uri = log_servable_model(
            model, 32, factory=cfg.model_factory, train_config=cfg.model_dump(mode="json"),
            tokenizer_json=tok.to_str() if tok else "",
        )  # fmt: skip
    assert (eager_spec(uri) is not None) == (kind == "gru")
    flavors = mlflow.models.get_model_info(uri).flavors
    assert ("transformers" in flavors) == kind.startswith("llama")  # a transformers model is the transformers flavor
    params = {"max_new_tokens": 6} if kind.startswith("llama") else {"max_tokens": 6}
    version = mlflow.register_model(uri, f"text-{kind}").version
    mlflow.MlflowClient().set_registered_model_alias(f"text-{kind}", "champion", version)

    outside = tmp_path / "outside"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"MLFLOW_TRACKING_URI": mlflow_store[0]}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, CHECKOUT, f"models:/text-{kind}@champion", json.dumps(params)],
        cwd=outside, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])

    want = []
    for prompt in ("def main():", "import os"):
        ids = tok.encode(prompt, add_special_tokens=False).ids if tok else list(prompt.encode())
        new = _greedy(model, ids, 6)
        if tok:
            stop = next((i for i, t in enumerate(new) if t == tok.token_to_id(tk.END_OF_TEXT)), len(new))
            want.append(tok.decode(new[:stop]))
        else:
            want.append(bytes(new).decode("utf-8", errors="replace"))
    assert got["texts"] == want and all(want)  # six ids each, none of them an end of text
    if kind == "gru":  # rebuilt by its factory from the code the model carries, not from the checkout
        assert got["ours"] and all(not f.startswith(CHECKOUT) for f in got["ours"].values())
    else:  # a pt2 program or the transformers flavor: nothing of shardline's was imported at all
        assert got["ours"] == {}


LIGHTNING_CHILD = textwrap.dedent(
    """
    import json, sys
    from training.served_forms import mlflow_pytorch
    module = mlflow_pytorch()
    loaded = {m: m in sys.modules for m in ("pytorch_lightning", "lightning", "torchmetrics")}
    same = module is sys.modules["mlflow.pytorch"] and callable(module.load_model) and callable(module.save_model)
    from mlflow.pytorch._lightning_autolog import patched_fit  # what mlflow.pytorch.autolog() imports
    print(json.dumps({"loaded": loaded, "same": same, "later": "pytorch_lightning" in sys.modules}))
    """
)


def test_mlflow_pytorch_is_imported_without_lightning_which_autolog_can_still_import():
    """Validation and every model replica import `mlflow.pytorch` without its Lightning autologging (seconds of
    pytorch_lightning and torchmetrics), in a fresh interpreter as they do; autologging still imports it later."""
    done = subprocess.run([sys.executable, "-c", LIGHTNING_CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"loaded": {"pytorch_lightning": False, "lightning": False, "torchmetrics": False}, "same": True,
                   "later": True}  # fmt: skip
