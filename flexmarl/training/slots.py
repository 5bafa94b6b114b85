"""One training slot (a device, or a CPU worker here): hosts the trainer of whichever agent the
allocator bound to it, and swaps states out and in through `training.state`.

The trainer objects (model, optimizer) are built once per agent and process, the first time the
agent is bound here, and kept: a swap-out captures the state (it leaves the slot as wire bytes
or a disk file), a swap-in loads a state into the agent's kept trainer. Nothing is rebuilt on a
swap. Same config and seed give the same initial weights in every process.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from flexmarl.config.schema import RunConfig
from flexmarl.policy import adapters
from flexmarl.policy.device import process_device
from flexmarl.policy.model import build_model
from flexmarl.training import state as st
from flexmarl.training.trainer import AgentTrainer


class SlotError(RuntimeError):
    """A command for an agent that is not resident on this slot."""


class _Resident(dict):
    """`TrainSlot.trainers`: the resident trainer by agent, with a clear error for the others."""

    def __missing__(self, agent: str) -> AgentTrainer:
        raise SlotError(f"agent {agent!r} is not resident on this training slot")


class TrainSlot:
    def __init__(self, cfg: RunConfig, vocab_size: int, max_seq_len: int,
                 swap_dir: str | None = None) -> None:
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.swap_dir = swap_dir  # None: swapped states go to the caller's host memory
        self.trainers: dict[str, AgentTrainer] = _Resident()  # resident (at most one)
        # every trainer built in this process, resident or not: swap-ins load into these
        self.kept: dict[str, AgentTrainer] = {}
        # shared bases (`models:`), built once per process: the trainers of the agents on one
        # wrap trees over its tensors, so the slot holds it once and a swap moves the adapter
        self.bases: dict[str, torch.nn.Module] = {}

    def _build(self, agent: str) -> AgentTrainer:
        acfg = self.cfg.agents[agent]
        shared = None
        if acfg.model.base is not None:
            name = acfg.model.base
            if name not in self.bases:
                self.bases[name] = build_model(f"models.{name}", acfg.model, self.vocab_size,
                                               self.max_seq_len, self.cfg.seed,
                                               process_device())
            shared = self.bases[name]
        return AgentTrainer(agent, acfg, self.vocab_size, self.max_seq_len,
                            self.cfg.seed, total_steps=self.cfg.train.iterations,
                            max_staleness=self.cfg.pipeline.max_staleness, shared_base=shared)

    def resident_bytes(self, agents: list[str] | None = None) -> int:
        """Memory the slot holds: the kept trainers' (of `agents`, default all) weights,
        gradients and optimizer states, each shared base once."""
        objects: list = list(self.bases.values())
        for agent, trainer in self.kept.items():
            if agents is None or agent in agents:
                objects += [*trainer._state_modules().values(), trainer.optimizer]
                if trainer.ref_model is not None:
                    objects.append(trainer.ref_model)
        return adapters.resident_bytes(*objects)

    def agent_bytes(self, agent: str) -> int:
        """What `agent` adds to the slot: an adapter agent its adapter, gradients and AdamW
        state (its base is shared); any other agent its whole model and optimizer."""
        return self.resident_bytes([agent]) - self.resident_bytes([])

    def bind(self, agent: str, incoming: Any) -> tuple[str | None, Any, dict[str, float]]:
        """Make `agent` resident: swap out the current resident (its state goes back, as wire
        bytes or a disk path), then swap `agent` in from `incoming` (None: the agent's initial
        state, as built from its config)."""
        timings: dict[str, float] = {}
        out_agent: str | None = None
        out_state: tuple[str, Any] | None = None
        for resident in [a for a in self.trainers if a != agent]:
            t0 = time.perf_counter()
            trainer = self.trainers.pop(resident)
            captured = st.capture(trainer, frozen=False)  # frozen base: kept in the object
            if self.swap_dir is not None:
                path = f"{self.swap_dir}/{resident}.safetensors"
                st.move(captured, st.Disk(path))
                out_state = ("disk", path)
            else:
                out_state = ("host", st.to_wire(captured))
            out_agent = resident
            timings["swap_out_s"] = time.perf_counter() - t0
            timings["swap_bytes"] = float(captured.nbytes)
            del captured
        if agent not in self.trainers:
            t0 = time.perf_counter()
            kept = self.kept.get(agent)
            if incoming is None or kept is None:
                # first binding, or a restart point follows (`set_state`): a fresh trainer is
                # exactly the initial state; built only then
                kept = self.kept[agent] = self._build(agent)
            trainer = kept
            if incoming is not None:
                kind, payload = incoming
                handle = st.StateHandle(st.Disk(payload)) if kind == "disk" else st.at(
                    st.from_wire(payload))
                st.restore(trainer, handle.load())
            self.trainers[agent] = trainer
            timings["swap_in_s"] = time.perf_counter() - t0
            timings["resident_bytes"] = float(self.resident_bytes())
            timings["agent_bytes"] = float(self.agent_bytes(agent))
        return out_agent, out_state, timings
