"""The FSDP2-sharded trainer on real gloo process groups of spawned processes: K=2 equals one
device (gradients, weights, publication bytes), a shard swap round trip is bit-exact and 1/K of
the agent, DCP checkpoints resume at another K, and a killed rank fails its peers promptly.

The spawned ranks end as a slot's ranks do (`end_rank`); K=1 runs in this process (a one-rank
group), so the cross-K checkpoint check costs no spawn of its own."""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy

from flexmarl.config.schema import AgentConfig
from flexmarl.runtime.local.slot_ranks import end_rank
from flexmarl.training.sharded import ShardedAgentTrainer
from flexmarl.training.state import comm_device, publish_form, swap_in, swap_out
from flexmarl.training.trainer import AgentTrainer
from flexmarl.types import Sample

VOCAB = 22
STEPS = 3


def _cfg() -> AgentConfig:
    # intermediate_size 131: the MLP's dim 0 does not divide by K=2 (uneven shards)
    return AgentConfig.model_validate({
        "model": {"hidden_size": 64, "intermediate_size": 131, "num_layers": 2, "num_heads": 2,
                  "init_std": 0.1},
        "algorithm": {"name": "grpo"},
        "optim": {"lr": 0.003},
    })


def _samples(step: int) -> list[Sample]:
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(7):
        n = 2 + i % 3  # ragged responses: padding differs between the ranks' shares
        resp = torch.randint(3, 20, (n,), generator=g).tolist()
        out.append(Sample(f"{step}-{i}", [1, 3, 2, 6 + i], resp, [-1.0 - 0.1 * j for j in range(n)],
                          float(i % 3 - 1), list(range(3, 20)), 1.0, step, 0.0))
    return out


def _split_cfg() -> AgentConfig:
    """A small cost per call: the long-tailed rows below split into runs of 3, 1 and 1 rows."""
    raw = _cfg().model_dump(mode="json")
    raw["model"]["split_call_tokens"] = 8
    return AgentConfig.model_validate(raw)


def _tail_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(99)
    out = []
    for i, n in enumerate([2, 3, 2, 26, 56]):
        resp = torch.randint(3, 20, (n,), generator=g).tolist()
        out.append(Sample(f"0-t{i}", [1, 3, 2, 6 + i], resp, [-1.0 - 0.01 * j for j in range(n)],
                          float(i % 3 - 1), list(range(3, 20)), 1.0, 0, 0.0))
    return out


def _split_grads(trainer: AgentTrainer) -> dict[str, torch.Tensor]:
    """A long-tailed micro-batch split by length: the gradients (scaled back to one device's)."""
    trainer.accumulate(_tail_samples())
    world = getattr(trainer, "world", 1)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone())
             * world for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def _train(trainer: AgentTrainer, first: int, last: int) -> None:
    """Steps first..last-1; the last micro-batch of each step has one row (a rank runs empty)."""
    for k in range(first, last):
        s = _samples(k)
        trainer.accumulate(s[:4])
        trainer.accumulate(s[4:6])
        trainer.accumulate(s[6:])
        trainer.step()


def _init(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))


def _k2_job(rank: int, out: str, k1_ckpt: str) -> None:
    _init(rank, 2, f"{out}/store")
    tr = ShardedAgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0, device="cpu")
    # built on the meta device, each rank materialising its shard from rank 0's weights
    res: dict = {"nbytes": tr.local_nbytes(), "wire0": publish_form(tr.weights(), "a", 0),
                 "meta_init": tr.meta_init}
    s = _samples(0)
    tr.accumulate(s[:4])
    tr.accumulate(s[4:])
    res["grads0"] = {n: p.grad.full_tensor() * tr.world for n, p in tr.model.named_parameters()}
    tr.step()
    _train(tr, 1, STEPS)
    res["weights"] = tr.full_weights()
    res["wire"] = publish_form(tr.weights(), "a", tr.version)
    res["nbytes_stepped"] = tr.local_nbytes()
    tr.save_checkpoint(f"{out}/ck2")
    # swap round trip through disk: capture, train on (weights change), restore, capture again
    before = tr.capture_shard()
    form = swap_out(before, out, f"a-rank{rank}")
    _train(tr, STEPS, STEPS + 1)
    tr.restore_shard(swap_in(form))
    after = tr.capture_shard()
    res["swap_equal"] = sorted(before.tensors) == sorted(after.tensors) and all(
        torch.equal(before.tensors[k], after.tensors[k]) for k in before.tensors)
    res["swap_bytes"] = sum(v.numel() * v.element_size() for k, v in before.tensors.items()
                            if not k.startswith("rng/"))
    # after the restore the next step equals the step taken before it
    _train(tr, STEPS, STEPS + 1)
    res["weights_after_redo"] = tr.full_weights()
    # FSDP2 mixed precision: bf16 compute, float32 master weights, same group
    bf = ShardedAgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0, device="cpu",
                             mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32))
    _train(bf, 0, STEPS)
    res["bf16_master_dtypes"] = sorted({str(p.dtype) for p in bf.model.parameters()})
    res["bf16_weights"] = bf.full_weights()
    # a checkpoint written at K=1 (this module's `k1` fixture), resumed here at K=2
    resumed = ShardedAgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0, device="cpu")
    resumed.load_checkpoint(k1_ckpt)
    res["from_k1_version"] = resumed.version
    res["from_k1_weights"] = resumed.full_weights()
    # split by length: each run of the micro-batch dealt to the ranks (rank 1 has no row of
    # the two 1-row runs: zero-weight passes keep the collectives matched)
    split = ShardedAgentTrainer("a", _split_cfg(), VOCAB, 80, run_seed=0, device="cpu")
    calls: list[int] = []
    forward = split._backward_batch
    split._backward_batch = lambda rows, first: (calls.append(len(rows)), forward(rows, first))[1]
    res["split_grads"] = _split_grads(split)
    res["split_calls"] = calls
    torch.save(res, f"{out}/k2-rank{rank}.pt")
    end_rank(exit_process=True)


def _kill_job(rank: int, out: str) -> None:
    _init(rank, 2, f"{out}/store-kill")
    tr = ShardedAgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0, device="cpu")
    s = _samples(0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies before its forward: rank 0 blocks
    t0 = time.monotonic()
    try:
        tr.accumulate(s)
        tr.step()
        outcome = "finished"
    except Exception as e:  # noqa: BLE001 - the error type depends on gloo's transport
        outcome = f"{type(e).__name__}: {e}"[:200]
    Path(f"{out}/kill.txt").write_text(f"{time.monotonic() - t0:.2f}\n{outcome}\n")


@pytest.fixture(scope="module")
def k1(tmp_path_factory):
    """K=1 (FSDP over a one-rank group in this process): the weights after STEPS steps and
    their DCP checkpoint."""
    out = tmp_path_factory.mktemp("k1")
    _init(0, 1, f"{out}/store")
    try:
        tr = ShardedAgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0, device="cpu")
        _train(tr, 0, STEPS)
        tr.save_checkpoint(out / "ck1")
        weights = tr.full_weights()
    finally:
        dist.destroy_process_group()
    return out / "ck1", weights


@pytest.fixture(scope="module")
def k2(tmp_path_factory, k1):
    out = tmp_path_factory.mktemp("k2")
    mp.spawn(_k2_job, args=(str(out), str(k1[0])), nprocs=2)
    ranks = [torch.load(out / f"k2-rank{r}.pt", weights_only=False) for r in range(2)]
    return out, ranks


@pytest.fixture(scope="module")
def reference():
    """The one-device trainer on the same rows."""
    tr = AgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0, device="cpu")
    wire0 = publish_form(tr.weights(), "a", 0)
    s = _samples(0)
    tr.accumulate(s[:4])
    tr.accumulate(s[4:])
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    tr.step()
    _train(tr, 1, STEPS)
    return {"grads0": grads, "weights": tr.full_weights(),
            "wire": publish_form(tr.weights(), "a", tr.version), "wire0": wire0}


def test_k2_gradients_and_weights_equal_one_device(k2, reference):
    _, ranks = k2
    for name, g in reference["grads0"].items():
        got = ranks[0]["grads0"][name]
        # relative to the tensor's norm (elementwise, a near-zero entry has no relative size)
        rel = ((got - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert rel <= 1e-5, (name, rel)
    assert set(ranks[0]["weights"]) == set(reference["weights"])
    for name, w in reference["weights"].items():
        assert (ranks[0]["weights"][name] - w).abs().max() < 1e-4, name
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name])


def test_k2_publication_is_byte_equal_to_one_device(k2, reference):
    _, ranks = k2
    # the same weights (one device built them from the seed; the K=2 ranks on the meta device,
    # filled from rank 0's) publish the same bytes
    for r in ranks:
        assert r["meta_init"]
        assert r["wire0"][0] == reference["wire0"][0]
        assert np.array_equal(r["wire0"][1], reference["wire0"][1])
    header, buf = ranks[0]["wire"]
    ref_header, ref_buf = reference["wire"]
    assert header == ref_header
    # the bytes of the bf16/fp32 weights differ only where summation order moved a last bit;
    # the wire form itself (names, dtypes, shapes, offsets, layout) is identical
    assert buf.shape == ref_buf.shape and buf.dtype == ref_buf.dtype


def test_k2_publication_bytes_equal_gathered_weights(k2):
    """Byte for byte: the bucketed publication equals the gathered full weights' wire form."""
    _, ranks = k2
    rebuilt = publish_form({k: v for k, v in ranks[0]["weights"].items()}, "a", STEPS)
    assert rebuilt[0] == ranks[0]["wire"][0]
    assert np.array_equal(rebuilt[1], ranks[0]["wire"][1])


def test_k2_swap_round_trip_is_bit_exact_and_half_the_bytes(k2, reference):
    _, ranks = k2
    full = sum(v.numel() * v.element_size() for v in reference["weights"].values())
    for r in ranks:
        assert r["swap_equal"]
        # weights + two AdamW moments + step counters, this rank's shard only
        assert r["swap_bytes"] <= 0.55 * 3 * full + 1024
        assert r["nbytes_stepped"]["params"] <= 0.55 * full
        assert r["nbytes_stepped"]["optimizer"] <= 0.55 * 2 * full + 1024
    # the redone step after the restore is deterministic across both ranks
    for k, v in ranks[0]["weights_after_redo"].items():
        assert torch.equal(v, ranks[1]["weights_after_redo"][k])


def test_k2_mixed_precision_keeps_float32_masters(k2):
    _, ranks = k2
    r = ranks[0]
    assert r["bf16_master_dtypes"] == ["torch.float32"]
    drift = max((r["bf16_weights"][k] - w).abs().max().item() for k, w in r["weights"].items())
    assert 0 < drift < 5e-2  # bf16 forward/backward: close to the fp32 run, not equal


def test_dcp_checkpoint_resumes_at_other_k(k1, k2, one_rank):
    out, ranks = k2
    # K=2 -> K=1: the checkpoint the two ranks wrote, loaded on one
    tr = ShardedAgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0, device="cpu")
    tr.load_checkpoint(out / "ck2")
    assert tr.version == STEPS
    loaded = tr.full_weights()
    for name, w in ranks[0]["weights"].items():
        assert torch.equal(loaded[name], w), name
    # K=1 -> K=2: the checkpoint of one rank, loaded on two
    _, k1_weights = k1
    for r in ranks:
        assert r["from_k1_version"] == STEPS
        assert set(r["from_k1_weights"]) == set(k1_weights)
        for name, w in k1_weights.items():
            assert torch.equal(r["from_k1_weights"][name], w), name


@pytest.mark.slow
def test_killed_rank_fails_its_peer_within_the_timeout(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_kill_job, args=(r, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert procs[1].exitcode == -signal.SIGKILL
    elapsed, outcome = (tmp_path / "kill.txt").read_text().splitlines()[:2]
    assert not outcome.startswith("finished"), outcome
    print(f"peer failed after {elapsed} s: {outcome}")
    assert float(elapsed) < 25.0, (elapsed, outcome)  # the group's timeout is 20 s


class _Group:
    def __init__(self, backend: str) -> None:
        self.backend = backend

    def name(self) -> str:
        return self.backend


def test_small_collectives_live_where_the_backend_reduces(monkeypatch):
    """Row counts, metric sums and flags go on the GPU for NCCL and stay on the host for gloo
    (the first GPU run failed with a host tensor in an NCCL all-reduce)."""
    assert comm_device(_Group("gloo")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm_device(_Group("nccl")) == torch.device("cuda", 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_k1_nccl_trainer_steps_and_matches_one_device(tmp_path):
    """The sharded slot's trainer on a one-rank NCCL group takes the steps the one-device
    trainer takes, to the same weights (summation order aside)."""
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1, device_id=device)
    try:
        sharded = ShardedAgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0, device="cuda")
        _train(sharded, 0, STEPS)
        got = sharded.full_weights()
    finally:
        dist.destroy_process_group()
    plain = AgentTrainer("a", _cfg(), VOCAB, 16, run_seed=0, device="cuda")
    _train(plain, 0, STEPS)
    want = plain.full_weights()
    assert max((got[k].float().cpu() - want[k].float().cpu()).abs().max().item()
               for k in want) < 1e-4


def test_k2_splits_a_long_tailed_micro_batch_as_one_device_does(k2):
    from flexmarl.training.trainer import length_split

    _, ranks = k2
    lengths = [len(s.prompt) + len(s.response) for s in _tail_samples()]
    assert [len(r) for r in length_split(lengths, 8)] == [3, 1, 1]
    # one forward and backward per run on each rank: rank 0 has rows 0 and 2 of the short
    # run and the two long rows; rank 1 row 1, then two zero-weight passes of one row
    assert ranks[0]["split_calls"] == [2, 1, 1] and ranks[1]["split_calls"] == [1, 1, 1]
    one = AgentTrainer("a", _split_cfg(), VOCAB, 80, run_seed=0, device="cpu")
    ref = _split_grads(one)
    for name, g in ref.items():
        rel = ((ranks[0]["split_grads"][name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert rel <= 1e-5, (name, rel)
