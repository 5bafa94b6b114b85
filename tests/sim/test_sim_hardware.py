"""Accelerator profiles: datasheet numbers and name lookup."""

from __future__ import annotations

import pytest

from flexmarl.sim.hardware import (
    ACCELERATORS,
    AcceleratorSpec,
    UnknownAcceleratorError,
    get_accelerator,
    known_accelerators,
)


def test_required_profiles_exist_with_datasheet_numbers() -> None:
    assert {"H800", "H20", "A100-80G", "H200", "H100"} <= set(known_accelerators())
    h800 = get_accelerator("H800")
    assert h800.peak_bf16_flops == pytest.approx(989.5e12)
    assert h800.hbm_bandwidth == pytest.approx(3.35e12)
    assert h800.memory_bytes == pytest.approx(80e9)
    assert h800.intra_node_bandwidth == pytest.approx(400e9)
    assert h800.inter_node_bandwidth == pytest.approx(50e9)  # 400 Gb/s
    h20 = get_accelerator("H20")
    assert (h20.peak_bf16_flops, h20.hbm_bandwidth, h20.memory_bytes) == pytest.approx(
        (148e12, 4.0e12, 96e9)
    )
    a100 = get_accelerator("A100-80G")
    assert (a100.peak_bf16_flops, a100.hbm_bandwidth, a100.intra_node_bandwidth) == (
        pytest.approx(312e12),
        pytest.approx(2.039e12),
        pytest.approx(600e9),
    )
    h200 = get_accelerator("H200")
    assert (h200.memory_bytes, h200.hbm_bandwidth) == pytest.approx((141e9, 4.8e12))


def test_lookup_is_forgiving_about_spelling() -> None:
    assert get_accelerator("a100-80g") is get_accelerator("A100_80G") is get_accelerator("A100")
    assert get_accelerator("h100 sxm5").name == "H100"


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(UnknownAcceleratorError) as info:
        get_accelerator("TPUv5")
    message = str(info.value)
    assert "TPUv5" in message
    for name in ACCELERATORS:
        assert name in message
    assert isinstance(info.value, LookupError) and isinstance(info.value, ValueError)


def test_profiles_are_immutable_and_sane() -> None:
    for spec in ACCELERATORS.values():
        assert isinstance(spec, AcceleratorSpec)
        assert spec.intra_node_unidirectional == spec.intra_node_bandwidth / 2
        # Every part's NVLink beats its NIC, and both beat nothing.
        assert spec.intra_node_unidirectional > spec.inter_node_bandwidth > 0
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        get_accelerator("H800").memory_bytes = 1.0  # type: ignore[misc]


def test_npu_64g_is_half_an_ascend_910c_chip() -> None:
    """issue 21's 64 GB NPU-class profile: per die, half of the CloudMatrix384 paper's per-chip
    figures (752 TFLOPS BF16, 128 GB at 3.2 TB/s, 392 GB/s UB, a 400 Gb/s RDMA plane)."""
    npu = get_accelerator("NPU-64G")
    assert npu.memory_bytes == pytest.approx(128e9 / 2)
    assert npu.peak_bf16_flops == pytest.approx(752e12 / 2)
    assert npu.hbm_bandwidth == pytest.approx(3.2e12 / 2)
    assert npu.intra_node_bandwidth == pytest.approx(392e9)  # 196 GB/s each way, summed
    assert npu.inter_node_bandwidth == pytest.approx(400e9 / 8 / 2)
    assert get_accelerator("ascend 910c") is npu and get_accelerator("npu") is npu
