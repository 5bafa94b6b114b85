"""Connect to a Ray cluster, or start a private one for this run; shut down only what we started.

A cluster started here gets its own short temp dir (Ray's socket paths have a length limit), no
dashboard, and `RAY_AUTH_MODE=disabled` unless the user configured auth in the environment.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Any

from flexmarl.errors import UserError


class RayRuntimeError(UserError, RuntimeError):
    """A Ray cluster problem the user can fix (address, resources), with the setting at fault."""


@dataclass
class RaySession:
    """`address` None: a private local cluster of `num_cpus` with custom `resources`."""

    address: str | None
    num_cpus: int | None = None
    temp_dir: str | None = None
    resources: dict[str, float] = field(default_factory=dict)
    connected_here: bool = field(default=False, init=False)  # we called ray.init: we shut down
    started_cluster: bool = field(default=False, init=False)  # ... a cluster that init started
    gcs_address: str | None = field(default=None, init=False)
    _made_temp: str | None = field(default=None, init=False)

    def start(self) -> None:
        import ray  # optional: ray (the ray extra); RayRuntimeError imports without it

        if ray.is_initialized():  # the caller's own session (a notebook, a test): reuse it
            self.gcs_address = ray.get_runtime_context().gcs_address
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kwargs: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
        if self.address is not None:
            self._probe(self.address)
            try:
                ray.init(address=self.address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise RayRuntimeError(
                    f"runtime.address={self.address}: cannot connect to a Ray cluster there "
                    f"({exc}); start one with `ray start --head --port PORT`"
                ) from exc
        else:
            temp = self.temp_dir
            if temp is None:
                temp = self._made_temp = tempfile.mkdtemp(prefix="fmray-", dir="/tmp")
            cpus = self.num_cpus or max(os.cpu_count() or 1, 1)
            ray.init(
                address="local", num_cpus=cpus, include_dashboard=False, _temp_dir=temp,
                resources={k: float(math.ceil(v)) for k, v in self.resources.items()} or None,
                **kwargs,
            )
            self.started_cluster = True
        self.connected_here = True
        self.gcs_address = ray.get_runtime_context().gcs_address

    @staticmethod
    def _probe(address: str) -> None:
        """Fail in a second on a HOST:PORT nobody listens on (ray.init would retry for minutes)."""
        if address == "auto" or "://" in address:
            return
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=5):
                pass
        except OSError as exc:
            raise RayRuntimeError(
                f"runtime.address={address}: no Ray head reachable there "
                f"({exc.strerror or exc}); start one with `ray start --head --port {port}`"
            ) from None

    def info(self) -> dict[str, Any]:
        return {"address": self.gcs_address, "requested_address": self.address,
                "started_cluster": self.started_cluster}

    def stop(self) -> None:
        """Disconnect if we connected; a cluster we started goes with it, a user's stays up."""
        import ray  # optional: ray (the ray extra)

        if self.connected_here and ray.is_initialized():
            ray.shutdown()
        self.connected_here = False
        if self._made_temp is not None:
            shutil.rmtree(self._made_temp, ignore_errors=True)
            self._made_temp = None
