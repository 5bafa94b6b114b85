"""A training slot of 2 ranks as the driver meets it: one worker process (rank 0, which starts
rank 1 itself) answering the unchanged slot protocol. Its publication is byte for byte the
one-device slot's; a swap leaves one shard file per rank and comes back bit-exact; stopping
the slot ends both ranks."""

import asyncio
import os

import numpy as np

from flexmarl.api.runtime import NullSink
from flexmarl.config.schema import load_config
from flexmarl.policy.device import Placement
from flexmarl.runtime.local.runtime import WorkerProxy
from flexmarl.runtime.local.workers import WorkerSpec, train_worker_main
from flexmarl.training.learner import published_form
from flexmarl.training.trainer import AgentTrainer
from tests.runtime.test_slot_ranks import RELAY


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def test_a_slot_of_two_publishes_the_one_device_bytes_and_swaps_per_rank(tmp_path):
    cfg = load_config(RELAY, ["runtime.deterministic=true"])
    config = cfg.model_dump(mode="json")
    agents = ["speaker", "relay"]

    def spec(ranks: tuple[Placement, ...]) -> WorkerSpec:
        return WorkerSpec(config, 28, 16, agents, 1, True, slot_ranks=ranks,
                          shard_dir=str(tmp_path))

    # the one-device slot's publication of the same agent (same config and seed)
    a = published_form(AgentTrainer("speaker", cfg.agents["speaker"], 28, 16, cfg.seed,
                                    total_steps=cfg.train.iterations))

    async def run():
        two = WorkerProxy("train", 1, train_worker_main, spec((Placement(),)), NullSink())
        await two.start()
        try:
            (rank1,) = _children(two.process.pid)
            await two.call("bind", ("speaker", None))
            b = await two.call("weights_pipe", "speaker")
            assert a[0] == b[0] and np.array_equal(a[1], b[1])  # header and bytes
            out, state, _, _ = await two.call("bind", ("relay", None))
            assert out == "speaker" and state[0] == "shards" and len(state[1]) == 2
            assert all(os.path.isfile(p) for p in state[1])
            # each rank's file holds about half of the agent
            sizes = [os.path.getsize(p) for p in state[1]]
            assert max(sizes) < 0.6 * sum(sizes)
            await two.call("bind", ("speaker", state))
            again = await two.call("weights_pipe", "speaker")
            assert np.array_equal(again[1], a[1])
        finally:
            await two.stop()
        for _ in range(100):  # rank 1 ends with its slot
            if not os.path.exists(f"/proc/{rank1}") or open(
                    f"/proc/{rank1}/stat").read().split()[2] == "Z":
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("rank 1 outlived its slot")

    asyncio.run(run())
