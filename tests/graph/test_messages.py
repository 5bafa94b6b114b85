"""Agent-to-agent messages: the wire codec (msgpack, FP16 arrays, zstd where it pays) and the
in-process bus's round trips (the benchmark's path: tests/serving/test_handoff.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from flexmarl.graph.messages import RAW, ZSTD, MessageBus, decode, encode


def test_codec_round_trip_fp16_and_zstd():
    obs = np.linspace(-3, 3, 256, dtype=np.float32)
    msg = {"step": 3, "obs": obs, "ids": np.arange(5, dtype=np.int64), "text": "hé", "b": b"\0"}
    wire = encode(msg)
    assert wire[0] == RAW and len(wire) < 256 * 4  # FP16: 2 bytes a value
    back = decode(wire)
    assert back["obs"].dtype == np.float16 and np.allclose(back["obs"], obs, atol=2e-3)
    assert back["ids"].tolist() == [0, 1, 2, 3, 4] and back["ids"].dtype == np.int64
    assert (back["step"], back["text"], back["b"]) == (3, "hé", b"\0")
    exact = decode(encode({"obs": obs}, fp16=False))["obs"]
    assert exact.dtype == np.float32 and np.array_equal(exact, obs)
    huge = np.array([1e6, 2.0], np.float32)  # beyond FP16: sent as float32
    assert decode(encode({"x": huge}))["x"].dtype == np.float32
    zeros = encode({"obs": np.zeros(64 * 1024, np.float32)})
    assert zeros[0] == ZSTD and len(zeros) < 1000
    assert decode(zeros)["obs"].shape == (64 * 1024,)
    noise = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    assert encode({"n": noise})[0] == RAW  # zstd would not pay
    with pytest.raises(TypeError, match="cannot encode set"):
        encode({"s": {1, 2}})


def test_bus_round_trips_and_unknown_receiver():
    async def run() -> None:
        bus = MessageBus(["a", "b"])

        async def echo() -> None:
            env, msg = await bus.receive("b")
            bus.send("b", env.sender, {"echo": msg["x"] * 2}, reply_to=env.id)

        task = asyncio.create_task(echo())
        assert await bus.request("a", "b", {"x": 21}) == {"echo": 42}
        await task
        with pytest.raises(KeyError, match="'c': no such agent"):
            bus.send("a", "c", {})

    asyncio.run(run())
