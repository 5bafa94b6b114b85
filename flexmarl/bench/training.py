"""Training-engine benchmarks, each measured side by side in one invocation:

(a) swap-out + swap-in of a full training state (weights + AdamW moments + grads) between host
    memory and disk, and between two processes (torch.distributed, gloo), in MB/s;
(b) tokens/s of one agent's micro-batch loop through `AgentTrainer` vs a plain PyTorch loop
    doing the same forward / backward / AdamW step on the same batches, and (with `trl`
    installed, the `bench` extra) vs TRL's `GRPOTrainer` computing the same GRPO loss on the
    same batches, without generation (rounds alternating);
(c) three agents with 1, 2 and 3 training slots: training-pool busy fraction, swaps and wall
    time per iteration.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from flexmarl.bench.engine_overhead import alternating
from flexmarl.config.schema import AgentConfig, load_config
from flexmarl.orchestrator.run import train
from flexmarl.policy.model import build_model
from flexmarl.training import lora
from flexmarl.training import state as st
from flexmarl.training.trainer import AgentTrainer
from flexmarl.types import Sample

MB = 1024 * 1024


def _agent(model: dict[str, Any], lora: dict[str, Any] | None) -> AgentConfig:
    raw: dict[str, Any] = {"model": model, "algorithm": {"name": "grpo"},
                           "optim": {"lr": 1e-4, "max_grad_norm": 1.0}}
    if lora:
        raw["lora"] = lora
    return AgentConfig.model_validate(raw)


def _batches(vocab: int, n: int, rows: int, prompt: int, response: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for b in range(n):
        out.append([
            Sample(f"0-{b}_{i}_0", rng.integers(3, vocab, size=prompt).tolist(),
                   rng.integers(3, vocab, size=response).tolist(),
                   (-rng.random(response) * 3).tolist(), float(rng.normal()), None, 1.0, 0)
            for i in range(rows)
        ])
    return out


# --- (a) swap ---------------------------------------------------------------------------------
def _peer(port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    got = st.move(st.incoming(st.Process(0)), st.Host())
    st.move(got, st.Process(0))
    dist.barrier()
    dist.destroy_process_group()


def bench_swap(cfg: AgentConfig, vocab: int, batch: list[Sample]) -> dict[str, float]:
    trainer = AgentTrainer("bench", cfg, vocab, 256, run_seed=0, total_steps=10)
    trainer.accumulate(batch)
    trainer.step()  # AdamW moments exist now
    # and gradients are pending: the state a yielding agent has
    trainer.accumulate([Sample(s.sample_id, s.prompt, s.response, s.old_logprobs, s.advantage,
                               s.allowed, s.temperature, 1) for s in batch])
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/state.safetensors"
        t0 = time.perf_counter()
        captured = st.capture(trainer)
        st.move(captured, st.Disk(path))
        t1 = time.perf_counter()
        nbytes = captured.nbytes
        del captured
        gc.collect()
        t2 = time.perf_counter()
        st.restore(trainer, st.move(st.StateHandle(st.Disk(path)), st.Host()).load())
        t3 = time.perf_counter()
    out["state_mb"] = nbytes / MB
    out["disk_out_mbs"] = nbytes / MB / (t1 - t0)
    out["disk_in_mbs"] = nbytes / MB / (t3 - t2)
    out["disk_pair_mbs"] = nbytes / MB / ((t1 - t0) + (t3 - t2))
    gc.collect()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    peer = mp.get_context("spawn").Process(target=_peer, args=(port,))
    peer.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    t0 = time.perf_counter()
    captured = st.capture(trainer)
    st.move(captured, st.Process(1))
    t1 = time.perf_counter()
    del captured
    gc.collect()
    t2 = time.perf_counter()
    st.restore(trainer, st.move(st.incoming(st.Process(1)), st.Host()).load())
    t3 = time.perf_counter()
    dist.barrier()
    dist.destroy_process_group()
    peer.join(timeout=120)
    out["proc_out_mbs"] = nbytes / MB / (t1 - t0)
    out["proc_in_mbs"] = nbytes / MB / (t3 - t2)
    out["proc_pair_mbs"] = nbytes / MB / ((t1 - t0) + (t3 - t2))
    del trainer
    gc.collect()
    return out


# --- (b) overhead -----------------------------------------------------------------------------
def _plain_setup(cfg: AgentConfig, vocab: int):
    """The same model, adapters and optimizer as the trainer builds, without the trainer."""
    model: Any = build_model("bench", cfg.model, vocab, 256, 0)
    if cfg.lora is not None:
        model = lora.apply("bench", model, cfg.lora, seed=0)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas,
                            weight_decay=cfg.optim.weight_decay)
    return model, params, opt


def _plain_iteration(model, params, opt, batches: list[list[Sample]], clip: float,
                     device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
                     ) -> None:
    """GRPO's clipped surrogate by hand: pad, forward, gather, loss, backward; clip, step.
    On `device`, under autocast to `dtype` when it is not float32 (as the trainer does)."""
    rows = 0
    for samples in batches:
        seqs = [s.prompt + s.response for s in samples]
        width = max(map(len, seqs))
        rw = max(len(s.response) for s in samples)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros((len(seqs), rw))
        old = torch.zeros((len(seqs), rw))
        pos = torch.zeros((len(seqs), rw), dtype=torch.long)
        tgt = torch.zeros((len(seqs), rw), dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(seqs[i])] = torch.tensor(seqs[i])
            attn[i, : len(seqs[i])] = 1
            n = len(s.response)
            mask[i, :n] = 1
            old[i, :n] = torch.tensor(s.old_logprobs)
            pos[i, :n] = torch.arange(len(s.prompt) - 1, len(s.prompt) - 1 + n)
            tgt[i, :n] = torch.tensor(s.response)
        ids, attn, mask, old, pos, tgt = (t.to(device) for t in (ids, attn, mask, old, pos, tgt))
        # like the trainer, LM-head logits only from the earliest response position on
        first = min(len(s.prompt) for s in samples) - 1
        dev_type = torch.device(device).type
        with torch.autocast(dev_type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False,
                           logits_to_keep=width - first).logits.float()
            picked = logits.gather(
                1, (pos - first).unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            logp = torch.log_softmax(picked, -1).gather(2, tgt.unsqueeze(-1)).squeeze(-1)
        adv = torch.tensor([s.advantage for s in samples], device=device).unsqueeze(1)
        ratio = torch.exp(logp - old)
        pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        loss = ((pg * mask).sum(-1) / mask.sum(-1)).sum()
        loss.backward()
        rows += len(samples)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(1.0 / rows)
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _trl_setup(cfg: AgentConfig, vocab: int, batches: list[list[Sample]]) -> Any:
    """TRL's GRPOTrainer on the same model, optimizer settings and loss (`loss_type: grpo`:
    each row's token mean, then the mean over rows; clip 0.2, no KL), or None without trl.
    Its tokenizer and dataset are placeholders: the benchmark feeds token ids directly."""
    try:  # optional: the `bench` extra
        from datasets import Dataset  # optional: TRL and its datasets (the bench extra)
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        return None
    model, _, _ = _plain_setup(cfg, vocab)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t2")
    rows = len(batches[0])
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-"), use_cpu=True,
                      per_device_train_batch_size=rows, num_generations=rows,
                      max_completion_length=max(len(s.response) for b in batches for s in b),
                      beta=0.0, loss_type="grpo", epsilon=0.2, learning_rate=cfg.optim.lr,
                      max_grad_norm=cfg.optim.max_grad_norm or 1e9, report_to="none",
                      weight_decay=cfg.optim.weight_decay, adam_beta1=cfg.optim.betas[0],
                      adam_beta2=cfg.optim.betas[1], bf16=False)
    def no_reward(completions: list[Any], **_: Any) -> list[float | None]:
        return [0.0] * len(completions)  # never called: the benchmark does not generate

    trl = GRPOTrainer(model=model, reward_funcs=no_reward, args=args,
                      train_dataset=Dataset.from_dict({"prompt": ["t3"] * rows}),
                      processing_class=tok)
    trl.create_optimizer_and_scheduler(num_training_steps=1000)
    return trl


def _trl_inputs(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """A batch as GRPOTrainer's loss reads it: prompts left-padded, completions right-padded,
    the rollout's log-probs as `old_per_token_logps`."""
    p = max(len(s.prompt) for s in samples)
    c = max(len(s.response) for s in samples)
    out = {k: torch.zeros((len(samples), n), dtype=torch.long) for k, n in (
        ("prompt_ids", p), ("prompt_mask", p), ("completion_ids", c), ("completion_mask", c))}
    old = torch.zeros((len(samples), c))
    for i, s in enumerate(samples):
        out["prompt_ids"][i, p - len(s.prompt):] = torch.tensor(s.prompt)
        out["prompt_mask"][i, p - len(s.prompt):] = 1
        out["completion_ids"][i, :len(s.response)] = torch.tensor(s.response)
        out["completion_mask"][i, :len(s.response)] = 1
        old[i, :len(s.response)] = torch.tensor(s.old_logprobs)
    return {**out, "old_per_token_logps": old,
            "advantages": torch.tensor([s.advantage for s in samples])}


def trl_same_step(cfg: AgentConfig, vocab: int, batch: list[Sample]) -> dict[str, float] | None:
    """The comparison's premise, checked: from the same initial weights, `AgentTrainer` and
    TRL's GRPOTrainer compute the same loss and gradient norm on `batch` (None without trl)."""
    trl = _trl_setup(cfg, vocab, [batch])
    if trl is None:
        return None
    trainer = AgentTrainer("bench", cfg, vocab, 256, run_seed=0, total_steps=1)
    trainer.accumulate(batch)
    ours = trainer.step()
    trl.model.train()
    trl.current_gradient_accumulation_steps = 1
    loss = trl.compute_loss(trl.model, _trl_inputs(batch))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(trl.model.parameters(), float("inf"))
    return {"loss": ours["loss/policy"], "trl_loss": loss.item(),
            "grad_norm": ours["grad_norm"], "trl_grad_norm": float(norm)}


def _trl_iteration(trl: Any, batches: list[list[Sample]], clip: float) -> None:
    """One optimizer step of TRL's GRPO over `batches` (gradient accumulation, as its
    Trainer's loop: the loss over `current_gradient_accumulation_steps`, clip, step)."""
    trl.model.train()
    trl.current_gradient_accumulation_steps = len(batches)
    for samples in batches:
        trl.compute_loss(trl.model, _trl_inputs(samples)).backward()
    torch.nn.utils.clip_grad_norm_(trl.model.parameters(), clip)
    trl.optimizer.step()
    trl.optimizer.zero_grad(set_to_none=True)


def bench_overhead(cfg: AgentConfig, vocab: int, batches: list[list[Sample]],
                   rounds: int) -> dict[str, float]:
    trainer = AgentTrainer("bench", cfg, vocab, 256, run_seed=0, total_steps=rounds + 1)
    model, params, opt = _plain_setup(cfg, vocab)
    trl = _trl_setup(cfg, vocab, batches) if cfg.lora is None else None
    tokens = sum(len(s.prompt) + len(s.response) for b in batches for s in b)
    clip = cfg.optim.max_grad_norm or 1e9

    def run(who: str) -> float:
        t0 = time.perf_counter()
        if who == "flexmarl":  # rows of the trainer's own version
            for b in batches:
                trainer.accumulate([Sample(s.sample_id, s.prompt, s.response, s.old_logprobs,
                                           s.advantage, s.allowed, s.temperature,
                                           trainer.version) for s in b])
            trainer.step()
        elif who == "plain":
            _plain_iteration(model, params, opt, batches, clip)
        else:
            _trl_iteration(trl, batches, clip)
        return time.perf_counter() - t0

    names = ["flexmarl", "plain"] + (["trl"] if trl is not None else [])
    alternating(names, 1, run)  # warms them up, not counted
    med = {who: statistics.median(t) for who, t in alternating(names, rounds, run).items()}
    out = {"tokens": tokens, "flexmarl_tps": tokens / med["flexmarl"],
           "plain_tps": tokens / med["plain"], "overhead": med["flexmarl"] / med["plain"] - 1.0}
    if "trl" in med:  # the goal: our step <= 0.8x TRL's
        out |= {"trl_tps": tokens / med["trl"], "vs_trl": med["flexmarl"] / med["trl"]}
    return out


# --- (c) slots --------------------------------------------------------------------------------
def bench_slots(config: str, overrides: list[str], slots: list[int]) -> list[dict[str, float]]:
    rows = []
    base = Path(tempfile.mkdtemp(prefix="flexmarl-slots-"))
    for n in slots:
        cfg = load_config(config, [*overrides, f"runtime.train_workers={n}"])
        result = train(cfg, base / f"slots{n}")
        steady = result.records[1:] or result.records
        rows.append({
            "slots": n,
            "busy": statistics.mean(r["pool/train/busy_frac"] for r in steady),
            "wall": statistics.median(r["wall_s"] for r in steady),
            "swaps": result.placement.get("train_swaps", 0),
            "success": result.records[-1]["task/success_rate"],
        })
        print(f"  {n} slot(s): {rows[-1]['wall']:.3f} s/iteration", flush=True)
    return rows
