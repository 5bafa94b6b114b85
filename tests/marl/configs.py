"""Classic MARL test configs in the run config's shape, written compactly: `share` (True: one
network "shared" for every agent, False: each agent its own), `network` (its fields) and
`algorithm` (every network's `algorithm`) are test shorthands turned into `networks:` /
`agents:` for the environment's real agents."""

from __future__ import annotations

import copy
from typing import Any

from flexmarl.config.schema import RunConfig, config_from_dict
from flexmarl.envs.pettingzoo import VecParallelEnv


def set_path(raw: dict[str, Any], key: str, value: Any) -> None:
    """`a.b.c` = value in a nested dict (as `--set`)."""
    node = raw
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def env_agents(env: dict[str, Any]) -> list[str]:
    """The trained agents of the environment, as the run's probe sees them."""
    probe = VecParallelEnv(env["id"], env.get("options", {}), 1, 0, env.get("opponents", {}))
    probe.reset()
    return list(probe.agents)


def shaped(raw: dict[str, Any], **over: Any) -> dict[str, Any]:
    """The raw config with overrides applied and the shorthands expanded."""
    raw = copy.deepcopy(raw)
    for key, value in over.items():
        set_path(raw, key, value)
    share = raw.pop("share", True)
    network = raw.pop("network", {})
    if "algorithm" in raw:
        network = {**network, "algorithm": raw.pop("algorithm")}
    if "agents" not in raw:
        agents = env_agents(raw["env"])
        if share:
            raw["networks"] = {"shared": network}
            raw["agents"] = {a: {"network": {"base": "shared"}} for a in agents}
        else:
            raw["agents"] = {a: {"network": dict(network)} for a in agents}
    return raw


def marl_cfg(raw: dict[str, Any], **over: Any) -> RunConfig:
    return config_from_dict(shaped(raw, **over))
