"""Corpus readers (stdlib, directory tree, JSON Lines, Parquet, saved datasets, object store, plug-in) and the policies.

Readers yield `Record`s and `Problem`s; `checked` checks every record and applies the configured policy per
cause: `fail` raises DataError with a one-line cause naming the file, `skip` counts it. Causes and their fields:

    empty        data.on_empty_record   record shorter than data.min_record_bytes
    oversize     data.on_oversize       record (file, object or JSON line) over data.max_record_bytes
    binary       data.on_binary         NUL byte in the content
    undecodable  data.on_undecodable    not UTF-8; for JSON Lines also bad JSON or a missing/non-string field; for
                                        Parquet and saved datasets a null value or a file that does not decode
    unreadable   data.on_unreadable     open/read fails, or the entry is not a regular file (FIFO, socket, device)
    symlink_loop data.on_symlink_loop   symlink loop (ELOOP or a link back to an ancestor) or dangling link
    unsafe_name  data.on_unsafe_name    key with a '..' segment, an absolute path, a drive letter or a NUL

Hidden entries (names starting with '.') are not read. A source that does not exist, or that holds no file
matching `data.include`, is always an error; so is a Parquet file or saved dataset without a text column named
data.text_field (a wrong setting, not a bad record).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from training.data.config import DataConfig
from training.data.readers import records_of
from training.data.records import POLICY_FIELD, Problem, Record, Tally, check_record, describe, load_callable
from training.data.shardset import DataError

__all__ = [
    "POLICY_FIELD",
    "Problem",
    "Record",
    "Tally",
    "check_record",
    "checked",
    "load_callable",
    "no_usable_records",
    "read_corpus",
]


def checked(items: Iterable[Record | Problem], cfg: DataConfig, tally: Tally) -> Iterator[Record]:
    """The good records of `items`, in order; a bad one raises DataError under `fail`, is counted under `skip`."""
    problem: Problem | None
    for item in items:
        if isinstance(item, Problem):
            problem = item
        elif (problem := check_record(item, cfg)) is None:
            yield item
            continue
        policy = getattr(cfg, POLICY_FIELD[problem.kind])
        if policy == "fail":
            raise DataError(f"{describe(problem)} (data.{POLICY_FIELD[problem.kind]}=fail)")
        tally.count(problem.kind, describe(problem))


def no_usable_records(cfg: DataConfig, tally: Tally) -> DataError:
    counts = ", ".join(f"{k}={v}" for k, v in sorted(tally.skipped.items())) or "none"
    first = f"; the first: {tally.examples[0]}" if tally.examples else ""  # a typo in data.text_field, say
    return DataError(f"{cfg.source}: no usable records (skipped: {counts}){first}")


def read_corpus(cfg: DataConfig, tally: Tally) -> Iterator[Record]:
    """Good records of the whole corpus in this process, in a deterministic order (benchmarks, one-off use)."""
    produced = 0
    for record in checked(records_of(cfg), cfg, tally):
        produced += 1
        yield record
    if produced == 0:
        raise no_usable_records(cfg, tally)
