"""The GPU monitor's arithmetic (means per window, per pool) with a fake sampler; the real
NVML sampler reports nothing on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch

from flexmarl.telemetry.gpu import GpuMonitor, nvml_sampler


def test_means_per_window_and_per_pool():
    values = iter([{0: (0.2, 10.0), 1: (1.0, 20.0)}, {0: (0.4, 12.0), 1: (0.0, 20.0)},
                   {0: (1.0, 1.0), 1: (1.0, 1.0)}])
    mon = GpuMonitor(lambda: next(values), pools={"rollout": [0], "train": [1], "none": [5]})
    mon.sample_once()
    mon.sample_once()
    out = mon.collect()
    assert out["gpu/0/util"] == pytest.approx(0.3)
    assert out["gpu/0/mem_used_gb"] == pytest.approx(11.0)
    assert out["pool/rollout/gpu_util"] == pytest.approx(0.3)
    assert out["pool/train/gpu_util"] == pytest.approx(0.5)
    assert "pool/none/gpu_util" not in out
    assert mon.collect()["gpu/1/util"] == 1.0  # a new window: read once now


def test_thread_samples_until_stopped():
    calls = []
    mon = GpuMonitor(lambda: calls.append(1) or {0: (0.5, 1.0)}, interval_s=0.01).start()
    import time

    time.sleep(0.1)
    mon.stop()
    n = len(calls)
    time.sleep(0.05)
    assert n >= 3 and len(calls) == n
    assert mon.collect()["gpu/0/util"] == 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_no_gpu_no_metrics():
    assert nvml_sampler() is None
    assert GpuMonitor.from_nvml().collect() == {}
