"""Hybrid graphs: LLM and network-policy agents in one MEG (docs/hybrid.md).

The units run in-process (the env rendezvous, the segment rows, credit into the step rewards,
the config's checks); one end-to-end run uses the local runtime's real worker processes: a
tiny random LLM on a rollout replica, the network learners in a training slot."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flexmarl.config.schema import ConfigError, NetworkSpaces, config_from_dict
from flexmarl.graph.envs import EnvSegment, EnvSession, Observation
from flexmarl.graph.meg import GraphError
from flexmarl.graph.task import TaskLoadError
from flexmarl.orchestrator.checkpoint import Checkpoint
from flexmarl.orchestrator.joint import JointOrchestrator
from flexmarl.orchestrator.networks import NetworkActors, network_samples
from flexmarl.orchestrator.run import prepare, train
from flexmarl.store.experience import ExperienceStore, Row
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.testing.fakes import FakeRolloutPool
from flexmarl.training.host import SlotPool, TrainHost
from tests.orchestrator.hybrid_tasks import CELLS, build_line

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NETWORK = {"hidden": [16], "algorithm": {"name": "mappo", "epochs": 2}}


def _raw(**over) -> dict:
    raw = {
        "name": "hybrid_line", "seed": 1,
        "task": {"builder": "tests.orchestrator.hybrid_tasks:build_line"},
        "agents": {
            "caller": {"model": {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1,
                                 "num_heads": 2}},
            "walker0": {"network": NETWORK}, "walker1": {"network": NETWORK}},
        "train": {"iterations": 2, "inputs_per_iteration": 2, "group_size": 2,
                  "micro_batch_size": 4},
        "runtime": {"kind": "local", "rollout_workers": 1, "train_workers": 1,
                    "torch_threads": 1},
    }
    raw.update(over)
    return raw


class Counter(EnvSession):
    def __init__(self, horizon: int = 100) -> None:
        super().__init__(["a", "b"])
        self.steps: list[dict[str, int]] = []
        self.horizon = horizon

    def observe(self, agent: str) -> Observation:
        return Observation(np.array([self.t, 0.0], np.float32),
                           np.array([self.t, 0.0, 1.0], np.float32))

    def step(self, actions: dict[str, int]) -> dict[str, tuple[float, bool]]:
        self.steps.append(dict(actions))
        done = self.t + 1 >= self.horizon
        return {a: (1.0, done) for a in actions}


def test_session_steps_once_when_every_agent_acted():
    async def main():
        env = Counter()
        both = await asyncio.gather(env.act("a", 0), env.act("b", 2))
        assert both == [(1.0, False), (1.0, False)] and env.steps == [{"a": 0, "b": 2}]
        first = asyncio.ensure_future(env.act("a", 1))
        await asyncio.sleep(0)
        assert not first.done() and env.t == 1  # waits for b
        with pytest.raises(GraphError, match="acted twice"):
            await env.act("a", 1)
        await env.act("b", 1)
        assert (await first) == (1.0, False) and env.t == 2

    asyncio.run(main())


def _actors() -> NetworkActors:
    cfg = config_from_dict(_raw())
    spaces = NetworkSpaces(obs_dim=2, critic_dim=3, actions=3)
    for name in ("walker0", "walker1"):
        cfg.agents[name].network.spaces = spaces  # what the run fills in from the task
    return NetworkActors(cfg)


def test_segment_rows_pad_after_the_episode_ends_and_sample_by_sample_id():
    actors = _actors()

    async def episode():
        env = Counter(horizon=3)
        env.agents = ["walker0", "walker1"]
        return await asyncio.gather(
            actors.run_segment("walker0", 0, EnvSegment(env, 5), "0-0_1_0"),
            actors.run_segment("walker1", 0, EnvSegment(env, 5), "0-0_2_0"))

    seg, other = asyncio.run(episode())
    assert len(seg.actions) == 3 and seg.reward_sum == 3.0
    arrays = seg.arrays
    assert arrays["obs"].shape == (5, 2) and arrays["critic_x"].shape == (5, 3)
    assert arrays["alive"].tolist() == [True, True, True, False, False]
    assert arrays["dones"].tolist() == [False, False, True, True, True]
    assert arrays["starts"].tolist() == [True, False, False, False, False]
    assert float(arrays["last_value"]) == 0.0  # the episode ended: no bootstrap
    # the same sample id and version draw the same actions, whatever else runs beside it
    again, _ = asyncio.run(episode())
    assert again.actions == seg.actions and np.array_equal(again.arrays["logp"], arrays["logp"])


def test_an_ippo_agents_critic_reads_its_own_observation():
    raw = _raw()
    raw["agents"]["walker0"]["network"] = {**NETWORK, "algorithm": {"name": "ippo"}}
    cfg = config_from_dict(raw)
    for name in ("walker0", "walker1"):
        cfg.agents[name].network.spaces = NetworkSpaces(obs_dim=2, critic_dim=3, actions=3)
    actors = NetworkActors(cfg)
    assert actors.nets["walker0"].critic_dim == 2 and actors.nets["walker1"].critic_dim == 3

    async def episode():
        env = Counter(horizon=4)
        env.agents = ["walker0", "walker1"]
        return await asyncio.gather(
            actors.run_segment("walker0", 0, EnvSegment(env, 2), "0-0_1_0"),
            actors.run_segment("walker1", 0, EnvSegment(env, 2), "0-0_2_0"))

    ippo, mappo = asyncio.run(episode())
    assert ippo.arrays["critic_x"].shape == (2, 2) and mappo.arrays["critic_x"].shape == (2, 3)
    assert np.array_equal(ippo.arrays["critic_x"], ippo.arrays["obs"])


def test_credit_beyond_the_step_rewards_lands_on_the_last_live_step():
    store = ExperienceStore(["walker0"])
    row = store.add(Row(sample_id="0-0_1_0", agent="walker0", node="w", input_id="0-0",
                        turn=1, trajectory_id=0, iteration=0, policy_version=0,
                        version_vector={"walker0": 0}))
    rewards = np.array([-1.0, -2.0, 0.0], np.float32)
    store.set_generated("walker0", row.sample_id, {"prompt": [], "response": [0, 1],
                                                   "step_reward": -3.0},
                        {"rewards": rewards, "alive": np.array([True, True, False])})
    store.set_rewarded("walker0", row.sample_id, -3.0 + 0.5)  # a team share of 0.5
    (sample,) = network_samples(store, [row])
    assert sample.arrays["rewards"].tolist() == [-1.0, -1.5, 0.0]
    assert rewards.tolist() == [-1.0, -2.0, 0.0]  # the stored row is left as generated


def test_config_names_what_a_network_agent_cannot_have():
    bad = _raw()
    bad["agents"]["walker0"] = {"network": NETWORK, "optim": {"lr": 0.1}}
    with pytest.raises(ConfigError, match="agents.walker0: optim: an agent with a `network`"):
        config_from_dict(bad)
    with pytest.raises(ConfigError, match="agents.walker0.network: a network agent's learner"):
        config_from_dict(_raw(pipeline={"mode": "one_step_off"}))
    task = build_line()
    cfg = config_from_dict(_raw())
    del task.network_spaces["walker1"]
    with pytest.raises(TaskLoadError, match="agents.walker1.network: .* gives no sizes"):
        task.resolve_networks(cfg.agents)


class InProcessSlots(SlotPool):
    """One training slot in this process: the real `TrainHost` of the run's config."""

    def __init__(self, host: TrainHost) -> None:
        super().__init__(1)
        self.host = host

    async def _run(self, slot: int, command: str, payload: Any) -> Any:
        await asyncio.sleep(0)
        return self.host.handle(command, payload)[0]  # (result, trace label)


def _in_process(mode: str, orchestrator: dict[str, Any] | None = None, **over: Any
                ) -> tuple[JointOrchestrator, FakeRolloutPool]:
    """The orchestrator over a model-free rollout pool for the (frozen) LLM caller and the
    network learners in an in-process slot: the whole hybrid path but the worker processes."""
    raw = _raw(pipeline={"mode": mode}, **over)
    raw["agents"]["caller"]["trainable"] = False
    cfg = config_from_dict(raw)
    task = prepare(cfg)
    rollout = FakeRolloutPool(cfg.seed)
    slots = InProcessSlots(TrainHost(cfg, task.vocab_size, task.max_seq_len))

    async def main() -> JointOrchestrator:
        orch = JointOrchestrator(cfg, task, rollout, slots, Telemetry(None),
                                 **(orchestrator or {}))
        await asyncio.wait_for(orch.run(), timeout=60)
        return orch

    return asyncio.run(main()), rollout


def test_network_agents_train_beside_an_llm_agent_and_sync_equals_async():
    runtime = dict(_raw()["runtime"], deterministic=True)
    runs = {mode: _in_process(mode, runtime=runtime) for mode in ("sync", "async")}
    rows = 2 * 2 * 2  # inputs x group x segments
    for orch, rollout in runs.values():
        for walker in ("walker0", "walker1"):
            audit = orch.audit[walker]
            assert len(audit) == len({sid for sid, _, _ in audit}) == 2 * rows
            assert all(version == step and sid.startswith(f"{step}-")
                       for sid, version, step in audit)
            # each step's weights reached the episodes' actors, not the replicas
            assert orch.networks is not None and orch.networks.versions[walker] == 2
        assert not any(agent.startswith("walker") for agent, _, _ in rollout.published)
        assert {g.agent for g in rollout.generated} == {"caller"}
        last = orch.records[-1]
        assert last["episodes/failed"] == 0 and np.isfinite(last["agent/walker0/reward_mean"])
        assert last["agent/walker1/loss/value"] > 0 and "agent/caller/reward_mean" in last
    # deterministic mode: the pipelines' records agree bit for bit (one step per forward)
    sync, asyn = (runs[m][0].records for m in ("sync", "async"))
    keys = [k for k in sync[-1] if k.startswith("agent/walker") and not k.endswith("_s")
            and "per_s" not in k and "swap" not in k and "wait" not in k]
    assert "agent/walker0/loss/policy" in keys
    assert [[r[k] for k in keys] for r in sync] == [[r[k] for k in keys] for r in asyn]


def test_a_resumed_hybrid_run_equals_the_uninterrupted_one():
    runtime = dict(_raw()["runtime"], deterministic=True)
    train_cfg = dict(_raw()["train"], iterations=4, checkpoint_every=2)
    saved: dict[int, Checkpoint] = {}

    def save(completed: int, position: dict, states: dict, rows: list,
             extra: dict | None = None) -> str:
        saved[completed] = Checkpoint(Path(f"ckpt-{completed}"), position, states, rows)
        return f"ckpt-{completed}"

    full, _ = _in_process("async", {"save_checkpoint": save}, runtime=runtime, train=train_cfg)
    assert sorted(saved) == [2, 4]
    resumed, _ = _in_process("async", {"resume": saved[2]}, runtime=runtime, train=train_cfg)
    for walker in ("walker0", "walker1"):
        assert resumed.audit[walker] == full.audit[walker]
        assert [r[f"agent/{walker}/loss/policy"] for r in resumed.records] == \
            [r[f"agent/{walker}/loss/policy"] for r in full.records]
        assert resumed.networks.versions[walker] == full.networks.versions[walker] == 4


@pytest.mark.slow  # real worker processes: about 15 s on 2 loaded cores
def test_hybrid_run_trains_llm_and_network_agents_on_their_own_rows(tmp_path):
    cfg = config_from_dict(_raw())
    result = train(cfg, tmp_path / "run")
    per_iteration = 2 * 2  # inputs x group: one row per node, two segments per episode
    for agent in ("caller", "walker0", "walker1"):
        ids = [sid for sid, _, _ in result.audit[agent]]
        assert len(ids) == len(set(ids)) == cfg.train.iterations * per_iteration * 2
        for sid, version, step in result.audit[agent]:
            assert version == step and sid.startswith(f"{step}-")
        assert result.store_stats[agent]["ready"] == 0
    last = result.records[-1]
    assert last["episodes/failed"] == 0
    for walker in ("walker0", "walker1"):
        assert last[f"agent/{walker}/policy_version"] == cfg.train.iterations
        assert np.isfinite(last[f"agent/{walker}/reward_mean"])
        assert f"agent/{walker}/loss/policy" in last and f"agent/{walker}/loss/value" in last
    assert "agent/caller/reward_mean" in last
    assert set(result.checkpoints) == {"caller", "walker0", "walker1"}
    assert CELLS  # the caller names cells (the task's tokens)


@pytest.mark.slow  # a Ray cluster started for the run: about 20 s
def test_hybrid_run_on_ray_hosts_the_network_learners_in_slot_actors(tmp_path):
    pytest.importorskip("ray")
    cfg = config_from_dict(_raw(runtime={"kind": "ray", "rollout_workers": 1,
                                         "train_workers": 1, "torch_threads": 1}))
    result = train(cfg, tmp_path / "run")
    last = result.records[-1]
    assert last["episodes/failed"] == 0
    for agent in ("caller", "walker0", "walker1"):
        assert last[f"agent/{agent}/policy_version"] == cfg.train.iterations
        assert len(result.audit[agent]) == cfg.train.iterations * 2 * 2 * 2
