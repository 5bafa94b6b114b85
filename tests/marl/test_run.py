"""The classic MARL driver end to end on real MPE environments: the consistency contract over
PPO epochs, GRU and Gaussian policies, config errors, and a short run that learns."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

pytest.importorskip("mpe2")

from flexmarl.cli.main import main  # noqa: E402
from flexmarl.config.schema import ConfigError  # noqa: E402
from flexmarl.marl.config import marl_config_from_dict  # noqa: E402
from flexmarl.marl.run import MarlTrainer, PolicyError, train_marl  # noqa: E402
from flexmarl.store.experience import ConsistencyError  # noqa: E402

SPEAKER_LISTENER_RANDOM = -40.4  # mean episode return per agent, random policy (issue 18)


def cfg(**over):
    raw = {"kind": "marl", "seed": 0,
           "env": {"id": "mpe2.simple_speaker_listener_v4", "options": {"max_cycles": 25},
                   "num_envs": 4},
           "policy": {"share_parameters": False},
           "algorithm": {"name": "mappo", "epochs": 3, "minibatches": 2},
           "train": {"env_steps": 200, "rollout_steps": 25}}
    for key, value in over.items():
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return marl_config_from_dict(raw)


def test_every_epoch_of_step_k_uses_only_iteration_k_rows(tmp_path) -> None:
    c = cfg(**{"train.env_steps": 300})  # 3 iterations of 4 envs x 25 steps
    res = train_marl(c, tmp_path / "run")
    assert len(res.records) == 3 and res.env_steps == 300
    assert set(res.audit) == {"speaker_0", "listener_0"}
    for audit in res.audit.values():
        counts = Counter((sid, step) for sid, _, step, _ in audit)
        for (sid, step), n in counts.items():
            assert n == 3  # once per epoch
            assert int(sid.split("-")[0]) == step  # the row's iteration is the step's
        assert all(version == step for _, version, step, _ in audit)
        assert len({sid for sid, *_ in audit}) == 4 * 3  # 4 envs x 3 iterations, this agent
        epochs = Counter((step, epoch) for _, _, step, epoch in audit)
        assert set(epochs.values()) == {4}  # each epoch of each step saw all 4 rows
    for stats in res.store_stats.values():
        assert stats["consumed"] == 12 and stats["ready"] == 0 and stats["failed"] == 0
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    assert (tmp_path / "run" / "checkpoints" / "final" / "listener_0" / "model.safetensors"
            ).exists()


def test_a_step_refuses_rows_of_another_iteration() -> None:
    trainer = MarlTrainer(cfg())
    trainer.rollout(0)
    with pytest.raises(ConsistencyError, match="iteration 0, but step 1"):
        trainer.store.take_ready("speaker_0", 0, 4, 1)


def test_gru_shared_and_gaussian_policies_run() -> None:
    gru = cfg(**{"env.id": "mpe2.simple_spread_v3", "policy.share_parameters": True,
                 "policy.network.kind": "gru", "algorithm.name": "ippo"})
    res = train_marl(gru, None)
    assert np.isfinite(res.records[-1]["agent/shared/loss/policy"])
    trainer = MarlTrainer(gru)
    assert trainer.policies["shared"].hidden.shape == (3 * 4, 64)  # carried across steps
    box = cfg(**{"env.id": "mpe2.simple_spread_v3", "env.options.continuous_actions": True,
                 "policy.share_parameters": True})
    res = train_marl(box, None)
    assert MarlTrainer(box).policies["shared"].spec.kind == "box"
    assert np.isfinite(res.records[-1]["agent/shared/entropy"])


def test_shared_speaker_listener_pads_discrete_heads() -> None:
    trainer = MarlTrainer(cfg(**{"policy.share_parameters": True}))
    p = trainer.policies["shared"]
    assert p.spec.nvec == (5,) and p.net.obs_dim == 11
    trainer.rollout(0)
    rows = trainer.store.take_ready("speaker_0", 0, 4, 0)
    actions = np.concatenate([trainer.store.fetch(r, "actions") for r in rows])
    assert actions.max() < 3  # the speaker's 3 words only: padded actions are masked


def test_config_errors_name_the_field(tmp_path, capsys) -> None:
    with pytest.raises(ConfigError, match="critic_input"):
        cfg(**{"algorithm.name": "ippo", "algorithm.critic_input": "state"})
    with pytest.raises(ConfigError, match="runtime.kind"):
        cfg(**{"runtime.kind": "ray"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: marl\nenv: {id: mpe2.simple_nothing_v9}\n")
    assert main(["train", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "env.id: unknown environment 'mpe2.simple_nothing_v9'" in capsys.readouterr().err
    from flexmarl.envs.spaces import ActionSpec
    from flexmarl.marl.run import _group_spec

    with pytest.raises(PolicyError, match="agents of env 'e' have different action spaces"):
        _group_spec(["a", "b"], {"a": ActionSpec("discrete", nvec=(3,)),
                                 "b": ActionSpec("box", dim=2, low=(-1, -1), high=(1, 1))}, "e")


def _speaker_listener(steps: int):
    c = cfg(**{"env.num_envs": 32, "train.env_steps": steps, "algorithm.epochs": 10,
               "algorithm.minibatches": 1})
    return train_marl(c, None).records


def test_mappo_speaker_listener_rises_well_above_random() -> None:
    """About 20 s on an idle 2-core machine: 24k environment steps (the random floor is
    -40.4 per agent; benchmarks/mpe.py measures -18.4 here at this budget)."""
    records = _speaker_listener(24_000)
    first = np.mean([r["return_mean"] for r in records[:3]])
    last = np.mean([r["return_mean"] for r in records[-8:]])
    assert first < -30  # starts near the random floor
    assert last > SPEAKER_LISTENER_RANDOM + 15, (first, last)


@pytest.mark.slow
def test_mappo_speaker_listener_longer_run_halves_the_distance() -> None:
    """About 2-4 minutes: 120k steps; return > floor + 20 and the listener ends well inside
    random's distance to its target (random: about 1.3)."""
    records = _speaker_listener(120_000)
    tail = records[-12:]
    assert np.mean([r["return_mean"] for r in tail]) > SPEAKER_LISTENER_RANDOM + 20
    assert np.mean([r["task/final_distance"] for r in tail]) < 0.75


@pytest.mark.parametrize("compress", [False, True])
def test_trainer_log_probs_equal_the_rollouts(compress: bool) -> None:
    """On-policy: at the first epoch the trainer's log-probs of iteration k's rows are the
    rollout's, also when the store holds FP16 + zstd observations (the policy acts on the
    rounded ones), and the compressed rows take fewer bytes."""
    import torch

    c = cfg(**{"env.id": "mpe2.simple_spread_v3", "policy.share_parameters": True,
               "store.compress_obs": compress, "train.env_steps": 200})
    trainer = MarlTrainer(c)
    trainer.run(None, iterations=1)  # obs statistics exist: version 1 normalises
    trainer.rollout(1)
    p = trainer.policies["shared"]
    batch, _ = trainer._batch(p, 1)
    with torch.no_grad():
        out = p.net.actor.sequence(p.net.actor_input(batch.obs, batch.agent_ids), None,
                                   batch.starts)
        logp = p.net.actor.dist(out, batch.action_mask).log_prob(batch.actions)
    torch.testing.assert_close(logp, batch.logp, rtol=0, atol=1e-5)
    raw, stored = trainer.payload_bytes
    assert raw > 0 and (stored < 0.5 * raw if compress else stored == raw)


def test_options_of_another_algorithm_are_named(tmp_path, capsys) -> None:
    with pytest.raises(ConfigError) as err:
        cfg(**{"algorithm.batch_size": 64})
    assert "algorithm.batch_size: unknown key (an option of vdn" in str(err.value)
    with pytest.raises(ConfigError, match="algorithm.epochz: unknown key"):
        cfg(**{"algorithm.epochz": 3})
