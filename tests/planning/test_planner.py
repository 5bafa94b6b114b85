"""The one planner (planning/planner.py) on a real runtime's demand (planning/demand.py's
`MeasuredDemand`): the training order along the critical path, the replica allotment from
measured node latencies, the training slots it was given. The simulator's demand is covered
by tests/sim/runtime and tests/sim (its figures are unchanged)."""

from __future__ import annotations

import pytest

from flexmarl.planning.demand import MeasuredDemand
from flexmarl.planning.planner import (
    Plan,
    Planner,
    Policy,
    Resources,
    bind_slots,
    critical_order,
    remaining_path,
)

FANOUT = [("route", "router", ()), ("b", "brief", ("route",)), ("d", "detailed", ("route",)),
          ("v", "verbose", ("route",))]
CHAIN = [("s", "speaker", ()), ("r", "relay", ("s",)), ("l", "listener", ("r",))]
FAN_AGENTS = ["router", "brief", "detailed", "verbose"]


def measured_plan(nodes, agents, trainable, n_replicas, latency, share=None, slots=None,
                  k=0, planner=None, **demand) -> Plan:
    """Plan iteration k+1 as the orchestrator does after iteration k's rollout."""
    slots = slots or max(1, len(trainable))
    d = MeasuredDemand("test", nodes, agents, trainable, latency, share, **demand)
    return (planner or Planner()).plan(d, Resources(n_replicas + slots, n_replicas, slots), k + 1)


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
    plan = measured_plan(FANOUT, FAN_AGENTS, ["router", "verbose", "brief"], 1,
                         {"route": [0.1, 0.1], "b": [0.05], "d": [0.1], "v": [0.2, 0.6]}, k=3)
    assert plan.iteration == 4
    assert plan.train_order == ["router", "verbose", "brief"]
    assert plan.replicas is None  # fewer replicas than agents: the pool's demand plan
    assert plan.replica_indices() is None
    assert abs(plan.critical_path_s - 0.5) < 1e-9
    out = plan.to_dict()
    assert out["train_order"] == ["router", "verbose", "brief"]
    assert out["critical_path_s"] == 0.5 and "replicas" not in out
    # one slot each, nothing time-shared: the runtime's own workers
    assert plan.train == {"router": 1, "verbose": 1, "brief": 1} and plan.shared_slots is None
    assert (plan.rollout_accelerators, plan.train_accelerators) == (1, 3)


def test_spare_replicas_go_along_the_critical_path_and_none_is_left_idle() -> None:
    lat = {"route": [0.1] * 8, "b": [0.05] * 8, "d": [0.1] * 8, "v": [0.3] * 7 + [1.2]}
    plan = measured_plan(FANOUT, FAN_AGENTS, FAN_AGENTS, 7, lat,
                         {a: 0.25 for a in FAN_AGENTS})  # measured on one shared replica
    assert plan.replicas is not None
    counts = dict(plan.replicas)
    assert sum(counts.values()) == 7 and min(counts.values()) >= 1
    assert counts["verbose"] == max(counts.values()) and counts["verbose"] >= 3
    indices = plan.replica_indices()
    assert indices is not None
    used = sorted(i for r in indices.values() for i in r)
    assert used == list(range(7))  # disjoint, every replica serves someone
    assert plan.to_dict()["replicas"] == indices
    assert plan.to_dict()["share"]["verbose"] == counts["verbose"]
    # no latency measured for an agent: nothing to plan from
    assert measured_plan(FANOUT, FAN_AGENTS, FAN_AGENTS, 7,
                         {"route": [0.1], "b": [0.1], "d": [0.1]}).replicas is None


def test_static_balance_leaves_the_equal_split_to_the_pool() -> None:
    lat = {"route": [0.1] * 8, "b": [0.05] * 8, "d": [0.1] * 8, "v": [0.3] * 7 + [1.2]}
    plan = measured_plan(FANOUT, FAN_AGENTS, FAN_AGENTS, 7, lat,
                         planner=Planner(policy=Policy(balance="static")))
    assert plan.replicas is None
    assert plan.train_order[:2] == ["router", "verbose"]  # the order is planned either way


def test_fewer_slots_than_agents_are_time_shared_and_priced_with_their_swaps() -> None:
    """The slots the runtime was given: all agents time-share them; the prediction counts
    the pool's measured work and swaps over the slots."""
    lat = {"s": [0.1] * 4, "r": [0.1] * 4, "l": [0.1] * 4}
    agents = ["speaker", "relay", "listener"]
    train_s = {"speaker": 0.3, "relay": 0.3, "listener": 0.3}
    calls = dict.fromkeys(agents, 4.0)
    one = measured_plan(CHAIN, agents, agents, 4, lat, slots=1, train_s=train_s, calls=calls,
                        swap_s=dict.fromkeys(agents, 0.05), planner=Planner("sync"))
    assert one.shared_slots == (("speaker", "relay", "listener"), 1, 1)
    three = measured_plan(CHAIN, agents, agents, 4, lat, slots=3, train_s=train_s,
                          calls=calls, planner=Planner("sync"))
    assert three.shared_slots is None
    assert one.predicted_s is not None and three.predicted_s is not None
    # sync: the rollout path plus the slowest agent's training; one slot serves 0.9 s of
    # work plus 3 x 4 calls x 2/3 misses x 2 swaps x 0.05 s
    assert three.predicted_s == pytest.approx(one.predicted_s - 0.9 - 0.8 + 0.3)


def test_a_plan_naming_other_agents_or_replicas_is_refused_by_the_balancer() -> None:
    from flexmarl.rollout.balancer import Balancer

    bal = Balancer(["a", "b"], 3)
    bal.follow(1, {"a": [0, 1], "b": [2]})
    assert bal.plan.replicas == {"a": [0, 1], "b": [2]} and bal.plan.iteration == 1
    bal.follow(2, None)  # nothing allotted: the plan stays
    assert bal.plan.iteration == 1
    with pytest.raises(ValueError, match="3 replicas for agents"):
        bal.follow(2, {"a": [0], "b": [3]})
    with pytest.raises(ValueError, match="allots replicas"):
        bal.follow(2, {"a": [0, 1, 2]})


def test_an_agent_behind_an_endpoint_gets_no_replicas_but_counts_on_the_path() -> None:
    """A judge served by an OpenAI-compatible endpoint: the replicas go to the served agents
    only; its measured time still makes the upstream agent the critical one."""
    nodes = [("s", "solver", ()), ("j", "judge", ("s",)), ("h", "helper", ())]
    lat = {"s": [0.2] * 4, "j": [1.0] * 4, "h": [0.3] * 4}
    plan = measured_plan(nodes, ["solver", "helper"], ["solver", "helper"], 3, lat)
    assert plan.replicas is not None and set(plan.replicas) == {"solver", "helper"}
    assert sum(plan.replicas.values()) == 3
    assert plan.train_order == ["solver", "helper"]  # 0.2 + 1.0 ahead of the helper's 0.3
    assert plan.critical_path_s == pytest.approx(1.2)


def test_slots_of_different_sizes_bind_the_heaviest_agent_to_the_largest() -> None:
    """`runtime.slot_sizes`: the heaviest agent on the largest slot, the others where the load
    per device stays smallest; the plan records the sizes and the binding."""
    assert bind_slots({"a": 1.0, "b": 8.0, "c": 2.0}, [1, 4, 2]) == {"b": 1, "c": 2, "a": 0}
    # per device: a, b -> 6/2 on slot 0 (a tie with 3/1 goes to the larger), c -> 3/1 on slot
    # 1, d -> 7/2 on slot 0 rather than 4/1
    assert bind_slots({"a": 3.0, "b": 3.0, "c": 3.0, "d": 1.0}, [2, 1]) == {
        "a": 0, "b": 0, "c": 1, "d": 0}
    lat = {"s": [0.1] * 4, "r": [0.4] * 4, "l": [0.1] * 4}
    agents = ["speaker", "relay", "listener"]
    d = MeasuredDemand("test", CHAIN, agents, agents, lat, None,
                       train_s={"speaker": 0.2, "relay": 0.9, "listener": 0.3},
                       calls=dict.fromkeys(agents, 4.0))
    plan = Planner().plan(d, Resources(4 + 2, 4, 2, (2, 1)), 1)
    assert plan.slot_of == {"relay": 0, "listener": 1, "speaker": 1}
    assert plan.train == {"relay": 2, "listener": 1, "speaker": 1}
    assert plan.to_dict()["slot_sizes"] == [2, 1]
