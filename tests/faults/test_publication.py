"""`runtime.publication: collective` under faults: the slot sends the weights to the replicas
over torch.distributed, the driver holds only refs. A replica killed around a publication is
restarted and loads the latest version from the slot; a slot lost between its step and the
publication is restored and its weights go through the pipes. Either run ends equal to the
fault-free reference (published through the pipes), every row trained on once."""

import os
import signal

import pytest

from flexmarl.orchestrator.run import train
from flexmarl.runtime.local.publication import PublishedRef
from tests.faults.conftest import (
    assert_final_equal,
    assert_rows_exactly_once,
    config,
    events,
)

COLLECTIVE = ("runtime.publication=collective", "runtime.publication_timeout_s=20")


def _check(result, out, reference, cfg, pool):
    assert_rows_exactly_once(result.audit, result.consumed, cfg)
    assert all(r["episodes/failed"] == 0 for r in result.records)
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert failed and failed[0]["pool"] == pool
    assert recovered and recovered[0]["pool"] == pool
    assert_final_equal(out, reference)


def test_replica_killed_at_a_collective_publication(tmp_path, reference):
    cfg = config(*COLLECTIVE)
    seen: dict = {"n": 0, "refs": 0}

    def hook(runtime):
        seen["runtime"] = runtime
        publisher = runtime.rollout.publisher
        original = publisher.publish

        async def publish(ref, replicas, **kw):
            seen["n"] += 1
            seen["refs"] += isinstance(ref, PublishedRef)
            if seen["n"] == 4:  # the first step's publications (after the two version 0s)
                os.kill(runtime.rollout.workers[1].process.pid, signal.SIGKILL)
            return await original(ref, replicas, **kw)

        publisher.publish = publish

    result = train(cfg, tmp_path / "run", on_runtime=hook)
    _check(result, tmp_path / "run", reference, cfg, "rollout")
    rt = seen["runtime"]
    assert rt.publication == "collective" and seen["refs"] == seen["n"] > 4
    # every version reached the replicas from the slot (the restart's load included)
    assert rt.rollout.publisher.fallbacks == 0 and rt.rollout.publisher.sent_bytes > 0
    assert all(isinstance(w, PublishedRef) for _, w in rt.rollout.latest.values())


@pytest.mark.slow  # a slot restart (~40 s, most of it importing torch)
def test_slot_lost_between_its_step_and_the_publication(tmp_path, reference):
    cfg = config(*COLLECTIVE)
    seen: dict = {"n": 0}

    def hook(runtime):
        seen["runtime"] = runtime
        pool = runtime.train
        original = pool.step

        async def step(agent):
            out = await original(agent)
            seen["n"] += 1
            if seen["n"] == 2:  # the step's weights are kept on the slot only: lost
                os.kill(pool.workers[0].process.pid, signal.SIGKILL)
            return out

        pool.step = step

    result = train(cfg, tmp_path / "run", on_runtime=hook)
    _check(result, tmp_path / "run", reference, cfg, "train")
    assert seen["runtime"].rollout.publisher.fallbacks >= 1
