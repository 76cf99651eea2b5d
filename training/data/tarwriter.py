"""Writing WebDataset tar shards fast and reproducibly: a ustar writer with templated headers and a file that
hashes what it writes on a background thread."""

from __future__ import annotations

import hashlib
import os
import tarfile
from concurrent.futures import Future
from typing import Any

FIXED_MTIME = 0  # tar headers carry no wall-clock time, so equal input gives equal bytes
TAR_BLOCK, TAR_RECORD = 512, 10240
_ZEROS = bytes(TAR_BLOCK)


class UstarWriter:
    """The per-shard writer: the tar bytes webdataset.TarWriter writes (ustar headers, mtime 0, user/group
    'shardline', mode 0444, records padded to 10240), from a header template instead of tarfile.addfile, which
    costs ~30 us per member and made shard writing 5x slower than a plain write. Byte-identity with
    webdataset.TarWriter is a unit test."""

    def __init__(self, stream: Any) -> None:
        info = tarfile.TarInfo("")
        info.mtime, info.mode, info.uname, info.gname = FIXED_MTIME, 0o444, "shardline", "shardline"
        h = bytearray(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict"))
        h[0:100], h[124:136], h[148:156] = bytes(100), bytes(12), b" " * 8
        # Only the name, the size and the checksum differ between members: keep the rest and its byte sum.
        self._mid, self._tail, self._base_sum = bytes(h[100:124]), bytes(h[136:148]), sum(h)
        self._rest = bytes(h[156:])
        self.stream, self.offset = stream, 0

    def _header(self, name: str, size: int) -> bytes:
        raw = name.encode("ascii")
        if len(raw) > 100 or size >= 8**11:
            raise ValueError(f"tar member {name!r} ({size} bytes) does not fit a ustar header")
        size_field = b"%011o\0" % size
        checksum = self._base_sum + sum(raw) + sum(size_field)
        return b"".join((raw.ljust(100, b"\0"), self._mid, size_field, self._tail, b"%06o\0 " % checksum, self._rest))

    def write(self, obj: dict[str, Any]) -> int:
        parts: list[bytes] = []
        total = 0
        for ext in sorted(obj):
            if ext.startswith("_"):
                continue
            data = obj[ext]
            pad = -len(data) % TAR_BLOCK
            parts += (self._header(f"{obj['__key__']}.{ext}", len(data)), data, _ZEROS[:pad])
            self.offset += TAR_BLOCK + len(data) + pad
            total += len(data)
        self.stream.write(b"".join(parts))  # one write per sample
        return total

    def close(self) -> None:
        end = self.offset + 2 * TAR_BLOCK
        self.stream.write(b"\0" * (2 * TAR_BLOCK + -end % TAR_RECORD))
        self.stream.close()


class HashingFile:
    """A write-only file whose sha256 is computed on a background thread: written pieces are handed over in
    batches of ~4 MB (by reference, no copy); hashlib releases the GIL, so hashing overlaps with writing.

    `durable`: on close the file is fsynced on that thread too, so the flush to disk overlaps with writing the next
    shard (and, with several workers, runs in every worker instead of in the coordinator at publish time).
    """

    HANDOFF = 4 << 20

    def __init__(self, path: str, pool: Any, durable: bool = False) -> None:
        self._fh = open(path, "wb")
        self._sha = hashlib.sha256()
        self._pool, self._pending_bytes = pool, 0
        self._pending: list[bytes] = []
        self._last: Future[None] | None = None
        self._durable, self._open = durable, True
        self.size = 0

    def write(self, data: bytes) -> int:
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= self.HANDOFF:
            self._handoff()
        self.size += len(data)
        return self._fh.write(data)

    def _handoff(self) -> None:
        pieces, self._pending, self._pending_bytes = self._pending, [], 0
        self._last = self._pool.submit(_update, self._sha, pieces)  # one worker thread: updates stay in order

    def close(self) -> None:
        if self._open:
            self._open = False
            self._fh.flush()  # readers of the path (the count read-back) see every byte from here on
            self._handoff()
            if self._durable:
                self._last = self._pool.submit(_sync_close, self._fh)
            else:
                self._fh.close()

    def result(self) -> tuple[int, str]:
        """(bytes, sha256) once every byte is hashed (and, if durable, on disk); an fsync error raises here."""
        self.close()
        if self._last is not None:
            self._last.result()
        return self.size, self._sha.hexdigest()


def _update(sha: Any, pieces: list[bytes]) -> None:
    for piece in pieces:
        sha.update(piece)


def _sync_close(fh: Any) -> None:
    try:
        os.fsync(fh.fileno())
    finally:
        fh.close()


def regular_member_names(path: str) -> list[str] | None:
    """Names of the regular-file members of a ustar file, read back header by header with each header checksum
    verified (ValueError when one is wrong); None when the file uses pax/GNU extensions (ask tarfile then).

    Why not tarfile: reading back every shard with it cost ~45 us per member, a quarter of the whole stage
    (measured, cProfile); this walk reads only the 512-byte headers and seeks over the data."""
    names: list[str] = []
    with open(path, "rb", buffering=0) as fh:
        offset = 0
        while True:
            fh.seek(offset)
            header = fh.read(TAR_BLOCK)
            if len(header) < TAR_BLOCK or header == _ZEROS:
                return names
            stored = int(header[148:156].strip(b"\0 ") or b"0", 8)
            if stored != sum(header[:148]) + 8 * 32 + sum(header[156:]):
                raise ValueError(f"{path}: bad tar header checksum at byte {offset}")
            kind = header[156:157]
            if kind not in (b"0", b"\0", b"5"):
                return None
            size = int(header[124:136].strip(b"\0 ") or b"0", 8)
            if kind != b"5":
                name = header[:100].split(b"\0", 1)[0]
                prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
                names.append((prefix + b"/" + name if prefix else name).decode("utf-8"))
            offset += TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK
