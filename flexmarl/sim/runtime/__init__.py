"""The ``sim`` runtime: the orchestrator's asyncio code on a virtual clock."""

from flexmarl.sim.runtime.clock import SimDeadlockError, VirtualTimeEventLoop, run_virtual

__all__ = ["SimDeadlockError", "VirtualTimeEventLoop", "run_virtual"]
