"""Liveness of local worker processes: a worker busy sending a long message is alive, however
long its pipe stays busy, because its heartbeat thread also beats into shared memory."""

import asyncio
from types import SimpleNamespace

from flexmarl.runtime.local.runtime import Supervisor, WorkerProxy
from flexmarl.runtime.local.workers import WorkerSpec
from tests.runtime.local.slow_sender import slow_sender_main


class _Sink:
    def __init__(self) -> None:
        self.faults: list[tuple[str, dict]] = []

    def fault(self, name: str, **fields) -> None:
        self.faults.append((name, fields))

    def span(self, *args) -> None:
        pass


def test_a_worker_whose_pipe_is_busy_longer_than_the_limit_is_not_declared_lost():
    async def run() -> tuple[str, list, bool]:
        sink = _Sink()
        spec = WorkerSpec({}, 0, 0, [], 1, False, heartbeat_s=0.1)
        worker = WorkerProxy("train", 0, slow_sender_main, spec, sink)
        rt = SimpleNamespace(
            cfg=SimpleNamespace(runtime=SimpleNamespace(
                heartbeat_interval_s=0.1, heartbeat_misses=3, progress_timeout_s=None,
                max_worker_restarts=0)),
            sink=sink, rollout_workers=[], train_workers=[worker], trainable=[],
            rollout=SimpleNamespace(), train=SimpleNamespace())
        await worker.start()
        supervisor = Supervisor(rt)
        await supervisor.start()
        try:
            # the pipe stays busy for 2 s, over six times the 0.3 s heartbeat limit
            answer = await asyncio.wait_for(worker.call("send", 2.0), 20)
            return answer, sink.faults, worker.alive
        finally:
            await supervisor.stop(timeout=1)
            worker.kill("test over")

    answer, faults, alive = asyncio.run(run())
    assert answer == "sent" and alive
    assert not [f for f in faults if f[0] == "worker_failed"], faults
