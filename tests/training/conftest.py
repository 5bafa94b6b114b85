"""Fixtures shared by the training tests."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist


@pytest.fixture()
def one_rank(tmp_path):
    """A one-rank gloo group in this process (FSDP over a mesh of 1: the K=1 FSDP path)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()
