"""Cluster simulator foundations: accelerator profiles, cost model, workload schema."""

from flexmarl.sim.cost import CostModel, Efficiency, GenerationTiming
from flexmarl.sim.hardware import ACCELERATORS, AcceleratorSpec, get_accelerator
from flexmarl.sim.lengths import LengthDistribution
from flexmarl.sim.models import MODEL_PRESETS, ModelSpec, get_model
from flexmarl.sim.workload import EpisodeNode, Workload, WorkloadError, load_workload

__all__ = [
    "ACCELERATORS",
    "MODEL_PRESETS",
    "AcceleratorSpec",
    "CostModel",
    "Efficiency",
    "EpisodeNode",
    "GenerationTiming",
    "LengthDistribution",
    "ModelSpec",
    "Workload",
    "WorkloadError",
    "get_accelerator",
    "get_model",
    "load_workload",
]
