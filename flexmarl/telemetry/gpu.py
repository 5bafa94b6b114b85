"""Per-GPU utilisation and memory, sampled through NVML (`nvidia-ml-py`, optional).

A daemon thread samples every device a few times a second; each iteration's record gets the
means since the previous one, next to the pools' busy fractions:
`gpu/<i>/util` (0..1, the fraction of time a kernel ran), `gpu/<i>/mem_used_gb`, and per pool
`pool/<pool>/gpu_util` over the devices the pool owns. Without NVML or a GPU it reports nothing.
NVML numbers devices in PCI bus order; FlexMARL's indices are CUDA's, which agree unless the
driver process itself runs under a CUDA_VISIBLE_DEVICES that reorders them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Sample = dict[int, tuple[float, float]]  # device -> (utilisation 0..1, memory used GB)


def nvml_sampler() -> Callable[[], Sample] | None:
    """A function reading every GPU's (utilisation, memory) now, or None without NVML/GPUs."""
    try:
        import pynvml  # optional dependency: the optional `gpu` extra
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                   for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no driver, no devices: nothing to report
        return None
    if not handles:
        return None

    def sample() -> Sample:
        out: Sample = {}
        for i, h in enumerate(handles):
            util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
            used = pynvml.nvmlDeviceGetMemoryInfo(h).used / 1e9
            out[i] = (util, used)
        return out

    return sample


class GpuMonitor:
    """Means of periodic samples between two `collect()` calls."""

    def __init__(self, sampler: Callable[[], Sample] | None = None, interval_s: float = 0.2,
                 pools: dict[str, list[int]] | None = None) -> None:
        self.sampler = sampler
        self.interval_s = interval_s
        self.pools = pools or {}
        self._sums: dict[int, list[float]] = {}  # device -> [util sum, mem sum, count]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_nvml(cls, pools: dict[str, list[int]] | None = None,
                  interval_s: float = 0.2) -> GpuMonitor:
        return cls(nvml_sampler(), interval_s, pools)

    @property
    def enabled(self) -> bool:
        return self.sampler is not None

    def sample_once(self) -> None:
        if self.sampler is None:
            return
        values = self.sampler()
        with self._lock:
            for dev, (util, mem) in values.items():
                acc = self._sums.setdefault(dev, [0.0, 0.0, 0])
                acc[0] += util
                acc[1] += mem
                acc[2] += 1

    def start(self) -> GpuMonitor:
        if self.sampler is None or self._thread is not None:
            return self

        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.sample_once()

        self.sample_once()
        self._thread = threading.Thread(target=loop, name="gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
            self._thread = None

    def collect(self) -> dict[str, float]:
        """Means since the last call, by the fixed metric names; resets the window."""
        if self.sampler is None:
            return {}
        with self._lock:
            sums, self._sums = self._sums, {}
        if not sums:  # a very short iteration: read once now
            self.sample_once()
            with self._lock:
                sums, self._sums = self._sums, {}
        out: dict[str, float] = {}
        utils: dict[int, float] = {}
        for dev, (u, m, n) in sorted(sums.items()):
            utils[dev] = u / n
            out[f"gpu/{dev}/util"] = u / n
            out[f"gpu/{dev}/mem_used_gb"] = m / n
        for pool, devices in self.pools.items():
            seen = [utils[d] for d in devices if d in utils]
            if seen:
                out[f"pool/{pool}/gpu_util"] = sum(seen) / len(seen)
        return out
