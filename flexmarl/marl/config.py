"""Configuration of a classic MARL run: a PettingZoo environment whose agents act with network
policies (MAPPO / IPPO, VDN / QMIX).

It has the run config's shape (docs/configuration.md): `agents:` names every trained agent of
the environment, each with its `network`; agents that name the same entry of the top-level
`networks:` (`network: {base: NAME}`) share that one network (agent id in its input), as LLM
agents share a base model. `runtime:` is the run config's `RuntimeConfig`. A YAML with `env:`
instead of `task:` at the top level is read by this schema (`flexmarl train` looks at that).
Unknown keys are errors, as everywhere in FlexMARL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from flexmarl.config.schema import (
    ConfigError,
    LoggingConfig,
    NetworkConfig,
    RuntimeConfig,
    Strict,
    _format_errors,
    apply_overrides,
    resolve_shared,
)
from flexmarl.training.algorithms.mappo import MappoConfig
from flexmarl.training.algorithms.vdn import VdnConfig

# RuntimeConfig's fields that place, pin and publish LLM workers (and grow their pool: an
# elastic rollout pool is the Ray LLM runtime's); a classic run's networks are
# small, live on the CPU and are published through the pipes (its workers are not pinned yet)
_LLM_ONLY_RUNTIME = ("colocate", "devices", "rollout_devices", "train_devices", "share_devices",
                     "rollout_cpus", "train_cpus", "publication", "publication_timeout_s",
                     "deterministic", "slot_size", "slot_sizes", "rollout_workers_max")


class EnvConfig(Strict):
    # module path (`mpe2.simple_spread_v3`) or a bare scenario name (looked up in mpe2, then
    # PettingZoo's classic / butterfly / sisl families); the Parallel API is used for training
    id: str
    options: dict[str, Any] = {}
    num_envs: int = Field(32, gt=0)  # environments per rollout worker, stepped as one batch
    # AEC-only (turn-based) games: agents played inside the environment, not trained
    # (agent -> "random": a uniform random legal move; flexmarl/envs/turns.py)
    opponents: dict[str, str] = {}


class MarlAgentConfig(Strict):
    """A trained agent of the environment: its network policy (own, or a shared `base`)."""

    network: NetworkConfig = NetworkConfig()


class MarlTrainConfig(Strict):
    env_steps: int = Field(200_000, gt=0)  # environment steps in total (all envs)
    rollout_steps: int = Field(25, gt=0)  # steps per environment per iteration
    # As the LLM run's (docs/reliability.md): a checkpoint generation every N iterations
    # (VDN/QMIX: the replay table included), the last `keep_checkpoints` kept under
    # OUT/checkpoints/
    checkpoint_every: int | None = Field(None, gt=0)
    keep_checkpoints: int = Field(3, gt=0)
    # MAPPO/IPPO: every N iterations (and after the last), a greedy evaluation of the new
    # weights on `eval_episodes` episodes of their own (marl/evaluate.py): `eval/return`,
    # `eval/<task metric>` in that iteration's record, beside the stochastic rollouts' figures
    eval_every: int | None = Field(None, gt=0)
    eval_episodes: int = Field(32, gt=0)


class MarlStoreConfig(Strict):
    # FP16 quantisation + Zstandard for the observation and critic-input payloads of the
    # store's rows; the policies then act on the FP16-rounded observations too, so the
    # trainer's log-probs still equal the rollout's (on-policy). Needs `zstandard`.
    compress_obs: bool = False
    zstd_level: int = Field(3, ge=1, le=22)


class MarlRunConfig(Strict):
    name: str = "marl"
    seed: int = 0
    env: EnvConfig
    # Shared networks by name; an agent runs on one with `network: {base: NAME}`
    networks: dict[str, NetworkConfig] = {}
    agents: dict[str, MarlAgentConfig]
    algorithm: MappoConfig | VdnConfig = Field(MappoConfig(), discriminator="name")
    train: MarlTrainConfig = MarlTrainConfig()
    store: MarlStoreConfig = MarlStoreConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    logging: LoggingConfig = LoggingConfig()
    out: str | None = None

    @property
    def iterations(self) -> int:
        per = self.env.num_envs * self.runtime.rollout_workers * self.train.rollout_steps
        return max(1, self.train.env_steps // per)

    @model_validator(mode="after")
    def _check(self) -> MarlRunConfig:
        if not self.agents:
            raise ValueError("agents: at least one trained agent of the environment")
        for field in _LLM_ONLY_RUNTIME:
            if getattr(self.runtime, field) != RuntimeConfig.model_fields[field].default:
                raise ValueError(f"runtime.{field}: places, pins or publishes LLM workers; "
                                 "a classic MARL run's networks live on the CPU, its workers "
                                 "unpinned (leave it out)")
        if self.runtime.kind == "sim":
            raise ValueError("runtime.kind: classic MARL runs on the local and ray runtimes, "
                             "not the simulator")
        def distinct_names(name: str, agent: Any, base: str) -> None:
            if base in self.agents and self.agents[base].network.base != base:
                raise ValueError(f"networks.{base}: also the name of an agent with a network "
                                 "of its own; rename one")

        resolve_shared("networks", "network", self.networks, self.agents, distinct_names)
        return self

    def policy_groups(self, env_agents: list[str]) -> dict[str, list[str]]:
        """The policies (one network each) and their agents in the environment's order: one
        per shared `networks` entry, one per agent with a network of its own. Checks that
        `agents:` names exactly the environment's trained agents."""
        unknown = [a for a in self.agents if a not in env_agents]
        if unknown:
            raise ConfigError(f"agents.{unknown[0]}: env {self.env.id!r} has no trained agent of "
                              f"that name (it has: {', '.join(env_agents)})")
        missing = [a for a in env_agents if a not in self.agents]
        if missing:
            raise ConfigError(f"agents: env {self.env.id!r} has agent(s) {', '.join(missing)} "
                              "without a config; add agents.<name>: {network: ...} for each "
                              "(or env.opponents for a turn-based game's built-in player)")
        groups: dict[str, list[str]] = {}
        for a in env_agents:
            groups.setdefault(self.agents[a].network.base or a, []).append(a)
        return groups

    def network_of(self, policy: str) -> NetworkConfig:
        """The network config of a policy named by `policy_groups`."""
        if policy in self.networks:
            return self.networks[policy]
        return self.agents[policy].network


def is_marl(raw: Any) -> bool:
    """A classic MARL run: an environment (`env:`) where an LLM run has a `task:`."""
    return isinstance(raw, dict) and "env" in raw and "task" not in raw


def marl_config_from_dict(raw: dict[str, Any], source: str = "<config>") -> MarlRunConfig:
    if raw.get("kind") == "marl":
        raise ConfigError(f"{source}: kind: marl is gone; a classic MARL run is a run config "
                          "with `env:` and `agents:` (each agent's `network`, shared ones in "
                          "`networks:`), see docs/marl.md and examples/mpe_*.yaml")
    try:
        cfg = MarlRunConfig.model_validate(raw)
    except ValidationError as exc:
        text = _format_errors(exc, source)
        for tag in ("mappo", "ippo", "vdn", "qmix"):  # the union's tag is not part of the YAML path
            text = text.replace(f"  algorithm.{tag}.", "  algorithm.")
        lines = []
        for line in text.splitlines():
            key = line.strip().split(":", 1)[0].removeprefix("algorithm.")
            if line.startswith("  algorithm.") and line.endswith("unknown key"):
                owners = [n for n, c in (("mappo/ippo", MappoConfig), ("vdn/qmix", VdnConfig))
                          if key in c.model_fields]
                if owners:
                    line += f" (an option of {owners[0]}, not of this algorithm)"
            lines.append(line)
        text = "\n".join(lines)
        raise ConfigError(text) from None
    if isinstance(cfg.algorithm, VdnConfig) and cfg.train.eval_every is not None:
        raise ConfigError(f"{source}: train.eval_every: {cfg.algorithm.name} has no greedy "
                          "evaluation yet (mappo/ippo do); unset it")
    return cfg


def load_marl_config(path: str | Path, overrides: list[str] | None = None) -> MarlRunConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return marl_config_from_dict(apply_overrides(raw, overrides or []), str(path))
