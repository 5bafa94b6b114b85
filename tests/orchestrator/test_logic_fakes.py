"""The joint orchestrator's logic on the in-memory fake pools (`flexmarl.testing.fakes`): one
process, no models, milliseconds per run. The real-process tests next to this file check the
same contracts end to end on fewer cases."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from flexmarl.config.schema import ConfigError, RunConfig, load_config
from flexmarl.graph.task import load_task
from flexmarl.orchestrator.checkpoint import Checkpoint
from flexmarl.orchestrator.joint import FailureBudgetExceeded, JointOrchestrator
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.testing.fakes import FakeRolloutPool, FakeTrainPool

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["train.iterations=3", "train.inputs_per_iteration=4", "train.group_size=4",
         "train.micro_batch_size=8"]


def config(*overrides: str, example: str = "relay_chain.yaml") -> RunConfig:
    return load_config(EXAMPLES / example, [*SMALL, *overrides])


def run(cfg: RunConfig, rollout: FakeRolloutPool | None = None,
        train: FakeTrainPool | None = None, **kwargs: Any
        ) -> tuple[JointOrchestrator, FakeRolloutPool, FakeTrainPool]:
    task = load_task(cfg.task.builder, cfg.task.options)
    rollout = rollout or FakeRolloutPool(cfg.seed)
    trainable = [a for a in cfg.agents if cfg.agents[a].trainable]
    train = train or FakeTrainPool(trainable)

    async def main() -> JointOrchestrator:
        orch = JointOrchestrator(cfg, task, rollout, train, Telemetry(None), **kwargs)
        # a pipeline that deadlocks (a version never published) fails instead of hanging
        await asyncio.wait_for(orch.run(), timeout=20)
        return orch

    return asyncio.run(main()), rollout, train


def per_step(train: FakeTrainPool) -> dict[tuple[str, int], list[list[str]]]:
    """Each (agent, step)'s micro-batches, in the order they were accumulated."""
    out: dict[tuple[str, int], list[list[str]]] = {}
    for acc in train.accumulated:
        out.setdefault((acc.agent, acc.trainer_version), []).append(acc.sample_ids)
    return out


def final_weights(train: FakeTrainPool) -> dict[str, tuple[int, str]]:
    return {a: (t.version, t.weights) for a, t in train.trainers.items()}


def assert_on_policy(orch: JointOrchestrator, rollout: FakeRolloutPool,
                     train: FakeTrainPool, lag: int = 0) -> None:
    """Every request was served with the weights of the version it asked for, every
    micro-batch of step k holds rows of version max(0, k - lag) of iteration k, each row
    trained on once."""
    for g in rollout.generated:
        if g.agent not in orch.trainable:  # frozen: the replicas' own model, never published
            assert (g.version, g.held) == (0, None), g
            continue
        assert g.held == g.version, f"{g.sample_id} asked for v{g.version}, replica had v{g.held}"
    seen: set[str] = set()
    for acc in train.accumulated:
        k = acc.trainer_version
        assert set(acc.policy_versions) == {max(0, k - lag)}, (acc.agent, k, acc.policy_versions)
        assert all(sid.startswith(f"{k}-") for sid in acc.sample_ids), (acc.agent, k)
        assert not seen & set(acc.sample_ids), "a row was trained on twice"
        seen.update(acc.sample_ids)
    for agent, trail in orch.audit.items():
        assert all(v == max(0, step - lag) for _, v, step in trail), agent


def test_sync_and_async_train_on_the_same_micro_batches_in_deterministic_mode():
    runs = {m: run(config(f"pipeline.mode={m}", "runtime.deterministic=true"))
            for m in ("sync", "async")}
    (o_sync, r_sync, t_sync), (o_async, r_async, t_async) = runs["sync"], runs["async"]
    assert per_step(t_sync) == per_step(t_async)
    assert final_weights(t_sync) == final_weights(t_async)
    assert sorted(r_sync.published) == sorted(r_async.published)
    tokens = {m: sorted((g.sample_id, g.tokens) for g in r.generated)
              for m, (_, r, _) in runs.items()}
    assert tokens["sync"] == tokens["async"]
    for orch, rollout, train in runs.values():
        assert_on_policy(orch, rollout, train)
        # every agent stepped once per iteration, on two micro-batches of two groups each
        assert [(a, v, n) for a, v, n in train.steps if a == "relay"] == \
            [("relay", 1, 2), ("relay", 2, 2), ("relay", 3, 2)]
    assert [r["agent/relay/reward_mean"] for r in o_sync.records] == \
        [r["agent/relay/reward_mean"] for r in o_async.records]


def test_async_without_determinism_trains_the_same_rows_per_step():
    """Micro-batches form in completion order, but each step still gets exactly its
    iteration's rows (a different split of them than sync's)."""
    _, _, t_sync = run(config("pipeline.mode=sync"))
    orch, rollout, t_async = run(config("pipeline.mode=async"))
    assert_on_policy(orch, rollout, t_async)
    rows = {m: {key: sorted(s for mb in mbs for s in mb) for key, mbs in per_step(t).items()}
            for m, t in (("sync", t_sync), ("async", t_async))}
    assert rows["sync"] == rows["async"]


def test_one_step_off_trains_rows_one_version_behind():
    orch, rollout, train = run(config("pipeline.mode=one_step_off"))
    assert_on_policy(orch, rollout, train, lag=1)
    # iterations 0 and 1 are both generated with version 0
    versions = {(g.sample_id.split("-")[0], g.version) for g in rollout.generated}
    assert versions == {("0", 0), ("1", 0), ("2", 1)}
    assert {a: t.version for a, t in train.trainers.items()} == dict.fromkeys(orch.trainable, 3)


def test_one_step_off_refuses_to_resume():
    cfg = config("pipeline.mode=one_step_off")
    ckpt = Checkpoint(Path("nowhere"), {}, {}, [])
    with pytest.raises(ConfigError, match="one_step_off"):
        run(cfg, resume=ckpt)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_episode_is_recorded_and_does_not_block_the_iteration(mode):
    bad = "1-2"  # iteration 1, input 2: every trajectory's relay call fails once

    def fail(request) -> bool:
        return request.agent == "relay" and request.sample_id.startswith(bad + "_") \
            and request.sample_id.endswith("_0")

    orch, rollout, train = run(config(f"pipeline.mode={mode}"), FakeRolloutPool(fail=fail))
    assert [r["episodes/failed"] for r in orch.records] == [0, 1, 0]
    assert "fake replica" in orch.records[1]["errors"][0]
    assert orch.episodes.first_error is not None and "episode 1-2/0" in orch.episodes.first_error
    assert_on_policy(orch, rollout, train)
    trained = {s for acc in train.accumulated for s in acc.sample_ids}
    assert not any(s.startswith(bad + "_") and s.endswith("_0") for s in trained)
    # the failed episode's group still trains its other trajectories
    assert any(s.startswith(bad + "_") for s in trained)
    per_iteration = 4 * 4
    for agent in orch.trainable:
        assert [len(orch.consumed[agent][k]) for k in range(3)] == \
            [per_iteration, per_iteration - 1, per_iteration]
        assert orch.store.stats()[agent]["ready"] == 0


def test_episodes_failing_beyond_the_budget_stop_the_run():
    cfg = config("train.max_failed_fraction=0.1", "train.max_consecutive_failed_iterations=1")

    def fail(request) -> bool:
        return request.agent == "listener" and request.sample_id.split("-")[1][0] in "01"

    with pytest.raises(FailureBudgetExceeded, match="2 consecutive"):
        run(cfg, FakeRolloutPool(fail=fail))


def test_time_shared_slots_train_agents_one_after_another_in_sync():
    _, _, shared = run(config("pipeline.mode=sync"),
                       train=FakeTrainPool(["speaker", "relay", "listener"], slots=1))
    assert shared.max_active == 1
    _, _, own = run(config("pipeline.mode=sync"),
                    train=FakeTrainPool(["speaker", "relay", "listener"]))
    assert own.max_active > 1  # with a trainer each they train side by side
    assert final_weights(shared) == final_weights(own)


def test_the_rollout_pool_replans_after_each_iteration():
    orch, rollout, _ = run(config(), FakeRolloutPool(plan=True))
    assert rollout.ended == [0, 1, 2]
    assert [r["rollout/plan"]["iteration"] for r in orch.records] == [1, 2, 3]
    assert orch.records[0]["rollout/plan"]["rows"] == {"listener": 16, "relay": 16,
                                                       "speaker": 16}


def test_both_pools_follow_the_planners_plan_after_each_iteration():
    """Between iterations the planner (planning/planner.py) orders training along the
    critical path from the measured node latencies; both pools get the plan, and the record
    holds it next to the rollout pool's own plan."""
    cfg = config("agents.listener.trainable=false")
    orch, rollout, train = run(cfg, FakeRolloutPool(plan=True),
                               FakeTrainPool(["speaker", "relay"]))
    assert [p.iteration for p in train.followed] == [1, 2, 3]
    assert rollout.followed == train.followed
    for plan, record in zip(train.followed, orch.records, strict=True):
        # a chain: upstream first; the frozen listener is never in the training order
        assert plan.train_order == ["speaker", "relay"]
        assert plan.replicas is None  # one replica: the pool keeps its demand plan
        assert record["rollout/plan"]["train_order"] == ["speaker", "relay"]
        assert record["rollout/plan"]["rows"]  # the pool's plan is still recorded
        assert set(plan.node_s) == {"speak", "relay", "listen"}


def test_versions_are_published_in_order_after_each_step():
    orch, rollout, train = run(config())
    for agent in orch.trainable:
        versions = [v for a, v, _ in rollout.published if a == agent]
        assert versions == [0, 1, 2, 3]
        assert orch.records[-1][f"agent/{agent}/policy_version"] == 3
    assert final_weights(train)["relay"][1] == rollout.held["relay"][1]


@pytest.mark.parametrize("normalize", ["group", "agent_previous"])
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(normalize):
    """agent_previous: the resumed run's first iteration takes its baselines from the
    checkpoint's records (the fake trainers' weights digest every advantage)."""
    cfg = config("runtime.deterministic=true", "train.iterations=4", "train.checkpoint_every=2",
                 *(f"agents.{a}.algorithm.normalize={normalize}"
                   for a in ("speaker", "relay", "listener")))
    saved: dict[int, Checkpoint] = {}

    def save(completed: int, position: dict, states: dict, rows: list,
             extra: dict | None = None) -> str:
        saved[completed] = Checkpoint(Path(f"ckpt-{completed}"), position, states, rows)
        return f"ckpt-{completed}"

    full, _, t_full = run(cfg, save_checkpoint=save)
    assert sorted(saved) == [2, 4]
    resumed, _, t_resumed = run(cfg, resume=saved[2])
    assert final_weights(t_resumed) == final_weights(t_full)
    assert resumed.audit == full.audit
    assert [r["agent/relay/reward_mean"] for r in resumed.records] == \
        [r["agent/relay/reward_mean"] for r in full.records]
    # the resumed run trained iterations 2 and 3 only
    assert {acc.trainer_version for acc in t_resumed.accumulated} == {2, 3}


def test_a_failed_step_fails_the_run():
    train = FakeTrainPool(["speaker", "relay", "listener"],
                          fail_step=lambda agent, version: agent == "relay" and version == 1)
    with pytest.raises(Exception, match="step 1 failed"):
        run(config(), train=train)


@pytest.mark.parametrize("schedule", ["dependency", "stage"])
def test_stage_schedule_holds_each_graph_level_until_the_one_below_is_done(schedule):
    orch, rollout, _ = run(config("pipeline.mode=sync", f"rollout.schedule={schedule}"))
    eps = orch.episodes
    level = {eps.graph.nodes[n].agent: eps.level[n] for n in eps.order}
    for k in range(3):
        served = [level[g.agent] for g in rollout.generated if g.sample_id.startswith(f"{k}-")]
        barrier_kept = served == sorted(served)
        # the fake serves requests out of order, so without the barrier levels interleave
        assert barrier_kept == (schedule == "stage"), (k, served)


def test_a_frozen_agent_generates_at_version_zero_and_is_never_trained():
    orch, rollout, train = run(config("agents.relay.trainable=false"),
                               train=FakeTrainPool(["speaker", "listener"]))
    assert orch.trainable == ["speaker", "listener"]
    assert {g.version for g in rollout.generated if g.agent == "relay"} == {0}
    assert all(acc.agent != "relay" for acc in train.accumulated)
    assert orch.records[-1]["agent/relay/policy_version"] == 0
    assert_on_policy(orch, rollout, train)
    # its rows are dropped once their iteration is done (bounded memory), still counted
    relay = orch.store.tables["relay"]
    assert not relay.rows
    made = sum(g.agent == "relay" for g in rollout.generated)
    assert made > 0 and orch.store.stats()["relay"]["rewarded"] == made


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_static_condition_skips_its_branch_as_a_dynamic_one_does(mode):
    """`static_when` (decided at the episode's start, no task for what it skips) serves the
    very same requests, rows and weights as the same condition evaluated after the inputs;
    a static condition that raises still fails its episode, naming the node."""
    cfg = config(f"pipeline.mode={mode}")

    def once(static: bool, when: Any) -> tuple[FakeRolloutPool, FakeTrainPool]:
        task = load_task(cfg.task.builder, cfg.task.options)
        order = task.graph.topological_order()
        node = task.graph.nodes[order[1]]  # has a node downstream of it
        node.when, node.static_when = when, static
        rollout = FakeRolloutPool(cfg.seed)
        train = FakeTrainPool([a for a in cfg.agents if cfg.agents[a].trainable])

        async def main() -> None:
            await asyncio.wait_for(JointOrchestrator(cfg, task, rollout, train,
                                                     Telemetry(None)).run(), timeout=20)

        asyncio.run(main())
        return rollout, train

    def odd(ctx: Any) -> bool:
        return ctx.trajectory_id % 2 == 1

    static, dynamic = once(True, odd), once(False, odd)
    everything, _ = once(False, None)
    assert static[0].generated == dynamic[0].generated
    assert len(static[0].generated) < len(everything.generated)  # branches were skipped
    assert per_step(static[1]) == per_step(dynamic[1])
    assert final_weights(static[1]) == final_weights(dynamic[1])

    def broken(ctx: Any) -> bool:
        raise KeyError("no such field")

    with pytest.raises(FailureBudgetExceeded, match=r"condition \(when=\) raised KeyError"):
        once(True, broken)
