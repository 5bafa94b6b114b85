"""The Ray replica's driver task, guarded: if it dies of an unexpected exception, every call
waiting on it is answered with the error (none hangs) and the replica ends its process so
that the supervisor restarts it. Runs the actor class in this process, without a Ray head."""

from __future__ import annotations

import asyncio
from pathlib import Path

from flexmarl.config.schema import load_config
from flexmarl.rollout.engine import GenerationRequest
from flexmarl.runtime.local.workers import WorkerSpec
from flexmarl.runtime.ray.actors import RolloutReplica
from flexmarl.tasks.referential import build_referential_game

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _replica() -> RolloutReplica:
    cfg = load_config(EXAMPLES / "referential_game.yaml")
    task = build_referential_game(**cfg.task.options)
    spec = WorkerSpec(cfg.model_dump(mode="json"), task.vocab_size, task.max_seq_len,
                      ["speaker"], 1, False)
    return RolloutReplica(spec)


def _request(i: int) -> GenerationRequest:
    return GenerationRequest(f"r{i}", "speaker", 0, [1, 5, 5], 2, seed=1)


def test_a_working_replica_answers():
    replica = _replica()

    async def main() -> list:
        replies, _ = await replica.generate([(_request(i), ()) for i in range(3)])
        return replies

    replies = asyncio.run(asyncio.wait_for(main(), 30))
    assert [ok for ok, _ in replies] == [True, True, True]
    assert not replica._pending


def test_a_failed_driver_answers_every_waiting_call_and_ends_the_replica():
    replica = _replica()
    crashes: list[BaseException] = []
    replica.on_crash = crashes.append

    def broken_step() -> list:
        raise AssertionError("scheduler invariant broken")

    replica.sched.step = broken_step  # type: ignore[method-assign]

    async def main() -> tuple:
        gen = asyncio.ensure_future(replica.generate([(_request(i), ()) for i in range(3)]))
        load = asyncio.ensure_future(replica.load_weights("speaker", 1, {}))
        return await asyncio.gather(gen, load, return_exceptions=True)

    gen, load = asyncio.run(asyncio.wait_for(main(), 30))  # hung before: wait_for timed out
    for answer in (gen, load):
        assert isinstance(answer, RuntimeError)
        assert "driver failed" in str(answer) and "scheduler invariant broken" in str(answer)
    assert len(crashes) == 1 and "scheduler invariant broken" in str(crashes[0])
    assert not replica._pending


def test_the_default_crash_action_exits_the_process_for_a_restart():
    import subprocess
    import sys

    code = ("import asyncio, sys; from flexmarl.runtime.ray.actors import _exit_for_restart\n"
            "async def main():\n"
            "    _exit_for_restart(RuntimeError('boom'))\n"
            "    await asyncio.sleep(5)\n"
            "asyncio.run(main()); sys.exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 70
    assert "boom" in proc.stderr and "restarted" in proc.stderr
