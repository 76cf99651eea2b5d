"""Hostile or broken input: a one-line cause naming the file under `fail`, a count under `skip`, never a publish.

Tests run as root here, so chmod 000 does not make a file unreadable; the honest unreadable case used is a FIFO
where a text file is expected (opening it would block a naive reader) plus, when not root, a chmod-000 file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.data_helpers import config, make_corpus

from training.data import DataError, build_shards


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))


def _published(out: Path) -> list[str]:
    if not out.exists():
        return []
    staging = out / "_staging"
    return [p.name for p in out.iterdir() if p.name != "_staging"] + [p.name for p in staging.glob("*")]


def _fails_with_one_line(cfg, out: Path, *fragments: str) -> str:
    with pytest.raises(DataError) as err:
        build_shards(cfg)
    message = str(err.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert _published(out) == []
    return message


def _corpus_with(tmp_path: Path, name: str, make) -> Path:
    root = make_corpus(tmp_path / "c", n=30)
    make(root / name)
    return root


BAD_FILES = {
    "binary": ("blob.txt", lambda p: p.write_bytes(b"abc\x00\x01\x02" * 10), "on_binary", "NUL byte at offset 3"),
    "undecodable": (
        "latin.txt",
        lambda p: p.write_bytes(b"caf\xe9 au lait\n"),
        "on_undecodable",
        "not valid UTF-8 at byte 3",
    ),
    "empty": ("empty.txt", lambda p: p.write_bytes(b""), "on_empty_record", "empty record"),
    "unreadable": ("pipe.txt", lambda p: os.mkfifo(p), "on_unreadable", "not a regular file (FIFO)"),
    "symlink_loop": ("self.txt", lambda p: os.symlink(p.name, p), "on_symlink_loop", "symlink loop"),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_fails_naming_the_file(tmp_path, kind):
    name, make, field, cause = BAD_FILES[kind]
    root = _corpus_with(tmp_path, name, make)
    out = tmp_path / "out"
    message = _fails_with_one_line(config(root, out, **{field: "fail"}), out, str(root / name), cause, field)
    assert message.startswith(str(root / name))


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_is_skipped_and_counted(tmp_path, kind):
    name, make, field, _ = BAD_FILES[kind]
    root = _corpus_with(tmp_path, name, make)
    shards = build_shards(config(root, tmp_path / "out", **{field: "skip"}))
    assert shards.skipped == {kind: 1} and shards.num_train + shards.num_val == 30


def test_directory_symlink_loop_and_dangling_link(tmp_path):
    root = make_corpus(tmp_path / "c", n=30)
    os.symlink("..", root / "a" / "up")
    os.symlink("missing.txt", root / "gone.txt")
    out = tmp_path / "out"
    _fails_with_one_line(config(root, out, on_symlink_loop="fail"), out, str(root / "a" / "up"), "is an ancestor")
    shards = build_shards(config(root, out, on_symlink_loop="skip"))
    assert shards.skipped == {"symlink_loop": 2} and shards.num_train + shards.num_val == 30


def test_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    _fails_with_one_line(config(tmp_path / "empty", out), out, str(tmp_path / "empty"), "no files matching '*'")


def test_nonexistent_source(tmp_path):
    out = tmp_path / "out"
    _fails_with_one_line(config(tmp_path / "nope", out), out, str(tmp_path / "nope"), "no such file or directory")


def test_only_bad_files_is_no_usable_records(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.bin").write_bytes(b"\x00" * 100)
    out = tmp_path / "out"
    _fails_with_one_line(config(root, out, on_binary="skip"), out, "no usable records (skipped: binary=1)")


def test_no_usable_records_names_the_first_cause(tmp_path):
    """A typo in data.text_field rejects every record: the message says why, not only how many."""
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.jsonl").write_text("\n".join(json.dumps({"content": "x" * 50}) for _ in range(20)))
    out = tmp_path / "out"
    _fails_with_one_line(
        config(root, out, format="jsonl"),
        out,
        "no usable records (skipped: undecodable=20); the first: ",
        "a.jsonl:1: no field 'text' (data.text_field)",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads chmod-000 files; the FIFO case covers unreadable")
def test_permission_denied(tmp_path):
    root = _corpus_with(tmp_path, "secret.txt", lambda p: (p.write_text("x"), p.chmod(0)))
    out = tmp_path / "out"
    _fails_with_one_line(config(root, out), out, str(root / "secret.txt"), "cannot read")


@pytest.fixture(scope="module")
def huge_line(tmp_path_factory):
    """A single 200 MB line (no newline until the end), generated here and deleted afterwards."""
    path = tmp_path_factory.mktemp("huge") / "huge.txt"
    chunk = b"x" * (1 << 20)
    with open(path, "wb") as fh:
        fh.write(b'{"text": "')
        for _ in range(200):
            fh.write(chunk)
        fh.write(b'"}\n')
    yield path
    path.unlink()


@pytest.mark.parametrize("fmt", ["text", "jsonl"])
def test_single_200mb_line(tmp_path, huge_line, fmt):
    root = make_corpus(tmp_path / "c", n=30) if fmt == "text" else tmp_path / "c"
    root.mkdir(exist_ok=True)
    name = "huge.txt" if fmt == "text" else "huge.jsonl"
    os.link(huge_line, root / name)
    if fmt == "jsonl":
        rows = [json.dumps({"text": f"row {i} " * 20}) for i in range(30)]
        (root / "ok.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    where = str(root / name) + (":1" if fmt == "jsonl" else "")
    _fails_with_one_line(config(root, out, format=fmt, on_oversize="fail"), out, where, "> data.max_record_bytes")
    shards = build_shards(config(root, out, format=fmt, on_oversize="skip"))
    assert shards.skipped == {"oversize": 1} and shards.num_train + shards.num_val == 30


def _jsonl_with_keys(path: Path, bad: str) -> Path:
    rows = [{"id": f"r{i}", "text": f"row {i} " * 20} for i in range(30)] + [{"id": bad, "text": "evil"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _jsonl_around(path: Path, bad: list[str], at: int, keys: bool = False) -> Path:
    """30 good JSON Lines records (keyed k0.. under "id" with `keys`) with the `bad` lines inserted before record
    `at`: the first bad one is line at + 1."""
    good = [json.dumps(({"id": f"k{i}"} if keys else {}) | {"text": f"row {i} " * 20}) for i in range(30)]
    path.write_text("\n".join([*good[:at], *bad, *good[at:]]) + "\n")
    return path


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd", "a/../../b", "C:\\windows"])
def test_unsafe_jsonl_key(tmp_path, bad):
    src = _jsonl_with_keys(tmp_path / "d.jsonl", bad)
    out = tmp_path / "out"
    cfg = dict(format="jsonl", key_field="id")
    _fails_with_one_line(config(src, out, **cfg), out, f"{src}:31", "unsafe record key", "on_unsafe_name=fail")
    shards = build_shards(config(src, out, on_unsafe_name="skip", **cfg))
    assert shards.skipped == {"unsafe_name": 1} and shards.num_train + shards.num_val == 30


def test_a_key_that_is_not_utf8_follows_on_unsafe_name(tmp_path):
    """A file name in another encoding (Latin-1 'café.txt', read back with a surrogate escape) or a lone surrogate
    in data.key_field has no UTF-8 bytes for the split, the tar member or the manifest: it is an unsafe name of
    its file, named with its bytes escaped, not a bare UnicodeEncodeError."""
    root = make_corpus(tmp_path / "c", n=30)
    with open(os.path.join(os.fsencode(root), b"caf\xe9.txt"), "wb") as fh:
        fh.write(b"a perfectly fine UTF-8 body\n")
    out = tmp_path / "out"
    _fails_with_one_line(config(root, out), out, "caf\\udce9.txt: unsafe record key", "on_unsafe_name=fail")
    assert build_shards(config(root, out, on_unsafe_name="skip")).skipped == {"unsafe_name": 1}
    src = _jsonl_around(tmp_path / "d.jsonl", ['{"id": "bad\\ud800key", "text": "fine text"}'], 30, keys=True)
    jsonl = dict(format="jsonl", key_field="id")
    out = tmp_path / "out-jsonl"
    _fails_with_one_line(config(src, out, **jsonl), out, f"{src}:31: unsafe record key 'bad\\ud800key'")


def test_malformed_jsonl_lines(tmp_path):
    src = tmp_path / "d.jsonl"
    good = [json.dumps({"text": f"row {i} " * 20}) for i in range(30)]
    src.write_bytes(("\n".join(good) + "\n").encode() + b'{"text": 1}\n{oops\n\xff\xfe\n')
    out = tmp_path / "out"
    _fails_with_one_line(
        config(src, out, format="jsonl", on_undecodable="fail"),
        out,
        f"{src}:31",
        "field 'text' is a number (1), not a string (data.text_field)",
    )
    shards = build_shards(config(src, out, format="jsonl", on_undecodable="skip"))
    assert shards.skipped == {"undecodable": 3}


def test_json_the_parser_refuses_without_a_decode_error_follows_on_undecodable(tmp_path):
    """json.loads raises RecursionError for deep nesting and ValueError for an integer past 4,300 digits: each is
    a bad line of its file, skipped and counted, or one line naming it, not a bare error of the whole stage."""
    deep, big = "[" * 100_000 + "]" * 100_000, '{"text": "x", "n": ' + "9" * 5000 + "}"
    src = _jsonl_around(tmp_path / "d.jsonl", [deep, big], 3)
    out = tmp_path / "out"
    _fails_with_one_line(
        config(src, out, format="jsonl", on_undecodable="fail"),
        out,
        f"{src}:4: not JSON this reader takes (RecursionError: ",
        "(data.on_undecodable=fail)",
    )
    shards = build_shards(config(src, out, format="jsonl"))
    assert shards.skipped == {"undecodable": 2} and shards.num_train + shards.num_val == 30


NOT_A_STRING = {
    '{"text": 12.5}': "field 'text' is a number (12.5), not a string",
    '{"text": null}': "field 'text' is null, not a string",
    '{"text": ["a", "b"]}': 'field \'text\' is an array (["a", "b"]), not a string',
    '{"text": {"en": "hi"}}': 'field \'text\' is an object ({"en": "hi"}), not a string',
    '{"text": true}': "field 'text' is a boolean (true), not a string",
    '{"body": "hi"}': "no field 'text' (data.text_field)",
    '["text"]': "not a JSON object but an array",
}


@pytest.mark.parametrize("line", sorted(NOT_A_STRING))
def test_jsonl_text_that_is_not_a_string_follows_on_undecodable(tmp_path, line):
    src = _jsonl_around(tmp_path / "d.jsonl", [line], 12)
    out = tmp_path / "out"
    _fails_with_one_line(
        config(src, out, format="jsonl", on_undecodable="fail"),
        out,
        f"{src}:13: {NOT_A_STRING[line]}",
        "(data.on_undecodable=fail)",
    )
    shards = build_shards(config(src, out, format="jsonl"))  # skip is the default
    assert shards.skipped == {"undecodable": 1} and shards.num_train + shards.num_val == 30


def _parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=8)
    return path


def _texts(n: int = 40) -> list[str]:
    return [f"row {i} " * 20 for i in range(n)]


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_parquet_without_the_text_column_stops_the_stage_whatever_the_policy(tmp_path, policy):
    good = _parquet(tmp_path / "c" / "a.parquet", {"text": _texts()})
    bad = _parquet(tmp_path / "c" / "b.parquet", {"id": list(range(40)), "body": _texts()})
    out = tmp_path / "out"
    message = _fails_with_one_line(
        config(good.parent, out, format="parquet", on_undecodable=policy),
        out,
        f"{bad}: no column 'text' (data.text_field; columns: id, body)",
    )
    assert message.startswith(str(bad))


def test_parquet_text_column_of_numbers_stops_the_stage(tmp_path):
    bad = _parquet(tmp_path / "c" / "a.parquet", {"text": list(range(40))})
    out = tmp_path / "out"
    _fails_with_one_line(
        config(bad.parent, out, format="parquet"), out, f"{bad}: column 'text' is int64, not a string (data.text_field)"
    )


def test_parquet_nulls_and_bad_utf8_follow_on_undecodable(tmp_path):
    texts: list = [t.encode() for t in _texts()]
    texts[9], texts[20] = None, b"caf\xe9"
    src = _parquet(tmp_path / "c" / "a.parquet", {"text": texts})
    out = tmp_path / "out"
    _fails_with_one_line(
        config(src.parent, out, format="parquet", on_undecodable="fail"),
        out,
        f"{src} row 9: column 'text' is null (data.text_field) (data.on_undecodable=fail)",
    )
    shards = build_shards(config(src.parent, out, format="parquet"))
    assert shards.skipped == {"undecodable": 2} and shards.num_train + shards.num_val == 38


def test_a_file_that_is_not_parquet_follows_on_undecodable(tmp_path):
    _parquet(tmp_path / "c" / "a.parquet", {"text": _texts()})
    fake = tmp_path / "c" / "b.parquet"
    fake.write_text("id,text\n1,hello\n")
    out = tmp_path / "out"
    _fails_with_one_line(
        config(fake.parent, out, format="parquet", on_undecodable="fail"),
        out,
        f"{fake}: not a Parquet file (ArrowInvalid",
    )
    assert build_shards(config(fake.parent, out, format="parquet")).skipped == {"undecodable": 1}


def test_saved_dataset_without_the_text_column_stops_the_stage(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"id": list(range(40)), "body": _texts()}).save_to_disk(str(saved))
    out = tmp_path / "out"
    _fails_with_one_line(
        config(saved, out, format="hf_dataset"), out, f"{saved}: no column 'text' (data.text_field; columns: id, body)"
    )
    _fails_with_one_line(
        config(saved, out, format="hf_dataset", text_field="id"),
        out,
        f"{saved}: column 'id' is int64, not a string (data.text_field)",
    )


def test_a_directory_that_is_not_a_saved_dataset(tmp_path):
    _parquet(tmp_path / "c" / "a.parquet", {"text": _texts()})
    out = tmp_path / "out"
    _fails_with_one_line(
        config(tmp_path / "c", out, format="hf_dataset"),
        out,
        f"{tmp_path / 'c'}: not a datasets save_to_disk directory (FileNotFoundError",
    )
    _fails_with_one_line(
        config(tmp_path / "nope", out, format="hf_dataset"), out, f"{tmp_path / 'nope'}: no such directory"
    )


def evil_reader(source, cfg):
    for i in range(30):
        yield f"doc{i}", f"text {i} " * 20
    yield "../../outside", b"escape"


def broken_reader(source, cfg):
    yield "a", b"fine"
    raise OSError(5, "Input/output error", "/mnt/corpus/b")


def test_plugin_reader_unsafe_key_and_own_failure(tmp_path):
    out = tmp_path / "out"
    _fails_with_one_line(config("x", out, reader=f"{__name__}:evil_reader"), out, "'../../outside'", "unsafe")
    shards = build_shards(config("x", tmp_path / "ok", reader=f"{__name__}:evil_reader", on_unsafe_name="skip"))
    assert shards.skipped == {"unsafe_name": 1} and shards.num_train + shards.num_val == 30
    _fails_with_one_line(config("x", out, reader=f"{__name__}:broken_reader"), out, "OSError", "/mnt/corpus/b")
    _fails_with_one_line(config("x", out, reader="no_such_module:f"), out, "data.reader='no_such_module:f'")


@pytest.mark.parametrize("where", ["shards", "", "a/deeper"])
def test_output_inside_the_source_is_refused_before_reading(tmp_path, where):
    """Shards written inside the corpus would be read back as corpus by the next build (a new digest every run)."""
    root = make_corpus(tmp_path / "c", n=10)
    out = root / where if where else root
    with pytest.raises(DataError) as err:
        build_shards(config(root, out))
    assert str(err.value) == (
        f"data.output {out.resolve()} is inside data.source {root.resolve()}: its shard sets would be read back as "
        "corpus; choose an output outside the source"
    )
    assert not (root / "shards").exists() and not (root / "_staging").exists()


def test_output_beside_the_source_with_a_common_name_prefix_is_fine(tmp_path):
    root = make_corpus(tmp_path / "c", n=10)
    shards = build_shards(config(root, tmp_path / "c-out"))
    assert shards.num_train + shards.num_val == 10
