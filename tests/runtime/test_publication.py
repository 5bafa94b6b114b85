"""Collective publication pieces (`runtime/local/publication.py`) between real processes over
gloo: exact bytes of every dtype to two replicas, a missing peer failing within the timeout,
and the backend / mode choice from the placements."""

import datetime
import multiprocessing as mp
import time

import pytest
import torch
import torch.distributed as dist

from flexmarl.policy.device import Placement
from flexmarl.runtime.local.publication import (
    PairGroups,
    SlotPublisher,
    backend_for,
    pair_key,
    receive,
)
from flexmarl.runtime.local.runtime import publication_mode


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(3, 5, generator=g),
            "b.weight": torch.randn(7, generator=g).to(torch.bfloat16),
            "c.weight": torch.randn(2, 2, generator=g).to(torch.float16),
            "steps": torch.arange(4, dtype=torch.int64)}


def _replica(conn, store, ref, key):  # a replica process: receive, send back the tensors
    got = receive(PairGroups(*store), ref, key, "gloo")
    conn.send(({k: v.float().numpy() for k, v in got.tensors.items()},
               {k: str(v.dtype) for k, v in got.tensors.items()}, got.meta))


@pytest.fixture()
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=120))
    yield s, ("127.0.0.1", s.port, 120.0)  # spawned processes start slowly under load


def test_a_kept_version_reaches_two_replicas_exactly(store):
    _, info = store
    publisher = SlotPublisher(PairGroups(*info))
    weights = _weights()
    ref = publisher.keep("speaker", 3, weights)
    publisher.keep("speaker", 2, weights)  # older: dropped by the send of 3
    assert ref.nbytes == sum(v.numel() * v.element_size() for v in weights.values())
    ctx = mp.get_context("spawn")
    keys = [pair_key(0, 0, i, 7 + i) for i in range(2)]
    conns, procs = [], []
    for key in keys:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_replica, args=(child, info, ref, key), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    errors = publisher.send("speaker", 3, [(k, "gloo") for k in keys])
    assert errors == [None, None]
    for conn, proc in zip(conns, procs, strict=True):
        assert conn.poll(60)
        arrays, dtypes, meta = conn.recv()
        proc.join(10)
        assert meta == {"agent": "speaker", "version": 3}
        for k, v in weights.items():
            assert dtypes[k] == str(v.dtype)
            assert torch.equal(torch.from_numpy(arrays[k]), v.float()), k
    assert sorted(publisher.kept["speaker"]) == [3]
    with pytest.raises(KeyError, match="version 2 is not kept"):
        publisher.send("speaker", 2, [])


def test_a_missing_peer_fails_the_send_within_the_timeout(store):
    s, _ = store
    publisher = SlotPublisher(PairGroups("127.0.0.1", s.port, 2.0))
    publisher.keep("speaker", 1, _weights())
    t0 = time.monotonic()
    errors = publisher.send("speaker", 1, [(pair_key(0, 0, 1, 0), "gloo")])
    assert errors[0] is not None and time.monotonic() - t0 < 20
    assert not publisher.groups._groups  # the failed group is dropped, rebuilt next time


def test_the_backend_follows_the_placements():
    cpu, g0, g1 = Placement(), Placement("cuda", (0,)), Placement("cuda", (1,))
    assert backend_for(g0, g1) == "nccl"
    assert backend_for(g0, g0) == "gloo"  # one GPU shared: NCCL refuses two ranks on it
    assert backend_for(cpu, g1) == "gloo"
    assert publication_mode("auto") == "collective"  # measured faster, on CPUs too
    assert publication_mode("pipe") == "pipe"
    assert publication_mode("auto", "one_step_off") == "pipe"  # no held-publication window
    assert publication_mode("collective", "one_step_off") == "collective"


def test_the_benchmark_measures_both_paths():
    """`benchmarks/publication.py` and gpu_check's transfers section run through this."""
    from flexmarl.bench.publication import measure, table

    rows = measure([1.0], [1], rounds=1, timeout_s=120.0)
    assert {(r["mode"], r["backend"]) for r in rows} == {("pipe", "pipe"),
                                                         ("collective", "gloo")}
    assert all(r["mb"] == 1 and r["mbs"] > 0 for r in rows)
    assert "| 1 | 1 |" in table(rows)


def test_without_restarts_a_lost_slot_is_reported_with_its_reason():
    """With `runtime.max_worker_restarts: 0` a publication whose slot was lost fails the run
    naming why the slot was lost (an out-of-memory kill names its agents), as every other
    lost-worker error does; it once said only "training slot 0 lost"."""
    import asyncio

    from flexmarl.api.runtime import WorkerLost
    from flexmarl.config.schema import load_config
    from flexmarl.runtime.local.runtime import LocalRuntime

    cfg = load_config("examples/referential_game.yaml",
                      ["runtime.max_worker_restarts=0", "runtime.publication=collective"])
    runtime = LocalRuntime(cfg, 16, 16)  # built, not started: no process runs
    runtime.train_workers[0].lost_reason = "killed by SIGKILL (exit code -9), most likely ..."
    publisher = runtime.rollout.publisher
    assert publisher is not None
    with pytest.raises(WorkerLost, match=r"train worker 0 lost: killed by SIGKILL"):
        asyncio.run(publisher.wait_slot(0))
