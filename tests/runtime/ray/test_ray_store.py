"""The decentralised store on a real Ray head: a table actor with 100k rows serves
micro-batches whose payloads stay in the object store and travel by ObjectRef."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import ray

from flexmarl.config.schema import load_config
from flexmarl.runtime.local.workers import WorkerSpec
from flexmarl.runtime.ray.actors import TrainWorker
from flexmarl.runtime.ray.store import AgentTableActor, RayObjectStore, fetch_payloads
from flexmarl.store.experience import ExperienceStore, Row, Status, StoreError
from flexmarl.tasks.referential import build_referential_game
from tests.runtime.ray.producer import Producer

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
N_ROWS = 100_000


def _spec() -> WorkerSpec:
    cfg = load_config(EXAMPLES / "referential_game.yaml")
    task = build_referential_game(**cfg.task.options)
    return WorkerSpec(cfg.model_dump(mode="json"), task.vocab_size, task.max_seq_len,
                      ["speaker"], 1, False)


def test_table_actor_holds_100k_rows_and_serves_micro_batches_by_reference(ray_head):
    ray.init(address=ray_head, log_to_driver=False)
    try:
        table = ray.remote(AgentTableActor).options(num_cpus=0).remote("speaker")
        producer = ray.remote(Producer).options(num_cpus=0).remote()
        hexes = ray.get(producer.fill.remote(table, "speaker", N_ROWS))
        assert len(set(hexes)) == -(-N_ROWS // 64)  # one object per 64-row block
        assert ray.get(table.counts.remote())["ready"] == N_ROWS

        batch = ray.get(table.take_ready.remote(0, 64, 0))
        assert len(batch) == 64
        assert [r["sample_id"] for r in batch] == sorted(r["sample_id"] for r in batch)
        for row in batch:  # payloads come back as references to the producer's objects
            block, j = row["refs"]["logprobs"]
            assert isinstance(block, ray.ObjectRef) and block.hex() in hexes
            assert row["data"]["advantage"] == 0.5 and row["data"]["reward"] == 1.0
        payloads = fetch_payloads([r["refs"]["logprobs"] for r in batch])
        for row, lp in zip(batch, payloads, strict=True):
            index = int(row["input_id"]) * 8 + row["trajectory_id"]
            assert lp.tolist() == [-0.5 - index % 7]
        # exactly once: the next micro-batch is disjoint
        second = ray.get(table.take_ready.remote(0, 64, 0))
        assert not {r["sample_id"] for r in batch} & {r["sample_id"] for r in second}
        counts = ray.get(table.counts.remote())
        assert counts["ready"] == N_ROWS - 128 and counts["consumed"] == 128
        assert ray.get(table.evict.remote(0)) == 128

        # Store -> trainer without the driver: the trainer actor gets only the table's handle,
        # pulls a micro-batch, fetches its payloads from the object store and trains on them.
        trainer = ray.remote(TrainWorker).options(num_cpus=1).remote(_spec())
        (evicted, _, _), _ = ray.get(trainer.bind.remote("speaker", None))  # the slot's agent
        assert evicted is None
        result, spans = ray.get(trainer.accumulate_from_table.remote("speaker", table, 0, 32, 0))
        assert result == {"rows": 32.0}
        assert [s[2] for s in spans] == ["pull:speaker:32", "acc:speaker:32"]
        (metrics, (ref,)), _ = ray.get(trainer.step.remote("speaker"))
        assert metrics["rows"] == 32.0 and metrics["grad_norm"] > 0
        assert isinstance(ref, ray.ObjectRef)  # the new weights: a reference, fetched on demand
        assert ray.get(table.counts.remote())["consumed"] == 32
    finally:
        ray.shutdown()


def test_experience_store_with_ray_payloads(ray_head):
    """RayObjectStore is a drop-in payload store for the spine's ExperienceStore."""
    ray.init(address=ray_head, log_to_driver=False)
    try:
        objects = RayObjectStore()
        store = ExperienceStore(["a"], objects=objects)
        store.add(Row(sample_id="0-0_0_0", agent="a", node="n", input_id="0-0", turn=0,
                      trajectory_id=0, iteration=0, policy_version=0, version_vector={"a": 0}))
        row = store.set_generated("a", "0-0_0_0", {"prompt": [1]},
                                  {"logprobs": np.array([-1.0, -2.0], dtype=np.float32)})
        assert isinstance(row.refs["logprobs"].key, ray.ObjectRef)
        assert row.refs["logprobs"].shape == (2,)
        store.set_rewarded("a", "0-0_0_0", 1.0)
        store.set_ready("a", "0-0_0_0", 0.0)
        (taken,) = store.take_ready("a", 0, 1, step=0)
        assert store.fetch(taken, "logprobs").tolist() == [-1.0, -2.0]
        store.release([taken])
        assert len(objects) == 0 and taken.status is Status.CONSUMED
        try:
            store.fetch(taken, "logprobs")
        except StoreError as exc:
            assert "freed" in str(exc)
        else:
            raise AssertionError("a freed payload must not be served")
    finally:
        ray.shutdown()


def test_live_run_keeps_rows_in_table_actors_and_payloads_in_the_object_store(tmp_path, ray_head):
    """A real referential-game run on Ray: every agent's rows live in its table actor, their
    log-probs are blocks in the object store that the replicas made, the trainer pulls each
    micro-batch from the table actor by id, and the driver never resolves a payload."""
    from flexmarl.orchestrator.run import train
    from flexmarl.runtime.ray.store import RayExperienceStore, RayMicroBatch

    cfg = load_config(EXAMPLES / "referential_game.yaml", [
        "runtime.kind=ray", f"runtime.address={ray_head}", "train.iterations=2",
        "train.inputs_per_iteration=4", "train.group_size=4", "train.micro_batch_size=8",
    ])
    seen: dict[str, list] = {"speaker": [], "listener": []}
    state: dict = {}

    def hook(runtime):
        state["runtime"] = runtime
        pool = runtime.train
        # inspect when the slot runs the pull (in the agent's call order, ahead of the step
        # the orchestrator queued behind it): the micro-batch's command names its rows
        batches: dict[tuple, RayMicroBatch] = {}
        queue, run = pool.accumulate, pool._run

        def accumulate(agent, batch):
            batches[tuple(batch.sample_ids)] = batch
            return queue(agent, batch)

        async def run_command(slot, command, payload):
            if command == "accumulate_from_table":
                agent, table = payload[0], payload[1]
                batch = batches[tuple(payload[6])]
                # Ordered after the store's writes (one caller, one actor): the rows are in.
                rows = {r["sample_id"]: r for r in await table.rows.remote()}
                mirror = {sid: runtime.store.table(agent).get(sid) for sid in batch.sample_ids}
                seen[agent].append((batch, table, rows, mirror))
            return await run(slot, command, payload)

        pool.accumulate, pool._run = accumulate, run_command

    result = train(cfg, tmp_path / "run", on_runtime=hook)
    runtime = state["runtime"]
    store = runtime.store
    assert isinstance(store, RayExperienceStore)
    assert store.payload_fetches == 0 and store.snapshot_fetches == 0
    placement = result.placement
    assert sorted(placement["tables"]) == ["listener", "speaker"]
    assert all(w["pid"] > 0 and w["actor_id"] for w in placement["tables"].values())
    for agent, calls in seen.items():
        assert len(calls) == 2 * 2  # 2 iterations x 16 rows / 8 per micro-batch
        for batch, table, rows, mirror in calls:
            assert isinstance(batch, RayMicroBatch) and len(batch) == 8
            assert batch.table._actor_id == table._actor_id  # served by this agent's table
            for sid in batch.sample_ids:
                row = rows[sid]
                assert row["status"] == "ready" and row["policy_version"] == batch.version
                block, i = row["refs"]["logprobs"]
                assert isinstance(block, ray.ObjectRef) and isinstance(i, int)
                # the driver's mirror holds the same reference and no payload bytes
                key = mirror[sid].refs["logprobs"].key
                assert key[0].hex() == block.hex() and key[1] == i
                assert not any(isinstance(v, np.ndarray) for v in mirror[sid].data.values())
        trained = sum(1 for sid, _, _ in result.audit[agent])
        assert trained == 2 * 16 and result.store_stats[agent]["consumed"] == 32
    assert not ray.is_initialized()


def test_table_actor_replays_a_micro_batch_only_into_the_step_that_took_it(ray_head):
    """A trainer lost after pulling a micro-batch: its successor may pull the same rows again
    for the same step (its restored state never summed them), never for another step."""
    import pytest

    ray.init(address=ray_head, log_to_driver=False)
    try:
        table = ray.remote(AgentTableActor).options(num_cpus=0).remote("speaker")
        producer = ray.remote(Producer).options(num_cpus=0).remote()
        ray.get(producer.fill.remote(table, "speaker", 16))
        ids = sorted(r["sample_id"] for r in ray.get(table.rows.remote()))
        first = ray.get(table.take_ready.remote(0, 8, 0, None, ids[:8]))
        again = ray.get(table.take_ready.remote(0, 8, 0, None, ids[:8], True))
        assert [r["sample_id"] for r in again] == [r["sample_id"] for r in first] == ids[:8]
        assert again[0]["refs"]["logprobs"][0].hex() == first[0]["refs"]["logprobs"][0].hex()
        with pytest.raises(ray.exceptions.RayTaskError, match="consumed by step 0"):
            ray.get(table.take_ready.remote(0, 8, 1, None, ids[:8], True))
        with pytest.raises(ray.exceptions.RayTaskError, match="is consumed, not ready"):
            ray.get(table.take_ready.remote(0, 8, 0, None, ids[:8]))
        # rows the lost trainer never pulled are consumed by the replay itself
        mixed = ray.get(table.serve.remote(0, 8, 0, None, ids[4:12], True))
        assert [r["sample_id"] for r in mixed["rows"]] == ids[4:12]
        assert len(mixed["objects"]) == 1  # 8 rows of one block: one reference
        assert ray.get(table.counts.remote())["consumed"] == 12
    finally:
        ray.shutdown()


def test_ray_store_facade_mirrors_the_table_actors_and_checks_on_the_driver(ray_head):
    """Without an event loop the facade writes through; its mirror refuses what the contract
    forbids before anything reaches an actor, and the micro-batch names the rows by id."""
    import pytest

    from flexmarl.runtime.ray.store import RayExperienceStore, RayMicroBatch
    from flexmarl.store.experience import ConsistencyError

    ray.init(address=ray_head, log_to_driver=False)
    try:
        table = ray.remote(AgentTableActor).options(num_cpus=0).remote("a")
        store = RayExperienceStore({"a": table})
        for j in range(3):
            sid = f"0-{j}_0_0"
            store.add(Row(sample_id=sid, agent="a", node="n", input_id=f"0-{j}", turn=0,
                          trajectory_id=0, iteration=0, policy_version=0,
                          version_vector={"a": 0}))
            store.set_generated("a", sid, {"prompt": [1], "response": [2, 3], "allowed": None,
                                           "temperature": 1.0},
                                {"logprobs": np.array([-1.0, -float(j)], dtype=np.float32)})
            store.set_rewarded("a", sid, float(j))
        store.set_ready("a", "0-0_0_0", 0.5)
        store.set_ready("a", "0-1_0_0", -0.5)
        with pytest.raises(ConsistencyError, match="0-2_0_0 is rewarded, not ready"):
            store.take_ready("a", 0, 3, step=0, sample_ids=["0-2_0_0"])
        rows = store.take_ready("a", 0, 2, step=0, sample_ids=["0-1_0_0", "0-0_0_0"])
        batch = store.micro_batch("a", rows)
        assert isinstance(batch, RayMicroBatch) and batch.sample_ids == ("0-1_0_0", "0-0_0_0")
        served = ray.get(table.serve.remote(0, 2, 0, {"a": 0}, list(batch.sample_ids)))
        assert [r["data"]["advantage"] for r in served["rows"]] == [-0.5, 0.5]
        values = ray.get(served["objects"])
        assert [values[k].tolist() for k, _ in (r["refs"]["logprobs"] for r in served["rows"])
                ] == [[-1.0, -1.0], [-1.0, 0.0]]
        assert store.payload_fetches == 0
        store.evict("a", 0)
        store.check(wait=True)
        assert ray.get(table.counts.remote()) == {**dict.fromkeys(
            ("pending", "generated", "ready", "consumed", "failed"), 0), "rewarded": 1}
        assert store.stats()["a"]["consumed"] == 2
    finally:
        ray.shutdown()
