"""The served run behind the HTTP routes: one `AgentWorker` per agent, generation as a stream
of pieces ending in an outcome, canary routing, and reload without a restart."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from flexmarl.policy.device import kv_token_budget
from flexmarl.serving.agents import (
    ServedRun,
    Version,
    explicit_source,
    resolve_source,
)
from flexmarl.serving.capture import Capture
from flexmarl.serving.deploy import Canary, DeployConfig, Deployment
from flexmarl.serving.drift import DriftConfig, DriftMonitor
from flexmarl.serving.protocol import (
    ApiError,
    Limits,
    Sampling,
    TextStream,
    bad,
    token_text,
)
from flexmarl.serving.team import TeamCanary, TeamCanaryConfig
from flexmarl.serving.tenants import Tenants
from flexmarl.serving.worker import AgentWorker, Job, ServeRequest

GREEDY_TEMPERATURE = 1e-4  # temperature 0 is served as (numerically) greedy decoding


@dataclass
class Piece:
    text: str
    tokens: list[int]
    logprobs: list[float]
    version: Version | None = None


@dataclass
class Outcome:
    text: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    version: Version


class Service:
    """The served run: agents, their workers, limits, and reload."""

    def __init__(self, run: ServedRun, limits: Limits | None = None,
                 api_key: str | None = None, max_batch_seqs: int | None = None,
                 capture: Capture | None = None, deploy: DeployConfig | None = None,
                 tenants: Tenants | None = None, drift: DriftConfig | None = None) -> None:

        self.run = run
        self.limits = limits or Limits()
        if api_key and tenants is not None:
            raise ValueError("an API key and tenants together: the tenants' keys replace it")
        self.api_key = api_key
        self.tenants = tenants
        self.capture = capture
        self.workers: dict[str, AgentWorker] = {}
        rcfg = run.cfg.rollout
        for name, spec in run.agents.items():
            if spec.adapter is not None and tenants is not None and tenants.trainers and \
                    not spec.tenant_adapters:  # each training tenant learns its own adapter
                spec.add_tenant_adapters(tenants.trainers, run.run_dir / "serving" / name /
                                         "tenants")
            budget = kv_token_budget(rcfg.max_batch_tokens, spec.model,
                                     rcfg.kv_memory_fraction / max(len(run.agents), 1))
            worker = AgentWorker(name, spec.model, spec.version,
                                 max_batch_seqs or rcfg.max_batch_seqs, budget, spec.adapters)
            worker.tenant_versions = {spec.tenant_adapters[t]: v
                                      for t, v in spec.tenant_versions.items()}
            self.workers[name] = worker
        self.started = time.time()
        self._reload_lock = asyncio.Lock()
        self.deployment = Deployment(self, deploy) if deploy is not None else None
        self.team_canary: TeamCanary | None = None
        # on by default with captured feedback (flexmarl serve); off for a bare Service
        self.drift = DriftMonitor(self, drift) if drift is not None and drift.window > 0 \
            and capture is not None else None

    def close(self) -> None:
        if self.deployment is not None:
            self.deployment.close()
        for w in self.workers.values():
            w.stop()
        if self.capture is not None:
            self.capture.close()

    @property
    def learning_tenants(self) -> list[str] | None:
        """The tenants whose traffic online learning may train on (None: no tenants, all)."""
        return self.tenants.trainers if self.tenants is not None else None

    @property
    def pending(self) -> int:
        return sum(w.pending for w in self.workers.values())

    def agent(self, body: dict) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model", f"required: the agent to ask (one of {', '.join(self.workers)})")
        if model not in self.workers:
            raise ApiError(404, f"model {model!r} is not served here (agents: "
                                f"{', '.join(self.workers)})", "model", code="model_not_found")
        return model

    # --- generation ----------------------------------------------------------------------------
    async def _raw(self, s: Sampling, deltas: bool) -> AsyncGenerator[tuple, None]:
        if self.pending >= self.limits.max_pending:
            raise ApiError(429, f"server busy: {self.pending} requests in flight (limit "
                                f"{self.limits.max_pending}, --max-pending); retry later",
                           kind="rate_limit_error", code="busy")
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple] = asyncio.Queue()
        spec = s.agent
        stops = list(s.stop_token_ids)
        if spec.tokenizer is not None and not s.token_ids_out:
            eos = spec.tokenizer.eos_token_id
            if isinstance(eos, int) and eos not in stops:
                stops.append(eos)
        request = ServeRequest(
            sample_id=s.request_id, agent=spec.name, version=0, prompt=s.prompt,
            max_new_tokens=s.max_tokens, allowed_tokens=s.allowed_token_ids, stop_tokens=stops,
            temperature=max(s.temperature, GREEDY_TEMPERATURE),
            noise_seed=(s.seed & ((1 << 63) - 1)) if s.seed is not None
            else uuid.uuid4().int & ((1 << 63) - 1),
            top_p=s.top_p, adapter=spec.tenant_adapters.get(s.tenant or ""))
        worker = self.workers[spec.name]
        if not worker.alive and not worker._stopped:
            worker = self.failover(spec.name)
        # a training tenant's own adapter serves it: never the (shared) canary's share
        pin = "shadow" if request.adapter is not None else s.pin
        worker.submit(Job(request, lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item),
                          deltas=deltas, pin=pin))
        finished = False
        try:
            while True:
                item = await inbox.get()
                # a busy server coalesces the steps queued meanwhile: one chunk, not many
                while item[0] == "tokens" and not inbox.empty():
                    nxt = inbox.get_nowait()
                    if nxt[0] != "tokens":
                        yield item
                        item = nxt
                        break
                    item = ("tokens", item[1] + nxt[1], item[2] + nxt[2], nxt[3])
                if item[0] != "tokens":
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the client went away, or a stop string ended it
                worker.cancel(request.sample_id)

    async def generate(self, s: Sampling) -> AsyncIterator[Piece | Outcome]:
        """Pieces of new text as they are decoded (streams and stop strings), then the Outcome."""
        deltas = s.stream or bool(s.stop)
        spec = s.agent
        text = TextStream(spec.tokenizer, s.stop) if not s.token_ids_out else None
        tokens: list[int] = []
        logprobs: list[float] = []
        stopped = False
        gen = self._raw(s, deltas)
        try:
            async for item in gen:
                if item[0] == "error":
                    raise ApiError(500, item[1], kind="server_error")
                if item[0] == "tokens":
                    if stopped:
                        continue
                    _, toks, lps, _version = item
                    tokens += toks
                    logprobs += lps
                    if text is not None:
                        piece = text.push(toks)
                        if text.stopped:
                            stopped = True
                            await gen.aclose()  # cancels the rest of the decoding
                    else:
                        piece = (" " if len(tokens) > len(toks) else "") + token_text(toks)
                    yield Piece(piece, toks, lps, _version)
                    if stopped:
                        break
                    continue
                _, result, version = item
                if not deltas:
                    tokens, logprobs = list(result.tokens), list(result.logprobs)
                break
        finally:
            await gen.aclose()
        if stopped:
            reason = "stop"
            version = self.workers[spec.name].version if _version is None else _version
        else:
            reason = ("stop" if tokens and tokens[-1] in (s.stop_token_ids + (
                [spec.tokenizer.eos_token_id] if spec.tokenizer is not None
                and not s.token_ids_out else [])) else "length")
        if text is not None:
            if deltas:
                rest = text.flush()
                if rest:
                    yield Piece(rest, [], [])
                full = text.text
            else:
                assert spec.tokenizer is not None  # a text stream implies a tokenizer
                full = spec.tokenizer.decode(tokens, skip_special_tokens=True)
        else:
            full = token_text(tokens)
        if self.capture is not None and s.response_id is not None:
            # durable before the response (or a stream's last chunk) is sent
            await asyncio.to_thread(self.capture.record, s.response_id, spec.name,
                                    version.describe(), s.endpoint, s.prompt, tokens, logprobs,
                                    full, reason, max(s.temperature, GREEDY_TEMPERATURE),
                                    s.top_p, s.allowed_token_ids, s.episode, s.tenant)
        yield Outcome(full, tokens, logprobs, reason, version)

    def failover(self, name: str) -> AgentWorker:
        """Replace an agent's dead engine thread with a fresh one over the same versions (the
        shadow, and the canary with its share); the dead one's jobs were already answered with
        an error. Logged in the deployment's events."""
        old = self.workers[name]
        if old.alive:
            return old
        spec = self.run.agents[name]
        new = AgentWorker(name, spec.model, spec.version, old.max_seqs, old.max_tokens,
                          spec.adapters)
        new.tenant_versions = dict(old.tenant_versions)
        dep = self.deployment.agents.get(name) if self.deployment is not None else None
        if dep is not None and dep.canary is not None:
            new.set_canary(dep.canary.model, dep.canary.version, old.canary_share)
        new.admitted = dict(old.admitted)
        self.workers[name] = new
        if dep is not None and self.deployment is not None:
            dep.worker = new
            self.deployment.events.log("failover", name, component="engine", error=old.error,
                                       version=spec.version.number)
        else:
            print(f"failover: agent {name!r}: engine thread lost ({old.error}); replaced",
                  flush=True)
        return new

    # --- team canary ---------------------------------------------------------------------------
    def start_team_canary(self, paths: dict[str, str], cfg: TeamCanaryConfig) -> dict[str, Any]:
        """Load new weights for the agents in `paths` as one team canary (`team.py`)."""
        if self.team_canary is not None:
            raise ApiError(409, "a team canary is in flight: decide it first "
                                "(POST /v1/admin/team-canary/decide)", code="team_canary_busy")
        if cfg.score == "feedback" and self.capture is None:
            raise bad("score", "\"feedback\" needs captured episodes: start the server with "
                               "--capture DB (or score \"task\")")
        for name in paths:
            if name not in self.workers:
                raise ApiError(404, f"agents.{name}: not served here (agents: "
                                    f"{', '.join(self.workers)})", "agents")
        busy = [n for n, w in self.workers.items() if w.canary_version is not None]
        if busy:
            raise ApiError(409, f"agent canary in flight for {', '.join(busy)}: decide it "
                                "before a team canary", code="canary_busy")
        versions, models = {}, {}
        for name, path in paths.items():
            spec = self.run.agents[name]
            source = explicit_source(path)
            models[name] = spec.next_model(source)
            versions[name] = Version(spec.next_number(), f"team-{source.label}",
                                     source.policy_version, time.time())
        for name in paths:  # share 0: only pinned episodes reach these engines
            self.workers[name].set_canary(models[name], versions[name], 0.0)
        self.team_canary = TeamCanary(versions, models, cfg)
        return self._team_event("team_canary_start", versions={
            n: v.number for n, v in versions.items()}, shadows={
            n: self.run.agents[n].version.number for n in versions}, share=cfg.share,
            min_episodes=cfg.min_episodes, confidence=cfg.confidence, margin=cfg.margin,
            score=cfg.score)

    def decide_team(self, force: bool = False) -> dict[str, Any] | None:
        """Apply the team canary's verdict when it has one (promote or roll back every agent
        of the vector together); None while it waits for evidence."""
        tc = self.team_canary
        if tc is None:
            return None
        verdict, stats = tc.verdict(force)
        if verdict is None:
            return None
        self.team_canary = None
        previous = {n: self.run.agents[n].version.number for n in tc.versions}
        for name, version in tc.versions.items():
            worker, spec = self.workers[name], self.run.agents[name]
            if verdict == "promote":
                spec.carry_tenant_adapters(tc.models[name])
                worker.promote()
                if spec.tenant_adapters:  # the canary's engine holds them as they were
                    worker.swap(tc.models[name], version)
                with spec.lock:
                    spec.model, spec.version = tc.models[name], version
                dep = self.deployment.agents.get(name) if self.deployment is not None else None
                if dep is not None:  # a restart serves the promoted vector (SHADOW files)
                    dep.heldout_cache = {}
                    dep._write_shadow(Canary(version, tc.models[name], tc.started, None))
                    if dep.learner is not None:  # training goes on from what now serves
                        dep.learner.reset(tc.models[name], version.number)
                        dep.since_candidate = 0
            else:
                worker.rollback()
        return self._team_event(f"team_{verdict}", versions={
            n: v.number for n, v in tc.versions.items()}, previous=previous, **stats)

    def _team_event(self, event: str, **fields: Any) -> dict[str, Any]:
        if self.deployment is not None:
            return self.deployment.events.log(event, "team", **fields)
        entry = {"time": time.time(), "event": event, "agent": "team", **fields}
        print(f"{event}: {fields}", flush=True)
        return entry

    # --- reload ----------------------------------------------------------------------------------
    async def reload(self, agent: str | None = None, path: str | None = None,
                     force: bool = False) -> dict[str, Any]:
        names = [agent] if agent else list(self.workers)
        if path and not agent:
            raise bad("path", "name the agent the weights are for (agent)")
        out: dict[str, Any] = {}
        async with self._reload_lock:
            for name in names:
                spec = self.run.agents[name]
                source = (explicit_source(path) if path
                          else resolve_source(self.run.run_dir, name, spec.cfg))
                if not force and not path and source.fingerprint == spec.fingerprint:
                    out[name] = {"reloaded": False, **spec.version.describe()}
                    continue
                if source.file is None and not force:
                    out[name] = {"reloaded": False, **spec.version.describe()}
                    continue
                model = await asyncio.to_thread(spec.next_model, source)
                version = Version(spec.next_number(), source.label, source.policy_version,
                                  time.time())
                spec.model, spec.version, spec.fingerprint = model, version, source.fingerprint
                self.workers[name].swap(model, version)
                out[name] = {"reloaded": True, **version.describe()}
        return out

    async def watch(self, every_s: float) -> None:
        """Reload any agent whose newest weights in the run folder changed (polling)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.reload()
            except Exception as exc:  # noqa: BLE001 - a half-written file: try again next time
                print(f"reload skipped: {type(exc).__name__}: {exc}", flush=True)
