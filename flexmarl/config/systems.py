"""The simulator's systems (`flexmarl simulate --baseline NAME`) as presets of the real runtime:
each a list of `--set` overrides applied before the user's own, so `flexmarl train --system
NAME` and `flexmarl bench compare` run the same comparison on real processes that
`flexmarl simulate` runs in virtual time (`sim/simulate.py` models the same names).

Systems the real runtime cannot run yet are named with the reason, so a comparison never
silently runs something else under their name.
"""

from __future__ import annotations

from flexmarl.config.schema import ConfigError

SYSTEM_SETTINGS: dict[str, list[str]] = {
    # async micro-batch pipeline, dependency-parallel rollout, hierarchical balancing
    "flexmarl": [],
    # ablations: one feature switched off each
    "flexmarl-sync": ["pipeline.mode=sync"],
    "flexmarl-stage": ["rollout.schedule=stage"],
    "flexmarl-static-balance": ["rollout.balance=static"],
    "flexmarl-static-alloc": ["runtime.train_binding=fixed"],
    # separate rollout and training pools, synchronous, turn by turn, static splits
    "sync-disaggregated": ["pipeline.mode=sync", "rollout.schedule=stage",
                           "rollout.balance=static"],
    # single-agent async applied per agent (verl's / AReaL's one-step off-policy)
    "one-step-off": ["pipeline.mode=one_step_off", "rollout.schedule=stage",
                     "rollout.balance=static"],
    # colocated (runtime.colocate): replicas and trainers on the same devices, the replicas
    # asleep (KV cache freed, weights in host memory) while training runs; synchronous.
    # MARTI today: per-episode workflows (dependency), each agent its equal share of the
    # replicas (static), every agent trained at once
    "marti": ["pipeline.mode=sync", "rollout.schedule=dependency", "rollout.balance=static",
              "runtime.colocate=true"],
    # MARTI until mid-2025: turn by turn, agents trained one at a time
    "marti-2025-05": ["pipeline.mode=sync", "rollout.schedule=stage", "rollout.balance=static",
                      "runtime.colocate=true", "pipeline.train_agents=one_at_a_time"],
    # MAS-RL as the paper describes it: turn by turn, each turn's agent on the whole pool
    # (shared), agents trained one at a time on the same devices
    "mas-rl-like": ["pipeline.mode=sync", "rollout.schedule=stage", "rollout.balance=shared",
                    "runtime.colocate=true", "pipeline.train_agents=one_at_a_time"],
}

NOT_YET: dict[str, str] = {}


def system_overrides(name: str) -> list[str]:
    """The `--set` overrides of system `name`; an unknown name or one the real runtime cannot
    run yet is an error naming the systems it can run."""
    if name in SYSTEM_SETTINGS:
        return list(SYSTEM_SETTINGS[name])
    known = ", ".join(SYSTEM_SETTINGS)
    if name in NOT_YET:
        raise ConfigError(f"--system {name}: the real runtime cannot run it yet (it needs "
                          f"{NOT_YET[name]}); `flexmarl simulate --baseline {name}` models it. "
                          f"Real systems: {known}")
    raise ConfigError(f"--system {name}: unknown system (real systems: {known})")
