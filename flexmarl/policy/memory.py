"""How much memory the agents' models need (a copy per rollout replica, a trainer's state per
trainable agent) against what this machine has: checked before any worker starts, and named
in the report of a worker killed for memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flexmarl.config.schema import RunConfig
from flexmarl.errors import UserError
from flexmarl.policy.model import approx_params

# bytes per parameter: a rollout replica's copy (fp32 on CPU), and a trainer's fp32 master
# weights + gradients + Adam's two moments
ROLLOUT_BYTES = 4
TRAINER_BYTES = 16


class MemoryEstimateError(UserError, RuntimeError):
    """The models will not fit in this machine's memory."""


def _adapter_params(agent) -> int:
    """LoRA parameters, roughly: r x (in + out) per targeted projection, taken as square."""
    model = agent.model
    hidden, layers = (576, 30) if model.kind == "smollm2" else (model.hidden_size,
                                                                model.num_layers)
    return agent.lora.r * 2 * hidden * layers * len(agent.lora.target_modules)


def available_memory() -> int | None:
    """Bytes of memory available to new processes (MemAvailable), None where unknown."""
    override = os.environ.get("FLEXMARL_AVAILABLE_MEMORY")
    if override:
        return int(float(override))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_estimate(cfg: RunConfig, vocab_size: int) -> dict[str, int]:
    """Host bytes each agent's models need on the CPU: a copy per rollout replica plus, for a
    trainable agent, its trainer state (a separate PPO critic doubles it)."""
    out = {}
    bases_seen: set[str] = set()
    for name, agent in cfg.agents.items():
        params = approx_params(agent.model, vocab_size)
        base = agent.model.base
        if base is not None:
            # a shared base: held once per replica and once per slot (the first of its agents
            # carries it); every agent adds its adapter, with AdamW and gradients
            adapter = _adapter_params(agent) if agent.lora is not None else 0
            need = (ROLLOUT_BYTES + TRAINER_BYTES * agent.trainable) * adapter
            if base not in bases_seen:
                bases_seen.add(base)
                on_base = sum(1 for a in cfg.agents.values()
                              if a.model.base == base and a.trainable)
                slots = min(cfg.runtime.train_workers, on_base)
                need += ROLLOUT_BYTES * params * (cfg.runtime.rollout_workers + slots)
            out[name] = need
            continue
        need = ROLLOUT_BYTES * params * cfg.runtime.rollout_workers
        if agent.trainable:
            trainer = TRAINER_BYTES * params
            if agent.algorithm.name == "ppo" and getattr(agent.algorithm, "critic", "") == \
                    "separate":
                trainer *= 2
            need += trainer
        out[name] = need
    return out


def memory_hints(cfg: RunConfig, vocab_size: int, n_rollout: int, n_train: int,
                 rollout_agents: list[str], trainable: list[str]) -> list[str]:
    """Per worker (rollout replicas, then training slots), what it holds and the estimate: the
    text an out-of-memory kill of that worker is reported with."""
    params = {a: approx_params(cfg.agents[a].model, vocab_size) for a in cfg.agents}
    rollout = ", ".join(f"{a} {_gib(ROLLOUT_BYTES * params[a])}" for a in rollout_agents)
    train = ", ".join(f"{a} {_gib(TRAINER_BYTES * params[a])}" for a in trainable)
    return ([f"; this rollout replica holds agents {rollout} (estimated)"] * n_rollout
            + [f"; this training slot trains agents {train} (estimated trainer state each; "
               f"runtime.swap_to={cfg.runtime.swap_to})"] * n_train)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def estimates_text(estimate: dict[str, int]) -> str:
    return ", ".join(f"{a} {_gib(b)}" for a, b in estimate.items())


def check_memory(cfg: RunConfig, vocab_size: int) -> dict[str, int]:
    """On the CPU, the agents' models against the available memory, before anything loads."""
    estimate = memory_estimate(cfg, vocab_size)
    if cfg.runtime.kind != "local" or _uses_cuda(cfg):
        return estimate  # device memory is checked by the workers; Ray places by resources
    available = available_memory()
    total = sum(estimate.values())
    if available is not None and total > available:
        worst = max(estimate, key=lambda name: estimate[name])
        raise MemoryEstimateError(
            f"the models need about {_gib(total)} of memory ({estimates_text(estimate)}: "
            f"{ROLLOUT_BYTES} bytes per parameter per rollout replica, {TRAINER_BYTES} per "
            f"trainable parameter), and this machine has {_gib(available)} available; make "
            f"agents.{worst}.model smaller (hidden_size, num_layers, intermediate_size) or use "
            "fewer runtime.rollout_workers")
    return estimate


def _uses_cuda(cfg: RunConfig) -> bool:
    if cfg.runtime.devices == "cpu":
        return False
    if cfg.runtime.devices == "cuda":
        return True
    try:

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch build with CUDA: the CPU
        return False
