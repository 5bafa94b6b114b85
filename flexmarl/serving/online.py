"""Online experience: the training policy learns from captured, rewarded interactions.

Rows come from the capture store (`Capture.claim`: marked consumed in the same transaction that
picks them, before training, so none is trained on twice, across restarts too). They were
sampled by whichever version served them (the shadow, or a canary), not by the training policy,
so the update is off-policy and is corrected explicitly and boundedly:

- each row's weight is the truncated importance ratio of its response under the training
  policy (before this update) to its probability under the serving version, recorded at
  serving time: w = min(is_max, prod_t pi_train(y_t) / pi_serve(y_t)) (IMPALA's truncated
  importance sampling, at the sequence level); rows served by exactly the training policy's
  current weights get w = 1;
- the loss is the project's GRPO loss (`training.algorithms.grpo`, through `AgentTrainer`)
  with the batch as the group, the advantage times w, and the PPO ratio taken against the
  training policy before the update (the proximal policy of decoupled PPO), so the clip bounds
  how far one update moves the training policy whatever the serving version was.
- or PPO (the agent's algorithm, or `--online-algorithm ppo`): a critic (the trainer's value
  head) is the baseline, GAE runs over the response tokens from the row's reward, and the
  served log-probs are the behaviour policy's, so the clipped ratio pi_train / pi_serve is
  the importance weight (the truncation above is reported, not applied).

After each optimizer step the KL divergence from the training policy to the shadow (mean per
response token, on this batch's prompts, over each row's allowed tokens at its temperature) is
measured; above `kl_max` the step is undone (weights and optimizer restored) and its rows are
settled as "kl_stop": an update that drifts too far from what serves never stands.
"""

from __future__ import annotations

import collections
import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flexmarl.config.schema import GRPOConfig, PPOConfig
from flexmarl.policy.adapters import adapter_tensors, load_adapter
from flexmarl.policy.sampling import TokenBatch, make_token_batch, response_forward
from flexmarl.serving.adapters import with_adapter
from flexmarl.serving.agents import AgentSpec, ServeError
from flexmarl.serving.capture import Capture, CapturedRow
from flexmarl.serving.snapshots import SnapshotStore
from flexmarl.training.algorithms import grpo
from flexmarl.training.trainer import AgentTrainer
from flexmarl.types import Sample

# an event log's `log` with the agent (and tenant) already given: log(event, **fields)
EventSink = Callable[..., Any]


def importance_weights(train_logprobs: list[list[float]], serve_logprobs: list[list[float]],
                       is_max: float) -> list[float]:
    """Truncated sequence importance weights min(is_max, exp(sum(train - serve))), one per row.

    Computed in log space (a long response's product of ratios would overflow)."""
    out = []
    for t, s in zip(train_logprobs, serve_logprobs, strict=True):
        if len(t) != len(s):
            raise ValueError(f"{len(t)} training log-probs for {len(s)} served tokens")
        log_w = float(sum(t) - sum(s))
        out.append(is_max if log_w >= math.log(is_max) else math.exp(log_w))
    return out


def _dists(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Log-probabilities [B, R, V] over the vocabulary at each response position (masked,
    tempered: the distribution the row's tokens were sampled from)."""
    width = batch.input_ids.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    logits = out.logits.float()
    rwidth = batch.response_tokens.shape[1]
    steps = torch.arange(rwidth, device=batch.response_start.device)
    idx = (batch.response_start.unsqueeze(1) + steps.unsqueeze(0) - 1).clamp(0, width - 1)
    picked = logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    picked = picked / batch.temperature.unsqueeze(-1)
    picked = picked.masked_fill(~batch.allowed.unsqueeze(1), float("-inf"))
    return F.log_softmax(picked, dim=-1)


def policy_kl(model: torch.nn.Module, reference: torch.nn.Module, batch: TokenBatch) -> float:
    """KL(model || reference) per response token, averaged over the batch's tokens."""
    with torch.no_grad():
        lp = _dists(model, batch)
        lq = _dists(reference, batch)
        p = lp.exp()
        terms = torch.where(p > 0, p * (lp - lq.clamp(min=-1e30)), torch.zeros_like(p))
        kl = terms.sum(-1)  # [B, R]
        mask = batch.response_mask
        return float((kl * mask).sum() / mask.sum().clamp(min=1.0))


@dataclass
class StepReport:
    """What one online update did (the events log's `train_step` / `kl_stop`)."""

    step: int
    ids: list[str]
    applied: bool
    kl: float
    mean_reward: float
    is_weight_mean: float
    is_weight_min: float
    is_weight_max: float
    truncated: int  # rows whose weight hit is_max
    off_policy: int  # rows served by a version other than the training policy's weights
    metrics: dict[str, float]

    def fields(self) -> dict[str, Any]:
        """The update as the events log writes it."""
        return {"step": self.step, "rows": len(self.ids), "ids": self.ids, "kl": self.kl,
                "mean_reward": self.mean_reward, "is_weight_mean": self.is_weight_mean,
                "is_weight_min": self.is_weight_min, "is_weight_max": self.is_weight_max,
                "truncated": self.truncated, "off_policy": self.off_policy}


class OnlineLearner:
    """The training buffer of one agent: an `AgentTrainer` fed by captured rows."""

    def __init__(self, spec: AgentSpec, vocab: int, max_seq_len: int, run_seed: int,
                 device: str, kl_max: float, is_max: float, lr: float | None = None,
                 algorithm: str = "auto", adapter: str | None = None,
                 shared_base: torch.nn.Module | None = None) -> None:
        """`adapter`: a LoRA agent's adapter in the served model this learner trains (the
        shadow's by default; a training tenant's own): only it is read, trained and
        published, the base stays shared and frozen. `shared_base`: the agent's base built
        once (float32, on `device`) for every tenant's learner, which wraps a tree over its
        tensors instead of building a base of its own."""

        cfg = spec.cfg
        if algorithm == "auto":
            if not isinstance(cfg.algorithm, (GRPOConfig, PPOConfig)):
                raise ServeError(f"--learn {spec.name}: online learning uses GRPO or PPO (the "
                                 f"agent's algorithm is {cfg.algorithm.name}); set "
                                 "algorithm.name: grpo or ppo for it, or --online-algorithm")
        elif algorithm in ("grpo", "ppo"):
            if cfg.algorithm.name != algorithm:  # the online loss, overriding the run's
                cfg = cfg.model_copy(update={"algorithm": GRPOConfig() if algorithm == "grpo"
                                             else PPOConfig()})
        else:
            raise ServeError(f"--online-algorithm {algorithm}: expected auto, grpo or ppo")
        if (cfg.lora is None) != (spec.adapter is None):
            raise ServeError(f"--learn {spec.name}: the served model and the agent's config "
                             "disagree on LoRA (served unmerged adapters need agents."
                             f"{spec.name}.lora)")
        self.spec = spec
        self.adapter = adapter or spec.adapter  # None: full weights
        self.algorithm: GRPOConfig | PPOConfig = cfg.algorithm  # type: ignore[assignment]
        self.vocab = spec.vocab  # the model's (a path model may have more than the task)
        self.kl_max = kl_max
        self.is_max = is_max
        self.trainer = AgentTrainer(spec.name, cfg, vocab, max_seq_len, run_seed,
                                    device=device, shared_base=shared_base)
        if lr is not None:  # online updates often want a smaller step than offline training
            for group in self.trainer.optimizer.param_groups[:1]:
                group["lr"] = group["base_lr"] = lr
        self.steps = 0  # updates attempted (the consumed table's step numbers)
        self.applied = 0  # updates that stood
        self.same_version: int | None = None  # served version whose weights the trainer holds
        self.last_weights: list[float] = []  # the importance weights of the last update
        self.reset(spec.model, spec.version.number)

    def reset(self, model: torch.nn.Module, version: int | None) -> None:
        """Start again from `model`'s weights (served `version`), with a fresh optimizer."""
        if self.adapter is not None:  # the served adapter into the trainer's own
            load_adapter(self.trainer.model, "default", adapter_tensors(model, self.adapter))
        else:
            params = next(self.trainer.model.parameters())
            self.trainer.model.load_state_dict({k: v.detach().to(params.device, torch.float32)
                                                if v.is_floating_point() else v
                                                for k, v in model.state_dict().items()})
        self.trainer.optimizer.state = collections.defaultdict(dict)
        self.same_version = version

    def restore_snapshot(self, snap: tuple[Any, dict[str, Any]] | None) -> int:
        """A snapshot's trainer state and step counters (None: nothing to restore); returns
        the steps it holds, after which the claims journal re-delivers rows. The weights are
        then no served version's."""
        if snap is None:
            return 0
        self.trainer.set_state(*snap)
        self.steps, self.applied = int(snap[1].get("steps", 0)), int(snap[1].get("applied", 0))
        self.same_version = None
        return self.steps

    def snapshot_model(self, like: torch.nn.Module) -> torch.nn.Module:
        """The training policy's current weights in a serving copy of `like` (a LoRA agent: a
        light copy, the trained adapter in place of the served one, the base shared)."""
        if self.adapter is not None:
            return with_adapter(like, self.adapter, self.published())
        model = copy.deepcopy(like)
        p = next(model.parameters())
        model.load_state_dict({k: v.to(p.device, p.dtype) if v.is_floating_point() else v
                               for k, v in self.trainer.weights().items()}, strict=False)
        return model.eval()

    def published(self) -> dict[str, torch.Tensor]:
        """What a new version of this policy publishes: a LoRA agent's adapter alone (its
        A and B tensors), else every weight."""
        if self.adapter is not None:
            return adapter_tensors(self.trainer.model)
        return {k: v.detach().cpu() for k, v in self.trainer.weights().items()}

    def _batch(self, rows: list[CapturedRow]) -> TokenBatch:
        return make_token_batch([r.prompt for r in rows], [r.response for r in rows],
                                [r.allowed for r in rows], [r.temperature for r in rows],
                                self.vocab).to(self.trainer.device)

    def train(self, rows: list[CapturedRow], shadow: torch.nn.Module, capture: Capture,
              micro_batch: int) -> StepReport:
        """One update on claimed `rows`, kept only if the KL to `shadow` stays within bound."""

        self.steps += 1
        batch = self._batch(rows)
        with torch.no_grad():
            lp, _, _ = response_forward(self.trainer.model, batch)
        lp = lp.float().cpu()
        train_lps = [lp[i, :len(r.response)].tolist() for i, r in enumerate(rows)]
        weights = importance_weights(train_lps, [r.logprobs for r in rows], self.is_max)
        same = [r.version == self.same_version for r in rows]
        weights = [1.0 if s else w for s, w in zip(same, weights, strict=True)]
        self.last_weights = weights
        rewards = [r.reward for r in rows]
        if isinstance(self.algorithm, PPOConfig):
            # PPO: the served log-probs are the behaviour policy's, so the clipped ratio
            # pi_train / pi_served is the (clipped) importance weight; the critic is the
            # baseline and GAE runs over the response tokens from the row's reward
            samples = [Sample(r.id, r.prompt, r.response, list(r.logprobs), float(r.reward),
                              r.allowed, r.temperature, self.trainer.version, r.reward)
                       for r in rows]
        else:
            adv = grpo.group_advantages(rewards, self.algorithm)
            samples = [Sample(r.id, r.prompt, r.response, train_lps[i], adv[i] * weights[i],
                              r.allowed, r.temperature, self.trainer.version, r.reward)
                       for i, r in enumerate(rows)]
        before = self.trainer.get_state()
        for i in range(0, len(samples), micro_batch):
            self.trainer.accumulate(samples[i:i + micro_batch])
        metrics = self.trainer.step()
        kl = policy_kl(self.trainer.model, shadow, batch) if not metrics.get("skipped") else 0.0
        applied = kl <= self.kl_max and not metrics.get("skipped")
        if not applied:
            self.trainer.set_state(*before)
        else:
            self.applied += 1
            self.same_version = None  # the weights are now no served version's
        capture.settle([r.id for r in rows], "trained" if applied else
                       ("kl_stop" if kl > self.kl_max else "skipped"))
        w = np.asarray(weights)
        off = [not s for s in same]
        return StepReport(self.steps, [r.id for r in rows], applied, kl,
                          float(np.mean(rewards)), float(w.mean()), float(w.min()),
                          float(w.max()), int(sum(x >= self.is_max for x in w)), sum(off),
                          {k: float(v) for k, v in metrics.items()
                           if isinstance(v, (int, float))})

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        arrays, meta = self.trainer.get_state()
        return arrays, {**meta, "steps": self.steps, "applied": self.applied}

    # --- recovery and the update round: the in-process deployment, a tenant's learner and
    # the serve-learn process run the same ones, under their snapshot and claims key -----------
    def resume(self, store: SnapshotStore, capture: Capture, key: str, log: EventSink) -> None:
        """Recovery after a crash: restore the last snapshot's parameters and optimizer, then
        hand back every row claimed after the snapshot's step (claimed but not trained, or
        trained into weights the crash lost), so each is trained into the restored lineage
        exactly once; rows the snapshot holds stay consumed. Logs each phase's time."""
        t0 = time.perf_counter()
        snap = store.read(key)
        steps = self.restore_snapshot(snap)
        t1 = time.perf_counter()
        ids = capture.release(key, steps)
        if snap is None and not ids:
            return  # a first start: nothing to recover
        log("training_resumed", steps=steps,
            policy_version=snap[1]["version"] if snap is not None else None,
            snapshot=snap is not None, url=store.url, restore_s=round(t1 - t0, 4),
            redeliver_s=round(time.perf_counter() - t1, 4), redelivered=len(ids),
            redelivered_ids=ids)

    def save_snapshot(self, store: SnapshotStore, key: str, log: EventSink) -> None:
        """The training policy's full state to the snapshot store (atomic for readers)."""
        arrays, meta = self.state()
        t0 = time.perf_counter()
        path = store.write(key, arrays, meta)
        log("training_snapshot", steps=self.steps, policy_version=meta["version"], url=path,
            write_s=round(time.perf_counter() - t0, 4))

    def train_ready(self, capture: Capture, agent: str, batch: int, min_temperature: float,
                    shadow: torch.nn.Module, micro_batch: int,
                    tenants: list[str] | None = None,
                    key: str | None = None) -> StepReport | None:
        """An update on the oldest `batch` rewarded rows of `agent` (served to `tenants`;
        claimed under `key`'s claims journal) when that many are ready; None when not."""
        if capture.available(agent, min_temperature, tenants) < batch:
            return None
        rows = capture.claim(agent, batch, self.steps + 1, min_temperature, tenants,
                             learner=key)
        return self.train(rows, shadow, capture, micro_batch) if rows else None
