"""A small GGUF header reader: metadata as plain Python values and the tensor index.

``gguf.GGUFReader`` builds a numpy view per array element and takes ~12 s on
the embedded model's 262k-token vocabulary; this reads the same header in a
fraction of a second. Tensor data is left on disk for the loader to memory-map, and a
long string array is decoded only when it is read (``LazyStrings``).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .errors import CheckpointError

# GGUF value types
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# A string array this long is decoded on first use (LazyStrings); a shorter one at once.
_LAZY_MIN = 1024


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    ggml_type: int
    offset: int  # absolute byte offset in its file
    file: str = ""  # the file holding it (a split model's part); "" : the one read


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict
    tensors: dict[str, GGUFTensorInfo]


def _decode_strings(data, pos: int, count: int) -> tuple[int, list[str]]:
    """``count`` strings from ``pos`` in one tight loop, and the position after them: a
    vocabulary holds 262k of them, and a call per string took 0.3 s of a process's start."""
    out = []
    append, unpack = out.append, _U64.unpack_from
    for _ in range(count):
        (n,) = unpack(data, pos)
        pos += 8
        append(data[pos:pos + n].decode("utf-8", errors="replace"))
        pos += n
    return pos, out


class LazyStrings(Sequence):
    """A long GGUF string array, decoded on first use; ``len()`` does not decode it.

    A vocabulary's 262k tokens take ~0.1 s to decode, and of the processes that read the
    header only the tokenizer stages read them (the frontend and the worker need their
    count at most); those read them from a cache when it has them (``fill``, keyed by
    ``digest``). Equal to a list of the same strings.
    """

    __slots__ = ("_raw", "_count", "_items")

    def __init__(self, raw: bytes, count: int):
        self._raw = raw  # the array's bytes: each string's u64 length, then it
        self._count = count
        self._items: list[str] | None = None

    def _list(self) -> list[str]:
        items = self._items
        if items is None:  # (two threads may both decode: either list is the same)
            items = self._items = _decode_strings(self._raw, 0, self._count)[1]
        return items

    def digest(self) -> bytes:
        """SHA-256 of the array as the file stores it (``string_array_digest``)."""
        return hashlib.sha256(self._raw).digest()

    def fill(self, items: list[str]) -> None:
        """Take ``items``, the strings a cache keyed by ``digest()`` kept, as the decoded
        array instead of decoding it."""
        if len(items) != self._count:
            raise ValueError(f"{len(items)} strings for an array of {self._count}")
        if self._items is None:
            self._items = items

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        return self._list()[index]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other):
        if isinstance(other, LazyStrings):
            other = other._list()
        return self._list() == other if isinstance(other, list) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        state = "decoded" if self._items is not None else "not decoded yet"
        return f"<LazyStrings: {self._count} strings, {state}>"


def string_array_digest(strings: Sequence[str]) -> bytes:
    """SHA-256 of a GGUF string array (a ``LazyStrings``, or a short one's list) in the
    file's layout: each string's UTF-8 after its length as a u64."""
    if isinstance(strings, LazyStrings):
        return strings.digest()
    digest = hashlib.sha256()
    for s in strings:
        data = s.encode("utf-8", "surrogatepass")
        digest.update(_U64.pack(len(data)) + data)
    return digest.digest()


class _Cursor:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str):
        v = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def strings(self, count: int) -> "list[str] | LazyStrings":
        if count < _LAZY_MIN:
            self.pos, out = _decode_strings(self.data, self.pos, count)
            return out
        # Only the lengths are walked (~0.03 s for 262k strings, against 0.2 s to decode).
        data, start, unpack = self.data, self.pos, _U64.unpack_from
        pos = start
        for _ in range(count):
            pos += 8 + unpack(data, pos)[0]
        if pos > len(data):
            raise ValueError("a string array runs past the end of the file")
        self.pos = pos
        return LazyStrings(data[start:pos], count)

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype == _STRING:
                return self.strings(count)
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                size = struct.calcsize(fmt)
                vals = list(struct.unpack_from(f"<{count}{fmt[1]}", self.data, self.pos))
                self.pos += size * count
                return vals
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


# llama.cpp's split models: NAME-00001-of-00003.gguf, ... (gguf-split, convert_hf_to_gguf's
# --split-max-*): the first part holds the metadata, every part some tensors
_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@lru_cache(maxsize=4)
def read_gguf_header(path: str) -> GGUFHeader:
    """The model's metadata and tensor index, each tensor with the file that holds it: one
    file, or every part of a split model named by its first (``split.count`` parts beside
    it). An array of ``_LAZY_MIN`` strings or more (a vocabulary, a merges list) is a
    ``LazyStrings``: a read-only sequence, not a list."""
    header = _read_one(path)
    count = int(header.metadata.get("split.count", 1) or 1)
    if count <= 1:
        return header
    m = _SPLIT_PART.search(path)
    if m is None or int(m[1]) != 1 or int(m[2]) != count:
        raise CheckpointError(f"{path!r} is part of a model split in {count} files: load its "
                              f"first part, NAME-00001-of-{count:05d}.gguf")
    tensors = dict(header.tensors)
    for i in range(2, count + 1):
        part = f"{path[:m.start()]}-{i:05d}-of-{count:05d}.gguf"
        if not os.path.exists(part):
            raise CheckpointError(f"{path!r} is split in {count} files; part {part!r} is missing")
        tensors.update(_read_one(part).tensors)
    total = header.metadata.get("split.tensors.count")
    if total is not None and int(total) != len(tensors):
        raise CheckpointError(f"{path!r}: the {count} parts hold {len(tensors)} tensors, "
                              f"the first says {total}")
    return GGUFHeader(header.metadata, tensors)


def _read_one(path: str) -> GGUFHeader:
    try:
        with open(path, "rb") as f:
            # Mapped, not read: only the header's pages are touched (reading copied 64 MiB).
            empty = os.fstat(f.fileno()).st_size == 0  # (mmap refuses an empty file)
            data = b"" if empty else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if data[:4] != b"GGUF":
                raise CheckpointError(f"{path!r} is not a GGUF file (bad magic)")
            cur = _Cursor(data)
            cur.pos = 4
            version = cur.unpack("<I")
            if version < 2:
                raise CheckpointError(f"{path!r}: GGUF version {version} is too old")
            n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
            meta = {}
            for _ in range(n_kv):
                key = cur.string()
                meta[key] = cur.value(cur.unpack("<I"))
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                ndim = cur.unpack("<I")
                shape = tuple(cur.unpack("<Q") for _ in range(ndim))
                ggml_type, rel = cur.unpack("<I"), cur.unpack("<Q")
                infos.append((name, shape, ggml_type, rel))
            align = int(meta.get("general.alignment", 32))
            start = (cur.pos + align - 1) // align * align
    except CheckpointError:
        raise
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read GGUF file {path!r}: {e}") from None
    tensors = {n: GGUFTensorInfo(n, s, t, start + r, path) for n, s, t, r in infos}
    return GGUFHeader(meta, tensors)


def read_gguf_metadata(path: str) -> dict:
    """Every key/value field, plus ``__has_output_weight`` (an untied LM head is present)."""
    header = read_gguf_header(path)
    meta = dict(header.metadata)
    meta["__has_output_weight"] = "output.weight" in header.tensors
    return meta
