"""The off-policy replay table: age weights and priorities against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flexmarl.store.replay import ReplayError, ReplayTable, age_weight


def test_age_weight_hand_computed() -> None:
    w = age_weight(np.array([1, 2, 10, 1000]))
    expected = [1.0, 1 / (1 + math.log(2)), 1 / (1 + math.log(10)), 1 / (1 + math.log(1000))]
    np.testing.assert_allclose(w, expected, rtol=1e-12)
    assert abs(w[1] - 0.590616) < 1e-6 and abs(w[2] - 0.302793) < 1e-6
    with pytest.raises(ReplayError, match="age must be >= 1"):
        age_weight(np.array([0]))


def make(n: int = 4, **kw) -> ReplayTable:
    t = ReplayTable(capacity=n, min_size=n, **kw)
    t.add({"x": np.arange(n, dtype=np.float32)[:, None]}, step=10)
    return t


def test_not_ready_below_min_size_and_config_errors() -> None:
    t = ReplayTable(capacity=10, min_size=5)
    t.add({"x": np.zeros((4, 1))}, step=0)
    assert not t.ready
    with pytest.raises(ReplayError, match="fewer than min_size 5"):
        t.sample(2, 1, np.random.default_rng(0))
    with pytest.raises(ReplayError, match="capacity"):
        ReplayTable(capacity=10, min_size=5000)
    assert ReplayTable(capacity=6000).min_size == 5000  # the enterprise default


def test_priority_fraction_and_proportional_draws() -> None:
    t = make(priority_fraction=0.2, alpha=1.0, eps=0.0)
    # |TD| 0, 0, 0, 3: every priority draw must be row 3 (probability 3/3)
    t.update_priorities(np.arange(4), np.array([0.0, 0.0, 0.0, -3.0]))
    np.testing.assert_allclose(t.priority, [0, 0, 0, 3])
    b = t.sample(10, step=12, rng=np.random.default_rng(0))
    assert b.prioritized.sum() == 2  # 20% of 10
    assert (b.index[b.prioritized] == 3).all()
    assert (b.data["x"][:, 0] == b.index).all()
    # age: inserted at 10, sampled at 12 -> age 3 -> w = 1 / (1 + ln 3)
    np.testing.assert_allclose(b.age_weight, 1 / (1 + math.log(3)))
    # proportional: priorities 1 and 3 (alpha 1) -> row 3 drawn 3/4 of the priority draws
    t.update_priorities(np.array([0]), np.array([1.0]))
    t.priority_fraction = 1.0
    idx = t.sample(20000, 12, np.random.default_rng(1)).index
    assert abs((idx == 3).mean() - 0.75) < 0.01 and set(np.unique(idx)) == {0, 3}


def test_uniform_when_fraction_zero_and_ring_buffer_overwrites_oldest() -> None:
    t = make(priority_fraction=0.0)
    b = t.sample(8, 10, np.random.default_rng(0))
    assert not b.prioritized.any()
    t.update_priorities(np.arange(4), np.array([5.0, 1.0, 1.0, 1.0]))
    t.add({"x": np.array([[9.0]])}, step=20)  # overwrites slot 0, at the max priority
    assert t.fields["x"][0, 0] == 9.0 and t.inserted[0] == 20 and len(t) == 4
    assert t.priority[0] == pytest.approx(5.001)
