"""An environment run (classic MARL) is a `RunConfig` with `env:` where a task run has `task:`:
its agents are network policies with one algorithm, its length is counted in env steps, and the
fields of the other kind of run are refused naming the field (no environment is built here)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from flexmarl.config.schema import (
    ConfigError,
    MappoConfig,
    RunConfig,
    VdnConfig,
    config_from_dict,
    load_config,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ENV_RUN: dict[str, Any] = {
    "env": {"id": "mpe2.simple_spread_v3", "num_envs": 4},
    "networks": {"shared": {"hidden": [16], "algorithm": {"name": "mappo", "epochs": 2}}},
    "agents": {a: {"network": {"base": "shared"}} for a in ("agent_0", "agent_1", "agent_2")},
    "train": {"env_steps": 1000, "rollout_steps": 25},
}


def env_run(**over: Any) -> RunConfig:
    raw = copy.deepcopy(ENV_RUN)
    for key, value in over.items():
        node = raw
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return config_from_dict(raw)


def test_an_env_run_counts_iterations_from_env_steps_and_runs_sync() -> None:
    cfg = env_run()
    assert cfg.task is None and cfg.environment.id == "mpe2.simple_spread_v3"
    assert cfg.train.iterations == 1000 // (4 * 1 * 25) == 10
    assert cfg.pipeline.mode == "sync"  # the task runs' default (async) is not an env run's
    algo = cfg.env_algorithm
    assert isinstance(algo, MappoConfig) and algo.epochs == 2 and algo.critic_input == "state"
    assert cfg.network_of("shared").hidden == [16]
    assert cfg.policy_groups(["agent_0", "agent_1", "agent_2"]) == {
        "shared": ["agent_0", "agent_1", "agent_2"]}
    # what workers get: the dumped config validates to the same run
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    assert env_run(**{"train.env_steps": None}).train.env_steps == 200_000
    # an agent without a network config gets the default network
    plain = env_run(networks={}, agents={"agent_0": {}, "agent_1": {}, "agent_2": {}})
    assert plain.agents["agent_0"].network is not None
    qmix = env_run(**{"networks.shared.algorithm": {"name": "qmix", "min_size": 10}})
    assert isinstance(qmix.env_algorithm, VdnConfig) and qmix.env_algorithm.name == "qmix"


@pytest.mark.parametrize(("over", "message"), [
    ({"task": {"builder": "x:y"}}, "task / env: .* give exactly one"),
    ({"train.iterations": 3}, "train.iterations: an environment run's iterations follow"),
    ({"train.group_size": 4}, r"train.group_size: a task run's; an environment run"),
    ({"train.credit": {"team": 0.5}}, "train.credit: a task run's"),
    ({"runtime.colocate": True}, "runtime.colocate: places, pins or publishes LLM"),
    ({"runtime.kind": "sim"}, "runtime.kind: an environment run runs on the local and ray"),
    ({"pipeline.mode": "one_step_off"}, "pipeline.mode: an environment run is on-policy"),
    ({"rollout.max_batch_seqs": 8}, "rollout: the LLM replicas' batching"),
    ({"models": {"base": {}}}, "models: shared LLM bases"),
    ({"agents.agent_0": {"network": {"base": "shared"}, "sampling": {"temperature": 0.5}}},
     "agents.agent_0: sampling: an agent with a `network` is a network policy"),
    ({"agents.agent_0": {"model": {"hidden_size": 32}}},
     "agents.agent_0.model: an environment run's agents are network policies"),
    ({"agents.agent_2": {"network": {"algorithm": {"name": "ippo"}}}},
     "agents.agent_2.network.algorithm: differs from agents.agent_0's"),
    ({"agents.agent_2": {"network": {"base": "shared", "hidden": [8]}}},
     "agents.agent_2.network.hidden: set next to network.base 'shared'"),
    ({"networks.shared.algorithm": {"name": "vdn"}, "train.eval_every": 2},
     "train.eval_every: vdn has no greedy evaluation"),
    ({"networks.shared.algorithm": {"name": "mappo", "batch_size": 8}},
     "networks.shared.algorithm.batch_size: option does not apply to algorithm 'mappo' "
     r"\(it is an option of vdn/qmix\)"),
    ({"networks.shared.algorithm": {"name": "dqn"}}, "algorithm.name must be one of mappo"),
])
def test_what_an_env_run_cannot_have_is_refused_naming_the_field(over, message) -> None:
    with pytest.raises(ConfigError, match=message):
        env_run(**over)


def test_a_task_run_refuses_the_env_runs_fields() -> None:
    relay = EXAMPLES / "relay_chain.yaml"
    for override, message in (
            ("train.env_steps=1000", "train.env_steps: an environment run's"),
            ("train.eval_every=2", "train.eval_every: an environment run's"),
            ("store.compress_obs=true", "store: compresses an environment run's"),
            ("networks={n: {}}", "networks: shared networks are an environment run's")):
        with pytest.raises(ConfigError, match=message):
            load_config(relay, [override])
    with pytest.raises(ConfigError, match="task / env: .* give exactly one"):
        config_from_dict({"agents": {"a": {}}})
    with pytest.raises(ConfigError, match="kind: marl is gone"):
        config_from_dict({"kind": "marl", "env": {"id": "x"}})
    with pytest.raises(ConfigError, match="algorithm: an environment run's algorithm is its"):
        config_from_dict({**ENV_RUN, "algorithm": {"name": "mappo"}})


@pytest.mark.parametrize("example", ["mpe_speaker_listener", "mpe_spread", "mpe_reference",
                                     "tictactoe"])
def test_the_classic_examples_are_run_configs(example) -> None:
    cfg = load_config(EXAMPLES / f"{example}.yaml", ["train.env_steps=210000"])
    assert cfg.env is not None and cfg.task is None and cfg.pipeline.mode == "sync"
    assert all(a.network is not None for a in cfg.agents.values())
    assert cfg.train.iterations == max(1, 210000 // (
        cfg.environment.num_envs * cfg.runtime.rollout_workers * cfg.train.rollout_steps))
