"""A real Ray head per test module: `ray start --head` on loopback, stopped at module end.

Teardown stops only this head's processes (its process group, their children, and anything
whose command line names its private temp dir), never other Ray sessions on the machine, and
runs also when a test fails. Every test also leaves the driver disconnected.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:  # ray is in the dev extra; without it these tests are not collected
    import ray  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def local_cluster(worker_cpus: tuple[int, ...] = (), **head: Any) -> Iterator[tuple[Any, list]]:
    """A multi-node `ray.cluster_utils.Cluster` on this machine: a head of 1 CPU (`head`: more
    head node args) and a worker node per entry of `worker_cpus`; the driver disconnected and
    the cluster shut down however the test ended."""
    import ray  # imported here: without ray this conftest only tells pytest to skip
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    c = Cluster(initialize_head=True, shutdown_at_exit=False,
                head_node_args={"num_cpus": 1, "include_dashboard": False, **head})
    nodes = [c.add_node(num_cpus=n) for n in worker_cpus]
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _own_pids(pgid: int, temp_dir: str) -> set[int]:
    """Processes of this head: its process group, their descendants, its temp dir's users."""
    parents: dict[int, int] = {}
    mine: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z":
            continue
        parents[pid] = int(fields[1])
        if int(fields[2]) == pgid or temp_dir in cmdline:
            mine.add(pid)
    grew = True
    while grew:
        children = {p for p, pp in parents.items() if pp in mine and p not in mine}
        grew = bool(children)
        mine |= children
    mine.discard(os.getpid())
    return mine


def _kill(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_head(pgid: int, temp_dir: str) -> None:
    pids = _own_pids(pgid, temp_dir)
    _kill(pids, signal.SIGTERM)
    deadline = time.time() + 2
    while time.time() < deadline and _own_pids(pgid, temp_dir):
        time.sleep(0.2)
    _kill(_own_pids(pgid, temp_dir), signal.SIGKILL)


# Per head address: the file whose content (`pool:command`) makes the first actor of that pool
# to run that command block its compute thread for good (`chaos_stall`), pings still answered.
CHAOS_STALL: dict[str, str] = {}


@pytest.fixture(scope="module")
def ray_head():
    """Address HOST:PORT of a fresh 2-CPU head on loopback."""
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="fmt-", dir="/tmp")
    env = dict(os.environ, RAY_AUTH_MODE="disabled",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               # the actors' fault-injection file (absent: no effect); see CHAOS_STALL
               FLEXMARL_CHAOS_STALL=f"{temp_dir}/chaos-stall")
    CHAOS_STALL[f"127.0.0.1:{port}"] = f"{temp_dir}/chaos-stall"
    proc = subprocess.Popen(
        [str(RAY), "start", "--head", "--port", str(port), "--num-cpus", "2",
         "--node-ip-address", "127.0.0.1", "--include-dashboard=false",
         "--temp-dir", temp_dir, "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            pytest.fail(f"ray start failed:\n{out.decode(errors='replace')[-2000:]}")
        yield f"127.0.0.1:{port}"
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        stop_head(proc.pid, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _disconnected_after_each_test():
    """The Ray session is always shut down, also when the test failed."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()
