"""Triple-buffer deployment per agent (issue 19 item 3), after the enterprise document's
"triple buffer policy update" (shadow / training / canary, heartbeats, snapshots):

- **shadow** serves production traffic and takes no gradient step (`AgentWorker`'s current
  engine);
- **training** learns online from captured, rewarded interactions (`online.OnlineLearner`),
  with a KL bound to the shadow;
- **canary**: every `canary_every` applied updates, a snapshot of the training policy is a
  candidate; it becomes the canary if its held-out score is at least `candidate_ratio` (0.95,
  the document's `current_best * 0.95`) of the shadow's. The canary gets `canary_share` of new
  requests (5% by default, the document's A/B share). Once it has `canary_min_feedback`
  feedback rewards (or after `canary_max_s`), it is scored against the shadow: the task's
  reward on held-out inputs (the same inputs and sampling noise for both: common random
  numbers), blended with the mean feedback of each version's traffic since the canary started
  (`feedback_weight`, when both have enough). Promoted to shadow when its score is at least
  the shadow's plus `margin`; rolled back otherwise (and the training policy restarts from the
  shadow).

Promotion and rollback are messages the engine thread applies between two steps (atomic for
admissions); requests in flight finish on the version that admitted them, which the response
reports. Every transition is versioned (a fresh version number) and appended to
`events.jsonl` (fsync'ed). Promoted weights are written to `<deploy_dir>/<agent>/v<N>/` with
`SHADOW` naming them, so a restarted server serves the last promoted shadow; the training
policy's full state (weights, optimizer) is snapshotted every `snapshot_every_s` (the
document's 5 minutes) and at each promotion, to `snapshot_url` (fsspec, `snapshots.py`), and
resumed on restart: rows claimed after the snapshot's step are handed back and trained again
into the restored weights, those it holds never are. Heartbeats: each agent's engine thread and its
learner beat every 2 s; a component silent for 3 beats is reported lost in /health and logged;
an engine thread that died is replaced by a fresh one over the same shadow and canary
(`failover` event), its requests answered with an error rather than left hanging.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file

from flexmarl.config.schema import ConfigError
from flexmarl.graph.chat import PromptRenderer
from flexmarl.graph.executor import GraphExecutor
from flexmarl.graph.meg import EpisodeContext
from flexmarl.policy.model import stable_seed
from flexmarl.rollout.engine import generate
from flexmarl.serving.adapters import save_adapter
from flexmarl.serving.agents import AgentSpec, ServeError, Version
from flexmarl.serving.online import OnlineLearner
from flexmarl.serving.snapshots import SnapshotStore
from flexmarl.serving.tenant_learning import TenantLearner, training_base
from flexmarl.types import GenerationRequest

if TYPE_CHECKING:
    from flexmarl.serving.tenant_learning import TenantLearner

HEARTBEAT_S = 2.0  # the enterprise document: a heartbeat every 2 s,
HEARTBEAT_MISSES = 3  # 3 missed ones mean the component is lost (reported; a dead engine
# thread is replaced at once: `Service.failover`)


@dataclass
class DeployConfig:
    """Triple-buffer deployment and online learning (`flexmarl serve` flags in brackets)."""

    learn: list[str] = field(default_factory=list)  # agents trained online [--learn]
    canary_share: float = 0.05  # [--canary-share]
    margin: float = 0.0  # promote when canary >= shadow + margin [--promote-margin]
    candidate_ratio: float = 0.95  # a snapshot becomes a canary at >= ratio * shadow held-out
    kl_max: float = 0.5  # nats per token, training vs shadow [--kl-max]
    is_max: float = 2.0  # truncation of the importance weights [--is-max]
    lr: float | None = None  # online learning rate (None: the agent's optim.lr) [--online-lr]
    batch: int = 64  # captured rows per online update [--online-batch]
    update_every_s: float = 0.0  # at most one update per this many seconds (the document's
    # cadence is 900: a PPO update every 15 minutes; 0: whenever a batch is ready)
    canary_every: int = 10  # applied updates between canary candidates [--canary-every]
    canary_min_feedback: int = 20  # canary responses with feedback before a decision
    canary_max_s: float = 300.0  # decide on what evidence there is after this long
    heldout: int = 256  # held-out task inputs to score versions on (0: feedback only)
    heldout_seed: int = 20260419
    feedback_weight: float = 0.5  # share of traffic feedback in a version's score
    min_temperature: float = 0.05  # rows sampled colder than this are not trained on
    tick_s: float = 0.2
    snapshot_every_s: float = 300.0
    deploy_dir: Path | None = None  # default RUN_DIR/serving
    snapshot_url: str | None = None  # fsspec URL of training snapshots (default deploy_dir)
    online_algorithm: str = "auto"  # grpo / ppo / auto (the agent's) [--online-algorithm]

    def validate(self) -> DeployConfig:
        checks = [
            ("--canary-share", 0 < self.canary_share <= 1, "must be in (0, 1]"),
            ("--kl-max", self.kl_max > 0, "must be > 0"),
            ("--online-lr", self.lr is None or self.lr > 0, "must be > 0"),
            ("--is-max", self.is_max >= 1, "must be >= 1 (1: weights never above 1)"),
            ("--online-batch", self.batch >= 2, "must be >= 2 (the batch is the baseline)"),
            ("--canary-every", self.canary_every >= 1, "must be >= 1"),
            ("--canary-min-feedback", self.canary_min_feedback >= 1, "must be >= 1"),
            ("--heldout", self.heldout >= 0, "must be >= 0"),
            ("--feedback-weight", 0 <= self.feedback_weight <= 1, "must be in [0, 1]"),
            ("candidate_ratio", self.candidate_ratio >= 0, "must be >= 0"),
            ("--canary-max-s", self.canary_max_s > 0, "must be > 0"),
            ("--snapshot-every", self.snapshot_every_s > 0, "must be > 0 seconds"),
            ("--update-every", self.update_every_s >= 0, "must be >= 0 seconds"),
        ]
        for flag, ok, what in checks:
            if not ok:
                raise ConfigError(f"serve: {flag} {what}")
        if self.heldout == 0 and self.feedback_weight == 0:
            raise ConfigError("serve: --heldout 0 with --feedback-weight 0 leaves nothing to "
                              "score a canary on")
        return self


class EventLog:
    """Append-only JSON lines, fsync'ed: the deployment's versioned history."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self.recent: list[dict[str, Any]] = []

    def log(self, event: str, agent: str, **fields: Any) -> dict[str, Any]:
        entry = {"time": time.time(), "event": event, "agent": agent, **fields}
        with self._lock:
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.recent = (self.recent + [entry])[-200:]
        return entry

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


def heldout_score(executor: GraphExecutor, models: dict[str, torch.nn.Module],
                  inputs: list[dict], temperatures: dict[str, float], seed: int) -> float:
    """Mean episode reward of the graph on `inputs` with `models`, every node decoded with
    noise keyed by (seed, input, node): two versions see the same noise. The nodes are the
    executor's (conditions, rendered prompts, text decoding, rewards), walked level by level
    so that each node's requests of all the episodes decode as one batch."""

    ctxs = [EpisodeContext(f"heldout-{i}", 0, dict(d)) for i, d in enumerate(inputs)]
    ran: list[dict[str, bool]] = [{} for _ in ctxs]
    for name in executor.order:
        calls = {}
        for i, ctx in enumerate(ctxs):
            inputs_ran = all(ran[i].get(d) for d in executor.graph.nodes[name].inputs)
            call = executor.prepare(ctx, name) if inputs_ran else None
            ran[i][name] = call is not None
            if call is not None:
                calls[i] = call
        agent = executor.graph.nodes[name].agent
        reqs = [GenerationRequest(str(i), agent, 0, list(c.prompt.tokens),
                                  c.prompt.max_new_tokens, c.prompt.allowed_tokens,
                                  list(c.prompt.stop_tokens), temperatures[agent],
                                  stop=list(c.prompt.stop),
                                  noise_seed=stable_seed(seed, i, name))
                for i, c in calls.items()]
        with torch.no_grad():
            results = generate(models[agent], reqs,
                               tokenizer=functools.partial(executor.renderer.tokenizer, agent))
        for res in results:
            i = int(res.sample_id)
            ctxs[i].outputs[name] = res.tokens
            if calls[i].is_text:
                ctxs[i].texts[name] = executor.renderer.decode(agent, res.tokens,
                                                               calls[i].prompt.stop)
    rewards = [executor.team_reward(ctx) if executor.graph.episode_reward is not None
               else sum(executor.node_rewards(ctx, [n for n in executor.order if ran[i][n]])
                        .values())
               for i, ctx in enumerate(ctxs)]
    return float(np.mean(rewards)) if rewards else 0.0


@dataclass
class Canary:
    version: Version
    model: torch.nn.Module
    started: float
    heldout: float | None


class AgentDeployment:
    """Shadow, training and canary of one agent."""

    def __init__(self, service: Any, name: str, cfg: DeployConfig, events: EventLog,
                 root: Path, store: SnapshotStore) -> None:

        self.service = service
        self.name = name
        self.cfg = cfg
        self.events = events
        self.root = root / name
        self.store = store
        self.spec: AgentSpec = service.run.agents[name]
        self.worker = service.workers[name]
        self.canary: Canary | None = None
        self.since_candidate = 0
        self.lock = threading.Lock()  # one transition or update at a time
        self.heldout_cache: dict[int, float] = {}
        self.beat = time.monotonic()
        self.last_snapshot = time.monotonic()
        self.last_update = float("-inf")
        self.learner: OnlineLearner | None = None
        self.tenant_learners: dict[str, TenantLearner] = {}
        if name in cfg.learn:
            run = service.run
            if service.capture is None:
                raise ConfigError(f"serve: --learn {name} trains on captured interactions: "
                                  "add --capture DB")
            if run.task is None:
                raise ServeError(f"--learn {name}: the run's task did not load: "
                                 f"{run.task_error}")
            if self.spec.tenant_adapters:  # a LoRA agent behind training tenants: each
                # tenant learns its own adapter, none learns the shared one (tenant_learning)
                base = training_base(self)  # held once, whatever the number of tenants
                self.tenant_learners = {t: TenantLearner(self, t, base)
                                        for t in self.spec.tenant_adapters}
                return
            self.learner = OnlineLearner(self.spec, run.task.vocab_size, run.task.max_seq_len,
                                         run.cfg.seed, run.device, cfg.kl_max, cfg.is_max, cfg.lr,
                                         cfg.online_algorithm)
            assert service.capture is not None
            self.learner.resume(self.store, service.capture, name, self._log)

    # --- scoring ---------------------------------------------------------------------------
    def _heldout(self, model: torch.nn.Module) -> float | None:
        svc = self.service
        task = svc.run.task
        if self.cfg.heldout == 0 or task is None or not set(task.graph.agents) <= set(
                svc.run.agents):
            return None
        rng = np.random.default_rng(self.cfg.heldout_seed)
        inputs = task.sample_inputs(rng, self.cfg.heldout)
        models = {n: s.model for n, s in svc.run.agents.items()}
        models[self.name] = model
        temps = {n: s.cfg.sampling.temperature for n, s in svc.run.agents.items()}
        executor = GraphExecutor(task.graph, PromptRenderer(svc.run.cfg.agents, task.vocab_size),
                                 svc.run.agents)
        return heldout_score(executor, models, inputs, temps, self.cfg.heldout_seed)

    def _shadow_heldout(self) -> float | None:
        v = self.spec.version.number
        if v not in self.heldout_cache:
            score = self._heldout(self.spec.model)
            if score is None:
                return None
            self.heldout_cache = {v: score}  # the others' shadows may change too: keep one
        return self.heldout_cache[v]

    # --- transitions -----------------------------------------------------------------------
    def start_canary(self, model: torch.nn.Module, source: str, policy_version: int | None,
                     gate: bool, share: float | None = None) -> dict[str, Any]:
        """Deploy `model` as the canary (after the candidate gate when `gate`)."""
        cand = self._heldout(model)
        shadow = self._shadow_heldout()
        if gate and cand is not None and shadow is not None and \
                cand < self.cfg.candidate_ratio * shadow:
            self.since_candidate = 0
            return self.events.log("candidate_rejected", self.name, source=source,
                                   heldout=cand, shadow_heldout=shadow,
                                   shadow_version=self.spec.version.number)
        if self.canary is not None:
            self.events.log("canary_replaced", self.name, version=self.canary.version.number)
        version = Version(self.spec.next_number(), source, policy_version, time.time())
        self.canary = Canary(version, model, time.time(), cand)
        self.worker.set_canary(model, version, share or self.cfg.canary_share)
        self.since_candidate = 0
        return self.events.log("canary_start", self.name, version=version.number,
                               source=source, share=share or self.cfg.canary_share,
                               heldout=cand, shadow_version=self.spec.version.number,
                               shadow_heldout=shadow)

    def ready(self) -> bool:
        c = self.canary
        if c is None:
            return False
        if time.time() - c.started >= self.cfg.canary_max_s:
            return True
        if self.cfg.feedback_weight == 0:
            return True
        fb = self.service.capture.feedback_by_version(
            self.name, c.started, self.service.learning_tenants) \
            if self.service.capture is not None else {}
        return fb.get(c.version.number, (0.0, 0))[1] >= self.cfg.canary_min_feedback

    def decide(self, force: bool = False) -> dict[str, Any] | None:
        """Score the canary against the shadow; promote or roll back (None: not yet)."""
        c = self.canary
        if c is None or not (force or self.ready()):
            return None
        shadow_v = self.spec.version
        fb = self.service.capture.feedback_by_version(
            self.name, c.started, self.service.learning_tenants) \
            if self.service.capture is not None else {}
        cf, sf = fb.get(c.version.number), fb.get(shadow_v.number)
        use_fb = self.cfg.feedback_weight > 0 and cf is not None and sf is not None and \
            min(cf[1], sf[1]) >= (1 if force else self.cfg.canary_min_feedback)
        ch, sh = c.heldout, self._shadow_heldout()
        fw = self.cfg.feedback_weight
        if ch is None or sh is None:  # no held-out set: feedback alone
            if not use_fb:
                return self._rollback(c, "no evidence: no held-out set and too little "
                                         "feedback", None, None)
            assert cf is not None and sf is not None  # use_fb says so
            c_score, s_score = cf[0], sf[0]
        elif use_fb:
            assert cf is not None and sf is not None
            c_score, s_score = (1 - fw) * ch + fw * cf[0], (1 - fw) * sh + fw * sf[0]
        else:
            c_score, s_score = ch, sh
        detail = {"canary_heldout": ch, "shadow_heldout": sh,
                  "canary_feedback": list(cf) if cf else None,
                  "shadow_feedback": list(sf) if sf else None,
                  "canary_score": c_score, "shadow_score": s_score, "margin": self.cfg.margin,
                  "shadow_version": shadow_v.number,
                  "served": {"canary": self.worker.admitted.get(c.version.number, 0)}}
        if c_score >= s_score + self.cfg.margin:
            return self._promote(c, detail)
        return self._rollback(c, "scored below the shadow", c_score, detail)

    def _promote(self, c: Canary, detail: dict[str, Any]) -> dict[str, Any]:
        old = self.spec.version.number
        self.spec.carry_tenant_adapters(c.model)  # those published since the canary began
        self.worker.promote()
        if self.spec.tenant_adapters:  # the canary's engine holds them as they were
            self.worker.swap(c.model, c.version)
        with self.spec.lock:
            self.spec.model, self.spec.version = c.model, c.version
        self.canary = None
        if c.heldout is not None:
            self.heldout_cache = {c.version.number: c.heldout}
        path = self._write_shadow(c)
        event = self.events.log("promote", self.name, version=c.version.number, previous=old,
                                source=c.version.source, snapshot=str(path), **detail)
        if self.learner is not None:  # the snapshot's steps cover what the new shadow holds,
            self.snapshot_training()  # so a restart re-delivers no row the shadow has learned
        return event

    def _rollback(self, c: Canary, why: str, score: float | None,
                  detail: dict[str, Any] | None) -> dict[str, Any]:
        self.worker.rollback()
        self.canary = None
        if self.learner is not None:  # training starts again from what serves
            self.learner.reset(self.spec.model, self.spec.version.number)
            self.since_candidate = 0
        return self.events.log("rollback", self.name, version=c.version.number, reason=why,
                               **{"shadow_version": self.spec.version.number, **(detail or {})})

    # --- snapshots -------------------------------------------------------------------------
    def _write_shadow(self, c: Canary) -> Path:

        folder = self.root / f"v{c.version.number}"
        folder.mkdir(parents=True, exist_ok=True)
        if self.spec.adapter is not None:  # a LoRA agent: its adapter alone
            save_adapter(folder, c.model, self.spec.adapter)
        else:
            tensors = {k: v.detach().contiguous().cpu() for k, v in c.model.state_dict().items()}
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
            config: Any = c.model.config  # a transformers model's config
            config.save_pretrained(str(folder))
        (folder / "flexmarl.json").write_text(json.dumps(
            {"agent": self.name, "version": c.version.number,
             "policy_version": c.version.policy_version, "source": c.version.source}))
        tmp = self.root / "SHADOW.tmp"
        tmp.write_text(folder.name)
        os.replace(tmp, self.root / "SHADOW")
        return folder

    def snapshot_training(self) -> None:
        """The training policy's full state, to the snapshot store (atomic for readers)."""
        for tl in self.tenant_learners.values():
            tl.snapshot()
            self.last_snapshot = time.monotonic()
        if self.learner is None:
            return
        self.learner.save_snapshot(self.store, self.name, self._log)
        self.last_snapshot = time.monotonic()

    def _log(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.events.log(event, self.name, **fields)

    # --- the loop --------------------------------------------------------------------------
    def tick(self) -> None:
        """One round: an online update when a batch is ready, a candidate when due, a canary
        decision when it has the evidence, a snapshot when due."""
        with self.lock:
            self.beat = time.monotonic()
            lr, capture = self.learner, self.service.capture
            started = time.monotonic()
            rep = None
            if lr is not None and capture is not None and \
                    started - self.last_update >= self.cfg.update_every_s:
                rep = lr.train_ready(capture, self.name, self.cfg.batch,
                                     self.cfg.min_temperature, self.spec.model,
                                     self.service.run.cfg.train.micro_batch_size,
                                     self.service.learning_tenants)  # None: every row
            if lr is not None and rep is not None:
                self.last_update = started
                self._log("train_step" if rep.applied else "kl_stop", **rep.fields(),
                          kl_max=self.cfg.kl_max, policy_version=lr.trainer.version,
                          shadow_version=self.spec.version.number)
                self.since_candidate += rep.applied
            if lr is not None and self.canary is None and \
                    self.service.team_canary is None and \
                    self.since_candidate >= self.cfg.canary_every:
                self.start_canary(lr.snapshot_model(self.spec.model),
                                  f"online-step-{lr.steps}", lr.trainer.version, gate=True)
            if self.canary is not None:
                self.decide()
            for tl in self.tenant_learners.values():
                tl.tick()
            if (lr is not None or self.tenant_learners) and \
                    time.monotonic() - self.last_snapshot >= self.cfg.snapshot_every_s:
                self.snapshot_training()

    def describe(self) -> dict[str, Any]:
        c = self.canary
        out: dict[str, Any] = {
            "shadow": self.spec.version.describe(),
            "canary": None if c is None else {**c.version.describe(), "heldout": c.heldout,
                                              "share": self.worker.canary_share},
            "admitted": dict(self.worker.admitted),
        }
        if self.learner is not None:
            out["training"] = {"steps": self.learner.steps, "applied": self.learner.applied,
                               "policy_version": self.learner.trainer.version,
                               "since_candidate": self.since_candidate}
        if self.tenant_learners:
            out["tenants"] = {t: {"adapter": tl.adapter, "steps": tl.learner.steps,
                                  "applied": tl.learner.applied,
                                  "served": self.spec.tenant_versions[t].describe()}
                              for t, tl in self.tenant_learners.items()}
        return out


class Deployment:
    """Every served agent's triple buffer, the events log and the heartbeats."""

    def __init__(self, service: Any, cfg: DeployConfig) -> None:
        cfg.validate()
        for name in cfg.learn:
            if name not in service.run.agents:
                raise ConfigError(f"serve: --learn {name}: not a served agent (agents: "
                                  f"{', '.join(service.run.agents)})")
        self.cfg = cfg
        self.root = cfg.deploy_dir or service.run.run_dir / "serving"
        self.events = EventLog(self.root / "events.jsonl")
        for e in self.events.read():  # version numbers stay fresh across restarts
            spec = service.run.agents.get(e.get("agent"))
            if spec is not None and isinstance(e.get("version"), int):
                spec.issued = max(spec.issued, e["version"])
        self.store = SnapshotStore(cfg.snapshot_url or str(self.root))
        self.agents = {n: AgentDeployment(service, n, cfg, self.events, self.root, self.store)
                       for n in service.run.agents}
        self.lost: set[str] = set()
        self.service = service
        self.events.log("deployment_start", "*", shadows={
            n: a.spec.version.number for n, a in self.agents.items()},
                        learn=cfg.learn, canary_share=cfg.canary_share)

    def heartbeats(self) -> dict[str, dict[str, Any]]:
        """Each component's seconds since its last beat, and whether it counts as lost."""
        now, limit = time.monotonic(), HEARTBEAT_S * HEARTBEAT_MISSES
        out: dict[str, dict[str, Any]] = {}
        for n, a in self.agents.items():
            beats = {"engine": now - a.worker.beat if a.worker.alive else float("inf")}
            if a.learner is not None or a.tenant_learners:
                beats["learner"] = now - a.beat
            if not a.worker.alive and not a.worker._stopped:
                self.service.failover(n)  # a dead thread: replaced at once, no 3 beats wait
            for part, age in beats.items():
                key = f"{n}.{part}"
                out[key] = {"age_s": round(age, 3) if age != float("inf") else None,
                            "ok": age <= limit}
                if age > limit and key not in self.lost:
                    self.lost.add(key)
                    self.events.log("heartbeat_lost", n, component=part, age_s=age)
                elif age <= limit:
                    self.lost.discard(key)
        return out

    def tick(self) -> None:
        for a in self.agents.values():
            a.tick()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.tick)
            except Exception as exc:  # noqa: BLE001 - logged; serving goes on
                self.events.log("deployment_error", "*", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(1.0)
            self.heartbeats()
            await asyncio.sleep(self.cfg.tick_s)

    def close(self) -> None:
        for a in self.agents.values():
            if (a.learner is not None and a.learner.steps) or any(
                    tl.learner.steps for tl in a.tenant_learners.values()):
                with a.lock:
                    a.snapshot_training()
