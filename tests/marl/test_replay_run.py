"""VDN / QMIX on the local MARL runtime: the replay learner's state (replay table included)
round-trips exactly, a run stopped and resumed from its checkpoint equals an uninterrupted
one, a SIGKILLed rollout worker redoes its iteration exactly, and the learner learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mpe2")

from flexmarl.envs.pettingzoo import VecParallelEnv  # noqa: E402
from flexmarl.marl.offpolicy import QLearner, QRollout, q_layouts  # noqa: E402
from flexmarl.marl.policies import MarlSample  # noqa: E402
from flexmarl.marl.run import train_marl  # noqa: E402
from flexmarl.training import state as st  # noqa: E402
from tests.marl.configs import marl_cfg  # noqa: E402
from tests.marl.test_reliability import _kill_during, events, final_weights  # noqa: E402

ITERATIONS = 4
ENVS = 4
COMPARED = ("return_mean", "agent/shared/loss/value", "agent/shared/q_mean",
            "agent/shared/td_abs_mean", "replay/size", "replay/updates", "epsilon",
            "task/landmarks_covered", "env_steps")


def cfg(**over):
    raw: dict = {"name": "spread_qmix", "seed": 5,
                 "env": {"id": "mpe2.simple_spread_v3", "num_envs": ENVS},
                 "algorithm": {"name": "qmix", "min_size": 150, "capacity": 300,
                               "batch_size": 32, "target_every": 7, "mixing_embed": 8,
                               "eps_decay_steps": 300},
                 "train": {"env_steps": ITERATIONS * ENVS * 25, "rollout_steps": 25,
                           "checkpoint_every": 1}}
    return marl_cfg(raw, **over)


def _parts(c):
    probe = VecParallelEnv(c.env.id, c.env.options, 1, c.seed)
    probe.reset()
    lay = q_layouts(c, probe)
    return lay, QLearner(c, lay["shared"]), QRollout(c, lay)


def _feed(learner: QLearner, worker: QRollout, k: int) -> dict:
    worker.load("shared", k, learner.weights())
    res = worker.run(k)
    learner.accumulate([MarlSample(f"{k}-w0_0_0", k, k, 0, res.transitions)])
    return learner.step()


def test_the_replay_learners_state_round_trips_exactly() -> None:
    """Captured through the wire form with the table wrapped around (capacity 300, 400 rows
    added) and rows held mid-step, restored into a fresh learner: the next steps are
    bit-identical (networks, targets, mixer, Adam, table, priorities, sampling generator)."""
    c = cfg()
    lay, a, worker = _parts(c)
    for k in range(3):
        _feed(a, worker, k)
    worker.load("shared", 3, a.weights())
    res = worker.run(3)
    a.accumulate([MarlSample("3-w0_0_0", 3, 3, 0, res.transitions)])
    assert a.replay.size == 300 and a.replay.cursor == 0  # full, wrapped once
    b = QLearner(c, lay["shared"])
    b.restore(st.from_wire(st.to_wire(a.capture())))
    ma, mb = a.step(), b.step()
    assert ma == mb
    twin = QRollout(c, lay)
    twin.set_state(worker.get_state())
    for k in (4, 5):
        assert _feed(a, worker, k) == _feed(b, twin, k)
    for x, y in zip(a.capture().tensors.items(), b.capture().tensors.items(), strict=True):
        assert x[0] == y[0] and torch.equal(x[1], y[1]), x[0]
    assert a.rng.bit_generator.state == b.rng.bit_generator.state
    with pytest.raises(RuntimeError, match="trains on iteration 6's rows"):
        a.accumulate([MarlSample("5-w0_0_0", 5, 5, 0, res.transitions)])


@pytest.mark.parametrize(("over", "field"), [
    ({"share": False}, "one joint learner"),
    ({"network.kind": "gru"}, "networks.shared.kind"),
    ({"store.compress_obs": True}, "store.compress_obs"),
])
def test_what_the_replay_learners_cannot_do_is_refused_naming_the_field(over, field):
    from flexmarl.config.schema import ConfigError

    with pytest.raises(ConfigError, match=field):
        _parts(cfg(**over))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    return train_marl(cfg(), out)


def assert_same(out, records, reference) -> None:
    ref_w, got_w = final_weights(reference.out_dir), final_weights(out)
    assert ref_w.keys() == got_w.keys() == {"shared"}
    assert any(k.startswith("mixer.") for k in got_w["shared"])
    for key, value in ref_w["shared"].items():
        assert np.array_equal(value, got_w["shared"][key]), key
    assert len(records) == len(reference.records) == ITERATIONS
    for a, b in zip(records, reference.records, strict=True):
        for key in COMPARED:  # (no loss before min_size rows)
            assert a.get(key) == b.get(key), (a["iteration"], key)
    assert all(key in records[-1] for key in COMPARED)


@pytest.mark.slow  # 12 s; env-run resume is checked in make test by test_reliability's MAPPO run
def test_qmix_stopped_after_two_iterations_then_resumed_equals_uninterrupted(tmp_path,
                                                                            reference):
    """The checkpoint holds the replay table (filled rows only); the records reach
    TensorBoard (`logging.backends`); the run learns from the replay table
    (updates from min_size on, every transition added once)."""
    pytest.importorskip("tensorboard")
    from safetensors.numpy import load_file

    from flexmarl.telemetry.loggers import read_tensorboard

    assert [r["replay/size"] for r in reference.records] == [100, 200, 300, 300]
    assert sum(r["replay/updates"] for r in reference.records) == (400 - 150) // 4 + 1
    assert reference.audit["shared"] == [(f"{k}-w0_0_0", k, k, 0) for k in range(ITERATIONS)]
    tb = {"logging.backends": ["jsonl", "tensorboard"]}
    out = tmp_path / "run"
    first = train_marl(cfg(**tb), out, iterations=2)
    assert len(first.records) == 2
    state = load_file(str(out / "checkpoints" / "gen-000002" / "agents" / "shared"
                          / "state.safetensors"))
    assert state["r/f/obs"].shape == (200, 3, 18) and state["r/f/state"].shape[0] == 200
    resumed = train_marl(cfg(**tb), out, resume=out)
    assert events(out, "resumed")[0]["completed"] == 2
    scalars = read_tensorboard(out / "tb")
    assert scalars["agent/shared/loss/value"] == pytest.approx(
        {r["iteration"]: r["agent/shared/loss/value"] for r in resumed.records
         if "agent/shared/loss/value" in r})
    assert_same(out, resumed.records, reference)


# make test budget (17 s measured with this module's reference run, which no other test of
# make test needs): the supervisor's redo of a killed rollout worker's iteration stays in
# make test on the MAPPO run (tests/marl/test_reliability.py::
# test_rollout_worker_killed_mid_iteration_redoes_it_exactly), the QRollout state the redo
# restores in test_the_replay_learners_state_round_trips_exactly above
@pytest.mark.slow
def test_rollout_worker_killed_mid_iteration_redoes_it_exactly(tmp_path, reference):
    out, state = tmp_path / "run", {}
    res = train_marl(cfg(), out, on_runtime=_kill_during("rollout", "rollout_on", 2, state))
    assert "pid" in state
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert failed[0]["pool"] == "rollout" and failed[0]["pid"] == state["pid"]
    assert recovered[0]["pool"] == "rollout"
    assert res.faults is not None and res.faults["iterations_redone"] == 1
    assert_same(out, res.records, reference)


@pytest.mark.slow  # two training-slot processes' worth of replay; ~1-2 min
def test_training_slot_killed_mid_step_is_restored_exactly(tmp_path, reference):
    """The restarted slot gets the restart point after step 1 (replay table included) and
    replays iteration 2's transitions."""
    out, state = tmp_path / "run", {}
    res = train_marl(cfg(), out, on_runtime=_kill_during("train", "step", 2, state))
    assert events(out, "worker_failed")[0]["pool"] == "train"
    assert_same(out, res.records, reference)


def test_vdn_learns_on_simple_v3_with_two_rollout_workers(tmp_path):
    """Learning smoke test: one agent to its landmark (`simple_v3`), two rollout workers;
    the greedy-ish late episodes beat the random first ones by a wide margin."""
    c = marl_cfg({
        "seed": 0, "env": {"id": "mpe2.simple_v3", "num_envs": 8},
        "algorithm": {"name": "vdn", "min_size": 1000, "capacity": 20000, "batch_size": 64,
                      "target_every": 100, "eps_decay_steps": 4000, "lr": 0.001},
        "runtime": {"rollout_workers": 2},
        "train": {"env_steps": 12000, "rollout_steps": 25}})
    res = train_marl(c, tmp_path / "run")
    rets = [r["return_mean"] for r in res.records if "return_mean" in r]
    first, last = float(np.mean(rets[:3])), float(np.mean(rets[-5:]))
    assert last > first + 10, (first, last)
