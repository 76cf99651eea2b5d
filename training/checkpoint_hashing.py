"""The save side of checkpoint integrity (training/checkpoint_manifest.py records and verifies): a DCP writer whose
filesystem hashes (XXH3-128) and counts every byte as it is written, and a save planner that checksums (XXH3-64)
every tensor chunk just before DCP serialises it. Nothing is read back to be hashed."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from training.checkpoint_manifest import FILE_DIGESTS, TENSOR_DIGESTS, chunk_key, file_hasher, tensor_checksum


class _HashingStream(io.IOBase):
    """A binary file that hashes (XXH3-128) and counts every byte written through it."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.size, self._hash = raw, 0, file_hasher(FILE_DIGESTS[0])

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self._hash.update(view)  # releases the GIL for large buffers: writer threads hash in parallel
        n = self.raw.write(view)
        self.size += len(view)
        return n if n is not None else len(view)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _hashing_filesystem() -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        """DCP's local FileSystem, recording name -> {bytes, xxh3_128} of every file it writes (renames followed)."""

        def __init__(self) -> None:
            super().__init__()
            self.files: dict[str, dict[str, Any]] = {}
            self._lock = threading.Lock()

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            path = Path(path)
            with path.open(mode) as raw:
                stream = _HashingStream(raw)
                yield stream
            with self._lock:
                self.files[path.name] = {"bytes": stream.size, FILE_DIGESTS[0]: stream.hexdigest()}

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
            super().rename(path, new_path)
            with self._lock:
                if Path(path).name in self.files:
                    self.files[Path(new_path).name] = self.files.pop(Path(path).name)

    return HashingFileSystem()


def writer(directory: str | os.PathLike, threads: int) -> Any:
    """A DCP FileSystemWriter that fsyncs every file and records its digest in `writer.fs.files` as it writes."""
    from torch.distributed.checkpoint import FileSystemWriter

    w = FileSystemWriter(str(directory), thread_count=threads, sync_files=True, overwrite=True)
    w.fs = _hashing_filesystem()
    return w


def checksum_planner() -> Any:
    """A DCP save planner recording {chunk key: {xxh3_64, sizes, dtype}} of every tensor chunk in `.tensors`.

    The checksum is taken from the tensor DCP is about to serialise (a device tensor is copied to CPU here,
    and that copy is what gets written, so there is no second device-to-host copy).
    """
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class ChecksumSavePlanner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__()
            self.tensors: dict[str, dict[str, Any]] = {}

        def resolve_data(self, write_item: Any) -> Any:
            data = super().resolve_data(write_item)
            if write_item.type != WriteItemType.BYTE_IO and isinstance(data, torch.Tensor):
                data = data.detach()
                if data.device.type != "cpu":
                    data = data.cpu()
                chunk = write_item.tensor_data.chunk
                self.tensors[chunk_key(write_item.index.fqn, chunk.offsets)] = {
                    TENSOR_DIGESTS[0]: tensor_checksum(data),
                    "sizes": [int(s) for s in chunk.sizes],
                    "dtype": str(data.dtype),
                }
            return data

    return ChecksumSavePlanner()
