"""The classic MARL driver end to end on real MPE environments, in the local runtime's worker
processes (rollout workers, training slots): the consistency contract over PPO epochs, exact
swaps of policies sharing a slot, GRU and Gaussian policies, config errors, and a short run
that learns. In-process pieces (`EnvRollout`, `PolicyLearner`) test what a worker computes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("mpe2")

from flexmarl.cli.main import main  # noqa: E402
from flexmarl.config.schema import ConfigError  # noqa: E402
from flexmarl.marl.learner import LearnerError, PolicyLearner  # noqa: E402
from flexmarl.marl.rollout import EnvRollout  # noqa: E402
from flexmarl.marl.run import MarlRun, PolicyError, train_marl  # noqa: E402
from flexmarl.store.experience import ConsistencyError  # noqa: E402
from flexmarl.training import state as st  # noqa: E402
from tests.marl.configs import marl_cfg, shaped  # noqa: E402

SPEAKER_LISTENER_RANDOM = -40.4  # mean episode return per agent, random policy (issue 18)


def cfg(**over):
    raw = {"seed": 0,
           "env": {"id": "mpe2.simple_speaker_listener_v4", "options": {"max_cycles": 25},
                   "num_envs": 4},
           "share": False,
           "algorithm": {"name": "mappo", "epochs": 3, "minibatches": 2},
           "train": {"env_steps": 200, "rollout_steps": 25}}
    return marl_cfg(raw, **over)


def in_process(c):
    """A run's layout and store, one rollout worker and one learner per policy, in this
    process (what the worker processes compute), at version 0."""
    run = MarlRun(c)
    env = EnvRollout(c, run.layouts)
    learners = {name: PolicyLearner(c, lay) for name, lay in run.layouts.items()}
    for name, learner in learners.items():
        env.load(name, 0, learner.weights())
    return run, env, learners


def step_in_process(run, env, learners, k: int) -> None:
    """Iteration k: rollout, store, step of every learner, version k+1 to the rollout."""
    run.sampler.put(k, [env.run(k)])
    for name, learner in learners.items():
        for _, samples in run.sampler.take(name, k).values():
            learner.accumulate(samples)
        learner.step()
        env.load(name, k + 1, learner.weights())


@pytest.mark.slow  # make test budget: the row rule and exact swaps have fast tests below
def test_every_epoch_of_step_k_uses_only_iteration_k_rows(tmp_path) -> None:
    """Two policies time-share one training slot (swapped each iteration); the same run with
    a slot each gives bit-identical losses: a swap moves the whole learner state."""
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
    assert res.placement["train_swaps_in"]["speaker_0"] >= 3  # swapped in every iteration
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    assert (tmp_path / "run" / "checkpoints" / "final" / "listener_0" / "model.safetensors"
            ).exists()
    two = train_marl(cfg(**{"train.env_steps": 300, "runtime.train_workers": 2}), None)
    assert len(two.placement["train"]) == 2 and two.placement["train_swaps"] == 0
    for a, b in zip(res.records, two.records, strict=True):
        for key in ("agent/speaker_0/loss/policy", "agent/listener_0/loss/value",
                    "return_mean"):
            assert a[key] == b[key], key


def test_a_step_refuses_rows_of_another_iteration() -> None:
    c = cfg()
    run, env, learners = in_process(c)
    run.sampler.put(0, [env.run(0)])
    with pytest.raises(ConsistencyError, match="iteration 0, but step 1"):
        run.store.take_ready("speaker_0", 0, 4, 1)
    _, samples = run.sampler.take("speaker_0", 0)["speaker_0"]
    learners["speaker_0"].version = 1  # a learner past step 0 refuses iteration 0's rows
    with pytest.raises(LearnerError, match="step 1 trains on iteration 1's rows"):
        learners["speaker_0"].accumulate(samples)
    with pytest.raises(RuntimeError, match="holds version 0, iteration 1 needs version 1"):
        env.run(1)  # a rollout never runs on weights of another version


def test_a_swapped_out_learner_resumes_exactly() -> None:
    """capture -> wire -> restore into a fresh learner, with rows held (accumulated, not
    stepped): its step equals the unswapped learner's, weights and metrics bit for bit."""
    c = cfg(**{"share": True, "network.kind": "gru"})
    run, env, learners = in_process(c)
    step_in_process(run, env, learners, 0)  # Adam state, statistics, version 1
    run.sampler.put(1, [env.run(1)])
    a = learners["shared"]
    for _, samples in run.sampler.take("shared", 1).values():
        a.accumulate(samples)
    b = PolicyLearner(c, run.layouts["shared"])
    b.restore(st.from_wire(st.to_wire(a.capture())))
    ma = a.step()
    mb = b.step()
    assert ma == mb and a.version == b.version == 2
    for key, value in a.weights().items():
        assert torch.equal(value, b.weights()[key]), key


@pytest.mark.slow  # 12 s; a smoke of two policy kinds (make test keeps its 15 minutes)
def test_gru_shared_and_gaussian_policies_run() -> None:
    gru = cfg(**{"env.id": "mpe2.simple_spread_v3", "share": True,
                 "network.kind": "gru", "algorithm.name": "ippo",
                 "runtime.rollout_workers": 2})
    res = train_marl(gru, None)  # 2 rollout workers x 4 envs: 1 iteration of 200 steps
    assert np.isfinite(res.records[-1]["agent/shared/loss/policy"])
    envs = {sid.split("_")[0].split("-")[1] for sid, *_ in res.audit["shared"]}
    assert envs == {str(e) for e in range(8)}  # both workers' environments, distinct ids
    _, env, _ = in_process(gru)
    assert env.actors["shared"].hidden.shape == (3 * 4, 64)  # carried across iterations
    box = cfg(**{"env.id": "mpe2.simple_spread_v3", "env.options.continuous_actions": True,
                 "share": True})
    res = train_marl(box, None)
    assert MarlRun(box).layouts["shared"].spec.kind == "box"
    assert np.isfinite(res.records[-1]["agent/shared/entropy"])


def test_shared_speaker_listener_pads_discrete_heads() -> None:
    run, env, _ = in_process(cfg(**{"share": True}))
    lay = run.layouts["shared"]
    assert lay.spec.nvec == (5,) and lay.obs_dim == 11
    run.sampler.put(0, [env.run(0)])
    rows = run.store.take_ready("speaker_0", 0, 4, 0)
    actions = np.concatenate([run.store.fetch(r, "actions") for r in rows])
    assert actions.max() < 3  # the speaker's 3 words only: padded actions are masked


def test_config_errors_name_the_field(tmp_path, capsys) -> None:
    with pytest.raises(ConfigError, match="critic_input"):
        cfg(**{"algorithm.name": "ippo", "algorithm.critic_input": "state"})
    with pytest.raises(ConfigError, match="(?s)runtime.kind.*not the simulator"):
        cfg(**{"runtime.kind": "sim"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: {id: mpe2.simple_nothing_v9}\nagents: {a: {}}\n")
    assert main(["train", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "env.id: unknown environment 'mpe2.simple_nothing_v9'" in capsys.readouterr().err
    from flexmarl.envs.spaces import ActionSpec
    from flexmarl.marl.policies import group_spec

    with pytest.raises(PolicyError, match="sharing a network have different action spaces"):
        group_spec(["a", "b"], {"a": ActionSpec("discrete", nvec=(3,)),
                                 "b": ActionSpec("box", dim=2, low=(-1, -1), high=(1, 1))}, "e")


def test_agents_and_shared_networks_are_checked_naming_the_field(tmp_path, capsys) -> None:
    """The run config's shape: every trained agent of the environment named once, a shared
    network named by `base` like a shared LLM base; each mistake names its field."""
    sl = {"env": {"id": "mpe2.simple_speaker_listener_v4"}, "share": False}
    with pytest.raises(ConfigError, match="agents.speaker_1: env .* has no trained agent"):
        MarlRun(marl_cfg({**sl, "agents": {"speaker_1": {}, "listener_0": {}}}))
    with pytest.raises(ConfigError, match="agent\\(s\\) listener_0 without a config"):
        MarlRun(marl_cfg({**sl, "agents": {"speaker_0": {}}}))
    with pytest.raises(ConfigError, match="agents.speaker_0.network.base: 'net' names no"):
        marl_cfg({**sl, "agents": {"speaker_0": {"network": {"base": "net"}}}})
    with pytest.raises(ConfigError, match="networks.spare: no agent uses it"):
        marl_cfg({**sl, "networks": {"spare": {}}, "agents": {"speaker_0": {}}})
    with pytest.raises(ConfigError, match="agents.listener_0.network.hidden: set next to"):
        marl_cfg({**sl, "networks": {"n": {}}, "agents": {
            "speaker_0": {"network": {"base": "n"}},
            "listener_0": {"network": {"base": "n", "hidden": [8]}}}})
    with pytest.raises(ConfigError, match="runtime.publication: places, pins or publishes"):
        cfg(**{"runtime.publication": "pipe"})
    with pytest.raises(ConfigError, match="runtime.train_cpus: places, pins or publishes"):
        cfg(**{"runtime.train_cpus": [0]})
    # partial sharing: two of spread's three agents on one network, the third on its own
    run = MarlRun(marl_cfg({"env": {"id": "mpe2.simple_spread_v3"}, "networks": {
        "pair": {"hidden": [16]}}, "agents": {"agent_0": {"network": {"base": "pair"}},
                                              "agent_1": {"network": {"base": "pair"}},
                                              "agent_2": {"network": {"hidden": [8]}}}}))
    assert {n: lay.agents for n, lay in run.layouts.items()} == {
        "pair": ("agent_0", "agent_1"), "agent_2": ("agent_2",)}
    assert run.cfg.network_of("pair").hidden == [16]
    old = tmp_path / "old.yaml"  # the retired shape says what replaced it
    old.write_text("kind: marl\nenv: {id: mpe2.simple_v3}\n")
    assert main(["train", str(old), "--out", str(tmp_path / "o")]) == 2
    assert "kind: marl is gone" in capsys.readouterr().err
    sl_file = tmp_path / "sl.yaml"
    sl_file.write_text(yaml.safe_dump(shaped(sl)))
    assert main(["train", str(sl_file), "--system", "flexmarl-sync"]) == 2
    assert "--system flexmarl-sync: the simulator's systems are presets of task runs" in (
        capsys.readouterr().err)
    old.write_text("env: {id: mpe2.simple_v3}\nagents: {agent_0: {}}\nalgorithm: {name: qmix}\n")
    assert main(["train", str(old), "--out", str(tmp_path / "o")]) == 2
    assert "algorithm: an environment run's algorithm is its agents' network.algorithm" in (
        capsys.readouterr().err)


def _speaker_listener(steps: int):
    c = cfg(**{"env.num_envs": 32, "train.env_steps": steps, "algorithm.epochs": 10,
               "algorithm.minibatches": 1})
    return train_marl(c, None).records


def test_mappo_speaker_listener_rises_well_above_random() -> None:
    """24k environment steps in the runtime's worker processes (the random floor is -40.4
    per agent; benchmarks/mpe_runtime.py measured -16.1 at 20k steps). About 20 s of training
    plus the workers' start on an idle 2-core machine; 170 s at load average 20."""
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
    """On-policy: at the first epoch the learner's log-probs of iteration k's rows are the
    rollout's, also when the store holds FP16 + zstd observations (the policy acts on the
    rounded ones), and the compressed rows take fewer bytes."""
    c = cfg(**{"env.id": "mpe2.simple_spread_v3", "share": True,
               "store.compress_obs": compress, "train.env_steps": 200})
    run, env, learners = in_process(c)
    step_in_process(run, env, learners, 0)  # obs statistics exist: version 1 normalises
    result = env.run(1)
    run.sampler.put(1, [result])
    learner = learners["shared"]
    samples = [s for _, ss in run.sampler.take("shared", 1).values() for s in ss]
    batch = learner._batch(samples, 1)
    net = learner.net
    with torch.no_grad():
        out = net.actor.sequence(net.actor_input(batch.obs, batch.agent_ids), None,
                                 batch.starts)
        logp = net.actor.dist(out, batch.action_mask).log_prob(batch.actions)
    torch.testing.assert_close(logp, batch.logp, rtol=0, atol=1e-5)
    raw, stored = result.payload_bytes
    assert raw > 0 and (stored < 0.5 * raw if compress else stored == raw)


def test_options_of_another_algorithm_are_named(tmp_path, capsys) -> None:
    with pytest.raises(ConfigError) as err:
        cfg(**{"algorithm.batch_size": 64})
    assert ("agents.speaker_0.network.algorithm.batch_size: option does not apply to "
            "algorithm 'mappo' (it is an option of vdn/qmix)") in str(err.value)
    with pytest.raises(ConfigError, match="algorithm.epochz: unknown key"):
        cfg(**{"algorithm.epochz": 3})
