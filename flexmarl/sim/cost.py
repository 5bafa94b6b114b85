"""Cost model for the cluster simulator: how long generation, training and transfers take.

Why: the ``sim`` runtime replaces real work with ``await asyncio.sleep(duration)``; the
durations come from here. The model is a roofline in the usual first-order form:

* prefill is compute-bound: ``2 * params * tokens / (tp * peak * MFU_prefill)``;
* a decode step is memory-bound: every step reads the weights and the whole batch's KV cache,
  ``(weight bytes + KV bytes) / (tp * HBM bandwidth * MBU)`` (or compute-bound for very large
  batches, whichever is slower), plus tensor-parallel all-reduces and a fixed per-step overhead;
* training is ``6 * params * tokens / (n * peak * MFU_train)`` plus an optimizer step bounded by
  memory bandwidth and a gradient all-reduce;
* transfers are ``latency + bytes / (bandwidth * efficiency)``.

Attention FLOPs are left out of prefill and decode compute (under ~10% of ``2 * params`` per
token for prompts below ~4k tokens at these model widths); tensor parallelism is assumed to
stay inside a node. Every efficiency factor is a field of `Efficiency` and every fixed cost a
named constant below, each with where it comes from; where no public measurement pins it down,
the comment says ASSUMPTION.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from flexmarl.sim.hardware import AcceleratorSpec, get_accelerator
from flexmarl.sim.models import ModelSpec

__all__ = ["CostModel", "Efficiency", "GenerationTiming"]

# --- Fixed costs --------------------------------------------------------------------------------

# CPU-side cost of one engine step (scheduling, sampling, detokenisation, kernel launches).
# ASSUMPTION: ~1 ms for vLLM-class engines with CUDA graphs; it bounds small-model decode speed.
DECODE_STEP_OVERHEAD_S = 1e-3
# Latency of one small-message NCCL all-reduce inside an NVLink node. ASSUMPTION: ~20 us, the
# order nccl-tests report for small messages on 8-GPU nodes. Decode pays two per layer.
ALLREDUCE_LATENCY_S = 20e-6
# Point-to-point latency for one transfer (or one per-layer bucket of a weight transfer).
# ASSUMPTIONS: ~10 us over NVLink, ~20 us across InfiniBand (NCCL send/recv small-message scale).
P2P_LATENCY_INTRA_S = 10e-6
P2P_LATENCY_INTER_S = 20e-6
# Fixed parts of colocated-baseline state changes. ASSUMPTIONS: putting a vLLM-style engine to
# sleep (free the KV cache, offload weights) ~0.5 s beyond the copy; waking it (re-allocate the
# KV cache, rebind CUDA graphs) ~1 s.
ENGINE_SLEEP_FIXED_S = 0.5
ENGINE_WAKE_FIXED_S = 1.0

# --- Sizes and engine defaults -----------------------------------------------------------------

# Bytes of one activation element exchanged by tensor-parallel all-reduces (BF16).
ACTIVATION_BYTES = 2
# Bytes of one gradient element in the data-parallel all-reduce (BF16 gradients).
GRAD_BYTES = 2
# Adam optimizer-step memory traffic per parameter with mixed precision: read the FP32 gradient
# (4), read+write FP32 master weight (8), Adam m (8) and v (8), write the BF16 weight (2) = 30.
ADAM_BYTES_PER_PARAM = 30
# Resident training state per parameter with mixed-precision Adam: BF16 weight (2) + BF16
# gradient (2) + FP32 master, m and v (12) = 16 bytes (ZeRO, Rajbhandari et al. 2020, sec. 3.1).
TRAIN_STATE_BYTES_PER_PARAM = 16
# Fraction of device memory an inference engine claims (vLLM's gpu_memory_utilization default).
KV_MEMORY_FRACTION = 0.9
# Fraction of device memory a trainer may fill with (sharded) training state; the rest holds
# activations and allocator slack. ASSUMPTION.
TRAIN_MEMORY_FRACTION = 0.8
# Maximum sequences an engine decodes at once (vLLM's max_num_seqs default).
MAX_NUM_SEQS = 256


# --- The cost model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationTiming:
    """Timeline of one engine serving a set of sequences with continuous batching.

    ``finish_s[i]`` is when sequence ``i`` (input order) has its last token, from the start.
    """

    total_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int
    peak_batch: int
    finish_s: np.ndarray = field(repr=False)


def _fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet peaks that real software reaches, each in (0, 1], with where
    each default comes from; override them to calibrate against a measured system or to ask
    "what if" questions, e.g. ``CostModel(H800, efficiency=Efficiency(mfu_train=0.1))``."""

    # Prefill MFU. ASSUMPTION: vLLM/SGLang prefill of batched prompts on A100/H100-class parts
    # runs at roughly 40-60% of dense BF16 peak for 1B-70B models; we take the middle.
    mfu_prefill: float = 0.5
    # Decode model-bandwidth utilisation (MBU: achieved bytes/s over peak HBM bandwidth).
    # Databricks' "LLM Inference Performance Engineering: Best Practices" (2023) reports
    # ~55-60% MBU for 7B models on A100; engines with CUDA graphs and fused kernels (vLLM,
    # SGLang, TensorRT-LLM) reach ~70-80%. ASSUMPTION: 0.7.
    mbu_decode: float = 0.7
    # Ceiling on decode compute efficiency, only binding for very large batches (roofline's
    # other side). ASSUMPTION: same as prefill.
    mfu_decode: float = 0.5
    # Training MFU. Megatron-LM reports ~40-47% MFU for GPT models at scale on A100/H100
    # (Narayanan et al. 2021; NVIDIA Megatron-Core performance tables); RL actor updates with
    # FSDP and short sequences usually do worse. ASSUMPTION: 0.4.
    mfu_train: float = 0.4
    # Fused Adam is a streaming elementwise kernel. ASSUMPTION: it reaches ~70% of HBM bandwidth.
    mbu_optimizer: float = 0.7
    # Achievable fraction of link peaks. ASSUMPTIONS from typical nccl-tests and cudaMemcpy
    # results: NVLink bus bandwidth ~80% of the per-direction peak, InfiniBand ~90% of line
    # rate, pinned host<->device copies ~80% of the PCIe per-direction peak.
    nvlink_efficiency: float = 0.8
    ib_efficiency: float = 0.9
    pcie_efficiency: float = 0.8

    def __post_init__(self) -> None:
        for f in fields(self):
            _fraction(f.name, getattr(self, f.name))


@dataclass(frozen=True)
class CostModel:
    """Durations of simulated work on one kind of accelerator.

    `efficiency` holds the fractions of the datasheet peaks that software reaches; the
    engine's fixed costs and limits default to the module's named constants. Override either
    to calibrate against a measured system or to ask "what if" questions.
    """

    accelerator: AcceleratorSpec
    accelerators_per_node: int = 8
    efficiency: Efficiency = Efficiency()
    decode_step_overhead_s: float = DECODE_STEP_OVERHEAD_S
    allreduce_latency_s: float = ALLREDUCE_LATENCY_S
    kv_memory_fraction: float = KV_MEMORY_FRACTION
    max_num_seqs: int = MAX_NUM_SEQS

    @classmethod
    def named(cls, accelerator: str, **overrides: Any) -> CostModel:
        """A cost model for an accelerator given by name, e.g. ``CostModel.named("H800")``."""
        return cls(get_accelerator(accelerator), **overrides)

    def __post_init__(self) -> None:
        if isinstance(self.accelerator, str):  # tolerate CostModel("H800")
            object.__setattr__(self, "accelerator", get_accelerator(self.accelerator))
        _fraction("kv_memory_fraction", self.kv_memory_fraction)
        if self.accelerators_per_node < 1 or self.max_num_seqs < 1:
            raise ValueError("accelerators_per_node and max_num_seqs must be >= 1")
        if self.decode_step_overhead_s < 0 or self.allreduce_latency_s < 0:
            raise ValueError("overheads and latencies must be >= 0")

    # --- helpers ----------------------------------------------------------------------------

    def _check_tp(self, tp: int) -> None:
        if not 1 <= tp <= self.accelerators_per_node:
            raise ValueError(
                f"tp must be in 1..{self.accelerators_per_node} (tensor parallelism stays "
                f"inside a node), got {tp}"
            )

    def _nvlink_bw(self) -> float:
        return self.accelerator.intra_node_unidirectional * self.efficiency.nvlink_efficiency

    def _link_bw(self, inter_node: bool) -> float:
        if inter_node:
            return self.accelerator.inter_node_bandwidth * self.efficiency.ib_efficiency
        return self._nvlink_bw()

    def _pcie_bw(self) -> float:
        return self.accelerator.host_link_bandwidth * self.efficiency.pcie_efficiency

    def tp_comm_time(self, model: ModelSpec, tp: int, tokens: float) -> float:
        """Tensor-parallel all-reduces of one forward pass over ``tokens`` tokens.

        Two ring all-reduces per layer (after attention and after the MLP), each moving
        ``2 (tp-1)/tp`` times the activations over NVLink, plus their latency.
        """
        if tp == 1:
            return 0.0
        message = tokens * model.hidden * ACTIVATION_BYTES
        per_allreduce = self.allreduce_latency_s + 2 * (tp - 1) / tp * message / self._nvlink_bw()
        return 2 * model.layers * per_allreduce

    # --- inference ---------------------------------------------------------------------------

    def kv_capacity_tokens(self, model: ModelSpec, tp: int) -> int:
        """Tokens of KV cache an engine on ``tp`` accelerators can hold (0 if weights don't fit).

        KV heads split across GPUs up to ``kv_heads`` ways; beyond that they are replicated.
        """
        self._check_tp(tp)
        free = self.accelerator.memory_bytes * self.kv_memory_fraction - model.weight_bytes / tp
        per_token = model.kv_bytes_per_token / min(tp, model.kv_heads)
        return max(0, int(free // per_token))

    def prefill_time(self, model: ModelSpec, tp: int, prompt_tokens: float) -> float:
        """One prefill step over ``prompt_tokens`` tokens (summed over the batch).

        Compute-bound: ``2 * params * tokens / (tp * peak * MFU_prefill)``, but never faster
        than reading the weights once; plus TP all-reduces and the step overhead.
        """
        self._check_tp(tp)
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        acc, eff = self.accelerator, self.efficiency
        compute = 2 * model.params * prompt_tokens / (tp * acc.peak_bf16_flops * eff.mfu_prefill)
        weights = model.weight_bytes / (tp * acc.hbm_bandwidth * eff.mbu_decode)
        return (
            max(compute, weights)
            + self.tp_comm_time(model, tp, prompt_tokens)
            + self.decode_step_overhead_s
        )

    def _decode_parts(
        self, model: ModelSpec, tp: int, batch_size: int
    ) -> tuple[float, float, float]:
        """(memory seconds of the weights, memory seconds per KV token, compute+fixed seconds)."""
        acc, eff = self.accelerator, self.efficiency
        bw = acc.hbm_bandwidth * eff.mbu_decode
        weights_s = model.weight_bytes / tp / bw
        kv_token_s = model.kv_bytes_per_token / min(tp, model.kv_heads) / bw
        compute_s = 2 * model.params * batch_size / (tp * acc.peak_bf16_flops * eff.mfu_decode)
        return weights_s, kv_token_s, compute_s

    def decode_step_time(
        self, model: ModelSpec, tp: int, batch_size: int, kv_tokens: float
    ) -> float:
        """One decode step producing a token for each of ``batch_size`` sequences.

        ``kv_tokens`` is the KV-cache length summed over the batch. Memory-bound:
        ``(weight bytes + KV bytes) / (tp * HBM * MBU)`` unless the batch is so large that
        ``2 * params * batch / (tp * peak * MFU_decode)`` is slower; plus TP all-reduces and the
        per-step overhead.
        """
        self._check_tp(tp)
        if batch_size < 1 or kv_tokens < 0:
            raise ValueError("batch_size must be >= 1 and kv_tokens >= 0")
        weights_s, kv_token_s, compute_s = self._decode_parts(model, tp, batch_size)
        return (
            max(weights_s + kv_token_s * kv_tokens, compute_s)
            + self.tp_comm_time(model, tp, batch_size)
            + self.decode_step_overhead_s
        )

    def _decode_segment_time(
        self, model: ModelSpec, tp: int, batch_size: int, kv_start: float, steps: int
    ) -> float:
        """Sum of ``steps`` decode steps of a fixed batch whose total KV grows by one token per
        sequence per step, starting at ``kv_start`` (closed form of the roofline's max)."""
        return self._segment_time(self._segment_parts(model, tp, batch_size), batch_size,
                                  kv_start, steps)

    def _segment_parts(self, model: ModelSpec, tp: int,
                       batch_size: int) -> tuple[float, float, float, float]:
        """What a decode segment's time needs of the batch size: `_decode_parts` and the fixed
        seconds per step (TP all-reduces and overhead); callers may keep them per size."""
        fixed = self.tp_comm_time(model, tp, batch_size) + self.decode_step_overhead_s
        return (*self._decode_parts(model, tp, batch_size), fixed)

    @staticmethod
    def _segment_time(parts: tuple[float, float, float, float], batch_size: int,
                      kv_start: float, steps: int) -> float:
        weights_s, kv_token_s, compute_s, fixed = parts
        m0 = weights_s + kv_token_s * kv_start  # memory time of the first step
        d = kv_token_s * batch_size  # growth of memory time per step
        if d <= 0.0:
            body = steps * max(m0, compute_s)
        else:
            # steps k < k_star are compute-bound (m0 + d k < compute_s), the rest memory-bound
            k_star = min(steps, max(0, math.ceil((compute_s - m0) / d)))
            tail = steps - k_star
            body = (
                k_star * compute_s
                + tail * m0
                + d * ((steps - 1) * steps - (k_star - 1) * k_star) / 2
            )
        return body + steps * fixed

    def generation_timing(
        self,
        model: ModelSpec,
        tp: int,
        prompt_lens: int | Sequence[int] | np.ndarray,
        output_lens: Sequence[int] | np.ndarray,
        *,
        max_num_seqs: int | None = None,
    ) -> GenerationTiming:
        """Serve ``len(output_lens)`` sequences that all arrive at t=0 on one engine.

        Continuous batching: up to ``max_num_seqs`` sequences (and as many as the KV cache can
        hold at their full length) run together; prefill produces each sequence's first token,
        every decode step one more token per running sequence; the batch shrinks as sequences
        finish and waiting ones are prefilled into the freed slots.
        """
        self._check_tp(tp)
        outs = np.asarray(output_lens, dtype=np.int64).reshape(-1)
        n = outs.size
        prompt_arr = np.asarray(prompt_lens, dtype=np.int64)
        if prompt_arr.ndim and prompt_arr.size != n:
            raise ValueError(
                f"got {prompt_arr.size} prompt lengths for {n} sequences (give one or one each)"
            )
        prompts = np.broadcast_to(prompt_arr.reshape(-1) if prompt_arr.ndim else prompt_arr, (n,))
        if n and (outs.min() < 1 or prompts.min() < 0):
            raise ValueError("output lengths must be >= 1 and prompt lengths >= 0")
        cap_seqs = self.max_num_seqs if max_num_seqs is None else max_num_seqs
        if cap_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {cap_seqs}")
        cap_tokens = self.kv_capacity_tokens(model, tp)
        need = prompts + outs  # KV tokens a sequence holds when it finishes
        if n and need.max() > cap_tokens:
            worst = int(need.argmax())
            raise ValueError(
                f"sequence {worst} needs {int(need[worst])} KV tokens but {model.name} on "
                f"tp={tp} x {self.accelerator.name} holds {cap_tokens}"
            )

        # plain lists: the loop below reads one element at a time (numpy scalars are slow)
        outs_l: list[int] = outs.tolist()
        prompts_l: list[int] = prompts.tolist()
        need_l: list[int] = need.tolist()
        finish = [0.0] * n
        join = [0] * n
        seg_parts: dict[int, tuple[float, float, float, float]] = {}  # per batch size
        waiting = deque(range(n))
        running: list[tuple[int, int]] = []  # (last decode step index, sequence)
        t = prefill_s = decode_s = 0.0
        step = 0  # decode steps done so far (global step index)
        kv_offset = 0.0  # sum over running i of (p_i + 1 - join_i): KV at step s = this + a*s
        reserved = 0  # KV tokens reserved by running sequences at their full length
        peak = 0

        def admit() -> None:
            nonlocal t, prefill_s, kv_offset, reserved, peak
            while waiting and len(running) < cap_seqs:
                batch: list[int] = []
                while (
                    waiting
                    and len(running) + len(batch) < cap_seqs
                    and reserved + need_l[waiting[0]] <= cap_tokens
                ):
                    i = waiting.popleft()
                    batch.append(i)
                    reserved += need_l[i]
                if not batch:
                    return  # KV cache full: wait for a running sequence to finish
                dt = self.prefill_time(model, tp, float(sum(prompts_l[i] for i in batch)))
                t += dt
                prefill_s += dt
                for i in batch:
                    if outs_l[i] == 1:  # prefill's token was the only one
                        finish[i] = t
                        reserved -= need_l[i]
                        continue
                    join[i] = step
                    heapq.heappush(running, (step + outs_l[i] - 2, i))
                    kv_offset += float(prompts_l[i]) + 1 - step
                peak = max(peak, len(running))

        admit()
        while running:
            last = running[0][0]
            steps = last - step + 1
            batch_size = len(running)
            parts = seg_parts.get(batch_size)
            if parts is None:
                parts = seg_parts[batch_size] = self._segment_parts(model, tp, batch_size)
            dt = self._segment_time(parts, batch_size, kv_offset + batch_size * step, steps)
            t += dt
            decode_s += dt
            step += steps
            while running and running[0][0] == last:
                _, i = heapq.heappop(running)
                finish[i] = t
                kv_offset -= float(prompts_l[i]) + 1 - join[i]
                reserved -= need_l[i]
            admit()

        return GenerationTiming(
            total_s=float(t),
            prefill_s=float(prefill_s),
            decode_s=float(decode_s),
            decode_steps=step,
            peak_batch=peak,
            finish_s=np.asarray(finish, dtype=float),
        )

    # --- training ----------------------------------------------------------------------------

    def forward_time(self, model: ModelSpec, n_accel: int, tokens: float) -> float:
        """A forward pass only (reference / old-policy log-probs): ``2 * params * tokens``."""
        return 2 * model.params * tokens / self._train_flops(n_accel)

    def policy_forwards_time(self, model: ModelSpec, n_accel: int, tokens: float,
                             passes: int) -> float:
        """The forward passes a step runs before its update (old-policy and reference
        log-probs, `TrainingSpec.forward_passes`): ``passes x 2 x params x tokens``."""
        return passes * self.forward_time(model, n_accel, tokens) if passes else 0.0

    def train_compute_time(self, model: ModelSpec, n_accel: int, tokens: float) -> float:
        """Forward + backward over ``tokens`` tokens: ``6 * params * tokens / (n peak MFU)``."""
        return 6 * model.params * tokens / self._train_flops(n_accel)

    def _train_flops(self, n_accel: int) -> float:
        if n_accel < 1:
            raise ValueError(f"n_accel must be >= 1, got {n_accel}")
        return n_accel * self.accelerator.peak_bf16_flops * self.efficiency.mfu_train

    def optimizer_step_time(self, model: ModelSpec, n_accel: int) -> float:
        """Gradient all-reduce plus the Adam update, once per optimizer step.

        Gradients accumulate locally over micro-batches and are reduced once (ring all-reduce
        of BF16 gradients; across nodes the NIC is the bottleneck link). The update streams
        ``ADAM_BYTES_PER_PARAM`` bytes per parameter, sharded over ``n_accel`` (ZeRO).
        """
        if n_accel < 1:
            raise ValueError(f"n_accel must be >= 1, got {n_accel}")
        acc = self.accelerator
        update = model.params * ADAM_BYTES_PER_PARAM / (
            n_accel * acc.hbm_bandwidth * self.efficiency.mbu_optimizer)
        if n_accel == 1:
            return update
        inter = n_accel > self.accelerators_per_node
        volume = 2 * (n_accel - 1) / n_accel * model.params * GRAD_BYTES
        latency = P2P_LATENCY_INTER_S if inter else P2P_LATENCY_INTRA_S
        return update + model.layers * latency + volume / self._link_bw(inter)

    def training_memory_bytes(self, model: ModelSpec, n_accel: int) -> float:
        """Training state per device with mixed-precision Adam fully sharded over ``n_accel``."""
        return model.params * TRAIN_STATE_BYTES_PER_PARAM / n_accel

    def min_train_accelerators(self, model: ModelSpec) -> int:
        """Fewest devices whose memory holds the sharded training state (plus activation room)."""
        usable = self.accelerator.memory_bytes * TRAIN_MEMORY_FRACTION
        return max(1, math.ceil(model.params * TRAIN_STATE_BYTES_PER_PARAM / usable))

    # --- transfers and state changes ---------------------------------------------------------

    def weight_transfer_time(self, model: ModelSpec, *, inter_node: bool, links: int = 1) -> float:
        """Publish a model's weights to another device group.

        The weights are split over ``links`` parallel GPU links (e.g. one per tensor-parallel
        shard) and sent in one bucket per layer, each bucket paying the link latency. A
        pipelined broadcast to several receivers costs about the same.
        """
        if links < 1:
            raise ValueError(f"links must be >= 1, got {links}")
        latency = P2P_LATENCY_INTER_S if inter_node else P2P_LATENCY_INTRA_S
        return model.layers * latency + model.weight_bytes / links / self._link_bw(inter_node)

    def engine_sleep_time(self, model: ModelSpec, tp: int, *, kv_bytes: float = 0.0) -> float:
        """Colocated baseline: offload an inference engine's weights (and ``kv_bytes`` of KV
        cache, 0 when it is simply discarded) to host memory over PCIe, per shard in parallel."""
        self._check_tp(tp)
        return (model.weight_bytes + kv_bytes) / tp / self._pcie_bw() + ENGINE_SLEEP_FIXED_S

    def engine_wake_time(self, model: ModelSpec, tp: int, *, kv_bytes: float = 0.0) -> float:
        """Colocated baseline: reload the engine's weights (and KV cache) from host memory."""
        self._check_tp(tp)
        return (model.weight_bytes + kv_bytes) / tp / self._pcie_bw() + ENGINE_WAKE_FIXED_S

    def train_state_swap_time(self, model: ModelSpec, n_accel: int) -> float:
        """Swap a trainer's sharded state (weights, grads, Adam) between device and host, one
        direction: what time-sharing devices between agents' trainers costs."""
        return self.training_memory_bytes(model, n_accel) / self._pcie_bw()
