"""A worker main for the heartbeat test (importable by a spawned process): it beats, then
answers `send` by holding its pipe's send lock for `payload` seconds, as a worker sending a
large message on a loaded machine does, before replying."""

import time
from typing import Any

from flexmarl.runtime.local.workers import WorkerSpec, serve_slot, start_heartbeat


def slow_sender_main(conn: Any, spec: WorkerSpec) -> None:
    locked = start_heartbeat(conn, spec)

    def handle(command: str, payload: Any) -> tuple[Any, str]:
        with locked._lock:  # the pipe is busy: no beat can go out on it
            time.sleep(float(payload))
        return "sent", command

    serve_slot(locked, handle)  # type: ignore[arg-type]
