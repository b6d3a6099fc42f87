"""Minimal streaming safetensors reader/writer over numpy (+ ``ml_dtypes`` for bfloat16).

Why not ``safetensors.numpy``: numpy has no bfloat16, so that backend cannot read the most common
checkpoint dtype, and the torch/flax backends would materialise tensors in a framework (flax: on one
accelerator). The format is simple (8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}``, then the raw little-endian bytes), so we read each
tensor through a memory map, one at a time, and write files tensor by tensor.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence

import ml_dtypes
import numpy as np

# safetensors dtype tag <-> numpy dtype.
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
TAGS = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one ``.safetensors`` file: headers are parsed, data is read on ``get``."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise ValueError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, "
                             "not an object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.header = header
        self.data_start = 8 + n
        size = os.path.getsize(path)
        for name, info in header.items():
            try:
                begin, end = (int(v) for v in info["data_offsets"])
                tuple(info["shape"]), info["dtype"]  # pylint: disable=expression-not-assigned
            except (TypeError, KeyError, ValueError):
                raise ValueError(f"{path}: corrupt safetensors header: entry {name!r} lacks "
                                 "dtype/shape/data_offsets") from None
            if not 0 <= begin <= end or self.data_start + end > size:
                raise ValueError(f"{path}: tensor {name!r} lies at bytes {begin}..{end} of the data, "
                                 f"beyond the file's {size - self.data_start}; the file is truncated "
                                 "or corrupt (download it again)")

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        tag = self.header[name]["dtype"]
        if tag not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {tag}, which is not supported "
                             f"(supported: {sorted(DTYPES)})")
        return DTYPES[tag]

    def get(self, name: str) -> np.ndarray:
        """Reads one tensor into host memory (a fresh array, the file is not kept mapped)."""
        info = self.header[name]
        begin, end = info["data_offsets"]
        dt, shape = self.dtype(name), self.shape(name)
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
            raise ValueError(f"{self.path}: tensor {name!r} has {end - begin} bytes but shape {shape} "
                             f"of {dt} needs {int(np.prod(shape)) * dt.itemsize}; the file is corrupt")
        if end == begin:
            return np.zeros(shape, dt)
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_start + begin,
                       shape=(end - begin,))
        out = np.array(mm.view(dt).reshape(shape))  # copy, little-endian on all supported hosts
        del mm
        return out


def write_safetensors(path: str, specs: Sequence[tuple[str, tuple[int, ...], np.dtype]],
                      arrays: Iterable[tuple[str, np.ndarray]], metadata: dict | None = None) -> int:
    """Writes a safetensors file whose header is built from ``specs`` (name, shape, dtype), then the
    data from ``arrays`` — an iterable yielding ``(name, array)`` in the same order — so that only
    one tensor is in host memory at a time. Returns the number of data bytes written."""
    header, offset = {}, 0
    for name, shape, dt in specs:
        dt = np.dtype(dt)
        if dt not in TAGS:
            raise ValueError(f"cannot write tensor {name!r} of dtype {dt} to safetensors")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        header[name] = {"dtype": TAGS[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header = {"__metadata__": {k: str(v) for k, v in metadata.items()}, **header}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        expected = iter(specs)
        for name, arr in arrays:
            want_name, want_shape, want_dt = next(expected)
            arr = np.asarray(arr)
            if name != want_name or tuple(arr.shape) != tuple(want_shape) or arr.dtype != np.dtype(want_dt):
                raise AssertionError(f"write_safetensors: got {name} {arr.shape} {arr.dtype}, expected "
                                     f"{want_name} {tuple(want_shape)} {np.dtype(want_dt)}")
            f.write(np.ascontiguousarray(arr).tobytes())
        if next(expected, None) is not None:
            raise AssertionError(f"write_safetensors: fewer arrays than specs for {path}")
        f.flush()
        os.fsync(f.fileno())
    return offset
