"""The agent-to-agent latency benchmark's code paths in a short run (benchmarks/handoff.py):
hand-offs inside a running graph (the executor's bus) and bare bus round trips, with and
without a one-token call to the served model."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import numpy as np
import pytest

from benchmarks.handoff import RayAgent, bus_block, graph_block, ray_block
from flexmarl.serving.agents import load_run
from flexmarl.serving.service import Service


def test_handoff_benchmark_paths_with_and_without_a_model_call(toy_run):
    service = Service(load_run(toy_run, "cpu"))
    try:
        obs = np.ones(16, np.float32)
        for model in (False, True):
            times = asyncio.run(bus_block(service, 10, 10, model, obs, 0))
            assert len(times) == 10 and all(t > 0 for t in times)
            times = asyncio.run(graph_block(service, 10, 10, model, 0))
            assert len(times) == 10 and all(t > 0 for t in times)
    finally:
        service.close()


@pytest.mark.slow  # starts a local Ray cluster
def test_handoff_benchmark_ray_row(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [root, os.environ.get("PYTHONPATH")])))  # the actors import benchmarks/
    temp = tempfile.mkdtemp(prefix="fmho-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    try:
        actors = [ray.remote(num_cpus=0.1)(RayAgent).remote(f"agent{i}") for i in range(3)]
        pids = set(ray.get([a.pid.remote() for a in actors]))
        assert len(pids) == 3 and os.getpid() not in pids  # three processes
        times = ray_block(actors, np.ones(16, np.float32), 9, 0)
        assert len(times) == 9 and all(t > 0 for t in times)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
