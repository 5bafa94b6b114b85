"""Configuration of a classic MARL run (a PettingZoo environment, network policies, MAPPO/IPPO).

A YAML with `kind: marl` at the top level is read by this schema instead of the LLM run's
(`flexmarl train` dispatches on it). Unknown keys are errors, as everywhere in FlexMARL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from flexmarl.config.schema import (
    ConfigError,
    LoggingConfig,
    RayConfig,
    Strict,
    _format_errors,
    apply_overrides,
)
from flexmarl.training.algorithms.mappo import MappoConfig
from flexmarl.training.algorithms.vdn import VdnConfig


class EnvConfig(Strict):
    # module path (`mpe2.simple_spread_v3`) or a bare scenario name (looked up in mpe2, then
    # PettingZoo's classic / butterfly / sisl families); the Parallel API is used for training
    id: str
    options: dict[str, Any] = {}
    num_envs: int = Field(32, gt=0)  # environments per rollout worker, stepped as one batch
    # AEC-only (turn-based) games: agents played inside the environment, not trained
    # (agent -> "random": a uniform random legal move; flexmarl/envs/turns.py)
    opponents: dict[str, str] = {}


class NetworkConfig(Strict):
    kind: Literal["mlp", "gru"] = "mlp"
    hidden: list[int] = [64, 64]
    activation: Literal["tanh", "relu"] = "relu"
    gru_hidden: int = Field(64, gt=0)
    # the on-policy MAPPO code's MLP: LayerNorm on the input and after each hidden layer
    # ("use_feature_normalization"), orthogonal init with the activation's gain
    layer_norm: bool = False
    orthogonal: bool = False


class PolicyConfig(Strict):
    # one network for every agent (agent one-hot id in its input) or one per agent; shared
    # agents must have the same action space (or Discrete ones, padded and masked)
    share_parameters: bool = True
    network: NetworkConfig = NetworkConfig()
    obs_norm: bool = True  # running mean/std of observations and critic inputs


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


class MarlRuntimeConfig(Strict):
    # local: worker processes on this machine; ray: the same workers as Ray actors (one
    # placement-group bundle each, `ray.rollout_bundle` / `train_bundle`), on the cluster at
    # `address` or on one started for the run
    kind: Literal["local", "ray"] = "local"
    address: str | None = None
    ray: RayConfig = RayConfig()
    torch_threads: int = Field(1, gt=0)  # per worker process
    # Worker processes of the local runtime. Each rollout worker steps its own
    # `env.num_envs` environments; policies share `train_workers` training slots (swapped
    # when fewer; VDN/QMIX have one policy, so one slot).
    rollout_workers: int = Field(1, gt=0)
    train_workers: int = Field(1, gt=0)
    swap_to: Literal["host", "disk"] = "host"
    # The supervisor of the worker processes, as the LLM run's: heartbeats, and
    # restarts of lost workers (0: a lost worker fails the run)
    heartbeat_interval_s: float = Field(2.0, gt=0)
    heartbeat_misses: int = Field(3, gt=0)
    progress_timeout_s: float | None = Field(None, gt=0)  # a stuck compute thread (off)
    max_worker_restarts: int = Field(10, ge=0)


class MarlRunConfig(Strict):
    kind: Literal["marl"]
    name: str = "marl"
    seed: int = 0
    env: EnvConfig
    policy: PolicyConfig = PolicyConfig()
    algorithm: MappoConfig | VdnConfig = Field(MappoConfig(), discriminator="name")
    train: MarlTrainConfig = MarlTrainConfig()
    store: MarlStoreConfig = MarlStoreConfig()
    runtime: MarlRuntimeConfig = MarlRuntimeConfig()
    logging: LoggingConfig = LoggingConfig()
    out: str | None = None

    @property
    def iterations(self) -> int:
        per = self.env.num_envs * self.runtime.rollout_workers * self.train.rollout_steps
        return max(1, self.train.env_steps // per)


def is_marl(raw: Any) -> bool:
    return isinstance(raw, dict) and raw.get("kind") == "marl"


def marl_config_from_dict(raw: dict[str, Any], source: str = "<config>") -> MarlRunConfig:
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
        if any(e["loc"][:1] == ("runtime",) and e["type"] == "literal_error"
               for e in exc.errors()):
            text += "\n  (classic MARL runs on the local and ray runtimes, not the simulator)"
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
