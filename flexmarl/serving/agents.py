"""The agents of a run folder: where each one's weights and tokenizer are, and loading them.

A run folder (`flexmarl train --out DIR`) holds `config.yaml` and `checkpoints/`: the final
weights (`checkpoints/final/<agent>/`, written when training ends) and checkpoint generations
(`checkpoints/gen-NNNNNN/agents/<agent>/`, `LATEST` naming the newest). An agent is served from
the newest of those by modification time; with neither, from its config (the initial weights:
random init from the run seed, `model.path`, `model.checkpoint`), as version 0.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoTokenizer

from flexmarl.config.schema import (
    AgentConfig,
    ConfigError,
    RolloutConfig,
    RunConfig,
    RuntimeConfig,
    Strict,
    TrainConfig,
    load_config,
)
from flexmarl.errors import UserError
from flexmarl.graph.task import Task, load_task
from flexmarl.policy.adapters import adapter_name, adapter_tensors, add_adapter, load_adapter
from flexmarl.policy.model import check_shapes
from flexmarl.policy.smollm import load_tokenizer as smollm_tokenizer
from flexmarl.policy.tokenizer import TOKENIZER_FILES
from flexmarl.serving.adapters import (
    ADAPTER_FILE,
    PEFT_ADAPTER_FILE,
    light_copy,
    read_adapter_file,
    tenant_adapter,
)
from flexmarl.serving.compress import is_packed, unpack


class ServeError(UserError, ValueError):
    """A run folder, agent or checkpoint that cannot be served; names what is at fault."""


@dataclass(frozen=True)
class WeightSource:
    """Where one version of an agent's weights comes from."""

    label: str  # "final", "gen-000004", "config" or an explicit path
    file: Path | None  # model.safetensors; None: the config's initial weights
    policy_version: int | None = None  # the trainer's version, where the folder records it

    @property
    def fingerprint(self) -> tuple:
        if self.file is None:
            return (self.label,)
        try:
            st = self.file.stat()
        except OSError:
            return (str(self.file),)
        return (str(self.file), st.st_mtime_ns, st.st_size)


@dataclass(frozen=True)
class Version:
    """A served version of one agent: `number` counts loads from 1; reported in responses."""

    number: int
    source: str
    policy_version: int | None
    loaded_at: float

    def describe(self) -> dict[str, Any]:
        return {"version": self.number, "source": self.source,
                "policy_version": self.policy_version, "loaded_at": self.loaded_at}


def _policy_version(folder: Path) -> int | None:
    for name in ("flexmarl.json", "trainer.json"):
        try:
            meta = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        for key in ("policy_version", "version"):
            if isinstance(meta.get(key), int):
                return meta[key]
    return None


def weight_candidates(run_dir: Path, agent: str, acfg: AgentConfig) -> list[WeightSource]:
    ckpts = run_dir / "checkpoints"
    out = []
    final = ckpts / "final" / agent / "model.safetensors"
    if final.is_file():
        out.append(WeightSource("final", final, _policy_version(final.parent)))
    try:
        latest = (ckpts / "LATEST").read_text().strip()
    except OSError:
        latest = ""
    if acfg.lora is not None:  # served unmerged: the trainer's adapter (PEFT's format)
        out = []
        peft = ckpts / "final" / agent / "adapter" / PEFT_ADAPTER_FILE
        if peft.is_file():
            out.append(WeightSource("final", peft, _policy_version(peft.parent.parent)))
    # a LoRA agent's generation holds the adapter-wrapped module, not plain model weights
    gen = ckpts / latest / "agents" / agent / "model.safetensors" if latest else None
    if gen is not None and gen.is_file() and acfg.lora is None:
        out.append(WeightSource(latest, gen, _policy_version(gen.parent)))
    # the shadow the server itself promoted last (continual learning, `deploy.py`)
    try:
        promoted = (run_dir / "serving" / agent / "SHADOW").read_text().strip()
    except OSError:
        promoted = ""
    served = ADAPTER_FILE if acfg.lora is not None else "model.safetensors"
    snap = run_dir / "serving" / agent / promoted / served if promoted else None
    if snap is not None and snap.is_file():
        out.append(WeightSource(f"promoted-{promoted}", snap, _policy_version(snap.parent)))
    return out


def resolve_source(run_dir: Path, agent: str, acfg: AgentConfig) -> WeightSource:
    """The newest weights the run folder holds for `agent` (config weights when none)."""
    cands = weight_candidates(run_dir, agent, acfg)
    if not cands:
        return WeightSource("config", None)
    return max(cands, key=lambda s: s.file.stat().st_mtime_ns if s.file else 0)


def explicit_source(path: str | Path) -> WeightSource:
    p = Path(path)
    file = p / "model.safetensors" if p.is_dir() else p
    if not file.is_file():
        raise ServeError(f"{path}: no such weights file (expected a model.safetensors or a "
                         "folder holding one)")
    return WeightSource(str(p), file, _policy_version(file.parent))


def load_tokenizer(agent: str, acfg: AgentConfig, source: WeightSource) -> Any | None:
    """The agent's tokenizer: next to its weights, in `model.path`, or SmolLM2's; None when it
    has none (a token-level agent, such as the referential game's)."""

    folders = []
    if source.file is not None:
        folders.append(source.file.parent)
    if acfg.model.kind == "path" and acfg.model.path:
        folders.append(Path(acfg.model.path))
    for folder in folders:
        if any((folder / f).is_file() for f in TOKENIZER_FILES):
            try:
                return AutoTokenizer.from_pretrained(str(folder))
            except (OSError, ValueError) as exc:
                raise ServeError(f"agent {agent!r}: tokenizer in {folder} cannot be loaded: "
                                 f"{exc}") from exc
    if acfg.model.kind == "smollm2":

        return smollm_tokenizer()
    return None


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ServeError(f"--device {device}: no CUDA device is visible")
    return device


def load_weights_file(agent: str, source: WeightSource, model: torch.nn.Module) -> None:
    """Load `source` into `model` in place; every model tensor must be there, shapes equal."""


    assert source.file is not None
    if is_packed(source.file):  # a compressed blob (compress.pack), e.g. from another process
        try:
            tensors = unpack(source.file.read_bytes())
        except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file
            raise ServeError(f"{source.file}: compressed weights cannot be read: "
                             f"{type(exc).__name__}: {exc}") from exc
    else:
        tensors = load_file(str(source.file))
    check_shapes(agent, str(source.file), {k: tuple(v.shape) for k, v in tensors.items()}, model)
    param = next(model.parameters())
    model.load_state_dict({k: v.to(param.device, param.dtype) if v.is_floating_point() else
                           v.to(param.device) for k, v in tensors.items()}, strict=False)


def load_adapter_file(agent: str, source: WeightSource, model: torch.nn.Module,
                      adapter: str) -> None:
    """Load a published adapter (`source`) into `adapter` of `model`, in place."""
    assert source.file is not None
    try:
        load_adapter(model, adapter, read_adapter_file(source.file))
    except ValueError as exc:
        raise ServeError(f"agent {agent!r}: {source.file}: {exc}") from exc


def wrap_adapter(agent: str, acfg: AgentConfig, model: torch.nn.Module, run_seed: int
                 ) -> torch.nn.Module:
    """`model` (the base) with the agent's adapter as training initialises it (the same seed,
    so an adapter never trained serves exactly the base)."""
    from flexmarl.policy.model import stable_seed  # transformers: loaded on first use
    from flexmarl.training.lora import check_targets

    assert acfg.lora is not None
    check_targets(agent, model, acfg.lora)
    return add_adapter(model, adapter_name(agent), acfg.lora,
                       stable_seed(run_seed, agent, "lora"))


@dataclass
class AgentSpec:
    """One served agent: its config, model, tokenizer and current version."""

    name: str
    cfg: AgentConfig
    model: torch.nn.Module
    tokenizer: Any | None
    version: Version
    fingerprint: tuple
    lock: threading.Lock = field(default_factory=threading.Lock)
    issued: int = 0  # the highest version number handed out (shadow, canary or reload)
    # a LoRA agent, served unmerged: its shadow's adapter in `model` (None: plain weights),
    # and the adapter of each training tenant that learns its own (`serving.adapters`)
    adapter: str | None = None
    tenant_adapters: dict[str, str] = field(default_factory=dict)  # tenant -> adapter
    tenant_versions: dict[str, Version] = field(default_factory=dict)  # tenant -> served

    @property
    def adapters(self) -> list[str] | None:
        """The adapters the served model holds, the shadow's first (None: plain weights)."""
        if self.adapter is None:
            return None
        return [self.adapter, *self.tenant_adapters.values()]

    def carry_tenant_adapters(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` (a new shadow: a promotion, a rollback) with the training tenants' adapters
        as served now: the shadow's version never changes what a tenant is served."""
        for adapter in self.tenant_adapters.values():
            load_adapter(model, adapter, adapter_tensors(self.model, adapter))
        return model

    def add_tenant_adapters(self, tenants: list[str], folder: Path) -> None:
        """One adapter per training tenant beside the shadow's: the tenant's last published
        adapter (`folder/<tenant>/adapter.safetensors`), else a copy of the shadow's."""
        assert self.adapter is not None and self.cfg.lora is not None
        shadow = adapter_tensors(self.model, self.adapter)
        for i, tenant in enumerate(tenants):
            name = tenant_adapter(i)
            self.model = add_adapter(self.model, name, self.cfg.lora, 0)
            saved = folder / tenant / ADAPTER_FILE
            version = self.version
            if saved.is_file():
                load_adapter(self.model, name, read_adapter_file(saved))
                number = _policy_version(saved.parent) or 0
                version = Version(number, f"tenant-{tenant}-v{number}", None, time.time())
                self.issued = max(self.issued, number)
            else:
                load_adapter(self.model, name, shadow)
            self.tenant_adapters[tenant] = name
            self.tenant_versions[tenant] = version
        param = next(self.model.parameters())
        self.model.to(device=param.device, dtype=param.dtype)
        self.model.set_adapter(self.adapter)  # type: ignore[operator]  # peft's
        self.model.eval()

    def next_number(self) -> int:
        """A fresh version number: reloads and canaries never share one."""
        with self.lock:
            self.issued = max(self.issued, self.version.number) + 1
            return self.issued

    @property
    def vocab(self) -> int:
        config: Any = self.model.config  # a transformers config (nn.Module does not type it)
        return int(config.vocab_size)

    @property
    def max_len(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def next_model(self, source: WeightSource) -> torch.nn.Module:
        """A copy of the served model with `source`'s weights: built beside the running one,
        which keeps serving its in-flight requests."""
        if self.adapter is not None:  # the adapter alone changes: the base is shared
            model = light_copy(self.model)
            if source.file is not None:
                load_adapter_file(self.name, source, model, self.adapter)
            return model.eval()
        model = copy.deepcopy(self.model)
        if source.file is not None:
            load_weights_file(self.name, source, model)
        model.eval()
        return model

    def adapter_model(self, tensors: dict[str, torch.Tensor], adapter: str | None = None
                      ) -> torch.nn.Module:
        """A light copy of the served model whose adapter (the shadow's by default) holds
        `tensors`: a new version of a LoRA agent."""
        out = light_copy(self.model)
        load_adapter(out, adapter or self.adapter or "", tensors)
        return out.eval()


class ServedConfig(Strict):
    """What the serving stack reads of a run's config (a `RunConfig` has these fields too):
    for a model folder served without a run (`flexmarl serve-model`), validated like a run's,
    every section but its one agent at its defaults."""

    seed: int = 0
    agents: dict[str, AgentConfig]
    train: TrainConfig = TrainConfig()
    rollout: RolloutConfig = RolloutConfig()
    runtime: RuntimeConfig = RuntimeConfig()


@dataclass
class ServedRun:
    run_dir: Path
    cfg: RunConfig | ServedConfig
    task: Task | None
    task_error: str | None
    agents: dict[str, AgentSpec]
    device: str


def served_agent(name: str, acfg: AgentConfig, source: WeightSource, run_seed: int, dev: str,
                 vocab: int, max_seq_len: int) -> AgentSpec:
    """One agent built for serving: its model (with `source`'s weights, or its adapter's), its
    tokenizer and its first version."""
    from flexmarl.policy.device import compute_dtype  # transformers: loaded on first use
    from flexmarl.policy.model import build_model

    model: torch.nn.Module = build_model(name, acfg.model, vocab, max_seq_len, run_seed, dev,
                                         compute_dtype(acfg.model.dtype, dev))
    adapter = None
    if acfg.lora is not None:
        dtype = next(model.parameters()).dtype
        model = wrap_adapter(name, acfg, model, run_seed).to(device=dev, dtype=dtype)
        adapter = adapter_name(name)
        if source.file is not None:
            load_adapter_file(name, source, model, adapter)
    elif source.file is not None:
        load_weights_file(name, source, model)
    model.eval()
    # a shadow the server promoted keeps its number across restarts (promoted-vN is vN)
    number = int(source.label.removeprefix("promoted-v")) if source.label.startswith(
        "promoted-v") and source.label[10:].isdigit() else 1
    return AgentSpec(name, acfg, model, load_tokenizer(name, acfg, source),
                     Version(number, source.label, source.policy_version, time.time()),
                     source.fingerprint, adapter=adapter)


def load_model_folder(path: str | Path, name: str | None = None, device: str = "auto"
                      ) -> ServedRun:
    """One model folder (`config.json` and weights, as `save_pretrained` writes them) served
    as one agent, named after the folder unless `name` says otherwise (`flexmarl
    serve-model`). There is no task, so no episodes; every other setting is its default."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ServeError(f"serve-model: {folder} is not a model folder (no config.json); pass a "
                         "checkpoint such as runs/<name>/checkpoints/final/<agent>")
    name = name or folder.name
    try:
        cfg = ServedConfig.model_validate(
            {"agents": {name: {"model": {"kind": "path", "path": str(folder)}}}})
    except ValidationError as exc:
        raise ServeError(f"serve-model: {folder}: {exc}") from None
    acfg = cfg.agents[name]
    dev = pick_device(device)
    source = WeightSource(str(folder), None, _policy_version(folder))  # weights: `model.path`
    return ServedRun(folder, cfg, None, "a model folder has no task",
                     {name: served_agent(name, acfg, source, cfg.seed, dev, 0, 0)}, dev)


def load_run(run_dir: str | Path, device: str = "auto", agents: list[str] | None = None
             ) -> ServedRun:
    rd = Path(run_dir)
    cfg_file = rd / "config.yaml"
    if not cfg_file.is_file():
        raise ServeError(f"{rd}: not a run folder (no config.yaml); pass the folder "
                         "`flexmarl train --out` wrote, e.g. runs/demo")
    cfg = load_config(cfg_file)
    try:
        task: Task | None = load_task(cfg.task_config.builder, cfg.task_config.options, cfg.agents)
        task_error = None
    except (UserError, ImportError) as exc:  # agents still serve; episodes will not
        task, task_error = None, str(exc)
    names = list(cfg.agents) if agents is None else agents
    for name in names:
        if name not in cfg.agents:
            raise ConfigError(f"--agent {name}: the run has no such agent (agents: "
                              f"{', '.join(cfg.agents)})")
        if cfg.agents[name].network is not None:  # hybrid graphs (docs/hybrid.md)
            llm = [a for a in cfg.agents if cfg.agents[a].network is None]
            raise ServeError(f"agent {name!r} is a network policy: flexmarl serve serves LLM "
                             f"agents; pick them with --agent ({', '.join(llm) or 'none'})")
    dev = pick_device(device)
    vocab = task.vocab_size if task is not None else 0
    max_seq_len = task.max_seq_len if task is not None else 64
    out: dict[str, AgentSpec] = {}
    for name in names:
        acfg = cfg.agents[name]
        if acfg.model.kind == "random" and task is None:
            raise ServeError(f"agent {name!r}: a random-init model needs the task's vocabulary, "
                             f"and the task did not load: {task_error}")
        out[name] = served_agent(name, acfg, resolve_source(rd, name, acfg), cfg.seed, dev,
                                 vocab, max_seq_len)
    return ServedRun(rd, cfg, task, task_error, out, dev)
