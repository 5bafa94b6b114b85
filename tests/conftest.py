"""Suite-wide hooks.

Ray's native core worker keeps C++ threads (its log sink among them) that can crash during
interpreter teardown once the test heads they talked to are gone (`std::bad_alloc` in
`ray_log_sink`, then a segfault, after every test passed). The driver is disconnected when the
session ends, and a process that imported Ray leaves with the suite's own exit status, skipping
the native teardown, so a green suite never exits red.
"""

from __future__ import annotations

import os
import sys

_status: dict[str, int] = {}


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001 - pytest hook
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    _status["exit"] = int(exitstatus)


def pytest_unconfigure(config):  # noqa: ANN001 - pytest hook
    if "ray" in sys.modules and "exit" in _status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status["exit"])
