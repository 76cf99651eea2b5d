"""The whole debug pipeline, twice, on a real Prefect server, real Ray, real MLflow: first champion, then canary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flows.config import load_config
from infra.cluster import free_port
from infra.names import TAG_DATA_RUN_ID, TAG_DATASET_DIGEST, TAG_FLOW_RUN_ID, TAG_PARENT, TAG_STAGE
from infra.tracking import STAGES

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.scenario]  # tests build on each other: see support/scenarios.py
SERVE_PORT = free_port()
SERVE = [f"serve.port={SERVE_PORT}"]
LLAMA = (  # a debug-sized transformers Llama whose embedding holds a 300-id BPE (TOML inline table for --set)
    '{model_type = "llama", vocab_size = 300, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, '
    "num_attention_heads = 2, num_key_value_heads = 1, max_position_embeddings = 128, tie_word_embeddings = false}"
)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("shardline-home")
    old = os.environ.get("SHARDLINE_HOME")
    os.environ["SHARDLINE_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield home
    from infra.head import stop_head

    assert stop_head()  # the long-lived head the first run started (and the endpoint on it) goes with the module
    if old is None:
        os.environ.pop("SHARDLINE_HOME", None)
    else:
        os.environ["SHARDLINE_HOME"] = old


def _client(home: Path):
    import mlflow

    uri = f"sqlite:///{home / 'mlflow.db'}"
    return mlflow.MlflowClient(uri, registry_uri=uri)


def _children(client, parent_run_id: str) -> dict:
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.`{TAG_PARENT}` = '{parent_run_id}'")
    return {r.data.tags[TAG_STAGE]: r for r in runs}


def test_first_run_makes_a_champion_with_full_lineage(prefect_server, home):
    from flows.pipeline import shardline_pipeline

    cfg = load_config(REPO / "configs" / "debug.toml", SERVE)
    summary = shardline_pipeline(cfg)

    assert summary.decision == "first-champion"
    # the flow has exited; the live endpoint keeps serving the champion
    assert summary.endpoint_url == f"http://127.0.0.1:{SERVE_PORT}"
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{summary.endpoint_url}/v1/completions", json={"prompt": "def main():", "max_tokens": 8})
        assert r.status_code == 200 and r.json()["model_version"] == "1"
        r = http.post(f"{summary.endpoint_url}/v1/score", json={"text": "import os\nimport sys\n"})
        assert r.status_code == 200 and r.headers["x-shardline-model-version"] == "1"
        assert 0 < r.json()["bits_per_byte"] < 8.5
    assert str(summary.model_version) == "1" and str(summary.champion_version) == "1"
    assert 0 < summary.val_bits_per_byte <= cfg.validation.max_bits_per_byte
    assert len(summary.dataset_digest) == 32

    client = _client(home)
    parent = client.get_run(summary.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags[TAG_FLOW_RUN_ID] == summary.flow_run_id
    children = _children(client, summary.parent_run_id)
    assert sorted(children) == sorted(STAGES)
    assert all(r.info.status == "FINISHED" for r in children.values())
    assert list(summary.stage_seconds) == list(STAGES) and all(v > 0 for v in summary.stage_seconds.values())
    shard, provision = children["shard_dataset"].info, children["provision_cluster"].info
    assert provision.start_time < shard.end_time and shard.start_time < provision.end_time  # they overlapped

    champion = client.get_model_version_by_alias(cfg.registry.model_name, "champion")
    assert str(champion.version) == "1"
    assert champion.run_id == children["train_fsdp"].info.run_id == summary.train_run_id
    data_run = children["shard_dataset"]
    logged = [d.dataset.digest for d in data_run.inputs.dataset_inputs]
    assert champion.tags[TAG_DATASET_DIGEST] == summary.dataset_digest
    assert summary.dataset_digest in logged
    assert champion.tags[TAG_DATA_RUN_ID] == data_run.info.run_id
    assert champion.tags[TAG_FLOW_RUN_ID] == summary.flow_run_id
    # the training run's metrics came from the Ray Train rank-0 worker
    losses = client.get_metric_history(summary.train_run_id, "loss")
    assert len(losses) >= 2 and losses[-1].value < losses[0].value


def test_second_run_through_the_cli_releases_into_live_traffic(prefect_server, home, s3_server):
    """Same corpus; shards and Ray Train checkpoints on a real S3 API server this time (moto_server, endpoint from
    env). Users send requests to the endpoint the whole time: none fails, and the served version moves 1 -> 2."""
    from support.load import Load

    env = {**os.environ, "PREFECT_API_URL": prefect_server, "SHARDLINE_HOME": str(home)}
    texts = [p.read_text()[:400] for p in sorted((REPO / "training").glob("*.py"))]
    with Load(f"http://127.0.0.1:{SERVE_PORT}", texts, rps=4.0, max_seconds=900) as load:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "run",
                "--config",
                "configs/debug.toml",
                "--json",
                "--set",
                SERVE[0],
                "--set",
                "data.output=s3://shardline/flow-shards",
                "--set",
                "train.storage_path=s3://shardline/flow-ckpt",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        time.sleep(1.0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load.answers and not load.failed, load.failed[:5]
    versions = [a.version for a in load.answers]
    assert versions[0] == "1" and versions[-1] == "2" and set(versions) == {"1", "2"}
    assert set(versions[: versions.index("2")]) == {"1"}
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("model_name", "model_version", "decision", "parent_run_id", "dataset_digest"):
        assert key in summary
    assert str(summary["model_version"]) == "2"
    assert summary["decision"] == "promoted", summary["reason"]
    assert summary["endpoint_url"] == f"http://127.0.0.1:{SERVE_PORT}"

    client = _client(home)
    name = summary["model_name"]
    children = _children(client, summary["parent_run_id"])
    assert sorted(children) == sorted(STAGES)
    canary_run = children["canary_deploy"]
    # the canary judged every ramp step on live and probe requests
    for pct in (10, 50, 100):
        assert canary_run.data.metrics[f"step{pct}.challenger.n"] >= 6, canary_run.data.metrics
        assert canary_run.data.metrics[f"step{pct}.paired"] >= 5
    champion = client.get_model_version_by_alias(name, "champion")
    v2 = client.get_model_version(name, "2")
    assert str(champion.version) == "2" and v2.tags["shardline.canary_decision"] == "promoted"
    health = httpx.get(f"{summary['endpoint_url']}/healthz", timeout=30).json()
    assert health["champion"] == "2" and health["challenger"] is None
    # same corpus and split: the digest is over content, so it is the same wherever the shards live
    v1 = client.get_model_version(name, "1")
    assert v1.tags[TAG_DATASET_DIGEST] == v2.tags[TAG_DATASET_DIGEST] == summary["dataset_digest"]
    assert summary["manifest_uri"] == f"s3://shardline/flow-shards/{summary['dataset_digest']}/manifest.json"
    train_tags = client.get_run(summary["train_run_id"]).data.tags
    assert summary["checkpoint_uri"].startswith(f"s3://shardline/flow-ckpt/train-{train_tags['shardline.train_key']}/")
    assert train_tags["shardline.init_from_version"] == f"{name}/1"  # debug.toml: init_from = "champion"
    assert train_tags["shardline.init_from_checkpoint"] == v1.tags["shardline.checkpoint_uri"]
    continued = sorted(client.get_metric_history(summary["train_run_id"], "loss"), key=lambda m: m.step)
    # the first logged loss (step 5) is far below a from-scratch run's at that step (~5.0; ln 256 = 5.545 at step 0)
    assert continued[0].step <= 5 and continued[0].value < 5.545 - 1.0
    assert v2.tags["shardline.checkpoint_uri"] == summary["checkpoint_uri"]
    assert "testing" not in json.dumps(client.get_run(children["shard_dataset"].info.run_id).data.params)

    # `shardline lineage` follows the same chain from the champion back to the digest the data stage logged
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "lineage", "--model", name, "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    chain = json.loads(proc.stdout.strip().splitlines()[-1])
    assert chain["version"] == str(champion.version) and chain["consistent"] is True
    assert chain["dataset_digest"] == summary["dataset_digest"]
    assert chain["train_run_id"] == champion.run_id


def test_azure_blob_source_and_output(prefect_server, home, azurite, unique_prefix):
    """The whole pipeline with the corpus read from and the shards written to Azure Blob (Azurite)."""
    import sysconfig

    from flows.pipeline import shardline_pipeline
    from infra import storage

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:80]:
        storage.upload_file(str(path), f"az://shardline/{unique_prefix}/corpus/{path.name}")
    cfg = load_config(
        REPO / "configs" / "debug.toml",
        [
            f"data.source=az://shardline/{unique_prefix}/corpus",
            f"data.output=az://shardline/{unique_prefix}/shards",
            # from scratch on 80 files: the champion's checkpoint is on S3 (not this test's), and the relative gate
            # would rightly refuse a model that much weaker than it
            "canary.enabled=false",
            "serve.enabled=false",  # no endpoint to start or change: it plays no part here (10-14 s a run)
            "train.init_from=",
            "validation.max_regression_vs_champion=100.0",
        ],
    )
    summary = shardline_pipeline(cfg)
    assert summary.manifest_uri.startswith(f"az://shardline/{unique_prefix}/shards/{summary.dataset_digest}/")
    assert storage.exists(summary.manifest_uri)
    assert summary.decision == "registered"  # a champion exists and the canary is off: registered, not promoted
    client = _client(home)
    version = client.get_model_version(summary.model_name, summary.model_version)
    assert version.tags[TAG_DATASET_DIGEST] == summary.dataset_digest
    assert "AccountKey" not in json.dumps(client.get_run(summary.parent_run_id).data.tags)


def _cli_run(prefect_server: str, home: Path, *sets: str, new_session: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "SHARDLINE_HOME": str(home)}
    args = [sys.executable, "-m", "flows.cli", "run", "--config", "configs/debug.toml", "--json", "--set", SERVE[0]]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(
        args,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


def test_a_killed_canary_falls_back_to_the_champion_and_the_next_run_cleans_up(prefect_server, home, s3_server):
    """SIGKILL the flow's whole process tree in the middle of a ramp step: within canary.lease_s every request is
    the champion's again without anyone acting; the same command run again completes and removes the orphan."""
    import signal

    url = f"http://127.0.0.1:{SERVE_PORT}"
    champion = httpx.get(f"{url}/healthz", timeout=30).json()["champion"]
    # a step that lasts; training continues from the champion, whose checkpoint is on the S3 server
    sets = ("canary.lease_s=8", "canary.bake_seconds=60", "canary.step_timeout_s=300")
    proc = _cli_run(prefect_server, home, *sets, new_session=True)
    deadline = time.monotonic() + 600
    with httpx.Client(timeout=30) as http:
        while (health := http.get(f"{url}/healthz").json())["challenger_percent"] == 0:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the canary never started"
            time.sleep(0.5)
        challenger = health["challenger"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        killed_at = time.monotonic()
        while http.get(f"{url}/healthz").json()["challenger_percent"] != 0:
            assert time.monotonic() - killed_at < 8 + 5, "the lease did not run out"
            time.sleep(0.5)
        assert {
            http.post(f"{url}/v1/score", json={"text": "import os"}).headers["x-shardline-model-version"]
            for _ in range(6)
        } == {champion}
    client = _client(home)
    name = load_config(REPO / "configs" / "debug.toml").registry.model_name
    assert str(client.get_model_version_by_alias(name, "champion").version) == champion  # no decision, no change
    assert "shardline.canary_decision" not in client.get_model_version(name, challenger).tags

    rerun = _cli_run(prefect_server, home, *sets[:1])
    out, err = rerun.communicate(timeout=900)
    assert rerun.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    # the killed run had finished training: the rerun reuses it and registers nothing new
    assert summary["model_version"] == challenger
    assert summary["decision"] == "promoted", summary["reason"]  # continued from the champion: better than it
    health = httpx.get(f"{url}/healthz", timeout=30).json()
    assert health["champion"] == challenger and health["challenger"] is None
    assert client.get_model_version(name, challenger).tags["shardline.canary_decision"] == "promoted"


def test_two_runs_at_once_release_one_at_a_time(prefect_server, home, s3_server):
    """Two pipelines against one registry: the release lock serialises them; one champion; every version they
    registered carries a canary decision taken against the champion of its turn; no 'database is locked'. (Two,
    not three: a third run added ~80 s on 2 cores and no new case; the lock across processes is
    tests/processes/test_release_lock.py's.)"""
    client = _client(home)
    name = load_config(REPO / "configs" / "debug.toml").registry.model_name
    before = {int(v.version) for v in client.search_model_versions(f"name = '{name}'")}
    champion = str(client.get_model_version_by_alias(name, "champion").version)
    # two different models (seeds, each continuing from the champion on S3), so two new versions; one ramp step
    # keeps the test short
    procs = [_cli_run(prefect_server, home, f"train.seed={seed}", "canary.steps=[100]") for seed in (11, 12)]
    results = [p.communicate(timeout=1500) for p in procs]
    for p, (_out, err) in zip(procs, results, strict=False):
        assert p.returncode == 0, err[-3000:]
        assert "database is locked" not in err
    summaries = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    assert len({int(s["model_version"]) for s in summaries} - before) == 2
    # replay the releases in the order their canaries ran: each compared against the champion of its turn
    canaries = sorted(
        (_children(client, s["parent_run_id"])["canary_deploy"] for s in summaries), key=lambda r: r.info.start_time
    )
    for run in canaries:
        assert run.info.end_time <= min(
            (r.info.start_time for r in canaries if r.info.start_time > run.info.start_time), default=run.info.end_time
        )  # no two canaries overlapped
        version = run.data.tags["shardline.model_version"]
        assert run.data.tags["shardline.champion_version"] == champion
        decision = client.get_model_version(name, version).tags["shardline.canary_decision"]
        assert decision == run.data.tags["shardline.canary_verdict"] != "skipped"  # a real canary decided it
        if decision == "promoted":
            champion = version
    assert str(client.get_model_version_by_alias(name, "champion").version) == champion
    assert httpx.get(f"http://127.0.0.1:{SERVE_PORT}/healthz", timeout=30).json()["champion"] == champion


def test_a_llama_over_a_bpe_trained_in_the_run_is_judged_against_the_byte_champion_on_live_traffic(
    prefect_server, home, s3_server
):
    """A team's model and tokenizer in one pipeline run: a transformers Llama (train.hf_config, built from its
    config) over tokenizer.kind = 'train'. The data stage learns a 300-id byte-level BPE from the training split and
    shards its ids; training and validation read them; the version carries the tokenizer; the endpoint serves it
    with transformers' KV cache and the canary pairs it with the byte-level GPT champion on the same live requests,
    in bits per byte. From scratch (the champion's weights embed bytes: train.init_from = 'champion' is refused for
    another tokenizer), with the quality gates opened: this checks the path, not that 30 steps beat a champion
    continued several times."""
    import mlflow
    from support.load import Load

    from deployments.lineage import describe_lineage
    from infra.names import (
        TAG_CHAT_TEMPLATE_SHA256,
        TAG_CHAT_TOKENS,
        TAG_INIT_VERSION,
        TAG_TOKENIZER_SHA256,
        TAG_TOKENIZER_TRAINED_ON,
    )
    from training import tokenizer as tk
    from training.chat_template import fingerprint as fingerprint_template
    from training.servable import served_chat_template, served_tokenizer

    url = f"http://127.0.0.1:{SERVE_PORT}"
    champion = httpx.get(f"{url}/healthz", timeout=30).json()["champion"]
    texts = [p.read_text()[:400] for p in sorted((REPO / "training").glob("*.py"))]
    template = "{% for m in messages %}# {{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endfor %}"
    (home / "chat_template.jinja").write_text(template)
    sets = (
        "tokenizer.kind=train",
        "tokenizer.vocab_size=300",
        f"tokenizer.chat_template={home / 'chat_template.jinja'}",
        "train.init_from=",
        f"train.hf_config={LLAMA}",
        "validation.max_regression_vs_champion=100.0",
        "canary.max_bpb_regression=4.0",
    )
    with Load(url, texts, rps=4.0, max_seconds=900) as load:
        out, err = _cli_run(prefect_server, home, *sets).communicate(timeout=900)
        time.sleep(1.0)
    assert load.answers and not load.failed, load.failed[:5]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["decision"] == "promoted", (summary["reason"], err[-2000:])
    version = str(summary["model_version"])
    served = [a.version for a in load.answers]
    assert served[0] == champion and served[-1] == version and set(served) == {champion, version}

    client = _client(home)
    children = _children(client, summary["parent_run_id"])
    data_tags = children["shard_dataset"].data.tags
    fingerprint = data_tags[TAG_TOKENIZER_SHA256]
    assert data_tags[TAG_TOKENIZER_TRAINED_ON]  # the text set whose training split it learned from
    assert children["validate_checkpoint"].data.tags[TAG_TOKENIZER_SHA256] == fingerprint
    assert children["validate_checkpoint"].data.tags[TAG_CHAT_TEMPLATE_SHA256] == fingerprint_template(template)
    tokens = '{"eos_token": "<|endoftext|>"}'  # the template writes eos_token: the run's BPE's end of text
    assert children["validate_checkpoint"].data.tags[TAG_CHAT_TOKENS] == tokens
    assert client.get_model_version(summary["model_name"], version).tags[TAG_TOKENIZER_SHA256] == fingerprint
    version_tags = client.get_model_version(summary["model_name"], version).tags
    assert version_tags[TAG_CHAT_TEMPLATE_SHA256] == fingerprint_template(template)
    assert version_tags[TAG_CHAT_TOKENS] == tokens
    chain = describe_lineage(summary["model_name"], version, f"sqlite:///{home / 'mlflow.db'}")
    assert chain["tokenizer_sha256"] == fingerprint and chain["consistent"] is True
    assert chain["chat_template_sha256"] == fingerprint_template(template)
    assert chain["chat_tokens"] == json.loads(tokens)  # an object, as `shardline lineage --json` prints it
    logged = client.download_artifacts(children["shard_dataset"].info.run_id, "tokenizer/tokenizer.json", str(home))
    tokenizer = tk.load(logged)
    assert tk.fingerprint(tokenizer) == fingerprint and tokenizer.get_vocab_size() == 300
    train_run = client.get_run(summary["train_run_id"])
    assert TAG_INIT_VERSION not in train_run.data.tags
    assert "'model_type': 'llama'" in train_run.data.params["train.hf_config"]
    # registered with MLflow's transformers flavor, the tokenizer the run trained inside it byte for byte
    previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(store := f"sqlite:///{home / 'mlflow.db'}")
    mlflow.set_registry_uri(store)
    try:
        registered = mlflow.models.get_model_info(f"models:/{summary['model_name']}/{version}")
        carried = served_tokenizer(f"models:/{summary['model_name']}/{version}")
        carried_template = served_chat_template(f"models:/{summary['model_name']}/{version}")
    finally:
        mlflow.set_tracking_uri(previous[0])
        mlflow.set_registry_uri(previous[1])
    assert registered.flavors["python_function"]["loader_module"] == "mlflow.transformers"
    assert carried.to_str() == tokenizer.to_str() and carried_template == template

    # both sides of every pair scored in bits per byte of the same requests: one scale, two vocabularies
    canary = children["canary_deploy"].data.metrics
    for pct in (10, 50, 100):
        assert canary[f"step{pct}.paired"] >= 5
        assert 0.5 < canary[f"step{pct}.challenger.bpb"] < 9 and 0.5 < canary[f"step{pct}.champion.bpb"] < 9
    # the endpoint encodes with the version's tokenizer: fewer ids than bytes for indented code
    prompt = "        return self\n        return self\n"
    body = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=60).json()
    assert body["model_version"] == version
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt).ids) < len(prompt.encode())
    # the chat API renders with the template the version's tokenizer carries (the byte champion had none)
    messages = [{"role": "user", "content": "return self"}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, timeout=60)
    assert chat.status_code == 200 and chat.json()["model_version"] == version, chat.text
    rendered = f"# user: return self{tk.END_OF_TEXT}\n"  # its eos_token: the trained BPE's one special token
    assert chat.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered).ids)
    assert tokenizer.token_to_id(tk.END_OF_TEXT) in tokenizer.encode(rendered).ids  # one id, not its characters
