"""Compressed weight publication across processes (issue 19 item 6; the enterprise document's
"FP16 quantization + Zstandard" for continuous data).

`pack` turns a state dict into one self-describing blob: safetensors bytes (float32 tensors
cast to float16 when `fp16`; other dtypes as they are), optionally zstd-compressed, behind a
small header; `unpack` restores every tensor to its original dtype. A trainer in another
process writes `pack(...)` to a `.fmw` file and the server loads it through
`POST /v1/admin/reload {"agent": ..., "path": "x.fmw"}` or a canary (`agents.load_weights_file`
reads the format by its magic bytes).

Header: b"FMW1", one flags byte (1: fp16, 2: zstd), then the payload. The original dtypes
travel in the safetensors metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load, save

from flexmarl.store.compression import check_fp16_range

MAGIC = b"FMW1"
FP16, ZSTD = 1, 2


def pack(tensors: dict[str, torch.Tensor], fp16: bool = True, zstd_level: int | None = 3
         ) -> bytes:
    """One blob holding `tensors` (FP16 for float32 ones when `fp16`; zstd when a level)."""


    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}
    if fp16:
        for k, v in tensors.items():
            if v.dtype == torch.float32:
                check_fp16_range(v.detach().cpu().numpy(), f"tensor {k!r}",
                                 "pack it with fp16=False")
    out = {k: (v.detach().to(torch.float16) if fp16 and v.dtype == torch.float32 else
               v.detach()).contiguous().cpu() for k, v in tensors.items()}
    payload = save(out, metadata={"dtypes": json.dumps(dtypes)})
    flags = FP16 if fp16 else 0
    if zstd_level is not None:
        import zstandard  # optional: zstandard (the serve and marl extras)

        payload = zstandard.ZstdCompressor(level=zstd_level, threads=-1).compress(payload)
        flags |= ZSTD
    return MAGIC + bytes([flags]) + payload


def unpack(blob: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a `pack` blob, each in its original dtype."""

    if blob[:4] != MAGIC or len(blob) < 5:
        raise ValueError("not a flexmarl weights blob (expected the FMW1 header)")
    flags, payload = blob[4], blob[5:]
    if flags & ZSTD:
        import zstandard  # optional: zstandard (the serve and marl extras)

        payload = zstandard.ZstdDecompressor().decompress(payload)
    tensors = load(payload)
    meta = _metadata(payload)
    dtypes = json.loads(meta.get("dtypes", "{}"))
    return {k: v.to(getattr(torch, dtypes[k])) if k in dtypes else v for k, v in tensors.items()}


def _metadata(payload: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (read from the bytes: 8-byte length, JSON)."""
    n = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8:8 + n]).get("__metadata__", {}) or {}


def is_packed(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def write(path: str | Path, tensors: dict[str, torch.Tensor], fp16: bool = True,
          zstd_level: int | None = 3) -> int:
    """Write a blob atomically (aside, then renamed); returns its size in bytes."""

    p = Path(path)
    blob = pack(tensors, fp16, zstd_level)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, p)
    return len(blob)
