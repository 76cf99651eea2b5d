"""The data stage with S3 (moto server) and Azure Blob (Azurite): sources, outputs, loader, outage, bad names."""

from __future__ import annotations

import json
import threading
import time

import boto3
import pytest
from support.data_helpers import config, make_corpus, make_jsonl

from infra import storage
from training.config import TrainConfig
from training.data import DataError, build_shards, load_shard_set
from training.data.loader import iter_texts, train_batches


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))


@pytest.fixture(params=["s3", "az"])
def store(request, unique_prefix):
    request.getfixturevalue("s3_server" if request.param == "s3" else "azurite")
    return f"{request.param}://shardline/{unique_prefix}"


def _upload_corpus(local_root, base):
    for path in sorted(p for p in local_root.rglob("*") if p.is_file()):
        storage.upload_file(path, storage.join(base, str(path.relative_to(local_root))))


def test_publish_to_store_then_cache_hit_rewrites_nothing(tmp_path, store):
    corpus = make_corpus(tmp_path / "c")
    local = build_shards(config(corpus, tmp_path / "local"))
    first = build_shards(config(corpus, storage.join(store, "out")))
    assert first.dataset_digest == local.dataset_digest and not first.cache_hit
    assert first.manifest_uri == storage.join(store, "out", first.dataset_digest, "manifest.json")
    names = sorted(
        e.uri.rsplit("/", 1)[1] for e in storage.list_prefix(storage.join(store, "out")) if "/_index/" not in e.uri
    )
    assert names == sorted(
        ["manifest.json", "validation.json"] + [u.rsplit("/", 1)[1] for u in first.train_shards + first.val_shards]
    )  # no _staging
    for uri, local_uri in zip(first.train_shards, local.train_shards, strict=False):
        assert storage.read_bytes(uri) == storage.read_bytes(local_uri)
    before = _stamps(store)
    time.sleep(1.1)  # object stores stamp whole seconds
    second = build_shards(config(corpus, storage.join(store, "out")))
    assert second.cache_hit and second.dataset_digest == first.dataset_digest and _stamps(store) == before
    assert load_shard_set(first.uri, verify="sha256").num_train == first.num_train


def test_unchanged_store_corpus_is_reused_unread_and_an_overwrite_is_seen(tmp_path, store):
    corpus = make_corpus(tmp_path / "c")
    source = storage.join(store, "corpus")
    _upload_corpus(corpus, source)
    first = build_shards(config(source, storage.join(store, "out")))
    again = build_shards(config(source, storage.join(store, "out")))
    assert again.cache_hit and again.chunks == 0 and again.dataset_digest == first.dataset_digest
    doc = storage.join(source, "a", "doc001.txt")
    storage.write_bytes(doc, bytes(reversed(storage.read_bytes(doc))))  # same size, new ETag
    changed = build_shards(config(source, storage.join(store, "out")))
    assert changed.chunks > 0 and changed.dataset_digest != first.dataset_digest


def test_publish_uploads_to_final_names_and_commits_with_the_manifest(tmp_path, store, monkeypatch):
    """Shards go straight to {output}/{digest} (no staging, no server-side copy: a private Azure account needs no
    SAS) and the manifest is written last: a publish that dies before it leaves a set no reader trusts, and the
    next build completes it."""
    corpus, out = make_corpus(tmp_path / "c"), storage.join(store, "out")

    def no_copy(src, dst, retries=None):
        raise AssertionError(f"server-side copy {src} -> {dst}")

    real_write = storage.write_bytes

    def die_at_the_manifest(uri, data, retries=None):
        if uri.endswith("/manifest.json"):
            raise storage.StorageError(f"{uri}: the process died here")
        return real_write(uri, data, retries)

    monkeypatch.setattr(storage, "copy", no_copy)
    monkeypatch.setattr(storage, "write_bytes", die_at_the_manifest)
    with pytest.raises(storage.StorageError, match="died here"):
        build_shards(config(corpus, out))
    left = sorted(e.uri.rsplit("/", 1)[1] for e in storage.list_prefix(out))
    assert "validation.json" in left and "manifest.json" not in left and any(n.endswith(".tar") for n in left)
    assert all(e.uri.count("/_staging/") == 0 for e in storage.list_prefix(out))
    digest = storage.list_prefix(out)[0].uri.split("/out/", 1)[1].split("/", 1)[0]
    with pytest.raises(DataError, match="no manifest.json; not a published shard set"):
        load_shard_set(storage.join(out, digest))

    monkeypatch.setattr(storage, "write_bytes", real_write)
    shards = build_shards(config(corpus, out))
    assert not shards.cache_hit and shards.dataset_digest == digest
    assert load_shard_set(shards.uri, verify="sha256").num_train == shards.num_train


def _stamps(base):
    loc = storage.parse(base)
    if loc.scheme == "s3":
        pages = storage.s3_client().list_objects_v2(Bucket=loc.bucket, Prefix=loc.key)
        return {o["Key"]: (o["LastModified"], o["ETag"]) for o in pages.get("Contents", [])}
    container = storage.azure_service().get_container_client(loc.bucket)
    return {b.name: (b.last_modified, b.etag) for b in container.list_blobs(name_starts_with=loc.key)}


def test_source_in_store_and_loader_streams_from_it(tmp_path, store):
    _upload_corpus(make_corpus(tmp_path / "c", n=40), storage.join(store, "corpus"))
    shards = build_shards(config(storage.join(store, "corpus"), storage.join(store, "out"), include="*.txt"))
    assert shards.num_train + shards.num_val == 40 and shards.train_shards[0].startswith(store)
    texts = list(iter_texts(shards.val_shards))
    assert len(texts) == shards.num_val and all(b"quick brown fox" in t for _, t in texts)
    cfg = TrainConfig(steps=6, micro_batch=2, seq_len=64)
    counts = [sum(1 for _ in train_batches(shards.train_shards, r, 2, cfg, 0, num_workers=1)) for r in range(2)]
    assert counts == [6, 6]


def test_jsonl_source_in_store(tmp_path, store):
    rows = [json.dumps({"text": f"line {i} " * 30}) for i in range(40)]
    storage.write_bytes(storage.join(store, "j", "part-0.jsonl"), ("\n".join(rows) + "\n").encode())
    shards = build_shards(config(storage.join(store, "j"), tmp_path / "out", format="jsonl"))
    assert shards.num_train + shards.num_val == 40


def test_a_source_naming_one_object_is_read_like_a_local_file(tmp_path, store):
    """A source that is one object, not a prefix, lists nothing under itself: it is the corpus' one input."""
    src = make_jsonl(tmp_path / "one.jsonl")
    storage.upload_file(src, storage.join(store, "data", "one.jsonl"))
    storage.write_bytes(storage.join(store, "data", "one.jsonl.bak"), b"not this")  # a sibling with the same prefix
    local = build_shards(config(src, tmp_path / "out", format="jsonl", text_field="body"))
    remote = build_shards(
        config(storage.join(store, "data", "one.jsonl"), tmp_path / "out2", format="jsonl", text_field="body")
    )
    assert remote.dataset_digest == local.dataset_digest and remote.num_train + remote.num_val == 40
    missing = storage.join(store, "data", "none.jsonl")
    with pytest.raises(DataError) as err:
        build_shards(config(missing, tmp_path / "out3", format="jsonl", text_field="body"))
    assert str(err.value) == f"{missing}: no objects under this prefix, nor an object of that name (data.source)"


def test_nonexistent_source_prefix(tmp_path, store):
    with pytest.raises(DataError, match=r"/nope: no objects under this prefix") as err:
        build_shards(config(storage.join(store, "nope"), storage.join(store, "out")))
    assert "\n" not in str(err.value) and storage.list_prefix(storage.join(store, "out")) == []


def test_unsafe_object_names_in_s3_source(tmp_path, s3_server, unique_prefix):
    base = f"s3://shardline/{unique_prefix}/corpus"
    _upload_corpus(make_corpus(tmp_path / "c", n=30), base)
    client = storage.s3_client()
    client.put_object(Bucket="shardline", Key=f"{unique_prefix}/corpus/../escape.txt", Body=b"dot dot")
    client.put_object(Bucket="shardline", Key=f"{unique_prefix}/corpus//etc/abs.txt", Body=b"absolute")
    out = f"s3://shardline/{unique_prefix}/out"
    with pytest.raises(DataError, match=r"unsafe object name '(\.\./escape|/etc/abs)\.txt'.*on_unsafe_name=fail"):
        build_shards(config(base, out))
    assert storage.list_prefix(out) == []
    shards = build_shards(config(base, out, on_unsafe_name="skip"))
    assert shards.skipped == {"unsafe_name": 2} and shards.num_train + shards.num_val == 30


def test_oversize_object_is_skipped_without_download(tmp_path, s3_server, unique_prefix):
    base = f"s3://shardline/{unique_prefix}/corpus"
    _upload_corpus(make_corpus(tmp_path / "c", n=30), base)
    storage.write_bytes(f"{base}/big.txt", b"y" * 5000)
    with pytest.raises(DataError, match=rf"{base}/big.txt: 5000 bytes > data.max_record_bytes=4096"):
        build_shards(config(base, tmp_path / "out", max_record_bytes=4096, on_oversize="fail"))


def test_credentials_in_uri_are_refused(tmp_path):
    with pytest.raises(DataError, match="data.output: .*credentials") as err:
        build_shards(config(tmp_path, "s3://AKIA:secret@bucket/x"))
    assert "secret" not in str(err.value)


def test_s3_outage_mid_run_is_retried_and_the_stage_completes(tmp_path, monkeypatch):
    """Stop the S3 server in the middle of the shard uploads, restart it on the same port 2 s later; the build
    rides it out on storage retries and publishes a set that verifies.

    moto's ThreadedMotoServer keeps its buckets in this process, so, like a real S3 outage, the data survives.
    The outage is triggered at the third shard upload (a wrapper around storage.upload_file) so it always falls
    mid-run, however fast or loaded the machine is.
    """
    from moto.server import ThreadedMotoServer
    from support.store_servers import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key, value in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="outage")
    events: dict[str, float] = {}
    uploads: list[str] = []
    real_upload = storage.upload_file

    def restart() -> None:
        server.start()
        events["restarted"] = time.monotonic()

    def upload_with_outage(path, uri, retries=None):
        uploads.append(uri)
        if len(uploads) == 3:
            server.stop()
            server._server.server_close()  # close the listening socket: clients now get "connection refused"
            events["stopped"] = time.monotonic()
            threading.Timer(2.0, restart).start()
        return real_upload(path, uri, retries)

    monkeypatch.setattr(storage, "upload_file", upload_with_outage)
    try:
        shards = build_shards(config(make_corpus(tmp_path / "c", n=40), "s3://outage/out", max_samples_per_shard=4))
        events["done"] = time.monotonic()
        assert events["stopped"] < events["restarted"] < events["done"]
        assert len(uploads) > 3  # uploads went on after the outage
        assert load_shard_set(shards.uri, verify="sha256").num_train == shards.num_train
        assert storage.list_prefix("s3://outage/out/_staging") == []
    finally:
        time.sleep(max(0.0, 2.5 - (time.monotonic() - events.get("stopped", time.monotonic()))))
        server.stop()


def test_a_tokenized_set_publishes_its_tokenizer_to_the_store(tmp_path, store):
    from training import tokenizer as tk

    corpus = make_corpus(tmp_path / "c")
    tok = tk.train_bpe((p.read_bytes() for p in sorted(corpus.rglob("*.txt"))), 300)
    local = build_shards(config(corpus, tmp_path / "local"), tok)
    remote = build_shards(config(corpus, storage.join(store, "out")), tok)
    assert remote.dataset_digest == local.dataset_digest and not remote.cache_hit
    assert remote.tokenizer_uri == storage.join(store, "out", remote.dataset_digest, "tokenizer.json")
    assert tk.fingerprint(tk.load(remote.tokenizer_uri)) == remote.tokenizer_sha256 == tk.fingerprint(tok)
    assert load_shard_set(remote.uri, verify="sha256").tokenizer_uri == remote.tokenizer_uri
