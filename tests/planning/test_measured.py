"""The planner's measured-demand entry point (planning/measured.py): the training order along
the critical path and the replica allotment from measured node latencies."""

from __future__ import annotations

from flexmarl.planning.measured import MeasuredPlanner, critical_order, remaining_path

FANOUT = [("route", "router", ()), ("b", "brief", ("route",)), ("d", "detailed", ("route",)),
          ("v", "verbose", ("route",))]
CHAIN = [("s", "speaker", ()), ("r", "relay", ("s",)), ("l", "listener", ("r",))]


def test_remaining_path_is_own_time_plus_longest_chain_downstream() -> None:
    level = remaining_path(FANOUT, {"route": 0.1, "b": 0.05, "d": 0.1, "v": 0.4})
    assert level == {"v": 0.4, "d": 0.1, "b": 0.05, "route": 0.1 + 0.4}


def test_long_tailed_expert_trains_before_the_short_ones_of_a_fan_out() -> None:
    """Graph order would train verbose last, and its next rollout, the longest, would start
    last; the critical path puts it right after the router everything waits on."""
    order = critical_order(FANOUT, {"route": 0.1, "b": 0.05, "d": 0.1, "v": 0.4},
                           ["brief", "detailed", "verbose", "router"])
    assert order == ["router", "verbose", "detailed", "brief"]
    # nothing measured (or ties): graph order
    assert critical_order(FANOUT, {}, ["verbose", "brief", "router"]) == [
        "router", "brief", "verbose"]


def test_a_chain_trains_upstream_first_and_leaves_out_frozen_agents() -> None:
    times = {"s": 0.01, "r": 0.5, "l": 0.02}
    assert critical_order(CHAIN, times, ["listener", "relay", "speaker"]) == [
        "speaker", "relay", "listener"]
    assert critical_order(CHAIN, times, ["listener", "speaker"]) == ["speaker", "listener"]


def test_plan_records_the_order_and_keeps_shared_replicas_to_the_pool() -> None:
    planner = MeasuredPlanner(FANOUT, ["router", "brief", "detailed", "verbose"],
                              ["router", "verbose", "brief"], n_replicas=1)
    plan = planner.plan(3, {"route": [0.1, 0.1], "b": [0.05], "d": [0.1], "v": [0.2, 0.6]})
    assert plan.iteration == 4
    assert plan.train_order == ["router", "verbose", "brief"]
    assert plan.replicas is None  # fewer replicas than agents: the pool's demand plan
    assert abs(plan.critical_path_s - 0.5) < 1e-9
    assert plan.to_dict() == {"train_order": ["router", "verbose", "brief"],
                              "critical_path_s": 0.5}


def test_spare_replicas_go_along_the_critical_path_and_none_is_left_idle() -> None:
    agents = ["router", "brief", "detailed", "verbose"]
    planner = MeasuredPlanner(FANOUT, agents, agents, n_replicas=7)
    lat = {"route": [0.1] * 8, "b": [0.05] * 8, "d": [0.1] * 8, "v": [0.3] * 7 + [1.2]}
    plan = planner.plan(0, lat, {a: 0.25 for a in agents})  # measured on one shared replica
    assert plan.replicas is not None
    counts = {a: len(r) for a, r in plan.replicas.items()}
    assert sum(counts.values()) == 7 and min(counts.values()) >= 1
    assert counts["verbose"] == max(counts.values()) and counts["verbose"] >= 3
    used = sorted(i for r in plan.replicas.values() for i in r)
    assert used == list(range(7))  # disjoint, every replica serves someone
    assert plan.to_dict()["share"]["verbose"] == counts["verbose"]
    # no latency measured for an agent: nothing to plan from
    assert planner.plan(0, {"route": [0.1], "b": [0.1], "d": [0.1]}).replicas is None
