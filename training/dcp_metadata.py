"""Reading DCP's .metadata (a pickle torch writes) through an allow-list unpickler: no arbitrary code on load."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

METADATA_FILE = ".metadata"

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided etc.
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata allowing only the plain dataclasses, dtypes and paths it is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{METADATA_FILE}: global {module}.{name} is not allowed")


def read_metadata(directory: str | os.PathLike) -> Any:
    """DCP's Metadata of a checkpoint, read with an allow-list unpickler (no arbitrary code on load)."""
    path = Path(directory) / METADATA_FILE
    with path.open("rb") as f:
        return _MetadataUnpickler(io.BytesIO(f.read())).load()


def safe_reader(directory: str | os.PathLike) -> Any:
    """A DCP FileSystemReader whose metadata goes through the allow-list unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            md = read_metadata(self.path)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _SafeReader(str(directory))
