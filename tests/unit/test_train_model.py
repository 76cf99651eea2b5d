"""The byte-level GPT: shapes, initial loss, FLOPs per token, plug-in factory resolution."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.config import TrainConfig
from training.model import GPT, build_gpt, flops_per_token

CFG = TrainConfig(seq_len=32, n_layer=2, n_head=4, d_model=32)


def test_logits_shape_for_any_length_up_to_seq_len():
    model = build_gpt(CFG)
    for t in (1, 7, 32):
        assert model(torch.randint(0, 256, (3, t))).shape == (3, t, 256)


def test_initial_loss_is_near_uniform_over_bytes():
    torch.manual_seed(0)
    model = build_gpt(CFG)
    x = torch.randint(0, 256, (4, 32))
    loss = F.cross_entropy(model(x).view(-1, 256), torch.roll(x, -1, 1).view(-1))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_attention_is_causal():
    model = build_gpt(CFG).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256  # change only the future of position 9
    assert torch.allclose(model(x)[0, :10], model(y)[0, :10], atol=1e-6)
    assert not torch.allclose(model(x)[0, 10:], model(y)[0, 10:])


def test_flops_per_token_is_6n_plus_attention():
    model = build_gpt(CFG)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("wte.", "wpe.")))
    assert flops_per_token(model, 32) == 6 * n + 12 * 2 * 32 * 32
    # a plug-in model that is not a GPT counts matmul weights only
    lin = torch.nn.Linear(4, 4)
    assert flops_per_token(lin, 32) == 6 * 20


def test_width_must_divide_heads():
    with pytest.raises(ValueError, match="d_model 30 is not divisible by n_head 4"):
        GPT(seq_len=8, n_layer=1, n_head=4, d_model=30)


def test_the_gpts_embedding_is_sized_for_the_shard_sets_ids_before_anything_trains(tmp_path):
    from support.train_support import shard_set

    from training.trainer import fit_vocabulary

    text = shard_set(tmp_path / "text", n_train=1, n_val=1)
    tokens = text.model_copy(update={"vocab_size": 4096, "token_dtype": "<u2", "tokenizer_sha256": "ab" * 32})
    cfg = TrainConfig()
    assert fit_vocabulary(cfg, text).vocab_size == 256 and fit_vocabulary(cfg, tokens).vocab_size == 4096
    padded = cfg.model_copy(update={"vocab_size": 4160})
    assert fit_vocabulary(padded, tokens).vocab_size == 4160  # a padded embedding is kept
    with pytest.raises(
        ValueError, match=r"^train.vocab_size=300: the shard set's tokenizer has 4096 ids; set it to 0 or"
    ):
        fit_vocabulary(cfg.model_copy(update={"vocab_size": 300}), tokens)
    llama = TrainConfig(
        hf_config={
            "model_type": "llama",
            "vocab_size": 256,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 256,
        }
    )
    assert fit_vocabulary(llama, text).vocab_size == 256  # the logits it trains and serves
    with pytest.raises(ValueError, match=r"^train.hf_config vocab_size=256: the shard set's tokenizer has 4096 ids"):
        fit_vocabulary(llama, tokens)


def test_a_transformers_spec_without_vocab_size_embeds_what_transformers_fills_in(tmp_path):
    from support.train_support import shard_set

    from training.trainer import fit_vocabulary

    spec = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    spec |= {"num_attention_heads": 2, "max_position_embeddings": 256}  # no vocab_size: llama's 32000
    llama = TrainConfig(hf_config=spec)
    text = shard_set(tmp_path / "text", n_train=1, n_val=1)
    assert fit_vocabulary(llama, text).vocab_size == 256  # the logits it trains and serves
    assert fit_vocabulary(llama, text.model_copy(update={"vocab_size": 4096})).vocab_size == 4096  # of 32000 rows


def test_the_data_decided_vocabulary_leaves_the_training_key_as_it_was():
    from training.resume import request_key

    # the key of the default config before train.vocab_size existed: runs recorded then still resume and reuse
    fields = {k: v for k, v in TrainConfig().model_dump().items() if k != "vocab_size"}
    from training.resume import OPERATIONAL_FIELDS, _digest

    before = _digest({"dataset": "d" * 32, "train": {k: v for k, v in fields.items() if k not in OPERATIONAL_FIELDS}})
    assert request_key(TrainConfig(), "d" * 32) == before
    assert request_key(TrainConfig(vocab_size=4160), "d" * 32) != before  # a padded embedding is another model
