"""The ``ray`` runtime: the same orchestrator driving Ray actors in two placement groups.

Imports are lazy so that light actors (the store's table actors) start without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RayRuntime", "RaySession", "RayWeights"]


def __getattr__(name: str) -> Any:
    if name in ("RayRuntime", "RayWeights"):
        from flexmarl.runtime.ray import runtime

        return getattr(runtime, name)
    if name == "RaySession":
        from flexmarl.runtime.ray.session import RaySession

        return RaySession
    raise AttributeError(name)
