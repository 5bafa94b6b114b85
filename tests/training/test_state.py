"""Location-agnostic state handles: host, disk and another process (real gloo group), and the
exact capture/restore of a trainer in the middle of an accumulation."""

import multiprocessing as mp
import socket

import pytest
import torch

from flexmarl.config.schema import AgentConfig
from flexmarl.runtime.local.slot_ranks import end_rank
from flexmarl.training import state as st
from flexmarl.training.trainer import AgentTrainer, Sample

CFG = AgentConfig.model_validate({
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2},
    "algorithm": {"name": "ppo", "kl_coef": 0.1},
})


def _samples(version, start):
    return [Sample(f"{version}-{i}_0_0", [1, 3, 2, 6 + i % 8], [14 + (i * 3) % 8, 15],
                   [-2.0, -2.1], 0.0, list(range(14, 22)), 1.0, version, float(i % 2))
            for i in range(start, start + 4)]


def _equal(a: st.TrainingState, b: st.TrainingState) -> bool:
    return (a.meta == b.meta and a.tensors.keys() == b.tensors.keys()
            and all(a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k],
                                                                             b.tensors[k])
                    for k in a.tensors))


def _state():
    return st.TrainingState(
        {"w": torch.randn(3, 4), "half": torch.randn(5).to(torch.bfloat16),
         "step": torch.tensor(7.0), "ids": torch.arange(6), "flag": torch.tensor([True, False])},
        {"agent": "a", "version": 3, "sums": {"kl": 0.1 + 0.2}},
    )


def test_same_call_for_host_device_and_disk(tmp_path):
    s = _state()
    host = st.move(s, st.Host())
    dev = st.move(host, st.Device("cpu"))
    disk = st.move(dev, st.Disk(str(tmp_path / "s.safetensors")))
    assert disk.state is None and (tmp_path / "s.safetensors").exists()
    back = st.move(disk, st.Host())
    assert _equal(s, back.load()) and _equal(s, dev.load())
    assert st.from_wire(st.to_wire(s)).meta == s.meta
    assert _equal(s, st.from_wire(st.to_wire(s)))


def _peer(port: int, path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    got = st.move(st.incoming(st.Process(0)), st.Host())  # receive...
    st.move(got, st.Process(0))  # ...and send it straight back
    st.move(got, st.Disk(path))
    end_rank(exit_process=True)  # the gloo threads' last release must not meet finalization


def test_same_call_between_two_processes(tmp_path):
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    peer = mp.get_context("spawn").Process(target=_peer, args=(port, str(tmp_path / "p.st")))
    peer.start()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=2)
        s = _state()
        st.move(s, st.Process(1))
        echoed = st.move(st.incoming(st.Process(1)), st.Host()).load()
        dist.destroy_process_group()
    finally:
        peer.join(timeout=60)
    assert peer.exitcode == 0
    assert _equal(s, echoed)
    assert _equal(s, st.StateHandle(st.Disk(str(tmp_path / "p.st"))).load())


def test_capture_restore_mid_accumulation_is_exact():
    a = AgentTrainer("a", CFG, 22, 16, run_seed=0, total_steps=4)
    a.accumulate(_samples(0, 0))
    a.step()
    a.accumulate(_samples(1, 0))  # gradients pending
    saved = st.move(st.capture(a), st.Host()).load()
    b = AgentTrainer("a", CFG, 22, 16, run_seed=0, total_steps=4)  # fresh: version 0
    st.restore(b, saved)
    for t in (a, b):
        t.accumulate(_samples(1, 4))
        t.step()
    sa, sb = st.capture(a), st.capture(b)
    sa.tensors.pop("rng/torch")
    sb.tensors.pop("rng/torch")
    assert _equal(sa, sb) and sa.meta["version"] == 2
    assert any(k.startswith("o/") for k in sa.tensors) and any(k.startswith("w/value_head")
                                                               for k in sa.tensors)


def test_swap_capture_of_a_lora_trainer_leaves_the_frozen_base_out():
    raw = CFG.model_dump()
    raw["algorithm"] = {"name": "grpo"}
    raw["lora"] = {"r": 2, "target_modules": ["q_proj"]}
    cfg = AgentConfig.model_validate(raw)
    a = AgentTrainer("a", cfg, 22, 16, run_seed=0)
    a.accumulate(_samples(0, 0))
    a.step()
    a.accumulate(_samples(1, 0))
    small, full = st.capture(a, frozen=False), st.capture(a)
    assert small.nbytes < full.nbytes / 5
    assert all("lora_" in k for k in small.tensors if k.startswith("w/"))
    b = AgentTrainer("a", cfg, 22, 16, run_seed=0)
    st.restore(b, st.from_wire(st.to_wire(small)))
    for t in (a, b):
        t.step()
    assert all(torch.equal(v, b.weights()[k]) for k, v in a.weights().items())


def _pair_peer(port: int, device: str, backend: str) -> None:
    import datetime

    import torch.distributed as dist

    if device.startswith("cuda"):
        torch.cuda.set_device(1)
    store = dist.PrefixStore("swap", dist.TCPStore("127.0.0.1", port, is_master=False))
    timeout = datetime.timedelta(seconds=60)
    group = (dist.ProcessGroupNCCL(store, 1, 2) if backend == "nccl"
             else dist.ProcessGroupGloo(store, 1, 2, timeout))
    got = st.move(st.incoming(st.Process(0, group)), st.Device(device))  # receive on device
    st.move(got, st.Process(0, group))  # and swap it back, device to device


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                        reason="NCCL between processes needs 2 CUDA devices")])]


@pytest.mark.parametrize("device", DEVICES)
def test_device_to_device_swap_through_a_pair_group(device):
    """A state moved to another process's device and back through an explicit process group
    (the local runtime's pair groups): exact, and it arrives on the group's device (a GPU for
    NCCL, so no host copy on either side; host memory for gloo)."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    peer = mp.get_context("spawn").Process(target=_pair_peer,
                                           args=(server.port, device, backend))
    peer.start()
    try:
        store = dist.PrefixStore("swap", server)
        timeout = datetime.timedelta(seconds=120)
        group = (dist.ProcessGroupNCCL(store, 0, 2) if backend == "nccl"
                 else dist.ProcessGroupGloo(store, 0, 2, timeout))
        s = st.move(_state(), st.Device(f"{device}:0" if device == "cuda" else device)).load()
        st.move(s, st.Process(1, group))
        echoed = st.move(st.incoming(st.Process(1, group)), st.Device(device)).load()
    finally:
        peer.join(timeout=120)
    assert peer.exitcode == 0
    assert all(v.device.type == device for v in echoed.tensors.values())
    assert _equal(st.move(s, st.Host()).load(), st.move(echoed, st.Host()).load())
