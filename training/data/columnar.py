"""Column-store corpora: Parquet files and `datasets` save_to_disk directories, one record per row of data.text_field.

Both are read a bounded piece at a time (a Parquet row group, an Arrow record batch), so a reader's memory follows
the largest row group, not the file. Values are taken as UTF-8 bytes without a decode/encode round trip, then the
usual record checks (corpus.checked) apply. A file or dataset without the column, or whose column holds no text,
stops the stage with one line whatever the policies: that is a wrong data.text_field, not a bad record. A null
value is a bad record (`undecodable`, like a JSON line without the field); so is a file that does not decode.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from infra import storage
from training.data.config import DataConfig
from training.data.records import Problem, Record, Source, local_source
from training.data.shardset import DataError

ROW_BATCH = 1024  # rows turned into Python objects at a time
DICT_JSON, STATE_JSON, INFO_JSON = "dataset_dict.json", "state.json", "dataset_info.json"  # save_to_disk's names


def read_columnar(item: Source, cfg: DataConfig, remote: bool) -> Iterator[Record | Problem]:
    """The records of one listed Parquet file or saved-dataset Arrow file, in row order."""
    if cfg.format == "parquet":
        return read_parquet(item, cfg, remote)
    return read_saved(item, cfg, remote)


# ---------------------------------------------------------------------------------------------- Parquet


def read_parquet(item: Source, cfg: DataConfig, remote: bool) -> Iterator[Record | Problem]:
    """The rows of one Parquet file, a row group at a time.

    Parquet keeps its schema and row-group offsets in a footer at the end of the file, so it is read with random
    access: an object is first copied to a local temporary file through storage.open_read (its retries, and its
    resume at the byte reached after a dropped connection), then read from there and deleted. Disk, not memory,
    holds the file while it is read.
    """
    if not remote:
        yield from _parquet_rows(item.where, item, cfg)
        return
    with tempfile.TemporaryDirectory(prefix="shardline-parquet-") as tmp:
        local = os.path.join(tmp, "object.parquet")
        try:
            with storage.open_read(item.where, cfg.storage_retries) as src, open(local, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except OSError as err:  # StorageError, or the local disk
            yield Problem("unreadable", item.where, f"cannot read: {str(err).split(': ', 1)[-1]}")
            return
        yield from _parquet_rows(local, item, cfg)


def _parquet_rows(path: str, item: Source, cfg: DataConfig) -> Iterator[Record | Problem]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        yield Problem("undecodable", item.where, f"not a Parquet file ({_one_line(err)})")
        return
    with pf:
        columns = _columns(pf.schema_arrow, item.where, cfg)
        row = 0
        for group in range(pf.num_row_groups):
            try:
                table = pf.read_row_group(group, columns=columns)
            except (pa.ArrowException, OSError) as err:
                lost = pf.metadata.row_group(group).num_rows  # one skipped item, so its message says how many rows
                why = f"cannot decode its {lost} rows ({_one_line(err)})"
                yield Problem("undecodable", f"{item.where} row group {group}", why)
                row += lost
                continue
            for batch in table.to_batches(max_chunksize=ROW_BATCH):
                yield from _rows(batch, row, item, cfg)
                row += batch.num_rows


# ---------------------------------------------------------------------------------------------- save_to_disk


def list_saved(cfg: DataConfig) -> Iterator[Source]:
    """The Arrow files of the save_to_disk directory data.source in dataset order (a DatasetDict: each split in
    dataset_dict.json's order); DataError when it is not such a directory or its features lack data.text_field."""
    if storage.is_remote(cfg.source):
        yield from _list_saved_remote(cfg)
    else:
        yield from _list_saved_local(cfg)


def _list_saved_local(cfg: DataConfig) -> Iterator[Source]:
    import datasets

    root = local_source(cfg.source).resolve()
    if not root.is_dir():
        raise DataError(
            f"{cfg.source}: no such directory (data.source; data.format='hf_dataset' reads a directory "
            "written by datasets' save_to_disk)"
        )
    try:
        loaded = datasets.load_from_disk(str(root), keep_in_memory=False)  # memory-maps; reads no rows
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(
            f"{cfg.source}: not a datasets save_to_disk directory ({_one_line(err)}) (data.source)"
        ) from None
    parts = list(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    for split, ds in parts:
        _columns(ds.features.arrow_schema, str(root / split) if split else str(root), cfg)
        for cache_file in ds.cache_files:
            # keyed by where the file sits in the dataset, not where a link points (DVC, git-annex, a dataset
            # assembled from links): opening and stat() follow the link
            path = Path(cache_file["filename"])
            if not path.is_relative_to(root):
                raise DataError(f"{path}: a data file outside {cfg.source} (data.source; data.format='hf_dataset')")
            st = path.stat()
            yield Source(str(path), path.relative_to(root).as_posix(), st.st_size, storage.file_stamp(st))


def _list_saved_remote(cfg: DataConfig) -> Iterator[Source]:
    """As _list_saved_local, for S3 and Azure, from save_to_disk's JSON files read through infra.storage.

    datasets.load_from_disk would take an s3:// path only through fsspec (s3fs, adlfs: a second filesystem layer
    with its own credentials and retries beside infra/storage.py), and it downloads the whole dataset to a local
    directory before reading a row. Here `datasets` still interprets the dataset info (its Features give the
    Arrow schema that is checked); the file list is state.json's `_data_files`, the order load_from_disk uses.
    """
    import datasets

    root, r = cfg.source.rstrip("/"), cfg.storage_retries
    try:
        entries = {e.uri: e for e in storage.list_prefix(root, r)}
    except storage.StorageError as err:
        raise DataError(f"{err} (data.source)") from err
    if not entries:
        raise DataError(f"{cfg.source}: no objects under this prefix (does it exist? data.source)")
    try:
        dict_uri = storage.join(root, DICT_JSON)
        splits = [str(s) for s in _json(dict_uri, r)["splits"]] if dict_uri in entries else [""]
        for split in splits:
            base = storage.join(root, split)
            for name in (STATE_JSON, INFO_JSON):
                if storage.join(base, name) not in entries:
                    raise DataError(f"{base}: no {name}, so not a datasets save_to_disk directory (data.source)")
            info = datasets.DatasetInfo.from_dict(_json(storage.join(base, INFO_JSON), r))
            if info.features is None:
                raise DataError(f"{storage.join(base, INFO_JSON)}: no features (data.source)")
            _columns(info.features.arrow_schema, base, cfg)
            for data_file in _json(storage.join(base, STATE_JSON), r)["_data_files"]:
                uri = storage.join(base, data_file["filename"])
                if uri not in entries:
                    raise DataError(f"{uri}: listed in {STATE_JSON} but not there (data.source)")
                yield Source(uri, uri[len(root) + 1 :], entries[uri].size, entries[uri].stamp)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(
            f"{cfg.source}: not a datasets save_to_disk directory ({_one_line(err)}) (data.source)"
        ) from None


def _json(uri: str, retries: int) -> Any:
    try:
        return json.loads(storage.read_bytes(uri, retries))
    except storage.StorageError as err:
        raise DataError(f"{err} (data.source)") from err


def read_saved(item: Source, cfg: DataConfig, remote: bool) -> Iterator[Record | Problem]:
    """The rows of one Arrow file of a save_to_disk directory, a record batch at a time.

    These files are Arrow IPC streams (what `datasets` itself memory-maps), read here with pyarrow rather than
    through `datasets`: the listing already used `datasets` to find them and check the column, so what is left is a
    plain Arrow stream. That keeps `datasets` (0.7 s of imports, pandas among them) out of every worker process,
    and the stream format needs no seeking, so an object is read straight through storage.open_read instead of
    being downloaded first (what load_from_disk does with a remote path).
    """
    import pyarrow as pa

    try:
        source = storage.open_read(item.where, cfg.storage_retries) if remote else pa.memory_map(item.where)
    except OSError as err:
        yield Problem("unreadable", item.where, f"cannot read: {str(err).split(': ', 1)[-1]}")
        return
    with source:
        try:
            reader = pa.ipc.open_stream(source)
        except (pa.ArrowException, OSError) as err:
            yield Problem("undecodable", item.where, f"not an Arrow stream ({_one_line(err)})")
            return
        columns = _columns(reader.schema, item.where, cfg)
        row = 0
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowException, OSError) as err:
                yield Problem("undecodable", f"{item.where} row {row}", f"cannot decode ({_one_line(err)})")
                return
            batch = batch.select(columns)
            for start in range(0, batch.num_rows, ROW_BATCH):
                part = batch.slice(start, ROW_BATCH)
                yield from _rows(part, row, item, cfg)
                row += part.num_rows


# ---------------------------------------------------------------------------------------------- rows


def _columns(schema: Any, where: str, cfg: DataConfig) -> list[str]:
    """The columns to read (text, then key); DataError naming the file and field when one is missing or wrong."""
    import pyarrow as pa

    wanted = [(cfg.text_field, "data.text_field")] + ([(cfg.key_field, "data.key_field")] if cfg.key_field else [])
    for name, field in wanted:
        if name not in schema.names:
            have = ", ".join(schema.names[:12]) + (", ..." if len(schema.names) > 12 else "")
            raise DataError(f"{where}: no column {name!r} ({field}; columns: {have or 'none'})")
    kind = schema.field(cfg.text_field).type
    if not _is_text(kind):
        raise DataError(f"{where}: column {cfg.text_field!r} is {kind}, not a string (data.text_field)")
    if cfg.key_field:
        kind = schema.field(cfg.key_field).type
        if not (_is_string(kind) or pa.types.is_integer(kind)):
            raise DataError(f"{where}: column {cfg.key_field!r} is {kind}, not a string or integer (data.key_field)")
    return [name for name, _ in wanted]


def _is_string(kind: Any) -> bool:
    """A string column in any of Arrow's layouts, string_view included (what pyarrow >= 16 and Polars write)."""
    import pyarrow as pa

    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _is_text(kind: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(kind):  # a categorical column (pandas' Categorical): strings, stored once each
        return _is_text(kind.value_type)
    return _is_string(kind) or any(
        check(kind) for check in (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view)
    )


def _rows(batch: Any, first: int, item: Source, cfg: DataConfig) -> Iterator[Record | Problem]:
    import pyarrow as pa

    text = batch.column(cfg.text_field)
    if pa.types.is_dictionary(text.type):
        text = text.dictionary_decode()
    # string -> binary is a zero-copy cast: the bytes are taken as stored, and check_record judges the UTF-8.
    # The view layouts are copied into plain binary (their to_pylist would decode, or keep views of the batch).
    if _is_string(text.type) or pa.types.is_binary_view(text.type):
        text = text.cast(pa.large_binary() if pa.types.is_large_string(text.type) else pa.binary())
    keys = batch.column(cfg.key_field).to_pylist() if cfg.key_field else None
    for i, data in enumerate(text.to_pylist()):
        row = first + i
        origin = f"{item.where} row {row}"
        if data is None:
            yield Problem("undecodable", origin, f"column {cfg.text_field!r} is null (data.text_field)")
            continue
        key = f"{item.key}:{row}"
        if keys is not None:
            if keys[i] is None:
                yield Problem("undecodable", origin, f"column {cfg.key_field!r} is null (data.key_field)")
                continue
            key = str(keys[i])
        yield Record(key, data, origin)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip().rstrip(":")
