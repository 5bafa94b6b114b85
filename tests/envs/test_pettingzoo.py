"""Adapter conformance on real PettingZoo environments: spaces, rounds of nodes, agents that
leave, truncation, AEC chains with action masks, the vectorised batch, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pettingzoo")
pytest.importorskip("mpe2")

from gymnasium import spaces  # noqa: E402

from flexmarl.envs.pettingzoo import (  # noqa: E402
    EnvError,
    ParallelAdapter,
    VecParallelEnv,
    make_parallel,
)
from flexmarl.envs.spaces import SpaceError, action_spec, obs_spec  # noqa: E402
from flexmarl.errors import UserError  # noqa: E402


def random_actions(adapter: ParallelAdapter, rng: np.random.Generator) -> dict:
    out = {}
    for a in adapter.live:
        spec = adapter.action_specs[a]
        if spec.kind == "box":
            out[a] = rng.uniform(spec.low, spec.high).astype(np.float32)
        else:
            out[a] = np.array([rng.integers(n) for n in spec.nvec])
    return out


@pytest.mark.parametrize("env_id,options,obs_dim,act", [
    ("mpe2.simple_spread_v3", {"N": 3, "max_cycles": 5}, 18, ("discrete", (5,))),
    ("mpe2.simple_spread_v3", {"N": 3, "max_cycles": 5, "continuous_actions": True}, 18,
     ("box", ())),
    ("simple_speaker_listener_v4", {"max_cycles": 5}, None, ("discrete", None)),
    ("pettingzoo.classic.rps_v2", {"num_actions": 3, "max_cycles": 5}, 4, ("discrete", (3,))),
])
def test_parallel_rounds_and_truncation(env_id, options, obs_dim, act) -> None:
    adapter = ParallelAdapter(make_parallel(env_id, options), env_id)
    obs, _ = adapter.reset(seed=1)
    for a in adapter.agents:
        spec = adapter.obs_specs[a]
        assert obs[a].shape == (spec.dim,) and obs[a].dtype == np.float32
        if obs_dim is not None:
            assert spec.dim == obs_dim
        assert adapter.action_specs[a].kind == act[0]
        if act[1]:
            assert adapter.action_specs[a].nvec == act[1]
    rng = np.random.default_rng(0)
    results = []
    while adapter.live:
        results.append(adapter.step(random_actions(adapter, rng)))
    # max_cycles steps, one round of one node per agent each, then every agent truncated
    assert len(adapter.rounds) == 5
    assert all(len(r) == len(adapter.agents) for r in adapter.rounds)
    assert adapter.rounds[2] == [f"{a}@2" for a in adapter.agents]
    last = results[-1]
    assert last.done and sorted(last.left) == sorted(adapter.agents)
    assert all(last.truncated[a] for a in adapter.agents)
    assert not any(r.done for r in results[:-1])


def test_agents_that_leave_stop_producing_nodes() -> None:
    """Knights, Archers, Zombies: agents killed mid-episode leave; the rest go on."""
    env_id = "pettingzoo.butterfly.knights_archers_zombies_v11"
    opts = {"max_cycles": 300, "spawn_delay": 5, "line_death": True, "max_zombies": 4}
    partial = 0
    for seed in range(6):
        adapter = ParallelAdapter(make_parallel(env_id, opts), env_id)
        adapter.reset(seed=seed)
        shape = adapter.env.observation_space("archer_0").shape
        assert len(shape) == 2 and adapter.obs_specs["archer_0"].dim == shape[0] * shape[1]
        rng = np.random.default_rng(seed)
        gone: set[str] = set()
        while adapter.live:
            t = len(adapter.rounds)
            res = adapter.step(random_actions(adapter, rng))
            assert not gone & {n.split("@")[0] for n in adapter.rounds[t]}
            assert set(res.left) <= {n.split("@")[0] for n in adapter.rounds[t]}
            gone |= set(res.left)
            if res.left and adapter.live:
                partial += 1
                assert set(adapter.live) == set(adapter.env.agents) - gone
        assert gone == set(adapter.agents)
    assert partial > 0, "no seed had an agent leave before the others"


def test_vectorised_batch_resets_and_records_episodes() -> None:
    venv = VecParallelEnv("mpe2.simple_spread_v3", {"max_cycles": 5}, num_envs=4, seed=0)
    venv.reset()
    assert venv.state.shape == (4, 54)
    rng = np.random.default_rng(0)
    for t in range(7):
        res = venv.step({a: rng.integers(5, size=(4, 1)) for a in venv.agents})
        assert all(res["done"][a].all() == (t == 4) for a in venv.agents)
        assert all(res["truncated"][a].all() == (t == 4) for a in venv.agents)
    eps = venv.pop_episodes()
    assert len(eps) == 4 and all(e.length == 5 for e in eps)
    assert all(0 <= e.metrics["landmarks_covered"] <= 3 for e in eps)
    assert venv.env_steps == 28
    assert all(venv.alive[a].all() for a in venv.agents)  # reset environments go on


def test_unknown_env_and_unsupported_spaces_are_user_errors() -> None:
    with pytest.raises(EnvError, match="env.id: unknown environment 'no_such_env_v1'"):
        make_parallel("no_such_env_v1")
    with pytest.raises(EnvError, match="env.opponents: .*simple_spread_v3 has a Parallel API"):
        make_parallel("mpe2.simple_spread_v3", opponents={"agent_0": "random"})
    with pytest.raises(EnvError, match="env.options"):
        make_parallel("mpe2.simple_spread_v3", {"bogus": 1})
    with pytest.raises(SpaceError, match="env 'e', agent 'a0'.*observation space"):
        obs_spec(spaces.Tuple((spaces.Discrete(2), spaces.Discrete(3))), "e", "a0")
    with pytest.raises(SpaceError, match="agent 'a1'.*shape \\(2, 2\\)"):
        action_spec(spaces.Box(-1, 1, (2, 2)), "e", "a1")
    assert issubclass(SpaceError, UserError) and issubclass(EnvError, UserError)


def test_multi_discrete_spaces_encode_and_decode() -> None:
    o = obs_spec(spaces.MultiDiscrete([2, 3]), "e", "a")
    assert o.dim == 5 and o.encode(np.array([1, 2])).tolist() == [0, 1, 0, 0, 1]
    a = action_spec(spaces.MultiDiscrete([4, 2]), "e", "a")
    assert a.logits_dim == 6
    assert a.to_env(np.array([3.0, 1.0])).tolist() == [3, 1]
    box = action_spec(spaces.Box(-1, 1, (2,)), "e", "a")
    assert box.to_env(np.array([2.0, -0.5])).tolist() == [1.0, -0.5]  # clipped to the box
