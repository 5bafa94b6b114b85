"""The online trainer in its own process (`flexmarl serve-learn RUN_DIR --capture DB --agent A
--server URL`), so training does not compete with serving for the server's CPU or GIL.

It is fed by the durable experience log the server writes (the capture store: SQLite in WAL
mode, shared by the two processes), claims rewarded rows through the same claims journal,
trains the agent with `OnlineLearner` (GRPO, the KL bound against the served shadow), and
publishes a candidate every `canary_every` applied updates as training publishes to
replicas: the weights packed (`compress.pack`, FP16 + zstd) to a file, then
`POST /v1/admin/canary {"agent", "path"}` on the server, which scores it against its shadow
and promotes or rolls it back (`--deploy` on the server). The trainer follows the server's
decision (`GET /v1/admin/deployment`): a promotion becomes its KL reference, a rollback resets
its training policy to the shadow. Snapshots and recovery are those of the in-process learner
(`snapshots.py`, `Capture.release`): after a SIGKILL of this process, the next one restores
the snapshot and re-delivers the rows claimed after it; the server is never interrupted.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexmarl.serving.agents import load_run
from flexmarl.serving.capture import Capture
from flexmarl.serving.compress import pack
from flexmarl.serving.deploy import EventLog
from flexmarl.serving.online import OnlineLearner
from flexmarl.serving.snapshots import SnapshotStore


@dataclass
class TrainerConfig:
    batch: int = 64
    canary_every: int = 10
    kl_max: float = 0.5
    is_max: float = 2.0
    lr: float | None = None
    update_every_s: float = 0.0
    snapshot_every_s: float = 300.0
    min_temperature: float = 0.05
    poll_s: float = 0.2
    algorithm: str = "auto"  # grpo / ppo / auto (the agent's)


class ServerClient:
    """The trainer's side of the server's admin API."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"

    def call(self, path: str, body: dict | None = None) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.url}{path}", method="POST" if body is not None
                                     else "GET", headers=self.headers,
                                     data=json.dumps(body).encode() if body is not None else None)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"server {path}: HTTP {exc.code}: "
                               f"{exc.read().decode(errors='replace')}") from None


class OnlineTrainer:
    def __init__(self, run_dir: str | Path, capture: str | Path, agent: str, server: str,
                 cfg: TrainerConfig, snapshot_url: str | None = None,
                 api_key: str | None = None) -> None:
        self.run = load_run(run_dir, "cpu", [agent])
        if self.run.task is None:
            raise RuntimeError(f"the run's task did not load: {self.run.task_error}")
        self.agent, self.cfg = agent, cfg
        self.spec = self.run.agents[agent]
        self.root = Path(run_dir) / "serving" / agent
        self.events = EventLog(Path(run_dir) / "serving" / f"trainer-{agent}.jsonl")
        self.capture = Capture(capture)
        self.store = SnapshotStore(snapshot_url or str(Path(run_dir) / "serving" / "trainer"))
        self.server = ServerClient(server, api_key)
        self.learner = OnlineLearner(self.spec, self.run.task.vocab_size,
                                     self.run.task.max_seq_len, self.run.cfg.seed, "cpu",
                                     cfg.kl_max, cfg.is_max, cfg.lr, cfg.algorithm)
        self.shadow = self.spec.model  # the KL reference: what the server serves
        self.pending: tuple[int, Any] | None = None  # (canary version, its model)
        self.since_candidate = 0
        self.last_update = float("-inf")
        self.last_snapshot = time.monotonic()
        self.resume()

    def resume(self) -> None:
        self.learner.resume(self.store, self.capture, self.agent, self._log)

    def snapshot(self) -> None:
        self.learner.save_snapshot(self.store, self.agent, self._log)
        self.last_snapshot = time.monotonic()

    def _log(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.events.log(event, self.agent, **fields)

    def publish(self) -> None:
        model = self.learner.snapshot_model(self.spec.model)
        folder = self.root / "published"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step-{self.learner.steps:08d}.fmw"
        t0 = time.perf_counter()
        # a LoRA agent publishes its adapter alone (the server holds the base)
        path.write_bytes(pack(self.learner.published() if self.learner.adapter is not None
                              else model.state_dict()))
        out = self.server.call("/v1/admin/canary", {"agent": self.agent, "path": str(path)})
        version = int(out["event"]["version"])
        self.pending = (version, model)
        self.since_candidate = 0
        self.events.log("published", self.agent, version=version, path=str(path),
                        steps=self.learner.steps, publish_s=round(time.perf_counter() - t0, 4))

    def follow(self) -> None:
        """Apply the server's verdict on the published canary."""
        if self.pending is None:
            return
        version, model = self.pending
        dep = self.server.call("/v1/admin/deployment")
        for e in dep.get("events", []):
            if e.get("agent") != self.agent or e.get("version") != version:
                continue
            if e["event"] == "promote":
                self.shadow = model
                self.spec.model = copy.deepcopy(model)
                self.pending = None
                self.snapshot()  # its steps cover what the new shadow learnt
                self.events.log("followed", self.agent, verdict="promote", version=version)
            elif e["event"] in ("rollback", "canary_replaced"):
                self.learner.reset(self.shadow, None)
                self.pending = None
                self.events.log("followed", self.agent, verdict="rollback", version=version)
            if self.pending is None:
                return

    def step(self) -> bool:
        """One round; True when an update ran."""
        cfg = self.cfg
        self.follow()
        started = time.monotonic()
        rep = None
        if started - self.last_update >= cfg.update_every_s:
            rep = self.learner.train_ready(self.capture, self.agent, cfg.batch,
                                           cfg.min_temperature, self.shadow,
                                           self.run.cfg.train.micro_batch_size)
        if rep is not None:
            self.last_update = started
            self._log("train_step" if rep.applied else "kl_stop", **rep.fields())
            self.since_candidate += rep.applied
        if self.pending is None and self.since_candidate >= cfg.canary_every:
            self.publish()
        if time.monotonic() - self.last_snapshot >= cfg.snapshot_every_s:
            self.snapshot()
        return rep is not None

    def loop(self, done: Callable[[], bool] = lambda: False) -> None:
        """Rounds until `done()`; a snapshot on the way out (a stop, an error)."""
        try:
            while not done():
                if not self.step():
                    time.sleep(self.cfg.poll_s)
        finally:
            if self.learner.steps:
                self.snapshot()

    def run_forever(self) -> None:
        print(f"online trainer of {self.agent}: {self.capture.path} -> {self.server.url}",
              flush=True)
        try:
            self.loop()
        finally:
            self.capture.close()
