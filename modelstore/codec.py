"""The weight codec of the model store: a version's tensors as a snapshot or a bit-exact delta.

Encoding of one tensor (delta mode ``xor``): the raw bit pattern (bytes, C order) of the new
tensor XOR the parent's, byte-plane shuffled (all byte 0s, then all byte 1s, ...), zstd
compressed. Mode ``raw`` (snapshots, or a tensor whose dtype/shape changed) skips the XOR.
XOR of bit patterns is exactly invertible, so reconstruction is bit-exact; unchanged bits are
zero bytes and the high byte planes of a small update are nearly all zero, which zstd
compresses well. Every reconstructed tensor is verified against the manifest's sha256.

Pure: bytes in, tensors out; where the bytes live is :mod:`modelstore.store`'s job.
"""

from __future__ import annotations

import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from schemas.manifest import tensor_sha256

if TYPE_CHECKING:  # torch is imported where tensors are handled (the `flywheel` command imports the store)
    import torch

ZSTD_LEVEL = 3


class CorruptVersionError(ValueError):
    """A version could not be reconstructed exactly.

    Attributes:
        version: the version being loaded.
        tensor: the tensor name at fault (or ``"*"`` for the whole version).
        reason: what was wrong (checksum, truncation, hash mismatch, wrong parent, ...).
    """

    def __init__(self, version: str, tensor: str, reason: str):
        self.version, self.tensor, self.reason = version, tensor, reason
        super().__init__(f"version {version}: tensor {tensor!r}: {reason}")



def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor, C order, as a uint8 numpy array (a copy)."""
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy().copy()


def _shuffle(b: np.ndarray, width: int) -> np.ndarray:
    """Byte-plane shuffle: ``(n, width) -> (width, n)``."""
    return np.ascontiguousarray(b.reshape(-1, width).T) if width > 1 else b


def _unshuffle(b: np.ndarray, width: int) -> np.ndarray:
    return np.ascontiguousarray(b.reshape(width, -1).T).reshape(-1) if width > 1 else b


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)}


def _dtype(name: str) -> torch.dtype:
    if name not in _dtypes():
        raise ValueError(f"dtype: {name!r} is not supported by the store")
    return _dtypes()[name]


def encode_state(state: dict[str, torch.Tensor],
                 parent: dict[str, torch.Tensor] | None) -> tuple[list[dict], bytes]:
    """Encode ``state`` as a delta on ``parent`` (or a snapshot when ``parent`` is None).

    Returns:
        ``(entries, payload)``: one entry per tensor (name, dtype, shape, mode ``xor``|``raw``,
        offset/length in bytes into ``payload``, sha256 of those payload bytes, parent
        tensor sha256 for ``xor``), and the concatenated zstd frames.
    """
    import torch

    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    entries: list[dict] = []
    chunks: list[bytes] = []
    off = 0
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
        _dtype(str(t.dtype))
        width = t.element_size()
        b = _raw_bytes(t)
        p = parent.get(name) if parent is not None else None
        entry = {"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "mode": "raw"}
        if p is not None and p.dtype == t.dtype and tuple(p.shape) == tuple(t.shape):
            b = np.bitwise_xor(b, _raw_bytes(p))
            entry["mode"] = "xor"
            entry["parent_sha256"] = tensor_sha256(p)
        blob = cctx.compress(_shuffle(b, width).tobytes())
        entry.update(offset=off, length=len(blob), payload_sha256=hashlib.sha256(blob).hexdigest())
        entries.append(entry)
        chunks.append(blob)
        off += len(blob)
    return entries, b"".join(chunks)


def decode_state(version: str, entries: list[dict], payload: bytes,
                 parent: dict[str, torch.Tensor] | None,
                 parent_hashes: dict[str, str] | None = None,
                 expected: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_state`. Tensors are decoded in parallel threads (zstd,
    numpy and hashlib release the GIL).

    Args:
        parent_hashes: ``{name: sha256}`` of ``parent`` already verified by the caller (the
            parent manifest's hashes): saves hashing the parent again; computed if None.
        expected: ``{name: sha256}`` each reconstructed tensor must have (the manifest's);
            checked here, per tensor, while the bytes are hot in cache.

    Raises:
        CorruptVersionError: a payload entry is truncated or fails its checksum, does not
            decompress to the expected size, an ``xor`` entry is offered a parent tensor
            whose sha256 differs from the one it was encoded against (wrong parent), or a
            reconstructed tensor's sha256 differs from ``expected``.
    """
    import torch

    def one(e: dict) -> tuple[str, torch.Tensor]:
        dctx = zstandard.ZstdDecompressor()
        name = e["name"]
        dt = _dtype(e["dtype"])
        shape = tuple(e["shape"])
        width = torch.empty(0, dtype=dt).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * width
        blob = payload[e["offset"]:e["offset"] + e["length"]]
        if len(blob) != e["length"]:
            raise CorruptVersionError(version, name, f"payload truncated: {len(blob)} of {e['length']} bytes")
        if hashlib.sha256(blob).hexdigest() != e["payload_sha256"]:
            raise CorruptVersionError(version, name, "payload checksum mismatch")
        try:
            raw = dctx.decompress(blob, max_output_size=max(nbytes, 1))
        except zstandard.ZstdError as exc:
            raise CorruptVersionError(version, name, f"zstd: {exc}") from exc
        if len(raw) != nbytes:
            raise CorruptVersionError(version, name, f"decoded {len(raw)} bytes, expected {nbytes}")
        b = _unshuffle(np.frombuffer(raw, dtype=np.uint8), width)
        if e["mode"] == "xor":
            p = parent.get(name) if parent is not None else None
            if p is None:
                raise CorruptVersionError(version, name, "wrong parent: parent has no such tensor")
            ph = parent_hashes.get(name) if parent_hashes is not None else None
            if (ph or tensor_sha256(p)) != e["parent_sha256"]:
                raise CorruptVersionError(version, name, "wrong parent: parent tensor sha256 differs "
                                          "from the one this delta was encoded against")
            b = np.bitwise_xor(b, _raw_bytes(p))
        elif e["mode"] != "raw":
            raise CorruptVersionError(version, name, f"unknown mode {e['mode']!r}")
        if not nbytes:
            t = torch.empty(0, dtype=torch.uint8)
        else:
            if not b.flags.writeable:  # width 1 raw: still a view of the zstd output
                b = b.copy()
            t = torch.from_numpy(b)
        t = t.view(dt).reshape(shape)
        if expected is not None and name in expected and tensor_sha256(t) != expected[name]:
            raise CorruptVersionError(version, name, "sha256 of the reconstructed tensor differs from the manifest")
        return name, t

    workers = min(8, os.cpu_count() or 1)
    if workers <= 1 or len(entries) <= 1:
        return dict(one(e) for e in entries)
    with ThreadPoolExecutor(workers) as ex:
        return dict(ex.map(one, entries))
