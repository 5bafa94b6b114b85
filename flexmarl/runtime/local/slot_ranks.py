"""The ranks of a sharded training slot (`runtime.slot_size` K > 1): one torch.distributed
group of K processes training one agent together (`training/sharded.py`).

Rank 0 is the slot's worker the driver talks to (`train_worker_main`, the pipe protocol
unchanged). It starts ranks 1..K-1 itself (`form_slot`): locally as child processes on this
machine; on Ray (`WorkerSpec.rank_launcher`, `runtime/ray/ranks.py`) as actors in the other
bundles of the slot's placement group, on rank 0's node. It hands every command of the slot
protocol to them through the group's TCPStore before it runs the command itself
(`SlotLeader.forward`), so every rank calls the collective methods of `ShardedAgentTrainer` in
the same order. Commands travel through the store rather than a
collective so that followers may wait for the next one for as long as a rollout takes, while
the collectives themselves keep a timeout.

A slot fails as a whole, promptly: rank 0 exits when a follower dies (it watches their
processes) or a collective fails (a hung peer: the group's timeout); a follower exits when rank
0 is gone. The supervisor then restarts rank 0, which forms the slot again, and the slot is
restored from the agent's restart point (`SlotPool.restore_slot`).

A rank that ends normally leaves through `end_rank`: its process exits without Python's
interpreter finalization (see there why).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch.distributed as dist

from flexmarl.policy.device import Placement

# the timeout of the slot's collectives: a rank that waits this long for a peer fails the slot
COLLECTIVE_TIMEOUT_S = 300.0
# how often the processes of a slot check on each other
WATCH_INTERVAL_S = 0.5
_HOST = "127.0.0.1"


def _backend(spec: Any) -> str:
    return "nccl" if spec.placement.kind == "cuda" else "gloo"


def _watch(check: Any, why: str) -> None:
    """Exit this process at once (no cleanup: peers may hold locks) when `check()` fails."""
    def loop() -> None:
        while check():
            time.sleep(WATCH_INTERVAL_S)
        if check():  # stopping meanwhile
            return
        print(f"flexmarl slot rank {os.getpid()}: {why}; the slot fails", file=sys.stderr,
              flush=True)
        os._exit(1)

    threading.Thread(target=loop, name="slot-watch", daemon=True).start()


def end_rank(exit_process: bool) -> None:
    """Leave the slot's process group once this rank's last collective returned; with
    `exit_process` (the rank's process is the slot's own: a child process, a local worker),
    end the process here, without interpreter finalization.

    Why: gloo's worker threads (and NCCL's) outlive `destroy_process_group` while anything
    still references the group (FSDP's state, device meshes, DTensor caches do), and a worker
    drops its last reference to a finished collective *after* `wait()` returned. When that
    collective's tensors were made in Python, the drop needs the GIL; if the main thread has
    begun finalizing by then (which load makes likely: the last collective of a checkpoint is
    immediately followed by the exit), Python ends the worker thread inside a C++ destructor
    and the process aborts (SIGABRT, "terminate called without an active exception"). No
    finalization, no race. A Ray rank actor (`exit_process` False) is ended by Ray, which
    exits its process without finalization too."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if exit_process:
        _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """Flush what this process printed, then exit without finalization."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to flush
            pass
    os._exit(code)


class SlotLeader:
    """Rank 0's side: the followers (processes, or handles with the same `poll`, `wait` and
    `kill`: Ray's rank actors) and the command channel to them."""

    def __init__(self, store: dist.TCPStore, followers: list[Any]) -> None:
        self.store = store
        self.followers = followers
        self.sent = 0
        self.stopping = False
        _watch(lambda: self.stopping or all(p.poll() is None for p in self.followers),
               "a follower rank exited")

    def forward(self, command: str, payload: Any) -> None:
        """Hand one command to every follower (they run it in this order)."""
        # (Store.set takes bytes as well as str; torch's stub names str only)
        self.store.set(f"cmd/{self.sent}", pickle.dumps((command, payload)))  # type: ignore[arg-type]
        self.sent += 1

    def lead(self, handle: Callable[[str, Any], tuple[Any, str]]
             ) -> Callable[[str, Any], tuple[Any, str]]:
        """`handle` run on every rank: forwarded, then run here. A failed collective (a peer
        lost or hung) fails the whole slot at once."""
        def run(command: str, payload: Any) -> tuple[Any, str]:
            self.forward(command, payload)
            try:
                return handle(command, payload)
            except Exception as exc:
                if self.peer_failed(exc):
                    print(f"flexmarl slot rank 0: {command} failed in a collective ({exc}); "
                          "the slot fails", file=sys.stderr, flush=True)
                    os._exit(1)
                raise  # the command's own error (every rank had it): reported to the driver

        return run

    def peer_failed(self, exc: BaseException) -> bool:
        """Whether `exc` is a peer's failure rather than the command's: a torch.distributed
        error, a transport error of gloo / NCCL, or a follower that exited meanwhile."""
        if isinstance(exc, dist.DistError) or any(
                word in str(exc) for word in ("gloo", "NCCL", "Connection reset")):
            return True
        deadline = time.monotonic() + 2 * WATCH_INTERVAL_S
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.followers):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        self.stopping = True
        self.forward("stop", None)
        deadline = time.monotonic() + 10
        for p in self.followers:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()


class ChildRanks:
    """Ranks as child processes of rank 0 (the local runtime's): each gets its arguments on
    stdin and ends when rank 0 does."""

    def start(self, rank: int, args: tuple) -> subprocess.Popen:
        spec = args[0]
        # a host that set this process's GPUs itself (several visible): rank r takes the r-th
        given = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if spec.placement.kind == "cuda" and not spec.placement.visible and len(given) > rank:
            args = (dataclasses.replace(spec, placement=Placement("cuda", (int(given[rank]),))),
                    *args[1:])
        proc = subprocess.Popen(
            [sys.executable, "-c",
             "from flexmarl.runtime.local.workers import slot_follower_main; "
             "slot_follower_main()"],
            stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps(args))
        proc.stdin.close()
        return proc


def form_slot(spec: Any) -> SlotLeader:
    """Rank 0: start ranks 1..K-1 (`spec.slot_ranks` are their placements) with
    `spec.rank_launcher` (child processes by default) and join them in the default process
    group (NCCL on GPUs, gloo on the CPU). Every rank is on this node (the store is on
    loopback): a Ray slot's placement group packs its bundles on one node."""
    world = 1 + len(spec.slot_ranks)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore(_HOST, 0, world, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    launcher = spec.rank_launcher or ChildRanks()
    followers = []
    for rank, placement in enumerate(spec.slot_ranks, start=1):
        child = dataclasses.replace(spec, placement=placement, slot_ranks=(), publication=None,
                                    rank_launcher=None)
        followers.append(launcher.start(rank, (child, rank, world, store.port, os.getpid())))
    leader = SlotLeader(store, followers)
    dist.init_process_group(_backend(spec), store=store, rank=0, world_size=world,
                            timeout=timeout)
    return leader


def follower_main(setup_torch: Callable[[Any], None], args: tuple | None = None) -> None:
    """Rank r > 0 of a slot (its process's main, `workers.slot_follower_main`): build the
    same `TrainHost`, then run rank 0's commands in order until `stop` (or until rank 0 is
    gone). `setup_torch(spec)`: the workers' device, threads and determinism settings.
    `args`: given by a rank actor (Ray ends it with rank 0's actor, its owner); a child
    process reads them from stdin and watches its parent."""
    # start-up cost: a spawned worker imports only its own role's stack
    from flexmarl.config.schema import RunConfig
    from flexmarl.training.host import TrainHost

    own_process = args is None  # a child process of rank 0's, not a Ray actor
    if args is None:
        args = pickle.loads(sys.stdin.buffer.read())
        leader_pid = args[4]
        _watch(lambda: os.getppid() == leader_pid, "rank 0 is gone")
    spec, rank, world, port, _ = args
    setup_torch(spec)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore(_HOST, port, world, is_master=False, timeout=timeout)
    dist.init_process_group(_backend(spec), store=store, rank=rank, world_size=world,
                            timeout=timeout)
    cfg = RunConfig.model_validate(spec.config)
    host = TrainHost(cfg, spec.vocab_size, spec.max_seq_len, spec.swap_dir, world=world,
                     shard_dir=spec.shard_dir)
    n = 0
    while True:
        key = f"cmd/{n}"
        while True:  # idle for as long as rank 0 is (its death ends this process)
            try:
                store.wait([key], datetime.timedelta(seconds=60))
                break
            except dist.DistStoreError:
                continue
        command, payload = pickle.loads(store.get(key))
        if store.add(f"read/{n}", 1) == world - 1:  # the last reader drops it
            store.delete_key(key)
            store.delete_key(f"read/{n}")
        n += 1
        if command == "stop":
            break
        try:
            host.handle(command, payload)
        except dist.DistError:
            raise  # a peer failed: this rank fails with the slot
        except Exception:  # noqa: BLE001, S110 - rank 0 ran the same command and reports it
            pass
    end_rank(exit_process=own_process)
