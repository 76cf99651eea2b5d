"""Running chunks concurrently: worker processes on this machine (engine=local) or Ray tasks (engine=ray).

Results come back in chunk order, with at most 2 x workers chunks in flight, so the coordinator's memory does not
grow with the corpus, and the first error in corpus order is the one raised (as a sequential run would).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from training.data.plan import CHUNK_MAX_ITEMS, Chunk
from training.data.shardset import DataError
from training.data.worker import ChunkJob, ChunkResult, shard_chunk, warm_up


def local_workers(configured: int) -> int:
    """data.workers, or the cores this process may run on when it is 0."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return configured or cores


def ray_workers(configured: int) -> int:
    """data.workers, or the connected Ray cluster's CPUs when it is 0; DataError when Ray is not connected."""
    import ray

    if not ray.is_initialized():
        raise DataError(
            "data.engine='ray' needs a Ray cluster: run the pipeline, which provisions one, "
            "or `shardline shard`, which provisions [cluster]"
        )
    return configured or max(1, int(ray.cluster_resources().get("CPU", 1)))


POOL_MIN_CHUNKS = 4  # a corpus listed at no more than this many chunks' bytes is written in this process


class LocalPool:
    """The local engine's worker processes (spawned: the caller may hold threads, e.g. Prefect's), started early.

    `listed` is told the size of every input as the corpus is listed. Once more than POOL_MIN_CHUNKS chunks' worth
    of bytes is listed, the processes are started, so their start-up (~0.2 s: interpreter, imports) overlaps the
    rest of the listing instead of following it. With `auto` (data.workers = 0), a corpus whose whole listing
    stays under that (`listing_done`) is written in this process: on so few chunks two workers save less than
    their start costs (50 MB: 0.29 s in process, 0.42 s with two workers). An explicit data.workers is obeyed.
    """

    def __init__(self, workers: int, chunk_bytes: int, auto: bool = False) -> None:
        self.workers, self.chunk_bytes, self.auto = workers, chunk_bytes, auto
        self._listed_bytes = self._listed_items = 0
        self._complete = False
        self._pool: ProcessPoolExecutor | None = None

    def listed(self, size: int) -> None:
        self._listed_bytes += size
        self._listed_items += 1
        if (
            self._pool is None
            and self.workers > 1
            and (
                self._listed_bytes > POOL_MIN_CHUNKS * self.chunk_bytes
                or self._listed_items > POOL_MIN_CHUNKS * CHUNK_MAX_ITEMS
            )
        ):
            self.executor()

    def listing_done(self) -> None:
        """Every input was passed to `listed`: a pool not started by now is not worth starting."""
        self._complete = True

    @property
    def not_worth_it(self) -> bool:
        return self.auto and self._complete and self._pool is None

    def executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=multiprocessing.get_context("spawn"),
            )
            with _interrupts_ignored_by_children():
                for _ in range(self.workers):
                    self._pool.submit(warm_up)  # starts every worker process
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None and issubclass(kind, KeyboardInterrupt) and self._pool is not None:
            # interrupted: what the workers are writing is staging, never trusted; stop them now rather than wait
            # for their chunks (ProcessPoolExecutor has no public way to, before Python 3.14's terminate_workers)
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.terminate()
        self.close()


@contextlib.contextmanager
def _interrupts_ignored_by_children() -> Iterator[None]:
    """Chunk workers started inside ignore Ctrl-C, which a terminal sends to the whole process group: the parent
    handles it (one line, exit 130, nothing published) and stops the workers (LocalPool.__exit__). A worker that
    took it itself printed its own KeyboardInterrupt traceback, and its death could reach the parent first as a
    BrokenProcessPool. The parent ignores Ctrl-C only while the processes are forked, and a spawned Python keeps
    the ignored SIGINT from its first instruction. Only on the main thread: a pool built on another (a Prefect
    task's thread in `shardline run`) never sees the KeyboardInterrupt, so its workers keep Ctrl-C and die of it,
    which stops the stage."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def run_chunks(
    chunks: Iterable[Chunk], job: ChunkJob, engine: str, workers: int, pool: LocalPool | None = None
) -> Generator[ChunkResult, None, None]:
    """Each chunk's result, in chunk order.

    engine=local with workers > 1 and more than one chunk uses `pool` (or a new LocalPool of `workers`), unless
    the pool found the whole listing too small to be worth it; otherwise chunks run in this process. engine=ray
    needs Ray connected.
    """
    it = iter(chunks)
    head = list(itertools.islice(it, 2))
    rest = itertools.chain(head, it)
    if engine == "ray":
        yield from _ray(rest, job, workers)
    elif workers <= 1 or len(head) < 2 or (pool is not None and pool.not_worth_it):
        yield from _ordered(rest, lambda c: c, lambda c: shard_chunk(c, job), lambda pending: None, window=1)
    else:
        with contextlib.ExitStack() as own:
            if pool is None:
                pool = own.enter_context(LocalPool(workers, job.cfg.chunk_bytes))
            executor = pool.executor()
            yield from _ordered(
                rest,
                lambda c: executor.submit(shard_chunk, c, job),
                _result,
                lambda pending: [f.cancel() for f in pending],
                window=2 * workers,
            )


def _result(future: Future) -> ChunkResult:
    try:
        return future.result()
    except BrokenProcessPool as err:  # retryable (the stage retries), but say what usually causes it
        raise BrokenProcessPool(
            "a data worker process died (killed for memory? or a script calling build_shards without "
            "`if __name__ == '__main__':`, which spawned workers re-run)"
        ) from err


def _ordered(
    chunks: Iterator[Chunk],
    submit: Callable[[Chunk], Any],
    get: Callable[[Any], ChunkResult],
    cancel: Callable[[list[Any]], Any],
    window: int,
) -> Iterator[ChunkResult]:
    pending: deque[tuple[Chunk, Any]] = deque()

    def fill() -> None:
        while len(pending) < window:
            chunk = next(chunks, None)
            if chunk is None:
                return
            pending.append((chunk, None if chunk.error else submit(chunk)))

    try:
        fill()
        while pending:
            chunk, handle = pending.popleft()
            if chunk.error:
                raise DataError(chunk.error)
            result = get(handle)
            fill()
            yield result
    finally:
        cancel([handle for _, handle in pending if handle is not None])


def _ray(chunks: Iterator[Chunk], job: ChunkJob, workers: int) -> Iterator[ChunkResult]:
    import ray
    from ray.exceptions import RayTaskError

    workers = ray_workers(workers)
    # max_retries: a chunk is idempotent, so a lost node only costs a rerun; errors of the chunk itself are final.
    task = ray.remote(num_cpus=1, max_retries=3, retry_exceptions=False)(shard_chunk)

    def get(ref: Any) -> ChunkResult:
        try:
            return ray.get(ref)
        except RayTaskError as err:  # the chunk's own error, not Ray's wrapper with the remote traceback
            cause = err.cause
            raise (cause if isinstance(cause, Exception) else err) from None

    def cancel(refs: list[Any]) -> None:
        for ref in refs:
            ray.cancel(ref, force=True)
        if refs:  # nothing may still write into the build directory the caller is about to delete
            ray.wait(refs, num_returns=len(refs), timeout=60)

    yield from _ordered(chunks, lambda c: task.remote(c, job), get, cancel, window=2 * workers)
