"""Streaming safetensors I/O: header-indexed, memory-mapped, one tensor at a time.

File layout: ``u64-LE N`` | ``N`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [b, e]},
"__metadata__": {...}}`` (space-padded to a multiple of 8) | raw little-endian row-major bytes.

:class:`SafetensorsFile` validates the whole header up front (so a truncated or corrupt file fails before any
work is done, with the file and tensor named) and then hands out one tensor at a time from an ``mmap``;
after copying a tensor out it drops the pages it touched (``MADV_DONTNEED``) so resident memory stays at
one tensor, whatever the shard size. :class:`SafetensorsWriter` takes the full plan (names, dtypes,
shapes) first, writes the header, then accepts the tensors one by one in plan order — the output never has
to exist in memory as a whole. The header it writes is byte-identical to the ``safetensors`` library's
(tensors ordered by dtype size descending then name, compact JSON, space padding).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "DTYPES",
    "SafetensorsError",
    "TensorInfo",
    "SafetensorsFile",
    "SafetensorsWriter",
    "dtype_name",
    "read_header",
    "write_safetensors",
]

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's limit

#: safetensors dtype tag -> numpy dtype
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_TAGS = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    """A safetensors file is truncated, corrupt, or does not hold what was expected (message names it)."""


def dtype_name(dtype: np.dtype | type) -> str:
    """numpy dtype -> safetensors tag (``"BF16"``, ``"F32"``, ``"U8"`` …)."""
    dt = np.dtype(dtype)
    if dt not in _TAGS:
        raise SafetensorsError(f"dtype {dt} has no safetensors tag")
    return _TAGS[dt]


@dataclass(frozen=True)
class TensorInfo:
    """One header entry; ``start``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    file: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse and validate the header of ``path`` without reading any tensor data.

    Returns ``(tensors by name, __metadata__, data_start)``. Raises :class:`SafetensorsError` naming the file
    (and tensor) for: a file shorter than its header, a header length beyond the file, invalid JSON,
    unknown dtypes, malformed entries, a byte range that disagrees with shape x dtype, overlapping ranges,
    and tensor data beyond the end of the file (truncated download).
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: file does not exist") from None
    if size < 8:
        raise SafetensorsError(f"{path}: truncated ({size} bytes; a safetensors file starts with 8 bytes)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: corrupt header (declared header length {n} bytes is implausible)")
        if 8 + n > size:
            raise SafetensorsError(
                f"{path}: truncated or corrupt header (header length {n} needs {8 + n} bytes, file has {size})"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: corrupt header (not valid JSON: {e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt header (JSON is not an object)")
    meta = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    data_len = size - data_start
    out: dict[str, TensorInfo] = {}
    ranges = []
    for name, e in header.items():
        try:
            dt = e["dtype"]
            shape = tuple(int(s) for s in e["shape"])
            b, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: corrupt header entry for tensor {name!r}: {e!r}") from None
        if dt not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unknown dtype {dt!r}")
        if any(s < 0 for s in shape) or not 0 <= b <= end:
            raise SafetensorsError(f"{path}: corrupt header entry for tensor {name!r}: {e!r}")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        if end - b != want:
            raise SafetensorsError(
                f"{path}: corrupt header: tensor {name!r} {dt}{list(shape)} needs {want} bytes, "
                f"data_offsets span {end - b}"
            )
        if end > data_len:
            raise SafetensorsError(
                f"{path}: truncated: tensor {name!r} ends at data byte {end}, file holds only {data_len} "
                f"data bytes ({size} bytes in all)"
            )
        out[name] = TensorInfo(name, dt, shape, data_start + b, data_start + end, path)
        ranges.append((b, end, name))
    ranges.sort()
    for (_, e0, n0), (b1, _, n1) in zip(ranges, ranges[1:], strict=False):
        if b1 < e0:
            raise SafetensorsError(f"{path}: corrupt header: tensors {n0!r} and {n1!r} overlap")
    return out, meta, data_start


class SafetensorsFile:
    """A read-only, memory-mapped safetensors file; tensors are copied out one at a time.

    Use as a context manager. ``get(name)`` returns a fresh numpy array (a copy: the mapping is released
    tensor by tensor, so resident memory is bounded by the largest tensor, never the shard).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.tensors, self.metadata, self.data_start = read_header(self.path)
        self._f = open(self.path, "rb")
        size = os.fstat(self._f.fileno()).st_size
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._f.close()

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a numpy array of its dtype and shape (owned copy)."""
        try:
            info = self.tensors[name]
        except KeyError:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}") from None
        dt = DTYPES[info.dtype]
        if info.nbytes == 0:
            return np.zeros(info.shape, dt)
        assert self._mm is not None
        view = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.start)
        arr = view.copy().view(dt).reshape(info.shape)
        del view
        _drop_pages(self._mm, info.start, info.nbytes)
        return arr


def _drop_pages(mm: mmap.mmap, start: int, length: int) -> None:
    """Tell the kernel we are done with these pages of a read-only file mapping (keeps RSS flat)."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    lo = (start // page) * page
    hi = start + length
    try:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError):
        pass


# ----------------------------------------------------------------------------------------------- writing
def _order(plan: Iterable[tuple[str, str, tuple[int, ...]]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """The safetensors library's data order: dtype size descending, then name."""
    return sorted(plan, key=lambda t: (-DTYPES[t[1]].itemsize, t[0]))


def _header_bytes(
    plan: list[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[int]]:
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    off = 0
    offsets = []
    for name, dt, shape in plan:
        nb = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        entries[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nb]}
        offsets.append(off)
        off += nb
    js = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js, offsets


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor.

    ``plan`` lists every ``(name, dtype_tag, shape)`` up front; the header is written immediately and the
    tensors must then be passed to :meth:`write` in :attr:`order` (dtype size descending, then name — the
    library's order). :meth:`close` fails if any planned tensor was not written.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        plan: Iterable[tuple[str, str, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
    ):
        self.path = os.fspath(path)
        self.order = _order((n, d, tuple(s)) for n, d, s in plan)
        header, _ = _header_bytes(self.order, metadata)
        self._f = open(self.path, "wb")
        self._f.write(header)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        if self._next >= len(self.order):
            raise SafetensorsError(f"{self.path}: unexpected tensor {name!r} (all planned tensors written)")
        want_name, dt, shape = self.order[self._next]
        if name != want_name:
            raise SafetensorsError(f"{self.path}: expected tensor {want_name!r} next, got {name!r}")
        arr = np.asarray(array)
        if arr.dtype != DTYPES[dt] or tuple(arr.shape) != shape:
            raise SafetensorsError(
                f"{self.path}: tensor {name!r}: planned {dt}{list(shape)}, got {arr.dtype}{list(arr.shape)}"
            )
        self._f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
        self._next += 1

    def close(self) -> None:
        try:
            if self._next != len(self.order):
                missing = [n for n, _, _ in self.order[self._next :]]
                raise SafetensorsError(f"{self.path}: {len(missing)} planned tensors not written: {missing[:3]}")
        finally:
            self._f.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write an in-memory ``{name: array}`` dict (small files, tests)."""
    plan = [(n, dtype_name(a.dtype), tuple(a.shape)) for n, a in tensors.items()]
    with SafetensorsWriter(path, plan, metadata) as w:
        for name, _, _ in w.order:
            w.write(name, tensors[name])
