"""Hierarchical load balancing: allotment follows demand, dispatch follows outstanding tokens."""

import pytest

from flexmarl.rollout.balancer import (
    Balancer,
    allot_replicas,
    equal_split,
    latency_allotments,
    share_replicas,
)
from flexmarl.store.experience import GenerationStats


def test_allotment_follows_demand():
    got = allot_replicas({"a": 6.0, "b": 3.0, "c": 1.0}, 10)
    assert got == {"a": 6, "b": 3, "c": 1}
    # tensor-parallel replicas take several accelerators each
    got = allot_replicas({"big": 9.0, "small": 1.0}, 10, units={"big": 4, "small": 1})
    assert got == {"big": 2, "small": 2}
    assert allot_replicas({"a": 6.0, "b": 3.0, "c": 1.0}, 9, "static") == {"a": 3, "b": 3, "c": 3}


def test_shares_when_one_agent_dominates():
    plan = share_replicas({"long": 80.0, "s1": 7.0, "s2": 7.0, "s3": 6.0}, 4)
    assert plan["long"] == [0, 1, 2, 3]  # 3.2 replicas' worth: three of its own plus a share
    assert plan["s1"] == plan["s2"] == plan["s3"] == [3]
    # fewer replicas than agents: everyone gets one, heaviest placed first
    plan = share_replicas({"a": 5.0, "b": 3.0, "c": 1.0, "d": 1.0}, 2)
    assert all(len(r) == 1 for r in plan.values())
    assert plan["a"] != plan["b"]
    assert equal_split(["a", "b", "c"], 7) == {"a": [0, 1, 2], "b": [3, 4], "c": [5, 6]}


def test_intra_agent_dispatch_picks_least_outstanding_tokens():
    bal = Balancer(["a", "b"], 4)
    # before measurements: equal split, a on replicas 0-1
    assert bal.plan.replicas == {"a": [0, 1], "b": [2, 3]}
    assert bal.pick("a", [500, 20, 0, 0]) == 1
    assert bal.pick("a", [10, 20, 0, 0]) == 0
    # outstanding work is counted in tokens: prompt + expected output
    assert bal.expected_cost("a", 10, 50) == 60
    bal.observe("a", 4)
    bal.observe("a", 6)
    assert bal.expected_cost("a", 10, 50) == 15


def test_static_deals_round_robin_whatever_the_load():
    bal = Balancer(["a", "b"], 4, mode="static")
    picks = [bal.pick("a", [1000, 0, 0, 0]) for _ in range(4)]
    assert picks == [0, 1, 0, 1]


def test_replanning_reacts_to_a_demand_shift():
    bal = Balancer(["a", "b", "c", "d"], 4, cost_per_token={"a": 1, "b": 1, "c": 1, "d": 2})
    stats = {"a": GenerationStats(32, 320, 3200), "b": GenerationStats(32, 320, 200),
             "c": GenerationStats(32, 320, 200), "d": GenerationStats(32, 320, 100)}
    demand = bal.demand_from(stats)
    assert demand["a"] == 3200 + 32.0
    assert demand["d"] == 2 * (100 + 32.0)
    plan = bal.replan(1, demand)
    assert len(plan.replicas["a"]) >= 3
    assert plan.share()["a"] > 2.5
    # demand moves to d: the next plan follows it
    stats["a"], stats["d"] = GenerationStats(32, 320, 100), GenerationStats(32, 320, 3200)
    plan = bal.replan(2, bal.demand_from(stats))
    assert len(plan.replicas["d"]) >= 3 and len(plan.replicas["a"]) == 1
    assert [p.iteration for p in bal.plans] == [0, 1, 2]
    # static never moves
    static = Balancer(["a", "b", "c", "d"], 4, mode="static")
    assert static.replan(1, demand).replicas == {"a": [0], "b": [1], "c": [2], "d": [3]}


# --- critical-path allotment --------------------------------------------------------------------
def _throughput_bound(work):
    """phase_time for agents whose phase takes work / replicas (mean and last alike)."""
    return lambda agent, r: (work[agent] / r, work[agent] / r)


def test_latency_allotment_follows_the_critical_path_hand_computed():
    # chain a -> b, a's phase 1/r s, b's 4/r s, 6 replicas: 1/ra + 4/rb is smallest at (2, 4)
    nodes = [("a@1", "a", ()), ("b@1", "b", ("a@1",))]
    steps = latency_allotments(nodes, _throughput_bound({"a": 1.0, "b": 4.0}), 6)
    assert steps[0].replicas == {"a": 1, "b": 1} and steps[0].critical_path_s == 5.0
    assert steps[-1].replicas == {"a": 2, "b": 4} and steps[-1].accelerators == 6
    assert steps[-1].critical_path_s == pytest.approx(1 / 2 + 4 / 4)
    assert [s.accelerators for s in steps] == list(range(2, 7))  # one replica per step
    paths = [s.critical_path_s for s in steps]
    assert paths == sorted(paths, reverse=True)
    assert steps[-1].first_start_s == {"a": 0.0, "b": 0.5}


def test_latency_allotment_grows_parallel_branches_together_and_counts_units():
    # a hub feeding two equal leaves: adding to one leaf alone does not shorten the path, yet
    # both leaves must grow; the hub's replica takes 4 accelerators
    nodes = [("h", "hub", ()), ("l1", "leaf1", ("h",)), ("l2", "leaf2", ("h",))]
    steps = latency_allotments(nodes, _throughput_bound({"hub": 0.01, "leaf1": 2.0,
                                                        "leaf2": 2.0}), 4 + 6,
                               units={"hub": 4, "leaf1": 1, "leaf2": 1})
    assert steps[-1].replicas == {"hub": 1, "leaf1": 3, "leaf2": 3}
    assert steps[-1].accelerators == 10


def test_latency_allotment_stops_when_no_replica_helps_and_one_tail_counts_once():
    # b's slowest request takes 10 s however many replicas it has, its mean phase stops
    # shrinking at 4 replicas (latency-bound), and a's phase does not shrink at all
    def phase(agent, r):
        return (1.0, 1.0) if agent == "a" else (max(0.5, 2.0 / r), 10.0)

    nodes = [("a@1", "a", ()), ("b@1", "b", ("a@1",)), ("b@2", "b", ("b@1",))]
    steps = latency_allotments(nodes, phase, 100)
    # the rest of the capacity is left for training
    last = steps[-1]
    assert last.replicas == {"a": 1, "b": 4} and last.accelerators == 5
    rb = last.replicas["b"]
    # a typical episode: a, then b twice; one tail (b's slowest request) on top, not two
    assert last.typical_path_s == pytest.approx(1.0 + 2 * 2.0 / rb)
    assert last.critical_path_s == pytest.approx(last.typical_path_s + 10.0 - 2.0 / rb)
    with pytest.raises(ValueError, match="cannot hold one replica of every agent"):
        latency_allotments(nodes, phase, 1)


def test_latency_allotment_does_not_stall_on_two_tied_parallel_branches():
    # issue 21's stall: a router feeds two tied specialists, then a summariser. Each
    # specialist's slowest request barely shrinks with replicas while its mean does, so the
    # tail term grows as the mean falls: a replica for either specialist alone leaves the
    # longer branch as long and lengthens the path; only both together shorten it.
    def phase(agent, r):
        if agent in ("spec_a", "spec_b"):
            return 100.0 / r, 150.0 + 50.0 / r
        return 1.0, 1.0

    nodes = [("r", "router", ()), ("a", "spec_a", ("r",)), ("b", "spec_b", ("r",)),
             ("s", "summariser", ("a", "b"))]
    steps = latency_allotments(nodes, phase, 64)
    last = steps[-1]
    assert last.replicas["spec_a"] > 8 and last.replicas["spec_b"] > 8
    assert abs(last.replicas["spec_a"] - last.replicas["spec_b"]) <= 1
    assert last.critical_path_s < 0.8 * steps[0].critical_path_s  # 153.6 vs 202 s
    paths = [s.critical_path_s for s in steps]
    assert paths == sorted(paths, reverse=True)
    # three tied branches: no pair of them shortens the path either, the near-critical
    # group does
    nodes3 = nodes[:3] + [("c", "spec_c", ("r",)),
                          ("s", "summariser", ("a", "b", "c"))]

    def phase3(agent, r):
        return phase("spec_a" if agent == "spec_c" else agent, r)

    last = latency_allotments(nodes3, phase3, 64)[-1]
    assert min(last.replicas[a] for a in ("spec_a", "spec_b", "spec_c")) > 4


def test_a_group_and_its_episodes_turns_stay_on_one_replica():
    bal = Balancer(["a"], 3)
    load = [0.0, 0.0, 0.0]
    homes = {}
    for group in range(3):  # groups of 8 samples, 300 tokens each, submitted one by one
        for traj in range(8):
            r = bal.pick("a", load, f"4-{group}_0_{traj}")
            homes.setdefault(group, set()).add(r)
            load[r] += 300
    # least-outstanding alone would deal every group over all three replicas
    assert all(len(h) == 1 for h in homes.values())
    assert {next(iter(h)) for h in homes.values()} == {0, 1, 2}  # groups still spread
    # the second turn of an episode goes where its conversation's first turn went
    assert bal.pick("a", load, "4-1_1_5") == next(iter(homes[1]))
    # without affinity (ids of another form) every request goes to the least loaded
    assert [bal.pick("a", [5.0, 0.0, 9.0], "x") for _ in range(2)] == [1, 1]


def test_affinity_gives_way_when_load_forces_otherwise():
    bal = Balancer(["a"], 2, affinity_slack_tokens=1000, affinity_slack_ratio=0.5)
    assert bal.pick("a", [0.0, 0.0], "7-0_0_0") == 0
    assert bal.pick("a", [900.0, 0.0], "7-0_0_1") == 0  # within the slack: stays
    assert bal.pick("a", [4400.0, 3000.0], "7-0_0_2") == 0  # within half the least load
    assert bal.pick("a", [5000.0, 100.0], "7-0_0_3") == 1  # overloaded: moves, and the
    assert bal.pick("a", [5000.0, 400.0], "7-0_1_0") == 1  # group's later turns follow
    assert bal.pick("a", [float("inf"), 400.0], "7-0_2_0") == 1  # a lost replica: never
    # a replan that takes the home replica away from the agent: the key moves with the plan
    bal = Balancer(["a", "b"], 2)
    assert bal.pick("a", [0.0, 0.0], "1-0_0_0") == 0
    bal.follow(1, {"a": [1], "b": [0]})
    assert bal.pick("a", [0.0, 0.0], "1-0_0_1") == 1
    # static mode (the peers' baseline) keeps dealing round robin
    static = Balancer(["a"], 2, mode="static")
    assert [static.pick("a", [0.0, 0.0], "1-0_0_0") for _ in range(2)] == [0, 1]


def test_a_replica_leaving_the_pool_replans_over_the_others():
    """An elastic pool shrinking: the balancer plans the current iteration again over the
    replicas left, the ones above the leaver move down an index, and affinities follow."""
    bal = Balancer(["a", "b"], 3)
    bal.replan(2, {"a": 30.0, "b": 10.0})
    bal._home[("b", "k-left")] = 1
    bal._home[("b", "k-moved")] = 2
    bal.remove_replica(1)
    assert bal.n_replicas == 2 and bal.plan.iteration == 2
    assert all(r and all(0 <= i < 2 for i in r) for r in bal.plan.replicas.values())
    assert bal.plan.demand == {"a": 30.0, "b": 10.0}
    assert ("b", "k-left") not in bal._home and bal._home[("b", "k-moved")] == 1
    assert bal.pick("b", [5, 0]) in bal.plan.replicas["b"]
    bal.remove_replica(1)
    with pytest.raises(ValueError, match="at least one replica"):
        bal.remove_replica(0)


def test_shared_gives_every_agent_the_whole_pool_round_robin():
    """`rollout.balance: shared` (mas-rl-like): every agent on every replica, whatever the
    demand, requests dealt in turn over all of them."""
    b = Balancer(["a", "b"], 3, "shared")
    assert b.plan.replicas == {"a": [0, 1, 2], "b": [0, 1, 2]}
    assert [b.pick("a", [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert b.replan(1, {"a": 100.0, "b": 1.0}).replicas == {"a": [0, 1, 2], "b": [0, 1, 2]}
