"""The trainer with each algorithm learns a small contextual bandit in-process (real tiny Llama,
real sampling); LoRA through real peft; credit assignment across a graph."""

import numpy as np
import pytest
import torch

from flexmarl.config.schema import AgentConfig, CreditConfig
from flexmarl.orchestrator.joint import assign_credit
from flexmarl.rollout.engine import generate
from flexmarl.training import algorithms
from flexmarl.training.trainer import AgentTrainer, Sample
from flexmarl.types import GenerationRequest

OBJECTS = list(range(6, 14))
SYMBOLS = list(range(14, 22))
VOCAB = 22


def _agent(name, **algo):
    return AgentConfig.model_validate({
        "model": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2,
                  "init_std": 0.1},
        "algorithm": {"name": name, **algo},
        "optim": {"lr": 0.003},
    })


def run_bandit(cfg: AgentConfig, steps: int, inputs=16, group=4) -> list[float]:
    """Mean reward per step: say the symbol paired with the shown object (chance 1/8)."""
    trainer = AgentTrainer("a", cfg, VOCAB, 16, run_seed=0, total_steps=steps)
    algo = algorithms.get(cfg.algorithm.name)
    rng = np.random.default_rng(0)
    curve = []
    for k in range(steps):
        targets = rng.integers(len(OBJECTS), size=inputs)
        reqs = [GenerationRequest(f"{k}-{i}_0_{j}", "a", k, [1, 3, 2, OBJECTS[t]], 1, SYMBOLS,
                                  [], 1.0, 0)
                for i, t in enumerate(targets) for j in range(group)]
        trainer.model.eval()
        with torch.no_grad():
            results = generate(trainer.model, reqs)
        trainer.model.train()
        rewards = [float(r.tokens[0] == SYMBOLS[targets[i // group]])
                   for i, r in enumerate(results)]
        advs = []
        for i in range(inputs):
            advs += algo.sequence_advantages(rewards[i * group:(i + 1) * group], cfg.algorithm)
        samples = [Sample(q.sample_id, q.prompt, r.tokens, r.logprobs, a, SYMBOLS, 1.0, k, rw)
                   for q, r, a, rw in zip(reqs, results, advs, rewards, strict=True)]
        half = len(samples) // 2
        trainer.accumulate(samples[:half])
        trainer.accumulate(samples[half:])
        metrics = trainer.step()
        assert {"loss/policy", "loss/value", "kl", "entropy", "clip_frac", "grad_norm",
                "lr"} <= set(metrics)
        curve.append(float(np.mean(rewards)))
    return curve


@pytest.mark.parametrize("name,algo", [
    ("grpo", {}),
    ("ppo", {"critic": "head"}),
    ("ppo", {"critic": "separate", "kl_coef": 0.01, "kl_mode": "reward"}),
    ("reinforce_pp", {"kl_coef": 0.01}),
])
def test_each_algorithm_learns_the_bandit(name, algo):
    curve = run_bandit(_agent(name, **algo), steps=22)
    first, last = np.mean(curve[:4]), np.mean(curve[-4:])
    assert first < 0.4
    assert last > first + 0.3, f"{name}: {first:.2f} -> {last:.2f}"


def test_lora_trains_only_adapters_and_publishes_merged_layers():
    raw = _agent("grpo", kl_coef=0.05).model_dump()
    raw["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    cfg = AgentConfig.model_validate(raw)
    trainer = AgentTrainer("a", cfg, VOCAB, 16, run_seed=0, total_steps=3)
    before = trainer.weights()
    assert set(before) == {f"model.layers.{i}.self_attn.{m}_proj.weight"
                           for i in (0, 1) for m in "qv"}
    full = trainer.full_weights()
    assert "lm_head.weight" in full and not any("lora" in k for k in full)
    assert trainer.n_actor == sum(p.numel() for n, p in trainer.model.named_parameters()
                                  if "lora_" in n)
    run = [Sample(f"0-{i}_0_0", [1, 3, 2, OBJECTS[i]], [SYMBOLS[i]], [-2.0], 1.0 - 2 * (i % 2),
                  SYMBOLS, 1.0, 0) for i in range(8)]
    trainer.accumulate(run)
    m = trainer.step()
    assert m["grad_norm"] > 0
    after = trainer.weights()
    moved = max(float((after[k] - before[k]).abs().max()) for k in after)
    assert moved > 0  # lora_B starts at 0, so only the step can move the merged weights
    base = trainer.model.get_base_model()
    emb_before = full["model.embed_tokens.weight"]
    assert torch.equal(base.model.embed_tokens.weight, emb_before)  # frozen


def test_credit_team_node_and_discounted_upstream_share():
    # a -> b -> c ; own rewards a 0, b 1, c 2 ; team 10
    down = {"a": {"b": 1, "c": 2}, "b": {"c": 1}, "c": {}}
    own = {"a": 0.0, "b": 1.0, "c": 2.0}
    plain = assign_credit(10.0, own, down, CreditConfig())
    assert plain == {"a": 10.0, "b": 11.0, "c": 12.0}
    shared = assign_credit(10.0, own, down, CreditConfig(team=0.5, node=1.0,
                                                         upstream_discount=0.5))
    assert shared == pytest.approx({"a": 5 + 0.5 * 1 + 0.25 * 2, "b": 5 + 1 + 0.5 * 2,
                                    "c": 5 + 2})
    # a node that did not run (branch ended) gives no share
    assert assign_credit(0.0, {"a": 0.0, "b": 1.0}, down,
                         CreditConfig(upstream_discount=0.5))["a"] == 0.5


def test_trainer_accepts_rows_up_to_max_staleness_old_and_rejects_older():
    from flexmarl.training.trainer import TrainingError

    def rows(version, n=2):
        return [Sample(f"{version}-{i}_0_0", [1, 3, 2, OBJECTS[i]], [SYMBOLS[i]], [-2.0], 1.0,
                       SYMBOLS, 1.0, version) for i in range(n)]

    cfg = _agent("grpo")
    strict = AgentTrainer("a", cfg, VOCAB, 16, run_seed=0)
    strict.accumulate(rows(0))
    strict.step()  # version 1: only version 1 rows from now on
    with pytest.raises(TrainingError, match=r"from version 0 offered to trainer at version 1 "
                                            r"\(accepts only version 1\)"):
        strict.accumulate(rows(0))

    stale = AgentTrainer("a", cfg, VOCAB, 16, run_seed=0, max_staleness=1)
    for _ in range(2):  # one_step_off: steps 0 and 1 both train version 0 rows
        assert stale.accumulate(rows(0))["rows"] == 2.0
        stale.step()
    assert stale.version == 2
    stale.accumulate(rows(1))  # one version stale: fine
    with pytest.raises(TrainingError, match=r"from version 0 offered to trainer at version 2 "
                                            r"\(accepts versions 1..2, max_staleness=1\)"):
        stale.accumulate(rows(0))
    with pytest.raises(TrainingError, match="from version 3"):  # never from the future
        stale.accumulate(rows(3))
