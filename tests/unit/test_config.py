"""PipelineConfig: TOML + overrides, unknown keys and bad values named, the keys scripts rely on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.config import ConfigError, PipelineConfig, apply_override, load_config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_the_embedded_single_machine_setup():
    cfg = PipelineConfig()
    assert cfg.data.source == "stdlib"
    assert cfg.data.output == ""
    assert cfg.cluster.mode == "local"
    assert cfg.train.workers == 2
    assert cfg.canary.steps == [10, 50, 100]
    assert cfg.cluster.host == "127.0.0.1" and cfg.serve.host == "127.0.0.1"
    assert cfg.validation.max_texts == 0  # the whole held-out split


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.toml")))
def test_shipped_configs_load(name):
    cfg = load_config(REPO / "configs" / name)
    assert cfg.train.steps >= cfg.train.checkpoint_every


def test_stable_key_names_exist():
    # Scripts and other tools rely on these names (issue 2); renaming one is a breaking change.
    cfg = PipelineConfig().model_dump()
    for dotted in [
        "data.source",
        "data.output",
        "cluster.mode",
        "train.steps",
        "train.workers",
        "train.checkpoint_every",
        "registry.model_name",
        "canary.steps",
        "serve.host",
        "serve.port",
        "validation.max_texts",
    ]:
        section, key = dotted.split(".")
        assert key in cfg[section], dotted


def test_overrides_parse_toml_values():
    cfg = load_config(
        REPO / "configs" / "debug.toml",
        ["train.steps=7", "canary.steps=[20, 100]", "data.source=/tmp/corpus", "train.use_gpu=false"],
    )
    assert cfg.train.steps == 7
    assert cfg.canary.steps == [20, 100]
    assert cfg.data.source == "/tmp/corpus"
    assert cfg.train.use_gpu is False


def test_a_string_setting_keeps_override_text_that_toml_reads_as_a_number_date_or_boolean():
    cfg = load_config(
        REPO / "configs" / "debug.toml",
        [
            "registry.model_name=2024",
            "registry.experiment=2024-01-01",
            "data.source=true",
            "train.init_from=1.5",
            "serve.host='0.0.0.0'",
            "train.steps=7",
            "validation.max_regression_vs_champion=0.25",
        ],
    )
    assert (cfg.registry.model_name, cfg.registry.experiment) == ("2024", "2024-01-01")
    assert (cfg.data.source, cfg.train.init_from, cfg.serve.host) == ("true", "1.5", "0.0.0.0")
    assert cfg.train.steps == 7 and cfg.validation.max_regression_vs_champion == 0.25  # other types: as TOML reads
    raw: dict = {}
    for assignment in ("registry.model_name=2024", "serve.autoscaling.min_replicas=2", "train.use_gpu=false"):
        apply_override(raw, assignment)
    assert raw == {
        "registry": {"model_name": "2024"},
        "serve": {"autoscaling": {"min_replicas": 2}},  # a nested section's int stays an int
        "train": {"use_gpu": False},
    }
    with pytest.raises(ConfigError, match="unknown key 'registry.nope'"):  # unknown keys are still named
        load_config(None, ["registry.nope=2024"])


def test_unknown_key_is_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nstepz = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value) == f"{bad}: unknown key 'train.stepz'"


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match="unknown key 'trian'"):
        load_config(None, ["trian.steps=3"])


def test_bad_value_names_key_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.workers=0"])
    assert "train.workers" in str(e.value) and "0" in str(e.value)
    with pytest.raises(ConfigError, match=r"cluster.mode.*'moon'"):
        load_config(None, ["cluster.mode=moon"])
    # a size no reader can hold is named here, not an OverflowError deep in the data stage
    with pytest.raises(ConfigError, match=r"data.max_record_bytes: Input should be less than or equal to 2147483647"):
        load_config(None, ["data.max_record_bytes=99999999999999999999999"])


@pytest.mark.parametrize("uri", ["http://[::1:5000", "http://mlflow:99999", "https://mlflow:abc/x"])
def test_a_tracking_uri_mlflow_cannot_parse_is_named_at_load(uri):
    """It failed deep in a command as a bare `ValueError: Invalid IPv6 URL` (the credential check raised it)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f'registry.tracking_uri="{uri}"'])
    assert str(e.value) == (
        "config (with --set): registry.tracking_uri: not a server address MLflow can reach: its host or port does "
        f"not parse (an IPv6 host is written in brackets, a port is a number up to 65535) (got '{uri}')"
    )


@pytest.mark.parametrize("name", ["bob's-gpt", 'say-"hi"', "a`b", "team/gpt", "gpt:2", "a\\b", "a?b", " gpt", ".."])
def test_a_model_name_mlflow_filters_or_uris_cannot_carry_is_named_at_load(name):
    """`bob's-gpt` registered the model, then every promotion failed: the registry's filter strings quote the name
    with '; a '/' or '?' splits its models:/ URI."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"registry.model_name={json.dumps(name)}"])
    assert str(e.value) == (
        "config (with --set): registry.model_name: not a registered model name MLflow's filter strings and "
        "models:/ URIs carry: no ' \" ` \\ / : ?, control characters or surrounding spaces "
        f"(got {name!r})"
    )
    assert "\n" not in str(e.value)


def test_a_model_name_with_spaces_at_signs_or_other_letters_loads():
    for name in ("shardline-gpt", "team gpt@2.1", "modèle_ß-1"):
        assert load_config(None, [f"registry.model_name={json.dumps(name)}"]).registry.model_name == name


def test_a_tracking_uri_with_a_password_is_refused_as_one_whatever_its_password_holds():
    """urlsplit reads a password's text before a '/' as the port: that error quoted it."""
    for uri in ("http://alice:s3cretpass/xyz@mlflow:5000", "http://alice:Tr0ub4dor?x@mlflow:5000"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f'registry.tracking_uri="{uri}"'])
        assert "holds a password in the URI" in str(e.value) and "s3cretpass" not in str(e.value)
        assert "Tr0ub4dor" not in str(e.value)
    databricks = load_config(None, ['registry.tracking_uri="databricks://profile:prefix"'])  # MLflow's scope:prefix
    assert databricks.registry.tracking_uri == "databricks://profile:prefix"


@pytest.mark.parametrize(
    "moved",
    [
        "canary.host=0.0.0.0",
        "canary.port=9000",
        "canary.max_request_bytes=1024",
        "canary.requests_per_step=8",
        "validation.eval_batches=4",
    ],
)
def test_keys_that_moved_or_went_are_named(moved):
    # an old config must fail loudly on the key, not be silently ignored (the endpoint's address is serve.*)
    key = moved.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, [moved])
    assert str(e.value) == f"config (with --set): unknown key '{key}'"


def test_serve_section_overrides():
    cfg = load_config(None, ["serve.port=8123", "serve.max_prompt_bytes=100", "canary.lease_s=5"])
    assert (cfg.serve.port, cfg.serve.max_prompt_bytes, cfg.canary.lease_s) == (8123, 100, 5.0)
    with pytest.raises(ConfigError, match=r"canary.lease_s.*1"):
        load_config(None, ["canary.lease_s=1"])
    with pytest.raises(ConfigError, match=r"canary.min_paired.*1"):
        load_config(None, ["canary.min_paired=1"])  # one pair has no spread to bound


def test_a_prompt_limit_the_body_limit_leaves_no_room_for_is_refused_naming_both():
    """A prompt one byte over serve.max_prompt_bytes in the smallest body ({"prompt":"..."}) must fit in
    serve.max_request_bytes, or the prompt's own 400 never answers (every such request is a 413)."""
    for overrides in (["serve.max_prompt_bytes=65536"], ["serve.max_request_bytes=4096"]):
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
        assert "serve.max_prompt_bytes=" in str(e.value) and "serve.max_request_bytes=" in str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="at most 65522"):
        load_config(None, ["serve.max_prompt_bytes=65523"])
    fits = load_config(None, ["serve.max_prompt_bytes=65522"]).serve  # a 65523-byte prompt: 65536-byte body, a 400
    assert len(b'{"prompt":""}') + fits.max_prompt_bytes + 1 == fits.max_request_bytes


def test_canary_steps_must_ascend():
    with pytest.raises(ConfigError, match="canary.steps"):
        load_config(None, ["canary.steps=[50, 10]"])
    with pytest.raises(ConfigError, match=r"strictly ascending percentages in \(0, 100\], got \[10, 10, 100\]"):
        load_config(None, ["canary.steps=[10, 10, 100]"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        apply_override({}, "train.steps")
    with pytest.raises(ConfigError, match="expected section.key=value"):
        apply_override({}, "steps=3")


def test_every_field_is_described():
    # The same model is the Prefect UI form: every field needs a description there.
    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")

    walk(PipelineConfig)


def test_a_canary_without_the_live_endpoint_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["serve.enabled=false"])
    assert str(e.value) == (
        "config (with --set): canary.enabled = true needs serve.enabled = true (the canary "
        "ramps on the live endpoint); set canary.enabled = false to end runs at the registry"
    )
    assert not load_config(None, ["serve.enabled=false", "canary.enabled=false"]).serve.enabled


def test_a_tokenizer_is_a_pipeline_setting():
    cfg = load_config(None, ["tokenizer.kind=train", "tokenizer.vocab_size=512"])
    assert (cfg.tokenizer.kind, cfg.tokenizer.vocab_size) == ("train", 512)
    assert load_config(None).tokenizer.kind == "bytes"


def test_a_tokenizer_path_with_a_credential_is_refused_masked():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["tokenizer.kind=file", "tokenizer.path=s3://AKIAEXAMPLE:hunter2@bucket/tok.json"])
    assert "tokenizer.path" in str(e.value) and "hunter2" not in str(e.value) and "\n" not in str(e.value)


def test_a_config_path_that_never_ends_or_nests_too_deep_is_a_one_line_error(tmp_path):
    import os

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # reading it would block until a writer came
    with pytest.raises(ConfigError, match=r"fifo.toml: not a regular file"):
        load_config(fifo)
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000)
    with pytest.raises(ConfigError, match=r"deep.toml: not TOML this reads: nested too deeply"):
        load_config(deep)
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(None, ["data.source=" + "[" * 5000])
    with pytest.raises(ConfigError, match=r"^s3://u:\*\*\*@b/c.toml: no such config file$"):
        load_config("s3://u:hunter2@b/c.toml")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.lr=inf"], "train.lr: Input should be a finite number"),
        (["train.resources_per_worker={GPU=nan}"], "train.resources_per_worker.GPU: Input should be a finite number"),
        (
            ['canary.prometheus_url="http://127.0.0.1:9090"', 'canary.promql_gates=[{name="p", query="up", max=nan}]'],
            "canary.promql_gates.0.max: Input should be a finite number",
        ),
        (["serve.autoscaling={min_replicas=5, max_replicas=2}"], "serve.autoscaling: max_replicas 2 < min_replicas 5"),
        (["train.vocab_size=100"], "train.vocab_size=100: tokenizer.kind='bytes' gives 256 ids"),
        (['tokenizer.kind="train"', "train.vocab_size=300"], "tokenizer.kind='train' gives 4096 ids"),
        (["train.n_head=3", "train.d_model=128"], "train.d_model=128 is not divisible by train.n_head=3"),
        (["train.global_batch=7"], "train.global_batch=7 != micro_batch 8 x grad_accum 1 x workers 2 = 16"),
        (
            ['train.hf_config={model_type="llama", hidden_size="abc"}'],
            "train.hf_config: model_type 'llama': StrictDataclassFieldValidationError",
        ),
        (["data.source=hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"], "data.source='\\*\\*\\*' holds a token"),
        (["stack.artifacts=s3://b/p?X-Amz-Signature=abc"], "stack.artifacts='s3://b/p\\?X-Amz-Signature=\\*\\*\\*'"),
        (["data.min_record_bytes=0"], r"data.min_record_bytes: Input should be greater than or equal to 1 \(got 0\)"),
        (
            ["data.min_record_bytes=5000", "data.max_record_bytes=10"],
            "data.min_record_bytes=5000 > data.max_record_bytes=10: no record could be kept",
        ),
        (
            ['train.parallelism="ddp"', "train.powersgd_rank=4", "train.workers=1", "train.global_batch=0"],
            "train.powersgd_rank=4 needs at least 2 train.workers, got 1",
        ),
        (
            ['train.loop="lightning"', 'train.lightning_module="training.lightning_example:ByteGPTModule"']
            + ['train.parallelism="ddp"', "train.d_model=130"],
            "train.d_model=130 is not divisible by train.n_head=4",  # the shipped module builds the built-in GPT
        ),
        (
            ['train.hf_config={model_type="llama", num_attention_heads=6, num_key_value_heads=4, hidden_size=48}'],
            "train.hf_config: num_key_value_heads 4 does not divide num_attention_heads 6",
        ),
    ],
)
def test_what_would_fail_after_a_stage_published_is_refused_at_load(overrides, message):
    """NaN passes every bound (`value > nan` is false); the rest would fail in training, after the shards were
    published, or reach Prefect's database and `mlflow server`'s command line."""
    from flows.config import load_stack_config

    with pytest.raises(ConfigError, match=message) as err:
        load_stack_config(None, overrides)
    assert "\n" not in str(err.value) and "hunter2" not in str(err.value)


def test_a_tokenizer_file_with_more_ids_than_the_model_embeds_is_refused_as_a_run_starts(tmp_path):
    """The data stage would tokenize and publish the whole corpus with it, and training refuse only then."""
    from flows.config import check_tokenizer_fits
    from training import tokenizer as tk

    path = tmp_path / "tokenizer.json"
    tk.train_bpe([b"def add(a, b):\n    return a + b\n" * 50], 300).save(str(path))
    ids = tk.id_count(tk.load(str(path)))
    assert 256 < ids <= 300
    small = load_config(None, ['tokenizer.kind="file"', f'tokenizer.path="{path}"', "train.vocab_size=260"])
    with pytest.raises(ConfigError, match=rf"^flow parameter: the tokenizer has {ids} ids but train.vocab_size=260 "):
        check_tokenizer_fits(small, "flow parameter")
    llama = {"model_type": "llama", "vocab_size": 260, "hidden_size": 16, "num_attention_heads": 2}
    hf = small.model_copy(update={"train": small.train.model_copy(update={"vocab_size": 0, "hf_config": llama})})
    with pytest.raises(ConfigError, match=rf"has {ids} ids but train.hf_config vocab_size=260 embeds 260"):
        check_tokenizer_fits(hf, "flow parameter")
    for fits in (["train.vocab_size=0"], [f"train.vocab_size={ids}"]):  # sized from the data, or exactly enough
        check_tokenizer_fits(load_config(None, ['tokenizer.kind="file"', f'tokenizer.path="{path}"', *fits]))
