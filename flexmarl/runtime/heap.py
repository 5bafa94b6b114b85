"""The cyclic garbage collector on processes with a large, long-lived heap (torch,
transformers, models) that then allocate many short-lived objects (futures, rows, messages).

Each full collection walks every tracked object: on the driver it was half of the event loop's
CPU time, time that a 2-core machine's workers need. Objects that exist once a process is set
up are frozen (never walked again), and young collections run less often; the collector still
runs, so cycles made later are still freed.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

THRESHOLD = (50_000, 50, 100)


def settle() -> None:
    """For a process's whole life, once it is set up (a worker after building its models)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLD)


@contextmanager
def settled() -> Iterator[None]:
    """`settle` for the duration of a block (a run inside a longer-lived process), undone after."""
    threshold = gc.get_threshold()
    settle()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
