"""The reward-curve table a run prints at its end: first k vs last k iterations per agent."""

from flexmarl.telemetry.curves import reward_curves


def _records(curves):
    n = len(next(iter(curves.values())))
    return [{"iteration": i, **{f"agent/{a}/reward_mean": c[i] for a, c in curves.items()},
             **{f"agent/{a}/top_response_frac": 0.25 for a in curves},
             **{f"agent/{a}/entropy": 0.5 for a in curves}} for i in range(n)]


def test_first_and_last_three_iterations_per_agent():
    lines = reward_curves(_records({"solver": [0.0, 0.1, 0.2, 0.5, 0.6, 0.7, 0.8],
                                    "judge": [0.9, 0.9, 0.9, 0.3, 0.3, 0.3, 0.3]}),
                          ["solver", "judge"])
    assert lines[0] == "reward per agent (first 3 vs last 3 iterations):"
    solver = lines[2].split()
    assert solver[:4] == ["solver", "0.100", "0.700", "+0.600"]
    assert solver[-7:] == ["0.00", "0.10", "0.20", "0.50", "0.60", "0.70", "0.80"]
    assert lines[3].split()[:4] == ["judge", "0.900", "0.300", "-0.600"]
    # short runs compare halves; events and empty runs print nothing
    short = reward_curves(_records({"a": [0.0, 1.0]}) + [{"event": "checkpoint"}], ["a"])
    assert short[0].startswith("reward per agent (first 1 vs last 1") and "+1.000" in short[2]
    assert reward_curves([{"event": "x"}], ["a"]) == []


def test_a_long_run_prints_window_means():
    values = [i / 99 for i in range(100)]
    lines = reward_curves(_records({"a": values}), ["a"], points=10)
    assert "10 means of ~10.0 iterations" in lines[0]
    curve = [float(x) for x in lines[2].split()[-10:]]
    assert len(curve) == 10
    assert abs(curve[0] - sum(values[:10]) / 10) < 0.005  # printed with 2 decimals
    assert abs(curve[-1] - sum(values[-10:]) / 10) < 0.005
