"""Accelerator profiles for the cluster simulator, as data.

Why: the cost model turns FLOPs and bytes into seconds, so it needs each accelerator's peak
compute, memory bandwidth, memory size and link speeds. Keeping them as named, sourced constants
makes every simulated duration traceable to a datasheet number (or to a stated assumption).

Conventions:

* ``peak_bf16_flops`` is *dense* BF16 tensor-core throughput. NVIDIA datasheets headline the
  2:4-sparsity figure; the dense figure is half of it.
* ``intra_node_bandwidth`` is the datasheet NVLink figure per GPU, which NVIDIA quotes as the
  *aggregate of both directions*; one direction carries half (``intra_node_unidirectional``).
* ``inter_node_bandwidth`` is per GPU and per direction: SXM nodes pair each GPU with one NIC
  (a rail-optimised fabric), and InfiniBand link rates are quoted per direction.
* ``host_link_bandwidth`` is the PCIe host link per direction (used for offload/reload).
* Memory sizes use the datasheet's decimal gigabytes (1 GB = 1e9 bytes), a slight
  underestimate of the usable HBM on real parts.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PositiveFloat

__all__ = [
    "ACCELERATORS",
    "A100_80G",
    "H20",
    "H100",
    "H200",
    "H800",
    "NPU_64G",
    "AcceleratorSpec",
    "UnknownAcceleratorError",
    "get_accelerator",
    "known_accelerators",
]

TERA = 1e12
GB = 1e9  # decimal gigabyte, as in datasheets
GBIT = 1e9 / 8  # one gigabit per second in bytes per second

# --- Link speeds shared by several parts --------------------------------------------------------
# PCIe Gen5 x16: 128 GB/s bidirectional = 64 GB/s each way (PCI-SIG; H100/H200/H800/H20
# datasheets list "PCIe Gen5: 128 GB/s").
PCIE_GEN5_X16 = 64 * GB
# PCIe Gen4 x16: 64 GB/s bidirectional = 32 GB/s each way (A100 datasheet: "PCIe Gen4: 64 GB/s").
PCIE_GEN4_X16 = 32 * GB
# NDR InfiniBand, 400 Gb/s per port = 50 GB/s each way. DGX H100 / DGX H200 ship 8x ConnectX-7
# 400 Gb/s, one per GPU (DGX H100/H200 datasheets). DeepSeek-V3 technical report
# (arXiv:2412.19437, sec. 3.2.2) describes its H800 nodes with IB at 50 GB/s per GPU.
IB_NDR_400G = 400 * GBIT
# HDR InfiniBand, 200 Gb/s per port = 25 GB/s each way. DGX A100 ships 8x ConnectX-6 200 Gb/s
# HDR, one per GPU (DGX A100 datasheet).
IB_HDR_200G = 200 * GBIT


class UnknownAcceleratorError(ValueError, LookupError):
    """An accelerator name that has no profile (the message lists the known ones)."""


class AcceleratorSpec(BaseModel):
    """One accelerator model's datasheet numbers (all rates in units per second)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    peak_bf16_flops: PositiveFloat  # dense BF16 FLOP/s
    hbm_bandwidth: PositiveFloat  # bytes/s
    memory_bytes: PositiveFloat  # bytes of device memory
    intra_node_bandwidth: PositiveFloat  # NVLink per GPU, both directions summed, bytes/s
    inter_node_bandwidth: PositiveFloat  # NIC per GPU, one direction, bytes/s
    host_link_bandwidth: PositiveFloat = PCIE_GEN5_X16  # PCIe per direction, bytes/s

    @property
    def intra_node_unidirectional(self) -> float:
        """NVLink bytes/s one GPU can send (or receive): half the datasheet's aggregate."""
        return self.intra_node_bandwidth / 2


def _spec(name: str, tflops: float, hbm_tbs: float, memory_gb: float, nvlink_gbs: float,
          inter_node: float, host_link: float) -> AcceleratorSpec:
    """A profile from datasheet units: dense BF16 TFLOPS, HBM TB/s, memory GB, NVLink GB/s
    (both directions summed), and the inter-node and host links in bytes/s."""
    return AcceleratorSpec(name=name, peak_bf16_flops=tflops * TERA, hbm_bandwidth=hbm_tbs * TERA,
                           memory_bytes=memory_gb * GB, intra_node_bandwidth=nvlink_gbs * GB,
                           inter_node_bandwidth=inter_node, host_link_bandwidth=host_link)


# --- Profiles -----------------------------------------------------------------------------------

# NVIDIA H100 SXM5 80GB (H100 Tensor Core GPU datasheet): BF16 1,979 TFLOPS with sparsity ->
# 989.5 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s; PCIe Gen5. Inter-node: NDR 400 Gb/s
# per GPU as in DGX H100.
H100 = _spec("H100", 989.5, 3.35, 80, 900, IB_NDR_400G, PCIE_GEN5_X16)

# NVIDIA H800 SXM5 80GB (H800 datasheet, the export variant of H100): same compute and memory as
# H100 SXM5 (989.5 TFLOPS dense BF16, 80 GB HBM3, 3.35 TB/s) with NVLink cut to 400 GB/s.
# Inter-node: 400 Gb/s IB per GPU (DeepSeek-V3 report's H800 cluster).
H800 = _spec("H800", 989.5, 3.35, 80, 400, IB_NDR_400G, PCIE_GEN5_X16)

# NVIDIA H20 96GB (NVIDIA H20 product brief as widely reproduced; not on nvidia.com's public
# pages): BF16 148 TFLOPS dense (296 with sparsity), 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s,
# PCIe Gen5. Inter-node: ASSUMPTION, 400 Gb/s-class IB per GPU like other Hopper SXM systems.
H20 = _spec("H20", 148, 4.0, 96, 900, IB_NDR_400G, PCIE_GEN5_X16)

# NVIDIA A100 SXM4 80GB (A100 Tensor Core GPU datasheet): BF16 312 TFLOPS dense (624 sparse),
# 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4. Inter-node: HDR 200 Gb/s per GPU as in
# DGX A100 (its generation's fabric, rather than the 400 Gb/s default used for Hopper parts).
A100_80G = _spec("A100-80G", 312, 2.039, 80, 600, IB_HDR_200G, PCIE_GEN4_X16)

# NVIDIA H200 SXM 141GB (H200 Tensor Core GPU datasheet): BF16 1,979 TFLOPS sparse -> 989.5
# dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5. Inter-node: NDR 400 Gb/s per GPU
# as in DGX H200.
H200 = _spec("H200", 989.5, 4.8, 141, 900, IB_NDR_400G, PCIE_GEN5_X16)

# A 64 GB NPU-class device, the kind the FlexMARL paper's cluster has (48 nodes x 16
# accelerators of 64 GB): one die of a Huawei Ascend 910C, which a node presents as a device of
# its own (8 chips, 16 devices per node). Per chip, from "Serving Large Language Models on
# Huawei CloudMatrix384" (Zuo et al. 2025, arXiv:2506.12708, sec. 3.1-3.2, as we read it):
# ~752 TFLOPS dense BF16, 128 GB on-package memory at 3.2 TB/s, two dies; 392 GB/s
# unidirectional Unified Bus (intra-node/supernode) and a 400 Gb/s RDMA plane per chip. Per
# die (device) half of each. Host link: ASSUMPTION, PCIe Gen5 x16 per device. The paper does
# not name its accelerator; this profile is an ASSUMPTION that its 64 GB devices are of this
# class.
NPU_64G = _spec("NPU-64G", 376, 1.6, 64, 2 * 196, 200 * GBIT, PCIE_GEN5_X16)

ACCELERATORS: dict[str, AcceleratorSpec] = {
    spec.name: spec for spec in (H800, H20, A100_80G, H200, H100, NPU_64G)
}

# Other spellings people use for the same parts; keys are normalised (upper case, no spaces,
# dashes or underscores).
_ALIASES: dict[str, str] = {
    "A100": "A100-80G",
    "A10080G": "A100-80G",
    "A10080GB": "A100-80G",
    "A100SXM": "A100-80G",
    "A100SXM480GB": "A100-80G",
    "H100SXM": "H100",
    "H100SXM5": "H100",
    "H100SXM580GB": "H100",
    "H800SXM": "H800",
    "H800SXM5": "H800",
    "H200SXM": "H200",
    "H200141GB": "H200",
    "H2096GB": "H20",
    "NPU": "NPU-64G",
    "ASCEND910C": "NPU-64G",
    "ASCEND910CDIE": "NPU-64G",
}


def _normalise(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


_BY_KEY: dict[str, str] = {_normalise(n): n for n in ACCELERATORS} | _ALIASES


def known_accelerators() -> list[str]:
    """Names :func:`get_accelerator` accepts (canonical spellings)."""
    return list(ACCELERATORS)


def get_accelerator(name: str) -> AcceleratorSpec:
    """Look an accelerator up by name (case, dashes and spaces ignored: ``"a100-80g"`` works)."""
    canonical = _BY_KEY.get(_normalise(name))
    if canonical is None:
        raise UnknownAcceleratorError(
            f"unknown accelerator {name!r}; known: {', '.join(known_accelerators())}"
        )
    return ACCELERATORS[canonical]
