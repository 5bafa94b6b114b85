"""The ``ray`` runtime: the same orchestrator driving Ray actors in two placement groups."""

from flexmarl.runtime.ray.runtime import RayRuntime, RayWeights
from flexmarl.runtime.ray.session import RaySession

__all__ = ["RayRuntime", "RaySession", "RayWeights"]
