"""Classic MARL (MAPPO on simple_speaker_listener) on a real Ray head (loopback, 2 CPUs):
the rollout worker and the training slot are Ray actors, and the run ends bit-identical to the
local runtime's, every row trained on exactly once; an actor SIGKILLed mid-iteration is
restarted by the same supervisor as locally and the run still ends identical."""

from __future__ import annotations

import pytest

pytest.importorskip("mpe2")

from flexmarl.marl.run import train_marl  # noqa: E402
from tests.marl.test_reliability import (  # noqa: E402
    _kill_during,
    assert_same_run,
    cfg,
    events,
    reference,  # noqa: F401 - the module fixture: the local fault-free run
)


def _on_ray(address: str, **over):
    return cfg(**{"runtime.kind": "ray", "runtime.address": address, **over})


def test_mappo_on_ray_equals_the_local_run(tmp_path, ray_head, reference):  # noqa: F811
    out = tmp_path / "run"
    res = train_marl(_on_ray(ray_head), out)
    assert res.placement["runtime"] == "ray"
    assert res.placement["ray"]["requested_address"] == ray_head
    for pool in ("rollout", "train"):
        for worker in res.placement[pool]:
            assert worker["actor_id"] and worker["node_id"]
            assert worker["resources"] == {"CPU": 1.0}
    assert_same_run(out, res.records, res.audit, reference)


@pytest.mark.slow
def test_rollout_actor_killed_mid_iteration_redoes_it_exactly(tmp_path, ray_head,
                                                              reference):  # noqa: F811
    out, state = tmp_path / "run", {}
    res = train_marl(_on_ray(ray_head), out,
                     on_runtime=_kill_during("rollout", "rollout_on", 1, state))
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert failed[0]["pool"] == "rollout" and failed[0]["pid"] == state["pid"]
    assert recovered[0]["pool"] == "rollout" and recovered[0]["pid"] != state["pid"]
    assert res.faults is not None and res.faults["iterations_redone"] == 1
    assert_same_run(out, res.records, res.audit, reference)


@pytest.mark.slow
def test_training_slot_actor_killed_mid_step_is_restored_exactly(tmp_path, ray_head,
                                                                 reference):  # noqa: F811
    out, state = tmp_path / "run", {}
    res = train_marl(_on_ray(ray_head), out, on_runtime=_kill_during("train", "step", 2, state))
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert failed[0]["pool"] == "train" and failed[0]["pid"] == state["pid"]
    assert recovered[0]["pool"] == "train"
    assert_same_run(out, res.records, res.audit, reference)


@pytest.mark.slow  # 12 s; Ray env-run parity is checked in make test by the MAPPO test
def test_qmix_on_ray_equals_the_local_run(tmp_path, ray_head):
    """The replay learner (Q-nets, mixer, replay table) in a slot actor, epsilon-greedy
    rollout in a rollout actor: the same records and final weights as on the local runtime."""
    from tests.marl.test_reliability import final_weights
    from tests.marl.test_replay_run import COMPARED as Q_COMPARED
    from tests.marl.test_replay_run import cfg as q_cfg

    local = train_marl(q_cfg(**{"train.checkpoint_every": None}), tmp_path / "local")
    ray = train_marl(q_cfg(**{"train.checkpoint_every": None, "runtime.kind": "ray",
                              "runtime.address": ray_head}), tmp_path / "ray")
    assert ray.placement["runtime"] == "ray"
    assert "agent/shared/loss/value" in local.records[-1]  # the learner did update
    for a, b in zip(local.records, ray.records, strict=True):
        for key in Q_COMPARED:  # (no loss before the replay table holds min_size rows)
            assert a.get(key) == b.get(key), (a["iteration"], key)
    got, want = final_weights(tmp_path / "ray"), final_weights(tmp_path / "local")
    assert got.keys() == want.keys()
    for policy, tensors in want.items():
        for key, value in tensors.items():
            assert (value == got[policy][key]).all(), (policy, key)
