"""The partition of a corpus into chunks, the unit of parallel work: a function of the listing alone.

A chunk is a run of consecutive inputs of the sorted listing, closed once it holds data.chunk_bytes of listed bytes
or CHUNK_MAX_ITEMS inputs; a file or object is never split. The number of workers and the engine play no part, so
every chunk, hence every shard, comes out the same however many processes write them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from training.data.config import DataConfig
from training.data.readers import Source, list_sources
from training.data.records import Problem
from training.data.shardset import DataError

# Bounds the plan a coordinator holds per chunk in flight when files are tiny (part of the layout in the manifest).
CHUNK_MAX_ITEMS = 10_000


@dataclass(frozen=True)
class Chunk:
    """Chunk `index` of the corpus: its inputs, the plug-in stream (always one chunk), or a listing error that
    surfaces in corpus order, after the chunks listed before it."""

    index: int
    items: tuple[Source | Problem, ...] = ()
    plugin: bool = False
    error: str = ""


def plan_chunks(cfg: DataConfig, listing: Iterable[Source | Problem] | None = None) -> Iterator[Chunk]:
    """The chunks of `cfg`'s corpus, in corpus order, listed lazily (memory does not grow with the listing).

    `listing`: the corpus' inputs as already listed (listing_index.spooled_listing); default: list them now.
    """
    if cfg.reader:
        yield Chunk(0, plugin=True)
        return
    items: list[Source | Problem] = []
    size = index = 0
    try:
        for item in list_sources(cfg) if listing is None else listing:
            items.append(item)
            size += item.size if isinstance(item, Source) else 0
            if size >= cfg.chunk_bytes or len(items) >= CHUNK_MAX_ITEMS:
                yield Chunk(index, tuple(items))
                items, size, index = [], 0, index + 1
    except DataError as err:  # e.g. "no files matching" found at the end of a walk: after what was listed
        if items:
            yield Chunk(index, tuple(items))
            index += 1
        yield Chunk(index, error=str(err))
        return
    if items:
        yield Chunk(index, tuple(items))
