"""Snapshots of the online training policy at a storage URL (`flexmarl serve --snapshot-url`),
through fsspec: a local folder by default, `file://` and `memory://` always, `s3://`, `gs://`
and the others when the matching fsspec package (s3fs, gcsfs, ...) is installed.

Layout under the URL, per agent: `<agent>/training-<steps>.npz` (parameters and optimizer
state, `OnlineLearner.state()`) and `<agent>/training.json` (the metadata, naming its npz). The
npz is written first under a fresh name, then the json: the json is the commit point, so a
crash in between leaves the previous snapshot readable; older npz files are removed after.
"""

from __future__ import annotations

import io
import json
from typing import Any

import fsspec
import numpy as np

from flexmarl.config.schema import ConfigError


class SnapshotStore:
    """Training snapshots of every agent under one fsspec URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:  # no such protocol, or its package missing
            raise ConfigError(f"serve: --snapshot-url {url}: {exc}") from None
        self.root = root.rstrip("/")

    def _path(self, agent: str, name: str) -> str:
        return f"{self.root}/{agent}/{name}"

    def write(self, agent: str, arrays: dict[str, Any], meta: dict[str, Any]) -> str:
        """Write one agent's snapshot; returns the npz's path. Atomic for readers: the json
        that names the npz is written last."""
        self.fs.makedirs(f"{self.root}/{agent}", exist_ok=True)
        steps = int(meta.get("steps", 0))
        npz_name = f"training-{steps:08d}.npz"
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        self.fs.pipe_file(self._path(agent, npz_name), buf.getvalue())
        meta_bytes = json.dumps({**meta, "file": npz_name}).encode()
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) \
            else tuple(self.fs.protocol)
        if "file" in protocols:
            tmp = self._path(agent, "training.json.tmp")  # a rename: atomic on a local disk
            self.fs.pipe_file(tmp, meta_bytes)
            self.fs.mv(tmp, self._path(agent, "training.json"))
        else:  # object stores replace a whole object at once
            self.fs.pipe_file(self._path(agent, "training.json"), meta_bytes)
        for old in self.fs.glob(self._path(agent, "training-*.npz")):
            if not str(old).endswith(npz_name):
                self.fs.rm_file(old)
        return self._path(agent, npz_name)

    def read(self, agent: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """The agent's last committed snapshot, or None when it has none."""
        meta_path = self._path(agent, "training.json")
        if not self.fs.exists(meta_path):
            return None
        meta = json.loads(self.fs.cat_file(meta_path))
        # a snapshot written before the store named its file: training.npz
        npz = self._path(agent, meta.get("file", "training.npz"))
        with np.load(io.BytesIO(self.fs.cat_file(npz))) as data:
            arrays = {k: data[k] for k in data.files}
        return arrays, meta
