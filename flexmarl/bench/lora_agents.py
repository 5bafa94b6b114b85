"""N adapter agents on one shared base vs N agents with their own models, measured side by side:

- resident memory of a rollout replica (the base once + N adapters, vs N models) and of a
  training slot holding every agent's trainer (the base once + N adapters with AdamW and
  gradients after one step each, vs N trainers with a base each: today's LoRA agents);
- rollout tokens/s of one mixed batch (B sequences over N adapters, one engine) vs the same B
  sequences as N per-agent batches on plain models (one engine per agent, taking turns), and
  vs a single-agent batch of B sequences on a plain model (the target's reference);
- the time of a swap (capture, wire form, restore) of an adapter agent's training state vs a
  full-model agent's (all weights trained).

Separate models of the same shape hold the same bytes and compute the same, so "N separate
models" is N times one built model for memory, and one plain model shared by the per-agent
engines for speed (building 8 SmolLM2 copies would only fill the memory of the machine).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, cast

import numpy as np
import torch

from flexmarl.bench.engine_overhead import alternating
from flexmarl.config.schema import RunConfig, config_from_dict
from flexmarl.policy import adapters
from flexmarl.policy.model import build_model
from flexmarl.rollout.engine import HFEngine
from flexmarl.training import state as st
from flexmarl.training.host import TrainHost
from flexmarl.training.trainer import AgentTrainer
from flexmarl.types import GenerationRequest, Sample

MB = 1024 * 1024
MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "smollm2": ({"kind": "smollm2"}, 49152),
    "tiny": ({"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
              "init_std": 0.1}, 512),
}
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
MAX_SEQ_LEN = 96


def run_config(model: dict[str, Any], n: int) -> RunConfig:
    """`n` adapter agents `a0..` on one shared base."""
    return config_from_dict({
        "task": {"builder": "bench:none"}, "models": {"base": model},
        "agents": {f"a{i}": {"model": {"base": "base"}, "lora": LORA,
                             "optim": {"lr": 1e-4}} for i in range(n)},
    }, "lora_agents")


def own_model_config(model: dict[str, Any], lora: bool) -> RunConfig:
    raw: dict[str, Any] = {"model": model, "optim": {"lr": 1e-4}}
    if lora:
        raw["lora"] = LORA
    return config_from_dict({"task": {"builder": "bench:none"}, "agents": {"a0": raw}},
                            "lora_agents")


def _samples(vocab: int, rows: int, prompt: int, response: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(f"0-{seed}_{i}_0", rng.integers(3, vocab, size=prompt).tolist(),
                   rng.integers(3, vocab, size=response).tolist(),
                   (-rng.random(response) * 3).tolist(), float(rng.normal()), None, 1.0, 0)
            for i in range(rows)]


def _one_step(trainer: AgentTrainer, vocab: int, seed: int) -> None:
    trainer.accumulate(_samples(vocab, 2, 16, 8, seed))
    trainer.step()


# --- memory -----------------------------------------------------------------------------------
def replica_memory(model: dict[str, Any], vocab: int, n: int) -> dict[str, float]:
    cfg = run_config(model, n)
    agents = list(cfg.agents)
    shared, _, mem = adapters.build_replica_model(cfg, agents, vocab, MAX_SEQ_LEN, "cpu",
                                                  torch.float32)
    own = build_model("a0", own_model_config(model, False).agents["a0"].model, vocab,
                      MAX_SEQ_LEN, 0)
    out = {"shared_mb": adapters.resident_bytes(shared) / MB,
           "separate_mb": n * adapters.resident_bytes(own) / MB,
           "adapter_mb": statistics.mean(mem["agent_bytes"].values()) / MB}
    del shared, own
    return out


def trainer_memory(model: dict[str, Any], vocab: int, n: int) -> dict[str, float]:
    """A slot that has trained each of `n` adapter agents once (so every AdamW state exists)
    vs `n` times one trainer with its own base and adapter (today's LoRA agent)."""
    cfg = run_config(model, n)
    slot = TrainHost(cfg, vocab, MAX_SEQ_LEN)
    for i, agent in enumerate(cfg.agents):
        slot.bind(agent, None)
        _one_step(cast(AgentTrainer, slot.trainers[agent]), vocab, i)
    shared = slot.resident_bytes()
    del slot
    own_cfg = own_model_config(model, True)
    own = AgentTrainer("a0", own_cfg.agents["a0"], vocab, MAX_SEQ_LEN, 0)
    _one_step(own, vocab, 0)
    one = adapters.resident_bytes(*own._state_modules().values(), own.optimizer)
    del own
    return {"shared_mb": shared / MB, "separate_mb": n * one / MB}


# --- rollout ----------------------------------------------------------------------------------
def _requests(agents: list[str], batch: int, vocab: int, prompt: int, new: int
              ) -> list[GenerationRequest]:
    rng = np.random.default_rng(0)
    return [GenerationRequest(f"q{i}_0_0", agents[i % len(agents)], 0,
                              [1, *rng.integers(3, vocab, size=prompt - 1).tolist()], new,
                              None, [], 1.0, 0) for i in range(batch)]


def _timed(fn) -> float:
    """CPU seconds of this process: on a machine shared with other jobs, wall time measures
    their load as much as ours (the benchmark runs on the CPU, `--threads` threads)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def rollout_speed(model: dict[str, Any], vocab: int, n: int, batch: int, prompt: int, new: int,
                  rounds: int) -> dict[str, float]:
    """tokens per CPU second of B sequences: one mixed batch over n adapters; n per-agent
    batches of B/n on plain models (engines taking turns); one single-agent batch of B on a
    plain model."""
    cfg = run_config(model, n)
    agents = list(cfg.agents)
    shared, names, _ = adapters.build_replica_model(cfg, agents, vocab, MAX_SEQ_LEN, "cpu",
                                                    torch.float32)
    gen = torch.Generator().manual_seed(0)
    for _, layer in adapters._lora_layers(shared):  # trained-looking adapters (B != 0)
        for name in layer.lora_B:
            layer.lora_B[name].weight.data.normal_(0, 0.02, generator=gen)
    plain = build_model("a0", cfg.agents["a0"].model, vocab, MAX_SEQ_LEN, 0)
    mixed_reqs = _requests(agents, batch, vocab, prompt, new)
    single_reqs = _requests(agents[:1], batch, vocab, prompt, new)

    def mixed() -> None:
        HFEngine(shared, batch, adapters=names).run_to_completion(mixed_reqs)

    def per_agent() -> None:
        for agent in agents:
            HFEngine(plain, batch).run_to_completion([r for r in mixed_reqs if r.agent == agent])

    def single() -> None:
        HFEngine(plain, batch).run_to_completion(single_reqs)

    fns = {"mixed": mixed, "per_agent": per_agent, "single": single}
    for fn in fns.values():  # warm-up
        fn()
    runs = alternating(list(fns), rounds, lambda key: _timed(fns[key]))
    tokens = batch * new
    out = {f"{k}_tps": tokens / statistics.median(v) for k, v in runs.items()}
    out["ratio"] = out["mixed_tps"] / out["single_tps"]
    return out


# --- swap -------------------------------------------------------------------------------------
def swap_time(model: dict[str, Any], vocab: int, rounds: int) -> dict[str, float]:
    """Seconds and MB of one swap out + in (capture, wire form, restore) of an adapter agent on
    a shared base vs an agent training its whole model."""
    out: dict[str, float] = {}
    cfg = run_config(model, 1)
    slot = TrainHost(cfg, vocab, MAX_SEQ_LEN)
    slot.bind("a0", None)
    trainers = {"adapter": cast(AgentTrainer, slot.trainers["a0"]),
                "full": AgentTrainer("a0", own_model_config(model, False).agents["a0"], vocab,
                                     MAX_SEQ_LEN, 0)}
    for kind, trainer in trainers.items():
        _one_step(trainer, vocab, 0)
        times = []
        for _ in range(rounds):
            t0 = time.process_time()  # CPU seconds, as for the rollout figures
            captured = st.capture(trainer, frozen=False)
            wire = st.to_wire(captured)
            st.restore(trainer, st.from_wire(wire))
            times.append(time.process_time() - t0)
        out[f"{kind}_s"] = statistics.median(times)
        out[f"{kind}_mb"] = captured.nbytes / MB
        del captured, wire
    return out
