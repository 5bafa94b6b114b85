"""The pipeline modes of an environment run: `async` streams each rollout worker's rows to
the learners as that worker ends (one micro-batch per agent and worker), `sync` hands them
over once every worker ended; both steps see the same rows in the same order, so the runs are
bit-identical (weights, records, the audit of rows each epoch used)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

pytest.importorskip("mpe2")

from flexmarl.marl.run import MarlRun, train_marl  # noqa: E402
from flexmarl.orchestrator.run import host_run  # noqa: E402
from tests.marl.configs import marl_cfg  # noqa: E402

COMPARED = ("return_mean", "env_steps", "episodes/total")
# an agent's counters of how its slot was scheduled (binds, their seconds, waits): when an
# agent's rows arrive decides them, not what it learned, so they may differ between modes
SCHEDULING = ("/swaps", "/swap_s", "/slot_wait_s")


def compared(record: dict) -> list[str]:
    """The keys two modes' records must agree on: the run's figures and every agent's,
    less how its slot was scheduled."""
    return [*COMPARED, *(k for k in record if k.startswith("agent/")
                         and not k.endswith(SCHEDULING))]


def raw(env_id: str, share: bool) -> dict:
    return {"name": "pipeline", "seed": 5,
            "env": {"id": env_id, "options": {"max_cycles": 25}, "num_envs": 3},
            "share": share, "algorithm": {"name": "mappo", "epochs": 2, "minibatches": 2},
            "runtime": {"rollout_workers": 2},
            "train": {"env_steps": 3 * 6 * 25, "rollout_steps": 25}}


def final_weights(out: Path) -> dict[str, dict[str, np.ndarray]]:
    return {p.name: load_file(str(p / "model.safetensors"))
            for p in sorted((out / "checkpoints" / "final").iterdir())}


def hosted(cfg, out: Path):
    """`train_marl`'s path, keeping the run to read its rollout source afterwards."""
    run = MarlRun(cfg)
    return run, host_run(cfg, out, None, lambda telemetry, stops: run.run_loop(
        telemetry, stops, out, None, cfg.train.iterations))


@pytest.mark.parametrize(("env_id", "share", "over"), [
    # one network shared by 3 agents: each step's micro-batches come per (agent, worker)
    ("mpe2.simple_spread_v3", True, {}),
    # two policies time-sharing one training slot: their micro-batches interleave on it
    pytest.param("mpe2.simple_speaker_listener_v4", False, {"runtime.train_workers": 1},
                 marks=pytest.mark.slow),
    # VDN / QMIX: each worker's transitions go to the replay learner in worker order
    pytest.param("mpe2.simple_spread_v3", True,
                 {"algorithm": {"name": "qmix", "min_size": 100, "batch_size": 16,
                                "mixing_embed": 8, "eps_decay_steps": 300}},
                 marks=pytest.mark.slow),
])
def test_async_equals_sync_bit_for_bit(tmp_path, env_id, share, over) -> None:
    """Four short runs of 2 rollout workers (process starts dominate: ~40 s at load 6)."""
    results = {}
    for mode in ("sync", "async"):
        cfg = marl_cfg(raw(env_id, share), **{"pipeline.mode": mode, **over})
        run, results[mode] = hosted(cfg, tmp_path / mode)
        # each iteration's bookkeeping went at its record: only version 3's signal is left
        assert run.source is not None and not run.source.iterations
        assert set(run.source.signals) == {("version", 3)}, mode
    sync, pipelined = results["sync"], results["async"]
    assert len(sync.records) == len(pipelined.records) == 3
    for a, b in zip(sync.records, pipelined.records, strict=True):
        for key in compared(a):
            assert a[key] == b[key], (a["iteration"], key)
    assert sync.audit == pipelined.audit  # the same rows, in the same order, each epoch
    ref, got = final_weights(tmp_path / "sync"), final_weights(tmp_path / "async")
    assert ref.keys() == got.keys()
    for policy, tensors in ref.items():
        for key, value in tensors.items():
            assert np.array_equal(value, got[policy][key]), (policy, key)


@pytest.mark.slow  # three runs of 2 rollout workers: ~1 min at load 6
def test_async_stopped_and_resumed_equals_the_uninterrupted_sync_run(tmp_path) -> None:
    """The boundary's checkpoint under the async schedule (rollout k+1 waits for every
    policy's version k+1, so the snapshot is the state after iteration k) resumes exactly."""
    def config(mode: str):
        return marl_cfg(raw("mpe2.simple_speaker_listener_v4", False),
                        **{"pipeline.mode": mode, "train.checkpoint_every": 1})

    reference = train_marl(config("sync"), tmp_path / "sync")
    out = tmp_path / "async"
    assert len(train_marl(config("async"), out, iterations=2).records) == 2
    assert (out / "checkpoints" / "LATEST").read_text().strip() == "gen-000002"
    resumed = train_marl(config("async"), out, resume=out)
    assert [r["iteration"] for r in resumed.records] == [0, 1, 2]
    for a, b in zip(reference.records, resumed.records, strict=True):
        for key in compared(a):
            assert a[key] == b[key], (a["iteration"], key)
    assert resumed.audit == reference.audit
    ref, got = final_weights(tmp_path / "sync"), final_weights(out)
    for policy, tensors in ref.items():
        for key, value in tensors.items():
            assert np.array_equal(value, got[policy][key]), (policy, key)
