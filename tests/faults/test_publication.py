"""`runtime.publication: collective` under faults: the slot sends the weights to the replicas
over torch.distributed, the driver holds only refs. A replica killed around a publication is
restarted and loads the latest version from the slot; a slot lost between its step and the
publication is restored and its weights go through the pipes. Either run ends equal to the
fault-free reference (published through the pipes), every row trained on once."""

import asyncio
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


@pytest.mark.slow  # a slot and a replica restarted: ~35 s here (+ the shared reference run)
def test_replica_and_slot_killed_at_once_around_a_collective_publication(tmp_path, reference):
    """The race that hung chaos runs: a replica and the slot die right after a collective
    publication; the restarted replica's load of that version from the restored slot is
    queued behind the agent's next step, so the slot no longer holds it. The replica must
    wait for the newer version's publication and load that, not fail (its restart task died
    silently, and with every replica lost the run waited forever)."""
    cfg = config(*COLLECTIVE)
    seen: dict = {"n": 0, "killed": None, "held": 0, "steps_after": {}}

    def hook(runtime):
        seen["runtime"] = runtime
        rollout, pool = runtime.rollout, runtime.train
        publisher = rollout.publisher
        publish, step, load_into = publisher.publish, pool.step, rollout.load_into
        restore_slot = pool.restore_slot
        loading = seen["loading"] = asyncio.Event()

        async def publish_then_kill(ref, replicas, restart=False):
            out = await publish(ref, replicas, restart=restart)
            if not restart:
                seen["n"] += 1
                if seen["n"] == 3:  # the first step's first publication went to both replicas
                    seen["killed"] = ref.agent
                    os.kill(pool.workers[0].process.pid, signal.SIGKILL)
                    os.kill(rollout.workers[1].process.pid, signal.SIGKILL)
            return out

        async def step_seen(agent):
            if seen["killed"] is not None:
                seen["steps_after"].setdefault(agent, asyncio.Event()).set()
            return await step(agent)

        async def restore_after_the_replica_asked(slot, run):
            await loading.wait()  # the replica's restart read `latest` before any new step
            return await restore_slot(slot, run)

        async def held_load(replica, agent, version, weights):
            loading.set()
            if agent == seen["killed"] and isinstance(weights, PublishedRef) and not seen["held"]:
                # a slow restart: its load reaches the restored slot after the agent's step
                seen["held"] = version
                await seen["steps_after"].setdefault(agent, asyncio.Event()).wait()
            return await load_into(replica, agent, version, weights)

        publisher.publish = publish_then_kill
        pool.step = step_seen
        rollout.load_into = held_load
        pool.restore_slot = restore_after_the_replica_asked

    result = train(cfg, tmp_path / "run", on_runtime=hook)
    out = tmp_path / "run"
    assert seen["held"] == 1  # the restart asked for version 1, lost with the slot
    assert_rows_exactly_once(result.audit, result.consumed, cfg)
    assert all(r["episodes/failed"] == 0 for r in result.records)
    assert not events(out, "worker_unrecoverable")
    failed = sorted((e["pool"], e["worker"]) for e in events(out, "worker_failed"))
    recovered = sorted((e["pool"], e["worker"]) for e in events(out, "worker_recovered"))
    assert failed == recovered == [("rollout", 1), ("train", 0)]
    assert_final_equal(out, reference)
