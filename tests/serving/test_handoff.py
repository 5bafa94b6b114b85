"""The agent-to-agent latency benchmark's code paths in a short run (benchmarks/handoff.py):
hand-offs inside a running graph (the executor's bus) and bare bus round trips, with and
without a one-token call to the served model."""

from __future__ import annotations

import asyncio

import numpy as np

from benchmarks.handoff import bus_block, graph_block
from flexmarl.serving.agents import load_run
from flexmarl.serving.service import Service


def test_handoff_benchmark_paths_with_and_without_a_model_call(toy_run):
    service = Service(load_run(toy_run, "cpu"))
    try:
        obs = np.ones(16, np.float32)
        for model in (False, True):
            times = asyncio.run(bus_block(service, 10, 20, model, obs, 0))
            assert len(times) == 20 and all(t > 0 for t in times)
            times = asyncio.run(graph_block(service, 10, 20, model, 0))
            assert len(times) == 20 and all(t > 0 for t in times)
    finally:
        service.close()
