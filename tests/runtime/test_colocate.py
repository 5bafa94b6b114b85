"""Colocated pools on the local runtime (`runtime.colocate`, the marti presets): real worker
processes pinned to the same cores, replicas that really release their KV cache while the
trainers compute (asked of the replica processes themselves), and a colocated sync run equal
bit for bit to the same sync run on separate pools."""

import asyncio
import os
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flexmarl.config.schema import ConfigError, load_config
from flexmarl.config.systems import system_overrides
from flexmarl.orchestrator.run import train

RELAY = Path(__file__).resolve().parents[2] / "examples" / "relay_chain.yaml"
# two short deterministic sync iterations; the training slot pinned to core 0 in both runs
COMMON = ["runtime.deterministic=true", "train.iterations=2", "train.inputs_per_iteration=4",
          "train.group_size=2", "train.micro_batch_size=4", "runtime.train_cpus=[0]"]


def _instrument(seen: dict[str, list]):
    """`on_runtime`: ask every replica process what it holds while each training call runs
    and, before each request goes to a replica, which engines are awake; note each worker's
    CPU affinity."""

    def hook(runtime) -> None:
        workers = runtime.rollout_workers

        async def held() -> list[dict]:
            return list(await asyncio.gather(*(w.call("memory", None) for w in workers)))

        accumulate, step = runtime.train.accumulate, runtime.train.step
        dispatch = runtime.rollout._dispatch

        # the training call goes to the pool first (the pool runs an agent's calls in the
        # order they come), the question to the replicas while it runs
        async def accumulate_seen(agent, batch):
            call = asyncio.ensure_future(accumulate(agent, batch))
            seen["training"].append(await held())
            return await call

        async def step_seen(agent):
            call = asyncio.ensure_future(step(agent))
            seen["training"].append(await held())
            return await call

        async def dispatch_seen(request, priority):
            seen["turns"].append((request.agent, await held()))
            return await dispatch(request, priority)

        runtime.train.accumulate, runtime.train.step = accumulate_seen, step_seen
        runtime.rollout._dispatch = dispatch_seen
        seen["affinity"] = [os.sched_getaffinity(w.process.pid)
                            for w in workers + runtime.train_workers]

    return hook


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The mas-rl-like preset (sync, colocated, the pool time-shared by one agent at a time),
    and the marti preset's settings on separate pools. (`marti` itself, colocated without
    turns, runs in tests/sim/calibration/test_compare.py.)"""
    out = tmp_path_factory.mktemp("colocate")
    seen: dict[str, list] = {"training": [], "turns": []}
    colocated = load_config(RELAY, [*system_overrides("mas-rl-like"), *COMMON])
    apart = load_config(RELAY, [*system_overrides("marti"), *COMMON, "runtime.colocate=false"])
    return (train(colocated, out / "colocated", on_runtime=_instrument(seen)),
            train(apart, out / "apart"), seen)


def _same_checkpoints(x, y) -> None:
    assert x.checkpoints.keys() == y.checkpoints.keys()
    for agent, path in x.checkpoints.items():
        a = load_file(str(path / "model.safetensors"))
        b = load_file(str(y.checkpoints[agent] / "model.safetensors"))
        assert a.keys() == b.keys()
        assert all((a[k] == b[k]).all() for k in a), agent


def assert_asleep_while_training(seen: dict) -> None:
    """What the replicas answered while each training call ran (`_instrument`): every engine
    asleep, no KV pool held; at least an accumulate and a step per agent and iteration."""
    assert len(seen["training"]) >= 2 * 3
    for replicas in seen["training"]:
        for engines in replicas:
            assert engines and all(e["asleep"] and e["kv_pool_bytes"] == 0
                                   for e in engines.values()), engines


def test_colocated_replicas_sleep_while_training_runs(runs):
    colocated, _, seen = runs
    # every worker process, replicas and training slot, pinned to the same core
    assert seen["affinity"] and all(a == {0} for a in seen["affinity"])
    # asked of the replica processes: while any training call runs, no engine holds a KV pool
    assert_asleep_while_training(seen)
    first, second = colocated.records
    assert first["pool/rollout/sleep_kv_bytes"] > 0 and first["pool/rollout/sleep_s"] > 0
    assert "pool/rollout/wake_s" not in first  # awake from the start
    assert second["pool/rollout/sleep_weight_bytes"] == 0  # a CPU: the weights stay in place
    trace = (colocated.out_dir / "trace.json").read_text()
    assert '"sleep:' in trace and '"wake:' in trace


def test_time_shared_pool_serves_one_agent_at_a_time(runs):
    """mas-rl-like: before each request, only its agent's engines are awake (asked of the
    replica); the switches are counted."""
    colocated, _, seen = runs
    assert len(seen["turns"]) == 2 * 4 * 2 * 3  # iterations x inputs x group x nodes
    for agent, replicas in seen["turns"]:
        for engines in replicas:
            awake = {a for a, e in engines.items() if not e["asleep"]}
            assert awake == {agent}, (agent, engines)
    # speaker, relay, listener in turn: the first iteration starts with all three awake
    assert [r["pool/rollout/switches"] for r in colocated.records] == [3, 3]
    assert all(r["pool/rollout/switch_s"] > 0 for r in colocated.records)


def test_colocated_sync_run_equals_the_run_on_separate_pools(runs):
    """Sleeping, waking and turns change when a request runs, never what it generates: the
    colocated, time-shared, turn-by-turn run ends with the same weights, bit for bit, as the
    run on separate pools."""
    colocated, apart, _ = runs
    _same_checkpoints(colocated, apart)
    for x, y in zip(colocated.records, apart.records, strict=True):
        assert x["task/success_rate"] == y["task/success_rate"]
        assert x["agent/relay/reward_mean"] == y["agent/relay/reward_mean"]
    assert "pool/rollout/sleep_s" not in apart.records[0]
    assert all(r["agent/relay/grad_norm"] > 0 for r in colocated.records)  # it trained


@pytest.mark.parametrize(("overrides", "message"), [
    (["runtime.colocate=true"],  # the example is async
     "runtime.colocate: colocated replicas sleep while training runs, so rollout cannot "
     "overlap training; it needs pipeline.mode=sync \\(got 'async'\\)"),
    (["pipeline.mode=one_step_off", "runtime.colocate=true"], "got 'one_step_off'"),
    (["pipeline.mode=sync", "runtime.colocate=true", "runtime.kind=ray",
      "runtime.slot_size=2"],
     r"runtime.colocate: on Ray a replica and a training slot of one device share a bundle; "
     r"a slot of 2 ranks is a placement group of its own \(runtime.slot_size / slot_sizes"),
    (["pipeline.mode=sync", "runtime.colocate=true", "runtime.kind=ray",
      "runtime.rollout_workers={min: 1, max: 2}"],
     r"runtime.colocate: the replicas an elastic pool grows \(runtime.rollout_workers "
     r"\{min, max\}\) would have no training slot"),
    (["pipeline.mode=sync", "runtime.colocate=true", "runtime.rollout_cpus=[0]",
      "runtime.train_cpus=[0,1]"],
     r"runtime.colocate: both pools compute on the same cpus, but runtime.rollout_cpus is "
     r"\[0\] and runtime.train_cpus is \[0, 1\]"),
    (["pipeline.train_agents=one_at_a_time"],
     "pipeline.train_agents: 'one_at_a_time' orders the synchronous pipeline's training"),
])
def test_colocated_settings_refused_with_the_field(overrides, message):
    if any("train_cpus=[0,1]" in o for o in overrides) and (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs")
    with pytest.raises(ConfigError, match=message):
        load_config(RELAY, overrides)


def test_one_at_a_time_trains_agent_after_agent_even_with_a_slot_each():
    """`pipeline.train_agents` (marti-2025-05, mas-rl-like) on the in-memory fake pools: with
    a trainer per agent, `together` trains the three at once, `one_at_a_time` never two; the
    steps are the same."""
    from tests.orchestrator.test_logic_fakes import config, final_weights, run

    _, _, together = run(config("pipeline.mode=sync"))
    _, _, alone = run(config("pipeline.mode=sync", "pipeline.train_agents=one_at_a_time"))
    assert together.max_active == 3 and alone.max_active == 1
    assert final_weights(together) == final_weights(alone)


def test_a_fixed_binding_keeps_every_agent_on_its_own_slot():
    """`runtime.train_binding: fixed` (flexmarl-static-alloc) on fake slots: three agents on
    two slots, each agent's every command on its own slot (dealt in turn), and the same steps
    as the on-demand binding."""
    from flexmarl.runtime.local.runtime import fixed_binding
    from flexmarl.testing.fakes import FakeSlotPool
    from tests.orchestrator.test_logic_fakes import config, run

    cfg = config(*system_overrides("flexmarl-static-alloc"), "runtime.deterministic=true",
                 "runtime.train_workers=2")
    assert cfg.runtime.train_binding == "fixed"
    agents = list(cfg.agents)
    binding = fixed_binding(agents, [1, 1], {})
    assert binding == {"speaker": 0, "relay": 1, "listener": 0}
    fixed = FakeSlotPool(2)
    fixed.fix_slots(binding)
    _, published, _ = run(cfg, train=fixed)
    for slot, host in enumerate(fixed.hosts):
        assert host.commands and {a for _, a in host.commands} == {
            a for a, s in binding.items() if s == slot}
    free = FakeSlotPool(2)
    _, on_demand, _ = run(config("runtime.deterministic=true", "runtime.train_workers=2"),
                          train=free)
    # on demand, agents go wherever a slot is free: every agent on both slots here
    assert all({a for _, a in host.commands} == set(agents) for host in free.hosts)
    # every version of every agent the same weights (digests), however the slots were bound
    assert sorted(published.published) == sorted(on_demand.published)
    assert len(published.published) == len(agents) * (cfg.train.iterations + 1)


def test_a_classic_marl_run_refuses_colocate_by_name():
    with pytest.raises(ConfigError, match="runtime.colocate: places, pins or publishes LLM"):
        load_config(RELAY.parent / "mpe_spread.yaml", ["runtime.colocate=true"])


def test_the_colocated_presets_are_what_the_simulator_models():
    cfgs = {s: load_config(RELAY, system_overrides(s))
            for s in ("marti", "marti-2025-05", "mas-rl-like", "sync-disaggregated")}
    got = {s: (c.pipeline.mode, c.rollout.schedule, c.rollout.balance, c.runtime.colocate,
               c.pipeline.train_agents) for s, c in cfgs.items()}
    assert got == {
        "marti": ("sync", "dependency", "static", True, "together"),
        "marti-2025-05": ("sync", "stage", "static", True, "one_at_a_time"),
        "mas-rl-like": ("sync", "stage", "shared", True, "one_at_a_time"),
        "sync-disaggregated": ("sync", "stage", "static", False, "together"),
    }
    # the cores both pools are pinned to: every CPU this process may use, unless named
    assert cfgs["marti"].runtime.colocated_cpus() == sorted(os.sched_getaffinity(0))


def test_colocated_placements_share_the_devices_and_the_cores():
    """On GPUs (a 2-GPU machine, as `plan_placements` is told) both pools see the same
    device ids, every visible one unless a list is given; every process is pinned to the
    same cores."""
    from flexmarl.policy.device import plan_placements, slot_placements

    cores = tuple(sorted(os.sched_getaffinity(0)))
    cfg = load_config(RELAY, [*system_overrides("marti"), "runtime.rollout_workers=2",
                              "runtime.train_workers=2"]).runtime
    rollout, train_ = plan_placements(cfg, 2, 2, gpu_count=2)
    slots = slot_placements(cfg, [1, 1], gpu_count=2)
    assert [p.visible for p in rollout] == [(0,), (1,)] == [p.visible for p in train_]
    assert [s[0].visible for s in slots] == [(0,), (1,)]
    assert {p.cpus for p in [*rollout, *train_, *(s[0] for s in slots)]} == {cores}
    one = load_config(RELAY, [*system_overrides("marti"), "runtime.train_devices=[1]",
                              "runtime.train_cpus=[0]"]).runtime
    rollout, _ = plan_placements(one, 1, 1, gpu_count=2)
    assert rollout[0].visible == (1,) and rollout[0].cpus == (0,)
    assert slot_placements(one, [1], gpu_count=2)[0][0].visible == (1,)
    # separate pools on two GPUs: split, rollout first, the training slot unpinned
    apart = load_config(RELAY, ["runtime.rollout_workers=1"]).runtime
    rollout, _ = plan_placements(apart, 1, 1, gpu_count=2)
    assert rollout[0].visible == (0,) and slot_placements(apart, [1], gpu_count=2)[0][0] \
        .visible == (1,)
    assert slot_placements(apart, [1], gpu_count=2)[0][0].cpus == ()


@pytest.mark.slow
def test_a_replica_restarted_while_the_pool_sleeps_sleeps_too(runs, tmp_path):
    """A replica killed (SIGKILL) while training runs is restarted asleep, wakes with the
    others, and the run ends as the uninterrupted one does."""
    _, apart, _ = runs
    seen: dict[str, list] = {"after": []}

    def hook(runtime) -> None:
        accumulate, step, workers = (runtime.train.accumulate, runtime.train.step,
                                     runtime.rollout_workers)

        async def step_later(agent):  # one hop later, as the accumulates: the order stays
            return await asyncio.ensure_future(step(agent))

        async def accumulate_killing(agent, batch):
            call = asyncio.ensure_future(accumulate(agent, batch))  # in order, see _instrument
            if not seen.get("killed"):
                seen["killed"] = [workers[0].process.pid]
                os.kill(workers[0].process.pid, signal.SIGKILL)
                while workers[0].process.pid == seen["killed"][0] or not workers[0].alive:
                    await asyncio.sleep(0.05)  # the supervisor's restart
                seen["after"].append(await workers[0].call("memory", None))
            return await call

        runtime.train.accumulate, runtime.train.step = accumulate_killing, step_later

    cfg = load_config(RELAY, [*system_overrides("marti"), *COMMON])
    result = train(cfg, tmp_path / "run", on_runtime=hook)
    assert seen["after"] and all(e["asleep"] and e["kv_pool_bytes"] == 0
                                 for e in seen["after"][0].values())
    assert result.faults["recoveries"] and result.records[1]["pool/rollout/wake_s"] > 0
    _same_checkpoints(result, apart)
