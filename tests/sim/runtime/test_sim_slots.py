"""The simulator on the run's training slots (`runtime.slot_sizes`, a workload's
`training.slot_sizes`): the planner binds the heaviest agent to the largest slot in the
simulator as in a real run, and the simulator prices a slot of K devices as one sharded
trainer: step 1/K of the compute, swaps of 1/K of the state per device."""

from pathlib import Path

import pytest

from flexmarl.planning.demand import MeasuredDemand
from flexmarl.planning.planner import Planner, Resources
from flexmarl.sim.simulate import simulate_system
from flexmarl.sim.task import workload_config
from flexmarl.sim.workload import load_workload

WORKLOAD = Path(__file__).resolve().parents[3] / "examples" / "sim" / "solver_verifier.yaml"


def _with_slots(sizes: list[int] | None):
    wl = load_workload(WORKLOAD)
    return wl.model_copy(update={"training": wl.training.model_copy(
        update={"slot_sizes": sizes})})


def test_planner_and_simulator_use_the_same_slot_sizes_and_binding():
    wl = _with_slots([1, 2])
    result = simulate_system(wl, "flexmarl", iterations=2)
    plan = result.runtime.plans[0]
    assert plan["slot_sizes"] == [2, 1]
    assert plan["slot_of"] == {"solver": 0, "verifier": 1}  # the 7B on the slot of 2
    assert plan["train"] == {"solver": 2, "verifier": 1} and plan["train_accelerators"] == 3
    # every later plan keeps the slots; the runs' training spans are on them, 2 and 1 wide
    assert all(p["slot_sizes"] == [2, 1] for p in result.runtime.plans)
    lanes = {(s.lane, s.agent, s.accelerators) for s in result.runtime.spans
             if s.pool == "train"}
    assert lanes == {("train/slot0/0", "solver", 2), ("train/slot1/0", "verifier", 1)}
    # the run's config from the same workload has these slots, and the real runtime's plan
    # (its pool's slots, the measured training seconds: the 7B trains longer) binds the same
    cfg = workload_config(wl, mode="async")
    sizes = cfg.runtime.train_slot_sizes(len(result.runtime.trainable))
    assert sizes == plan["slot_sizes"]
    nodes = [("solver#0", "solver", ()), ("verifier#0", "verifier", ("solver#0",))]
    demand = MeasuredDemand(wl.name, nodes, ["solver", "verifier"], ["solver", "verifier"],
                            {"solver#0": [4.0], "verifier#0": [1.0]},
                            train_s={"solver": 30.0, "verifier": 6.0},
                            calls={"solver": 8.0, "verifier": 8.0})
    real = Planner("async", result.runtime.features).plan(
        demand, Resources(2 + len(sizes), 2, len(sizes), tuple(sizes)), 1)
    assert (real.slot_sizes, real.slot_of) == (plan["slot_sizes"], plan["slot_of"])


def test_a_slot_of_two_prices_half_the_step_and_half_the_swap_per_device():
    wl = _with_slots([2, 1])
    rt = simulate_system(wl, "flexmarl", iterations=1).runtime
    cost, model = rt.cost, wl.agent("solver").model
    assert cost.train_state_swap_time(model, 2) == pytest.approx(
        cost.train_state_swap_time(model, 1) / 2, rel=0.05)
    assert cost.train_compute_time(model, 2, 1000) == pytest.approx(
        cost.train_compute_time(model, 1, 1000) / 2)
    # the verifier on a slot of 2 ([2, 2]) against a slot of 1 ([2, 1])
    two = simulate_system(_with_slots([2, 2]), "flexmarl", iterations=1).runtime
    assert two.plans[0]["train"]["verifier"] == 2
    busy = {r: sum(s.end - s.start for s in x.spans if s.pool == "train" and
                   s.agent == "verifier") for r, x in (("two", two), ("one", rt))}
    assert busy["two"] < 0.75 * busy["one"]


def test_slots_that_cannot_hold_an_agent_or_leave_no_rollout_device_are_refused():
    with pytest.raises(ValueError, match=r"training.slot_sizes \[8\] leave no rollout"):
        simulate_system(_with_slots([8]), "flexmarl", iterations=1)
    with pytest.raises(ValueError, match=r"agent 'solver' needs 2 devices to train .* the "
                       r"largest training slot has 1"):
        simulate_system(_with_slots([1, 1]), "flexmarl", iterations=1)
