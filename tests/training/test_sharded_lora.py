"""LoRA agents on sharded slots (K=2, real gloo groups of spawned processes) against one
device: an agent with its own base (base and adapter sharded, merged publication) and two
agents on one shared base sharded once (adapter-only publication), trained in turns; their
swaps move 1/K of the adapter, bit-exact, and a K=2 restart point resumes on one device."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from flexmarl.config.schema import AgentConfig
from flexmarl.policy.adapters import adapter_name
from flexmarl.policy.model import build_model
from flexmarl.runtime.local.slot_ranks import end_rank
from flexmarl.training.sharded import ShardedAgentTrainer, shard_shared_base
from flexmarl.training.state import swap_in, swap_out
from flexmarl.training.trainer import AgentTrainer
from tests.training.test_sharded import STEPS, VOCAB, _train

SEED = 3
# intermediate_size 131 and r=3: dims that do not divide by K=2 (uneven shards)
MODEL = {"hidden_size": 64, "intermediate_size": 131, "num_layers": 2, "num_heads": 2,
         "init_std": 0.1}


def _own() -> AgentConfig:
    return AgentConfig.model_validate({
        "model": MODEL, "algorithm": {"name": "grpo"}, "optim": {"lr": 0.02},
        "lora": {"r": 3, "alpha": 6, "target_modules": ["q_proj", "v_proj", "down_proj"]}})


def _on_base(r: int, targets: list[str]) -> AgentConfig:
    return AgentConfig.model_validate({
        "model": {**MODEL, "base": "shared"}, "algorithm": {"name": "grpo"},
        "optim": {"lr": 0.05}, "lora": {"r": r, "alpha": 2 * r, "target_modules": targets}})


SHARED = {"speaker": _on_base(4, ["q_proj", "v_proj"]),
          "listener": _on_base(3, ["q_proj", "o_proj", "up_proj"])}


def _shared_base(device: str = "cpu") -> torch.nn.Module:
    return build_model("models.shared", SHARED["speaker"].model, VOCAB, 16, SEED, device)


def _turns(trainers: dict[str, AgentTrainer]) -> dict[str, dict[str, torch.Tensor]]:
    """Each agent's steps in turn (a slot time-shared by agents); its publications."""
    for k in range(STEPS):
        for tr in trainers.values():
            _train(tr, k, k + 1)
    return {a: tr.weights() for a, tr in trainers.items()}


def _k2_job(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    own = ShardedAgentTrainer("a", _own(), VOCAB, 16, run_seed=SEED, device="cpu")
    res: dict = {"own0": own.weights(), "own_full0": own.full_weights()}
    policy = shard_shared_base(_shared_base(), SHARED, SEED, own.mesh)
    trainers = {a: ShardedAgentTrainer(a, c, VOCAB, 16, run_seed=SEED, device="cpu",
                                       mesh=own.mesh, policy=policy, adapter=adapter_name(a))
                for a, c in SHARED.items()}
    res["shared0"] = {a: tr.weights() for a, tr in trainers.items()}
    res["published"] = _turns({"a": own, **trainers})
    res["own_full"] = own.full_weights()
    res["nbytes"] = {a: tr.local_nbytes() for a, tr in trainers.items()}
    listener = trainers["listener"]
    listener.save_checkpoint(f"{out}/ck-listener")
    own.save_checkpoint(f"{out}/ck-own")
    # swap round trip of the listener's adapter shard, while the speaker trains on
    before = listener.capture_shard()
    form = swap_out(before, out, f"listener-rank{rank}")
    _train(listener, STEPS, STEPS + 1)
    _train(trainers["speaker"], STEPS, STEPS + 1)
    listener.restore_shard(swap_in(form))
    after = listener.capture_shard()
    res["swap_equal"] = sorted(before.tensors) == sorted(after.tensors) and all(
        torch.equal(before.tensors[k], after.tensors[k]) for k in before.tensors)
    res["swap_bytes"] = before.nbytes
    res["swap_keys"] = sorted(before.tensors)
    torch.save(res, f"{out}/rank{rank}.pt")
    end_rank(exit_process=True)  # as a slot's rank ends (no finalization: see end_rank)


@pytest.fixture(scope="module")
def k2(tmp_path_factory):  # about 35 s on the 2-core machine (3 agents x 3 steps at K=2)
    out = tmp_path_factory.mktemp("lora-k2")
    mp.spawn(_k2_job, args=(str(out),), nprocs=2)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def one_device():
    own = AgentTrainer("a", _own(), VOCAB, 16, run_seed=SEED, device="cpu")
    base = _shared_base()
    trainers = {a: AgentTrainer(a, c, VOCAB, 16, run_seed=SEED, device="cpu", shared_base=base)
                for a, c in SHARED.items()}
    res = {"own0": own.weights(), "own_full0": own.full_weights(),
           "shared0": {a: tr.weights() for a, tr in trainers.items()}}
    res["published"] = _turns({"a": own, **trainers})
    res["own_full"] = own.full_weights()
    res["adapter_bytes"] = {a: sum(p.numel() * 4 for p in tr.actor_params)
                            for a, tr in trainers.items()}
    return res


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.allclose(got[k], v, rtol=0, atol=atol), (k, (got[k] - v).abs().max())


@pytest.mark.slow
def test_initial_publications_are_byte_equal_to_one_device(k2, one_device):
    _, ranks = k2
    for r in ranks:
        for key in ("own0", "own_full0"):
            _close(r[key], one_device[key], atol=0)
        for agent in SHARED:
            _close(r["shared0"][agent], one_device["shared0"][agent], atol=0)
    # adapters only, from a shared base; merged adapted layers from an own base
    assert all(k.endswith((".lora_A", ".lora_B")) for k in ranks[0]["shared0"]["listener"])
    assert all("lora" not in k for k in ranks[0]["own0"])


@pytest.mark.slow
def test_k2_lora_training_equals_one_device(k2, one_device):
    _, ranks = k2
    for r in ranks:
        for agent, want in one_device["published"].items():
            _close(r["published"][agent], want, atol=1e-5)
        _close(r["own_full"], one_device["own_full"], atol=1e-5)
    # the adapters moved (the equality is not that of two untouched states)
    moved = one_device["published"]["listener"]
    assert any((moved[k] - one_device["shared0"]["listener"][k]).abs().max() > 1e-3
               for k in moved)


@pytest.mark.slow
def test_shared_base_swap_moves_half_the_adapter_bit_exact(k2, one_device):
    _, ranks = k2
    for r in ranks:
        assert r["swap_equal"]
        assert not any("base_layer" in k or "embed" in k or "speaker" in k
                       for k in r["swap_keys"])
    adapter = one_device["adapter_bytes"]["listener"]
    params = [r["nbytes"]["listener"]["params"] for r in ranks]
    assert sum(params) >= adapter and max(params) <= 0.6 * adapter
    # param + 2 AdamW moments per rank (+ small step counters and the RNG state)
    assert max(r["swap_bytes"] for r in ranks) < 0.6 * 3 * adapter + 10_000


@pytest.mark.slow
def test_k2_lora_restart_point_resumes_on_one_device(k2, one_device):
    out, _ = k2
    for agent, ck, cfg in (("listener", "ck-listener", SHARED["listener"]),
                           ("a", "ck-own", _own())):
        base = _shared_base() if agent == "listener" else None
        tr = AgentTrainer(agent, cfg, VOCAB, 16, run_seed=SEED, device="cpu", shared_base=base)
        tr.set_state({}, {"agent": agent, "version": STEPS, "dcp": str(out / ck)})
        assert tr.version == STEPS
        _close(tr.weights(), one_device["published"][agent], atol=1e-5)
        # the optimizer state came too: one more step equals the one-device run's
        assert all(len(tr.optimizer.state[p]) == 3 for p in tr.actor_params)


def test_one_rank_shared_base_adapter_trains_alone_and_publishes_only_itself(one_rank, tmp_path):
    """The sharded shared-base path in seconds: one FSDP rank, two adapters on one base; a
    step of one agent equals the one-device trainer's and leaves the other adapter and the
    base untouched; swaps and publication hold the agent's adapter only; its saved folder
    is the one-device trainer's (files, merged weights, adapter, flexmarl.json)."""
    own = ShardedAgentTrainer("a", _own(), VOCAB, 16, run_seed=SEED, device="cpu")
    policy = shard_shared_base(_shared_base(), SHARED, SEED, own.mesh)
    sharded = {a: ShardedAgentTrainer(a, c, VOCAB, 16, run_seed=SEED, device="cpu",
                                      mesh=own.mesh, policy=policy, adapter=adapter_name(a))
               for a, c in SHARED.items()}
    base = _shared_base()
    plain = AgentTrainer("listener", SHARED["listener"], VOCAB, 16, run_seed=SEED,
                         device="cpu", shared_base=base)
    speaker0 = sharded["speaker"].weights()
    frozen0 = {n: p.full_tensor().clone() for n, p in policy.named_parameters()
               if not p.requires_grad}
    _close(sharded["listener"].weights(), plain.weights(), atol=0)
    _train(sharded["listener"], 0, 1)
    _train(plain, 0, 1)
    _close(sharded["listener"].weights(), plain.weights(), atol=1e-6)
    _close(sharded["speaker"].weights(), speaker0, atol=0)  # untouched by the other's step
    assert all(torch.equal(p.full_tensor(), frozen0[n]) for n, p in policy.named_parameters()
               if not p.requires_grad)
    shard = sharded["listener"].capture_shard()
    params = [k for k in shard.tensors if k.startswith("param/")]
    assert params and all(adapter_name("listener") in k for k in params)
    assert sharded["listener"]._canonical(params[0][len("param/"):]) is not None
    other = next(n for n, _ in sharded["speaker"].named_trainable)
    assert sharded["listener"]._canonical(other) is None
    assert len(sharded["listener"].optimizer.param_groups[0]["params"]) == len(params)
    folders = {"sharded": sharded["listener"].save(tmp_path / "sharded"),
               "plain": plain.save(tmp_path / "plain")}
    files = {k: sorted(str(f.relative_to(d)) for f in d.rglob("*")  # peft adds a README
                       if f.is_file() and f.name != "README.md") for k, d in folders.items()}
    assert files["sharded"] == files["plain"] and "adapter/adapter_model.safetensors" in \
        files["plain"]
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        _close(load_file(folders["sharded"] / name), load_file(folders["plain"] / name),
               atol=1e-6)
    assert (folders["sharded"] / "flexmarl.json").read_text() == \
        (folders["plain"] / "flexmarl.json").read_text()
    # an own-base agent's merged export in small buckets (a large model's): each adapted
    # layer's merged weight, never its base weight from a later bucket
    with torch.no_grad():  # B != 0: merged and base weights differ
        for name, p in own.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.01)
    merged = {k: v for bucket in own.weight_buckets(bucket_bytes=1) for k, v in bucket.items()}
    _close(merged, own.full_weights(), atol=0)
