"""Agent-to-agent messages: a mailbox per agent and a wire codec (msgpack; FP16 observations;
zstd where it pays and the `zstandard` package is installed), after the enterprise document's
message layer ("msgpack + zstd", its latency table of 10 agents and 1,000 round trips). The
graph executor hands each node's output to the nodes that read it through a bus
(`GraphExecutor(handoff="bus")`, what `flexmarl serve`'s episodes use).

`encode` turns a message (dicts, lists, numbers, strings, bytes and numpy arrays) into bytes:
msgpack, numpy arrays as an extension (dtype, shape, raw bytes; float32 cast to float16 when
`fp16` and the values fit), and the whole zstd-compressed when it is at least `min_zstd`
bytes and compression saves at least 10%. One header byte says which. `decode` inverts it
(FP16 arrays come back as float16: the receiver casts if it needs to).

`MessageBus` hands messages between agents of a running graph without HTTP: each agent has an
asyncio mailbox; `send` encodes (the same bytes another process or node would receive),
`receive` decodes; `request` is a round trip (send, then wait for the reply that names it).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

try:  # the serve and marl extras; without it messages are never compressed
    import zstandard
except ImportError:  # pragma: no cover - every extra that serves installs it
    zstandard = None  # type: ignore[assignment]

RAW, ZSTD = 0, 1
ARRAY_EXT = 1
FP16_MAX = float(np.finfo(np.float16).max)


def _default(obj: Any, fp16: bool) -> Any:
    if isinstance(obj, np.ndarray):
        arr = obj
        if fp16 and arr.dtype == np.float32 and (arr.size == 0 or float(
                np.abs(arr).max()) <= FP16_MAX):
            arr = arr.astype(np.float16)
        head = msgpack.packb([arr.dtype.str, list(arr.shape)])
        return msgpack.ExtType(ARRAY_EXT, head + np.ascontiguousarray(arr).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"message: cannot encode {type(obj).__name__} (send dicts, lists, "
                    "numbers, strings, bytes or numpy arrays)")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != ARRAY_EXT:
        return msgpack.ExtType(code, data)
    unpacker = msgpack.Unpacker()
    unpacker.feed(data)
    dtype, shape = next(unpacker)
    offset = unpacker.tell()
    return np.frombuffer(data[offset:], dtype=np.dtype(dtype)).reshape(shape)


_compressor = zstandard.ZstdCompressor(level=3) if zstandard is not None else None
_decompressor = zstandard.ZstdDecompressor() if zstandard is not None else None


def encode(message: Any, fp16: bool = True, min_zstd: int = 1024) -> bytes:
    raw = msgpack.packb(message, default=lambda o: _default(o, fp16), use_bin_type=True)
    if _compressor is not None and len(raw) >= min_zstd:
        packed = _compressor.compress(raw)
        if len(packed) <= 0.9 * len(raw):
            return bytes([ZSTD]) + packed
    return bytes([RAW]) + raw


def decode(data: bytes) -> Any:
    body = data[1:]
    if data[0] == ZSTD:
        if _decompressor is None:
            raise ValueError("message: zstd-compressed, and the zstandard package is not "
                             "installed (pip install zstandard)")
        body = _decompressor.decompress(body)
    elif data[0] != RAW:
        raise ValueError(f"message: unknown header byte {data[0]}")
    return msgpack.unpackb(body, ext_hook=_ext_hook, raw=False)


@dataclass
class Envelope:
    sender: str
    receiver: str
    id: int
    reply_to: int | None
    data: bytes  # the encoded payload, as it would cross a process


class MessageBus:
    """Mailboxes of a graph's agents in one process (messages encoded as on the wire)."""

    def __init__(self, agents: list[str], fp16: bool = True, min_zstd: int = 1024) -> None:
        self.mailboxes: dict[str, asyncio.Queue[Envelope]] = {a: asyncio.Queue() for a in agents}
        self.fp16, self.min_zstd = fp16, min_zstd
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}

    def send(self, sender: str, receiver: str, payload: Any, reply_to: int | None = None
             ) -> int:
        if receiver not in self.mailboxes:
            raise KeyError(f"message to {receiver!r}: no such agent (agents: "
                           f"{', '.join(self.mailboxes)})")
        data = encode(payload, self.fp16, self.min_zstd)
        env = Envelope(sender, receiver, next(self._ids), reply_to, data)
        waiter = self._waiting.pop(reply_to, None) if reply_to is not None else None
        if waiter is not None:  # a reply goes straight to whoever awaits it
            waiter.set_result(decode(data))
        else:
            self.mailboxes[receiver].put_nowait(env)
        return env.id

    async def receive(self, agent: str) -> tuple[Envelope, Any]:
        env = await self.mailboxes[agent].get()
        return env, decode(env.data)

    async def request(self, sender: str, receiver: str, payload: Any) -> Any:
        """Send and wait for the receiver's reply (`send(..., reply_to=id)`)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # the id is known only after send; reserve the next one for the waiter first
        mid = next(self._ids)
        self._waiting[mid] = fut
        data = encode(payload, self.fp16, self.min_zstd)
        self.mailboxes[receiver].put_nowait(Envelope(sender, receiver, mid, None, data))
        return await fut
