"""Checkpoint generations: written aside, published by one atomic rename, verified on load.

Layout of OUT/checkpoints/:
    LATEST                  the name of the newest complete generation (replaced atomically)
    gen-000004/             one generation, taken after 4 completed iterations
        MANIFEST.json       sha256 and size of every other file: what "complete" means
        position.json       the orchestrator's position: iterations done, versions, records,
                            the audit trail of rows trained on
        store.msgpack       the experience store's rows not yet trained on, with their status
        agents/<a>/model.safetensors, config.json   weights (reloadable by transformers)
        agents/<a>/state.safetensors, trainer.json  optimizer moments, step counts, RNG states
        extra/<name>            opaque files of a driver (classic MARL: each rollout worker's
                                environment state), checked by the manifest like the rest

A generation is written to a `.tmp-*` folder, every file fsynced, the folder renamed into place,
then LATEST is replaced by `os.replace`: a crash at any point leaves the previous generation
intact and LATEST pointing at it. The last `keep` generations are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from safetensors.numpy import load_file, save_file

from flexmarl.errors import UserError

LATEST = "LATEST"
MANIFEST = "MANIFEST.json"
TrainerState = tuple[dict[str, np.ndarray], dict[str, Any]]


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be written, or one on disk is missing, truncated or corrupt."""


@dataclass
class Checkpoint:
    path: Path
    position: dict[str, Any]
    trainer_states: dict[str, TrainerState]
    rows: list[dict[str, Any]]
    extra: dict[str, bytes] = field(default_factory=dict)

    @property
    def completed(self) -> int:
        return int(self.position["completed"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _slow_down() -> None:
    """Fault injection for the test suite: FLEXMARL_CHAOS_SLOW_CHECKPOINT_S stretches each file
    write, so a test can SIGKILL the run while a generation is half written."""
    delay = float(os.environ.get("FLEXMARL_CHAOS_SLOW_CHECKPOINT_S", "0") or 0)
    if delay > 0:
        time.sleep(delay)


class CheckpointManager:
    def __init__(self, root: str | Path, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep

    # --- writing ------------------------------------------------------------------------------
    def save(
        self,
        completed: int,
        position: dict[str, Any],
        trainer_states: dict[str, TrainerState],
        rows: list[dict[str, Any]],
        extra: dict[str, bytes] | None = None,
    ) -> Path:
        """Write generation `completed` (and the `extra` files) and publish it; on any OSError
        (full disk, permissions)
        the partial folder is removed, LATEST is untouched and a CheckpointError says so."""
        name = f"gen-{completed:06d}"
        final = self.root / name
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        previous = self.latest_name()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            for agent, (arrays, meta) in trainer_states.items():
                adir = tmp / "agents" / agent
                adir.mkdir(parents=True)
                weights = {k[len("model."):]: v for k, v in arrays.items()
                           if k.startswith("model.")}
                rest = {k: v for k, v in arrays.items() if not k.startswith("model.")}
                save_file({k: np.ascontiguousarray(v) for k, v in weights.items()},
                          str(adir / "model.safetensors"), metadata={"format": "pt"})
                _slow_down()
                save_file({k: np.ascontiguousarray(v) for k, v in rest.items()},
                          str(adir / "state.safetensors"))
                hf = meta.get("hf_config")
                if hf is not None:
                    _write_bytes(adir / "config.json", json.dumps(hf, indent=2).encode())
                if "dcp" in meta:  # a sharded slot's state: its ranks' DCP shards, copied in
                    shutil.copytree(meta["dcp"], adir / "dcp")
                    meta = {**meta, "dcp": "dcp"}  # relative to the agent's folder
                _write_bytes(adir / "trainer.json", json.dumps(
                    {k: v for k, v in meta.items() if k != "hf_config"}).encode())
                _slow_down()
            for extra_name, data in (extra or {}).items():
                _write_bytes(tmp / "extra" / extra_name, data)
            _write_bytes(tmp / "store.msgpack", msgpack.packb(rows, use_bin_type=True))
            _write_bytes(tmp / "position.json", json.dumps(position).encode())
            _slow_down()
            files = {}
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                rel = path.relative_to(tmp).as_posix()
                if path.suffix == ".safetensors":  # safetensors writes without fsync
                    with path.open("rb+") as f:
                        os.fsync(f.fileno())
                files[rel] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
            _write_bytes(tmp / MANIFEST, json.dumps(
                {"generation": completed, "files": files}, indent=1).encode())
            _fsync_dir(tmp)
            if final.exists():  # a generation published but never pointed to (crash between)
                shutil.rmtree(final)
            os.rename(tmp, final)
            pointer = self.root / f"{LATEST}.tmp"
            _write_bytes(pointer, (name + "\n").encode())
            os.replace(pointer, self.root / LATEST)
            _fsync_dir(self.root)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            kept = f"generation {previous} is intact" if previous else "no earlier generation"
            raise CheckpointError(
                f"checkpoint {name} could not be written under {self.root}: "
                f"{exc.strerror or exc} ({type(exc).__name__} errno {exc.errno}); {kept}"
            ) from exc
        self._prune()
        return final

    def _prune(self) -> None:
        gens = self.generations()
        latest = self.latest_name()
        for path in gens[: max(0, len(gens) - self.keep)]:
            if path.name != latest:
                shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob(".tmp-gen-*"):  # left by a crashed save
            shutil.rmtree(stale, ignore_errors=True)

    # --- reading ------------------------------------------------------------------------------
    def generations(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("gen-*") if p.is_dir())

    def latest_name(self) -> str | None:
        try:
            return (self.root / LATEST).read_text().strip() or None
        except OSError:
            return None

    def load(self, generation: str | None = None) -> Checkpoint:
        """Load LATEST (or `generation`), verifying every file against the manifest."""
        name = generation or self.latest_name()
        if name is None:
            raise CheckpointError(f"{self.root}: no {LATEST} pointer, so no checkpoint to resume "
                                  f"from (is this a run folder with checkpoints/?)")
        path = self.root / name
        others = [p.name for p in self.generations() if p.name != name]
        hint = f" (other generations: {', '.join(others)})" if others else ""
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{manifest_path}: missing or unreadable manifest, refusing "
                                  f"to resume from {path}{hint}: {exc}") from exc
        for rel, info in manifest["files"].items():
            file = path / rel
            if not file.is_file():
                raise CheckpointError(f"{file}: listed in the manifest but missing{hint}")
            size, digest = file.stat().st_size, _sha256(file)
            if size != info["bytes"] or digest != info["sha256"]:
                raise CheckpointError(
                    f"{file}: truncated or corrupt ({size} bytes, sha256 {digest[:12]}..., "
                    f"manifest says {info['bytes']} bytes, {info['sha256'][:12]}...); refusing "
                    f"to resume from {path}{hint}"
                )
        position = json.loads((path / "position.json").read_text())
        rows = msgpack.unpackb((path / "store.msgpack").read_bytes(), raw=False)
        states: dict[str, TrainerState] = {}
        agents_dir = path / "agents"
        for adir in sorted(agents_dir.iterdir()) if agents_dir.is_dir() else []:
            model = load_file(str(adir / "model.safetensors"))
            arrays = {f"model.{k}": v for k, v in model.items()}
            arrays.update(load_file(str(adir / "state.safetensors")))
            meta = json.loads((adir / "trainer.json").read_text())
            if "dcp" in meta:  # sharded (torch.distributed.checkpoint): any K reads it
                meta["dcp"] = str(adir / meta["dcp"])
            states[adir.name] = (arrays, meta)
        extra_dir = path / "extra"
        extra = {f.name: f.read_bytes() for f in sorted(extra_dir.iterdir())} \
            if extra_dir.is_dir() else {}
        return Checkpoint(path, position, states, rows, extra)


def find_checkpoints(directory: str | Path) -> CheckpointManager:
    """`--resume DIR` accepts a run folder (with checkpoints/) or its checkpoints/ folder."""
    d = Path(directory)
    if (d / LATEST).exists():
        return CheckpointManager(d)
    if (d / "checkpoints" / LATEST).exists() or (d / "checkpoints").is_dir():
        return CheckpointManager(d / "checkpoints")
    raise CheckpointError(f"--resume {d}: no checkpoints found (expected {d}/checkpoints/{LATEST})")
