"""Per-tenant adapters (`flexmarl serve --tenants FILE --learn AGENT` on a LoRA agent): each
tenant marked `train: true` learns its own adapter on its own traffic, and its requests are
served by that adapter (the other tenants by the shadow's).

Isolation is by construction: a tenant's learner claims only rows served to that tenant
(`Capture.claim(..., tenants=[tenant], learner=...)`, its own claims journal), trains only its
adapter (the base is frozen and shared), and publishes only into its adapter slot of the
served model. The KL bound is taken against the tenant's served adapter. Every `canary_every`
applied updates the trained adapter is a candidate: published when its held-out score is at
least `candidate_ratio` times the served tenant adapter's (the same gate as a shared canary's;
a tenant's traffic is too thin for a 5% split of its own). Published adapters are written to
`RUN_DIR/serving/<agent>/tenants/<tenant>/adapter.safetensors`, so a restart serves them;
training snapshots go to the snapshot store under `<agent>/tenant-<tenant>`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from flexmarl.policy.adapters import adapter_tensors
from flexmarl.serving.adapters import save_adapter, view
from flexmarl.serving.agents import AgentSpec, Version
from flexmarl.serving.online import OnlineLearner


def training_base(deployment: Any) -> torch.nn.Module:
    """The agent's base as its trainers hold it (float32, the run's initial weights: LoRA
    never changes them), built once and shared by every tenant's learner."""
    from flexmarl.policy.model import build_model  # transformers: loaded on first use

    run, spec = deployment.service.run, deployment.spec
    return build_model(spec.name, spec.cfg.model, run.task.vocab_size, run.task.max_seq_len,
                       run.cfg.seed, run.device)


class TenantLearner:
    """One training tenant's adapter of one agent: its learner and its publication."""

    def __init__(self, deployment: Any, tenant: str, base: torch.nn.Module) -> None:
        """`base`: the agent's frozen base, built once for all its tenants' learners."""
        dep = deployment
        self.dep = dep
        self.tenant = tenant
        self.spec: AgentSpec = dep.spec
        self.adapter = self.spec.tenant_adapters[tenant]
        self.key = f"{dep.name}/tenant-{tenant}"  # claims journal and snapshot key
        self.folder: Path = dep.root / "tenants" / tenant
        run, cfg = dep.service.run, dep.cfg
        self.learner = OnlineLearner(self.spec, run.task.vocab_size, run.task.max_seq_len,
                                     run.cfg.seed, run.device, cfg.kl_max, cfg.is_max, cfg.lr,
                                     cfg.online_algorithm, adapter=self.adapter,
                                     shared_base=base)
        self.learner.same_version = self.spec.tenant_versions[tenant].number
        self.since_candidate = 0
        self.last_update = float("-inf")
        self.resume()

    @property
    def served(self) -> torch.nn.Module:
        """The tenant's served policy (its adapter active): the KL reference and score base."""
        return view(self.spec.model, self.adapter)

    def resume(self) -> None:
        """As the shared learner's recovery: the snapshot's state, then the rows claimed
        after it handed back to this tenant's learner alone."""
        self.learner.resume(self.dep.store, self.dep.service.capture, self.key, self._log)

    def snapshot(self) -> None:
        self.learner.save_snapshot(self.dep.store, self.key, self._log)

    def _log(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.dep.events.log(event, self.dep.name, tenant=self.tenant, **fields)

    def tick(self) -> None:
        """An update on this tenant's rows when a batch is ready; a publication when due."""
        cfg = self.dep.cfg
        started = time.monotonic()
        if started - self.last_update >= cfg.update_every_s:
            rep = self.learner.train_ready(self.dep.service.capture, self.dep.name, cfg.batch,
                                           cfg.min_temperature, self.served,
                                           self.dep.service.run.cfg.train.micro_batch_size,
                                           [self.tenant], key=self.key)
            if rep is not None:
                self.last_update = started
                self._log("train_step" if rep.applied else "kl_stop", **rep.fields(),
                          kl_max=cfg.kl_max)
                self.since_candidate += rep.applied
        if self.since_candidate >= cfg.canary_every:
            self.candidate()

    def candidate(self) -> dict[str, Any]:
        """Publish the trained adapter into the tenant's slot if it passes the held-out gate."""
        self.since_candidate = 0
        dep = self.dep
        model = self.learner.snapshot_model(self.spec.model)  # light: the adapter is new
        cand = dep._heldout(view(model, self.adapter))
        served = dep._heldout(self.served)
        if cand is not None and served is not None and \
                cand < dep.cfg.candidate_ratio * served:
            self.learner.reset(self.spec.model, self.spec.tenant_versions[self.tenant].number)
            return dep.events.log("candidate_rejected", dep.name, tenant=self.tenant,
                                  heldout=cand, served_heldout=served)
        return self.publish(model, cand, served)

    def publish(self, model: torch.nn.Module, heldout: float | None = None,
                served: float | None = None) -> dict[str, Any]:
        """`model`'s tenant adapter becomes what the tenant is served (a swap of the agent's
        engine: the shadow and the other tenants' adapters are unchanged)."""
        dep, spec = self.dep, self.spec
        t0 = time.perf_counter()
        version = Version(spec.next_number(), f"tenant-{self.tenant}-step-{self.learner.steps}",
                          self.learner.trainer.version, time.time())
        with spec.lock:  # the served model takes this adapter; its other adapters stay
            spec.model = spec.adapter_model(adapter_tensors(model, self.adapter), self.adapter)
            spec.tenant_versions[self.tenant] = version
        dep.worker.swap(spec.model, spec.version, {self.adapter: version})
        swap_s = time.perf_counter() - t0
        path = save_adapter(self.folder, spec.model, self.adapter)
        (self.folder / "flexmarl.json").write_text(json.dumps(
            {"agent": dep.name, "tenant": self.tenant, "version": version.number}))
        self.learner.same_version = None
        self.snapshot()
        return dep.events.log("tenant_publish", dep.name, tenant=self.tenant,
                              version=version.number, heldout=heldout, served_heldout=served,
                              path=str(path), swap_s=round(swap_s, 4))
