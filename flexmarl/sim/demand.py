"""The simulator's demand for the planner (`planning.planner.Demand`): phases and training
priced by the cost model on the workload's distributions, or (`measured`) on the lengths,
prompts and training cost per token the simulated runtime measured since the last plan.
Units: accelerators. A real runtime's is `planning.demand.MeasuredDemand`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from flexmarl.planning.planner import Node
from flexmarl.sim.cost import CostModel
from flexmarl.sim.workload import Workload


class CostModelDemand:
    """The simulator's demand for one plan. The measurements are the host's, shared by
    reference: `lengths` and `prompts` (each agent's output and prompt lengths since the last
    plan), `train_cost` (per agent: busy training accelerator-seconds and the tokens they
    trained), and `measured_rollout()` (busy rollout accelerator-seconds per agent since it
    was last called; read only by the static split)."""

    priced = True

    def __init__(self, wl: Workload, cost: CostModel, measured: bool,
                 lengths: Mapping[str, list[int]], prompts: Mapping[str, list[int]],
                 train_cost: Mapping[str, Sequence[float]],
                 measured_rollout: Callable[[], dict[str, float]]) -> None:
        self.wl, self.cost, self.measured = wl, cost, measured
        self.name = wl.name
        self.nodes: list[Node] = [(n.id, n.agent, n.inputs) for n in wl.episode_nodes()]
        self.agents = [a.name for a in wl.agents]
        self.trainable = [a.name for a in wl.agents if a.trainable]
        self.units = {a.name: a.tp for a in wl.agents}
        self.min_train = {a: cost.min_train_accelerators(wl.agent(a).model)
                          for a in self.trainable}
        self.lengths, self.prompts, self.train_cost = lengths, prompts, train_cost
        self.measured_rollout = measured_rollout
        self._phases: dict[str, tuple[np.ndarray, int]] | None = None
        self._memo: dict[tuple[str, int], tuple[float, float]] = {}

    def phase_time(self, agent: str, r: int) -> tuple[float, float]:
        """The cost model's generation timing of one round's lengths dealt to r replicas."""
        if (agent, r) not in self._memo:
            if self._phases is None:
                self._phases = self.phases()
            lengths, prompt = self._phases[agent]
            spec = self.wl.agent(agent)
            timing = self.cost.generation_timing(spec.model, spec.tp, prompt, lengths[::r])
            self._memo[agent, r] = float(timing.finish_s.mean()), timing.total_s
        return self._memo[agent, r]

    def node_seconds(self, replicas: Mapping[str, int] | None) -> dict[str, float]:
        """Each node at its agent's mean phase time on the planned replicas (no more
        replicas than the round has requests)."""
        if replicas is None:
            return {}
        if self._phases is None:
            self._phases = self.phases()
        phases = self._phases
        return {n: self.phase_time(a, max(1, min(replicas[a], len(phases[a][0]))))[0]
                for n, a, _ in self.nodes}

    def rollout_work(self) -> dict[str, float]:
        """Busy rollout accelerator-seconds once measured, else the estimate
        (`rollout_estimate`)."""
        return self.measured_rollout() if self.measured else self.rollout_estimate()

    def rollout_estimate(self) -> dict[str, float]:
        """Estimated accelerator-seconds per iteration of each agent's rollout (cost x
        tokens), before anything is measured: the equal-split baselines' rollout/training
        split follows it."""
        wl, cost = self.wl, self.cost
        out = {}
        for a in wl.agents:
            calls = wl.calls_per_episode(a.name) * wl.episodes_per_iteration
            tokens = calls * a.output_length.mean
            # per-token cost at a typical batch of 64 sequences
            step = cost.decode_step_time(a.model, a.tp, 64, 64 * (self.expected_prompt(a.name)
                                                                   + 256))
            out[a.name] = tokens * step * a.tp / 64
        return out

    def expected_prompt(self, agent: str) -> float:
        """An agent's mean prompt over its nodes of the full graph: its own prompt plus, with
        `append_inputs`, its inputs' mean outputs (a summariser reading three 2,048-token
        drafts trains on 4x the tokens its own prompt says; leaving them out once made the
        first plan starve its training)."""
        spec = self.wl.agent(agent)
        mine = [inputs for _, a, inputs in self.nodes if a == agent]
        if not spec.append_inputs or not mine:
            return spec.prompt_length.mean
        agent_of = {node: a for node, a, _ in self.nodes}
        added = sum(self.wl.agent(agent_of[i]).output_length.mean
                    for inputs in mine for i in inputs) / len(mine)
        return spec.prompt_length.mean + added

    def train_seconds(self) -> dict[str, float]:
        """Accelerator-seconds of training each agent needs per iteration: its rows' tokens
        (the last iteration's requests once measured) x its training cost per token (measured
        busy accelerator-seconds per trained token once it has trained, else the cost model's
        6 x params / (peak x MFU)). Per token, not per step: the cost stays the same whatever
        number of accelerators did the work, so the measurement does not follow the plan."""
        wl, cost, measured = self.wl, self.cost, self.measured
        out = {}
        for a in wl.agents:
            if not a.trainable:
                continue
            if measured and self.lengths.get(a.name):
                tokens = float(sum(self.lengths[a.name]) + sum(self.prompts[a.name]))
            else:
                calls = wl.calls_per_episode(a.name) * wl.episodes_per_iteration
                tokens = calls * (self.expected_prompt(a.name) + a.output_length.mean)
            spent, trained = self.train_cost.get(a.name, (0.0, 0.0))
            rate = (spent / trained if measured and trained > 0
                    else cost.train_compute_time(a.model, 1, 1.0) + cost.policy_forwards_time(
                        a.model, 1, 1.0, wl.training.forward_passes))
            out[a.name] = rate * tokens
        return out

    def train_calls(self) -> dict[str, float]:
        wl = self.wl
        mb = wl.micro_batch_size
        return {a: wl.calls_per_episode(a) * wl.episodes_per_iteration / mb + 1
                for a in self.trainable}

    def swap_seconds(self, agent: str, g: int) -> float:
        return self.cost.train_state_swap_time(self.wl.agent(agent).model, g)

    def phases(self) -> dict[str, tuple[np.ndarray, int]]:
        """Per agent, one round's output lengths (longest first) and the mean prompt length:
        the last iteration's requests once measured, else quantiles of the workload's
        distributions for every call of the full graph."""
        wl = self.wl
        out = {}
        for a in wl.agents:
            rounds = len(wl.agent_rounds(a.name))
            lengths = self.lengths.get(a.name) if self.measured else None
            if lengths:
                ordered = np.sort(np.asarray(lengths, dtype=np.int64))[::-1][::rounds]
                prompt = round(float(np.mean(self.prompts[a.name])))
            else:
                n = wl.episodes_per_iteration * wl.copies_per_round(a.name)
                ordered = np.array([max(1, a.output_length.draw(1 - (i + 0.5) / n))
                                    for i in range(n)], dtype=np.int64)
                ordered[::-1].sort()
                prompt = round(self.expected_prompt(a.name))
            out[a.name] = (ordered, prompt)
        return out
