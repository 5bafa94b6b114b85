"""The production orchestrator on the simulated runtime: virtual time, baselines, reports."""

import time
from pathlib import Path

import pytest

from flexmarl.sim.simulate import SYSTEMS, simulate, simulate_system
from flexmarl.sim.workload import load_workload

WORKLOAD = Path(__file__).resolve().parents[3] / "examples" / "sim" / "solver_verifier.yaml"


@pytest.fixture(scope="module")
def wl():
    return load_workload(WORKLOAD)


def test_simulated_hours_take_seconds_and_are_deterministic(wl):
    started = time.perf_counter()
    a = simulate_system(wl, "flexmarl", iterations=2)
    real = time.perf_counter() - started
    b = simulate_system(wl, "flexmarl", iterations=2)
    assert a.makespan_s == b.makespan_s and a.utilisation == b.utilisation
    assert a.makespan_s > 10 * real  # virtual time runs far ahead of the wall clock
    assert [r["iteration"] for r in a.records] == [0, 1]
    assert 0 < a.utilisation <= 1 and 0 < a.efficiency <= 1.0 + 1e-9
    # every agent stepped once per iteration, through the real orchestrator's version gates
    for agent in a.runtime.trainable:
        assert a.records[-1][f"agent/{agent}/policy_version"] == 2


def test_baselines_are_the_same_simulator_with_features_switched(wl):
    flex = simulate_system(wl, "flexmarl", iterations=2)
    sync = simulate_system(wl, "flexmarl-sync", iterations=2)
    marti = simulate_system(wl, "marti-2025-05", iterations=2)
    # the async pipeline never loses to the same system run synchronously
    assert flex.makespan_s <= sync.makespan_s * 1.001
    # the colocated baseline pays engine sleep/wake and trains agents one after another
    kinds = {s.kind for s in marti.runtime.spans}
    assert "sleep" in kinds
    assert set(SYSTEMS) >= {"marti-2025-05", "sync-disaggregated", "flexmarl"}
    with pytest.raises(ValueError, match="unknown system 'nope'"):
        simulate_system(wl, "nope")


def test_report_writes_trace_and_gantt(tmp_path, capsys):
    simulate(WORKLOAD, ["marti-2025-05"], iterations=1, out=tmp_path)
    out = capsys.readouterr().out
    assert "speedup" in out and "marti-2025-05" in out and "efficiency" in out
    assert (tmp_path / "trace.json").stat().st_size > 0
    assert (tmp_path / "gantt.png").read_bytes()[:4] == b"\x89PNG"


def _request_times_by_level(result):
    """{(iteration, graph level): [(submitted, done), ...]} from the simulated requests."""
    from flexmarl.store.experience import parse_sample_id

    orch = result.orchestrator
    node_of = {turn: name for name, turn in orch.episodes.turns.items()}
    out: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for sid, times in result.runtime.requests.items():
        input_id, turn, _ = parse_sample_id(sid)
        k = int(input_id.split("-")[0])
        out.setdefault((k, orch.episodes.level[node_of[turn]]), []).append(times)
    return out


def test_stage_schedule_holds_each_level_until_the_previous_level_is_done_everywhere():
    wl = load_workload(WORKLOAD.parent / "planner_coder_reviewer.yaml")
    stage = _request_times_by_level(simulate_system(wl, "flexmarl-stage", iterations=1))
    levels = sorted(level for _, level in stage)
    assert len(levels) >= 3
    for level in levels[1:]:
        first_submit = min(t0 for t0, _ in stage[(0, level)])
        last_done_below = max(t1 for t1, _ in stage[(0, level - 1)])
        assert first_submit >= last_done_below
    # dependency-parallel: a fast episode's next node runs while slow ones are still at the
    # previous level
    dep = _request_times_by_level(simulate_system(wl, "flexmarl", iterations=1))
    assert any(min(t0 for t0, _ in dep[(0, level)]) < max(t1 for t1, _ in dep[(0, level - 1)])
               for level in levels[1:])


def _overlap(a, b) -> bool:
    return a.start < b.end - 1e-9 and b.start < a.end - 1e-9


def test_marti_2025_05_gives_each_agent_its_own_devices_and_trains_one_agent_at_a_time(wl):
    marti = simulate_system(wl, "marti-2025-05", iterations=2)
    rt = marti.runtime
    assert sum(rt.groups.values()) <= rt.total
    for agent, group in rt.groups.items():
        assert rt.active[agent] * wl.agent(agent).tp == group
    train = [s for s in rt.spans if s.pool == "train"]
    roll = [s for s in rt.spans if s.pool == "rollout"]
    assert train and roll
    for t in train:
        # its own engines sleep while an agent trains on their devices ...
        assert not any(r.agent == t.agent and _overlap(r, t) for r in roll)
        # ... and agents train one after another
        assert not any(o.agent != t.agent and _overlap(o, t) for o in train)


def test_marti_trains_every_agent_at_once_and_broadcasts_in_turn(wl):
    marti = simulate_system(wl, "marti", iterations=2)
    rt = marti.runtime
    train = [s for s in rt.spans if s.pool == "train"]
    roll = [s for s in rt.spans if s.pool == "rollout"]
    # every agent's fit starts at once: different agents' training overlaps ...
    assert any(o.agent != t.agent and _overlap(o, t) for t in train for o in train)
    # ... each on its own share, where its engines sleep while it trains
    for t in train:
        assert not any(r.agent == t.agent and _overlap(r, t) for r in roll)
    publish = [s for s in rt.spans if s.pool == "publish" and s.end > s.start]
    assert len(publish) >= 2
    assert not any(_overlap(a, b) for a in publish for b in publish if a is not b)


def test_mas_rl_like_time_shares_the_whole_cluster_between_agents(wl):
    mas = simulate_system(wl, "mas-rl-like", iterations=2)
    rt = mas.runtime
    for agent in rt.active:
        assert rt.active[agent] * wl.agent(agent).tp == rt.total  # every agent: all of it
    train = [s for s in rt.spans if s.pool == "train"]
    roll = [s for s in rt.spans if s.pool == "rollout"]
    assert train and roll and all(t.accelerators == rt.total for t in train)
    busy = train + roll
    # one agent at a time holds the cluster: no two agents' work overlaps, nor rollout and
    # training
    assert not any(a.agent != b.agent and _overlap(a, b) for a in busy for b in busy)
    assert not any(_overlap(r, t) for r in roll for t in train)
    assert any(s.kind == "switch" and s.end > s.start for s in rt.spans)
    # On a strict chain (solver -> verifier -> ...) only one agent works at a time, so the
    # whole cluster in turn can beat fixed per-agent shares; where agents work in parallel
    # (a debate), time-sharing serialises them and is slower than MARTI's shares.
    debate = load_workload(WORKLOAD.parent / "math_debate.yaml")
    assert simulate_system(debate, "mas-rl-like", iterations=2).makespan_s > \
        simulate_system(debate, "marti", iterations=2).makespan_s


def test_hierarchical_balancing_plans_the_critical_path_and_beats_the_equal_split():
    """planner (72B) -> coder (7B, Pareto tail) <-> reviewer (1.5B): the equal split gives the
    72B planner as many replicas as the 1.5B reviewer; the critical-path plan gives the coder,
    whose tail is on every episode's path, the most, and finishes iterations sooner."""
    wl = load_workload(WORKLOAD.parent / "planner_coder_reviewer.yaml")
    flex = simulate_system(wl, "flexmarl", iterations=2)
    static = simulate_system(wl, "flexmarl-static-balance", iterations=2)
    plan = flex.runtime.plans[-1]["replicas"]
    assert plan["coder"] > plan["reviewer"] and plan["coder"] > plan["planner"]
    assert flex.makespan_s < static.makespan_s
    # the split leaves every trainer at least its memory minimum, and uses the whole cluster
    rt = flex.runtime
    for agent, n in rt.plans[-1]["train"].items():
        assert n >= rt.cost.min_train_accelerators(wl.agent(agent).model)
    assert rt.roll_acc + rt.train_acc == rt.total
    assert sum(plan[a] * wl.agent(a).tp for a in plan) <= rt.roll_acc


def test_lower_bound_runs_each_agents_chain_to_the_end_of_the_episode(wl):
    """solver -> verifier -> solver -> verifier: the solver's rows are rewarded when the
    verifier's last node is done, so one iteration lasts at least an episode's whole solo
    path plus the solver's step and publication, whatever the system."""
    from collections import defaultdict

    from flexmarl.sim.simulate import _cycle, lower_bound
    from flexmarl.store.experience import parse_sample_id

    res = simulate_system(wl, "flexmarl", iterations=1)
    rt, orch = res.runtime, res.orchestrator
    node_of = {turn: name for name, turn in orch.episodes.turns.items()}
    episodes = defaultdict(dict)
    for sid, lat in rt.solo_latency.items():
        input_id, turn, traj = parse_sample_id(sid)
        episodes[(input_id, traj)][node_of[turn]] = lat
    assert {len(e) for e in episodes.values()} == {4}  # a chain of four nodes
    longest = max(sum(e.values()) for e in episodes.values())
    solver = wl.agent("solver")
    step = (rt.cost.optimizer_step_time(solver.model, rt.total)
            + rt.cost.weight_transfer_time(solver.model, inter_node=True, links=solver.tp))
    assert _cycle(rt, orch, list(episodes.values())) == pytest.approx(longest + step)
    assert lower_bound(rt, orch, 1) <= res.per_iteration_s


def test_simulated_replicas_admit_waiting_requests_in_priority_order(wl):
    """As the production replica does: with a full batch, the waiting request of the earliest
    (iteration, input, trajectory) goes in next, whatever the order they arrived in."""
    import asyncio
    import dataclasses

    from flexmarl.sim.runtime.clock import run_virtual
    from flexmarl.sim.runtime.runtime import SimFeatures, SimRuntime
    from flexmarl.types import GenerationRequest

    async def main():
        rt = SimRuntime(wl, SimFeatures(balance="static"),
                        cost=dataclasses.replace(wl.cost_model(), max_num_seqs=1))
        await rt.start()
        rt._resize_replicas({"solver": 1, "verifier": 1})
        done = []

        async def ask(i, priority):
            request = GenerationRequest(f"0-{i}/0/0", "solver", 0, [1] * 16, 64)
            await rt.rollout.generate(request, priority)
            done.append(i)

        # request 0 takes the only batch slot; 1..3 wait and go in by priority, not arrival
        await asyncio.gather(ask(0, (0, 0, 0)), ask(1, (0, 9, 0)), ask(2, (0, 5, 0)),
                             ask(3, (0, 7, 1)))
        await rt.stop()
        return done

    assert run_virtual(main()) == [0, 2, 3, 1]


def test_small_trainers_time_share_slots_through_the_production_allocator():
    """star_hub's eight 0.5B leaves are light trainers: the planner gives them fewer slots
    than agents, and the production `SlotAllocator` binds them, swapping states in and out."""
    from flexmarl.training.allocator import SlotAllocator

    res = simulate_system(load_workload(WORKLOAD.parent / "star_hub.yaml"), "flexmarl",
                          iterations=2)
    rt = res.runtime
    shared = rt.plans[-1]["shared_slots"]
    pool = rt.slot_pool
    members, g, alloc = pool.members, pool.accelerators, pool.allocator
    assert isinstance(alloc, SlotAllocator) and list(members) == shared["agents"]
    assert 1 <= shared["slots"] < len(members) and g == shared["accelerators_per_slot"]
    assert all(rt.plans[-1]["train"][a] == g for a in members)
    lanes = {s.lane for s in rt.spans if s.lane.startswith(f"train/shared{g}/")}
    assert len(lanes) <= max(p.get("shared_slots", {}).get("slots", 0) for p in rt.plans)
    for lane in lanes:  # one agent's work (or swap) at a time on a slot
        spans = sorted((s for s in rt.spans if s.lane == lane), key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(spans, spans[1:], strict=False))
    for agent in members:  # and an agent's state on one slot at a time
        spans = sorted((s for s in rt.spans if s.agent == agent and s.pool == "train"),
                       key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(spans, spans[1:], strict=False))
        assert res.records[-1][f"agent/{agent}/policy_version"] == 2
    outs = [s for s in rt.spans if s.kind == "swap_out"]
    ins = [s for s in rt.spans if s.kind == "swap_in"]
    assert alloc.swaps > 0 and len(outs) >= alloc.swaps and 0 < len(ins) <= len(outs)
    # swaps cost time but no accelerator-seconds of useful work
    assert all(s.accelerators == 0 and s.end > s.start for s in outs + ins)


def test_planner_prices_fewer_slots_by_the_pools_work_and_its_swaps():
    rt = simulate_system(load_workload(WORKLOAD.parent / "star_hub.yaml"), "flexmarl",
                         iterations=1).runtime
    from flexmarl.sim.demand import CostModelDemand

    planner = rt.planner
    demand = CostModelDemand(rt.wl, rt.cost, False, {}, {}, {}, dict)  # from the workload
    train_d = demand.train_seconds()
    mins = {a: rt.cost.min_train_accelerators(rt.wl.agent(a).model) for a in rt.trainable}
    members, g = planner.pool_candidates(train_d, mins)
    assert len(members) >= 2 and "hub" not in members
    calls = demand.train_calls()
    budget = rt.total - 40
    times = []
    for slots in range(len(members), 0, -1):
        alloc, train_s = planner.pooled_split(train_d, budget, mins, members, g, slots, calls)
        assert sum(alloc.values()) == budget - slots * g + len(members) * g
        times.append(train_s[members[0]])
    # all slots: no swaps, and no slower than the agent's own work on g accelerators
    first = members[0]
    assert times[0] == pytest.approx(max(train_d[first] / g,
                                         sum(train_d[a] for a in members) / g / len(members)))
    assert times == sorted(times)  # fewer slots: longer


def test_fixed_replicas_pin_the_rollout_and_give_training_the_rest(wl):
    """The oracle sweep's fixed splits: pinned agents keep their replicas in every plan,
    training gets every other accelerator, and an unknown agent or an impossible split is
    refused by name."""
    import dataclasses

    from flexmarl.sim.runtime.runtime import SimRuntime

    base = SYSTEMS["flexmarl"][2]
    planned = SimRuntime(wl, base).plans[0]
    agent = next(iter(planned["replicas"]))
    pin = planned["replicas"][agent] + 1
    res = simulate_system(wl, "flexmarl", 2,
                          features=dataclasses.replace(base, fixed_replicas={agent: pin}))
    plans = res.runtime.plans
    assert len(plans) >= 2
    for plan in plans:
        assert plan["replicas"][agent] == pin
        assert plan["train_accelerators"] == wl.cluster.total_accelerators - \
            plan["rollout_accelerators"]
        assert sum(plan["train"].values()) == plan["train_accelerators"]
        assert "shared_slots" not in plan
    with pytest.raises(ValueError, match="no agent 'nobody'"):
        SimRuntime(wl, dataclasses.replace(base, fixed_replicas={"nobody": 1}))
    with pytest.raises(ValueError, match="leave .* for training"):
        SimRuntime(wl, dataclasses.replace(base, fixed_replicas={agent: 10_000}))
    with pytest.raises(ValueError, match="fixed_replicas: needs balance 'hierarchical'"):
        dataclasses.replace(SYSTEMS["flexmarl-static-balance"][2], fixed_replicas={agent: 1})


def test_conditional_edges_skip_nodes_at_their_probability_and_every_system_sees_the_same():
    from flexmarl.sim.workload import parse_workload

    wl = parse_workload({
        "name": "cond", "seed": 3, "iterations": 1,
        "cluster": {"nodes": 1, "accelerators_per_node": 8, "accelerator": "H800"},
        "agents": [{"name": n, "model": "0.5B", "prompt_length": 64,
                    "output_length": {"kind": "uniform", "mean": 32, "spread": 0.5}}
                   for n in ("router", "often", "rarely", "merge")],
        "graph": {"edges": [{"src": "router", "dst": "often", "probability": 0.7},
                            {"src": "router", "dst": "rarely", "probability": 0.2},
                            {"src": "often", "dst": "merge"},
                            {"src": "rarely", "dst": "merge"}]},
        "rollout": {"prompts_per_iteration": 50, "group_size": 8},
    })
    runs = {}
    for system in ("flexmarl", "marti"):
        res = simulate_system(wl, system, iterations=1)
        node_of = {turn: name for name, turn in res.orchestrator.episodes.turns.items()}
        nodes = res.orchestrator.episodes.graph.nodes
        agent_of = {name: node.agent for name, node in nodes.items()}
        calls: dict[str, set] = {}
        for sid in res.runtime.requests:
            from flexmarl.store.experience import parse_sample_id

            input_id, turn, traj = parse_sample_id(sid)
            calls.setdefault(agent_of[node_of[turn]], set()).add((input_id, traj))
        runs[system] = calls
    n = 400
    calls = runs["flexmarl"]
    assert len(calls["router"]) == n
    # binomial(400, p): 4 standard deviations either side
    for agent, p in (("often", 0.7), ("rarely", 0.2), ("merge", 1 - 0.3 * 0.8)):
        sd = (n * p * (1 - p)) ** 0.5
        assert abs(len(calls[agent]) - n * p) < 4 * sd, (agent, len(calls[agent]))
    # merge reads whichever specialists ran, and runs only when one did
    assert calls["merge"] == calls["often"] | calls["rarely"]
    assert runs["marti"] == calls  # keyed draws: the same episodes in every system


def test_planner_never_predicts_worse_than_the_equal_split_and_does_not_stall_on_near_ties():
    """issue 21: paper_ma at 256 episodes per iteration. From measured lengths the three
    solvers nearly tie; the greedy search once left them one replica each (and lost to the
    equal split by 1.28x). Every equal split is a candidate now, predicted the same way, and
    the search moves every agent at once when no smaller group helps."""
    base = load_workload(WORKLOAD.parent / "paper_ma.yaml")
    data = base.model_dump(mode="json")
    wl = type(base).model_validate(
        {**data, "rollout": {**data["rollout"], "prompts_per_iteration": 16}})
    flex = simulate_system(wl, "flexmarl", iterations=3)
    static = simulate_system(wl, "flexmarl-static-balance", iterations=3)
    for plan in flex.runtime.plans:
        assert min(plan["replicas"][s] for s in ("solver_a", "solver_b", "solver_c")) > 5, plan
    # by its own prediction the chosen plan is the best candidate, equal splits included
    planner = flex.runtime.planner
    chosen = min(c for c, _ in planner.predicted)
    equal = [c for c, reps in planner.predicted if len(set(reps.values())) == 1]
    assert equal and chosen <= min(equal)
    assert planner.previous == flex.runtime.plans[-1]["replicas"]
    # and simulated: no worse than the equal split beyond the prediction's error
    assert flex.per_iteration_s <= 1.03 * static.per_iteration_s


def test_static_conditions_decided_at_the_episode_start_change_nothing(monkeypatch):
    """The simulator's conditional variants are `static_when` nodes: skipped ones get no task.
    The same run with every condition evaluated after its inputs (as for any other `when`)
    gives the very same requests at the very same times."""
    from flexmarl.sim import simulate as sim_module
    from flexmarl.sim.task import workload_task

    wl = load_workload(WORKLOAD.parent / "customer_service.yaml")
    data = wl.model_dump(mode="json")
    wl = type(wl).model_validate({**data, "cluster": {**data["cluster"], "nodes": 8},
                                  "rollout": {"prompts_per_iteration": 12, "group_size": 4}})
    fast = simulate_system(wl, "flexmarl", iterations=2)
    assert fast.orchestrator.episodes.executor._static  # the variants are static

    def dynamic(w):
        task = workload_task(w)
        for node in task.graph.nodes.values():
            node.static_when = False
        return task

    monkeypatch.setattr(sim_module, "workload_task", dynamic)
    slow = simulate_system(wl, "flexmarl", iterations=2)
    assert not slow.orchestrator.episodes.executor._static
    assert fast.runtime.requests == slow.runtime.requests
    assert fast.makespan_s == slow.makespan_s
    for system in ("flexmarl-stage", "sync-disaggregated"):  # the stage barrier counts skips too
        monkeypatch.setattr(sim_module, "workload_task", workload_task)
        a = simulate_system(wl, system, iterations=1)
        monkeypatch.setattr(sim_module, "workload_task", dynamic)
        b = simulate_system(wl, system, iterations=1)
        assert a.runtime.requests == b.runtime.requests and a.makespan_s == b.makespan_s
