"""PPO (value head, separate critic), a KL reference and `algorithm.epochs > 1` on sharded
slots: K=2 (a real gloo group of spawned processes) ends with the weights of one device, the
critic's included, and a K=2 restart point of a PPO agent resumes on one device; the same
path on one FSDP rank in seconds."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flexmarl.config.schema import AgentConfig
from flexmarl.runtime.local.slot_ranks import end_rank
from flexmarl.training.sharded import ShardedAgentTrainer
from flexmarl.training.trainer import AgentTrainer
from tests.training.test_sharded import STEPS, VOCAB, _samples, _train

SEED = 5
MODEL = {"hidden_size": 64, "intermediate_size": 131, "num_layers": 2, "num_heads": 2,
         "init_std": 0.1}
ALGORITHMS = {
    "ppo_head": {"name": "ppo", "critic": "head", "epochs": 2},
    "ppo_separate": {"name": "ppo", "critic": "separate", "critic_lr": 0.01},
    "grpo_kl_epochs": {"name": "grpo", "kl_coef": 0.2, "epochs": 3},
}


def _cfg(which: str) -> AgentConfig:
    return AgentConfig.model_validate({"model": MODEL, "algorithm": ALGORITHMS[which],
                                       "optim": {"lr": 0.003}})


def _state(trainer: AgentTrainer) -> dict[str, torch.Tensor]:
    """Every trained tensor, gathered (collective on a sharded trainer), by part."""
    out: dict[str, torch.Tensor] = {}
    for part, module in trainer._state_modules().items():
        for k, v in module.state_dict().items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"{part}.{k}"] = v.detach().clone()
    return out


def _run(trainer: AgentTrainer) -> dict:
    metrics = []
    for k in range(STEPS):
        s = _samples(k)
        trainer.accumulate(s[:4])
        trainer.accumulate(s[4:6])
        trainer.accumulate(s[6:])
        metrics.append(trainer.step())
    return {"state": _state(trainer), "metrics": metrics,
            "optim_slots": sum(len(v) for v in trainer.optimizer.state.values())}


def _poisoned(trainer: AgentTrainer) -> dict:
    s = _samples(0)
    # row 1 (rank 1's share at K=2) with NaN behaviour log-probs: a non-finite loss
    s[1] = dataclasses.replace(s[1], old_logprobs=[float("nan")] * len(s[1].response))
    trainer.accumulate(s)
    first = trainer.step()
    _train(trainer, 1, 2)
    return {"first": first, "state": _state(trainer)}


def _k2_job(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    res = {}
    for which in ALGORITHMS:
        tr = ShardedAgentTrainer(which, _cfg(which), VOCAB, 16, run_seed=SEED, device="cpu")
        res[which] = _run(tr)
        if which == "ppo_separate":
            tr.save_checkpoint(f"{out}/ck-ppo")
    # a non-finite row on rank 1 only: both ranks skip the step (no hang), then train on
    tr = ShardedAgentTrainer("poisoned", _cfg("grpo_kl_epochs"), VOCAB, 16, run_seed=SEED,
                             device="cpu")
    res["poisoned"] = _poisoned(tr)
    torch.save(res, f"{out}/rank{rank}.pt")
    end_rank(exit_process=True)  # as a slot's rank ends (no finalization: see end_rank)


@pytest.fixture(scope="module")
def k2(tmp_path_factory):  # about 40 s on the 2-core machine
    out = tmp_path_factory.mktemp("algos-k2")
    mp.spawn(_k2_job, args=(str(out),), nprocs=2)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def one_device():
    return {which: _run(AgentTrainer(which, _cfg(which), VOCAB, 16, run_seed=SEED,
                                     device="cpu")) for which in ALGORITHMS}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.allclose(got[k], v, rtol=0, atol=atol), (k, (got[k] - v).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("which", list(ALGORITHMS))
def test_k2_equals_one_device(k2, one_device, which):
    _, ranks = k2
    want = one_device[which]
    for r in ranks:
        _close(r[which]["state"], want["state"], atol=1e-4)
        for got, ref in zip(r[which]["metrics"], want["metrics"], strict=True):
            assert got.get("skipped") is None and got["rows"] == ref["rows"]
            assert got["train_world_size"] == 2.0
            for key in ("epochs", "loss/policy_last_epoch", "grad_norm"):
                if key in ref:
                    assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    if ALGORITHMS[which].get("epochs", 1) > 1:
        assert want["metrics"][-1]["epochs"] == ALGORITHMS[which]["epochs"]


@pytest.mark.slow
def test_k2_ppo_restart_point_resumes_on_one_device(k2, one_device):
    out, _ = k2
    tr = AgentTrainer("ppo_separate", _cfg("ppo_separate"), VOCAB, 16, run_seed=SEED,
                      device="cpu")
    tr.set_state({}, {"agent": "ppo_separate", "version": STEPS, "dcp": str(out / "ck-ppo")})
    assert tr.version == STEPS
    _close(_state(tr), one_device["ppo_separate"]["state"], atol=1e-4)
    # AdamW's state came too, the critic's included (its unused lm_head has none)
    slots = sum(len(v) for v in tr.optimizer.state.values())
    assert slots == one_device["ppo_separate"]["optim_slots"] > 3 * len(tr.actor_params)


def test_one_rank_ppo_and_kl_epochs_equal_one_device(one_rank):
    """The sharded path (FSDP over one rank) of PPO with a value head and 2 passes, and of a
    KL reference with 3 passes, one step each: equal to the one-device trainer."""
    for which in ("ppo_head", "grpo_kl_epochs"):
        sharded = ShardedAgentTrainer(which, _cfg(which), VOCAB, 16, run_seed=SEED,
                                      device="cpu")
        plain = AgentTrainer(which, _cfg(which), VOCAB, 16, run_seed=SEED, device="cpu")
        for tr in (sharded, plain):
            _train(tr, 0, 1)
        _close(_state(sharded), _state(plain), atol=1e-6)
        assert len(sharded.optimizer.param_groups) == len(plain.optimizer.param_groups)
        shard = sharded.capture_shard()
        if which == "ppo_head":
            assert any(k.startswith("param/value_head.") for k in shard.tensors)


@pytest.mark.slow
def test_a_non_finite_row_on_one_rank_skips_the_step_on_every_rank(k2):
    _, ranks = k2
    plain = _poisoned(AgentTrainer("poisoned", _cfg("grpo_kl_epochs"), VOCAB, 16,
                                   run_seed=SEED, device="cpu"))
    assert plain["first"]["skipped"] == 1.0
    for r in ranks:
        assert r["poisoned"]["first"]["skipped"] == 1.0
        _close(r["poisoned"]["state"], plain["state"], atol=1e-4)
