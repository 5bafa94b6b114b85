"""Bad training input: one clear message each, naming the agent and the field."""

from pathlib import Path

import pytest
from safetensors.torch import save_file

from flexmarl.config.schema import ConfigError, load_config
from flexmarl.orchestrator.run import prepare
from flexmarl.policy.model import ModelLoadError, build_model
from flexmarl.training.lora import LoraTargetError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GAME = EXAMPLES / "referential_game.yaml"


def test_option_of_another_algorithm_names_agent_and_field():
    with pytest.raises(ConfigError) as info:
        load_config(GAME, ["agents.speaker.algorithm.gae_lambda=0.9"])
    assert ("agents.speaker.algorithm.gae_lambda: option does not apply to algorithm 'grpo' "
            "(it is an option of ppo)") in str(info.value)
    with pytest.raises(ConfigError, match=r"agents.listener: optim.schedule: 'critic_scaled'"):
        load_config(GAME, ["agents.listener.optim.schedule=critic_scaled"])
    with pytest.raises(ConfigError, match=r"agents.speaker.algorithm: algorithm.name must be"):
        load_config(GAME, ["agents.speaker.algorithm.name=dqn"])
    cfg = load_config(GAME, ["agents.speaker.algorithm={name: ppo, gae_lambda: 0.9}"])
    assert cfg.agents["speaker"].algorithm.gae_lambda == 0.9


def test_missing_lora_target_names_agent_and_field():
    cfg = load_config(GAME, ["agents.listener.lora={r: 4, target_modules: [q_proj, qkv]}"])
    with pytest.raises(LoraTargetError, match=r"agent 'listener': lora.target_modules: 'qkv' "
                                              r"matches no linear layer .*q_proj"):
        prepare(cfg)


def test_checkpoint_with_wrong_shapes_names_agent_tensor_and_shapes(tmp_path):
    cfg = load_config(GAME)
    small = cfg.agents["speaker"].model.model_copy(update={"hidden_size": 32,
                                                           "intermediate_size": 64})
    task = prepare(cfg)
    model = build_model("speaker", small, task.vocab_size, task.max_seq_len, 0)
    path = tmp_path / "ckpt.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    bad = load_config(GAME, [f"agents.speaker.model.checkpoint={path}"])
    with pytest.raises(ModelLoadError, match=r"agent 'speaker': model.checkpoint .* tensor "
                                             r"'model.embed_tokens.weight' has shape \[30, 32\], "
                                             r"the configured model .* expects \[30, 64\]"):
        prepare(bad)
    # the same checkpoint loads under a config of its own shape, weights equal
    ok = load_config(GAME, [f"agents.speaker.model.checkpoint={path}",
                            "agents.speaker.model.hidden_size=32",
                            "agents.speaker.model.intermediate_size=64"])
    prepare(ok)
    again = build_model("speaker", ok.agents["speaker"].model, task.vocab_size,
                        task.max_seq_len, 99)
    assert all((again.state_dict()[k] == v).all() for k, v in model.state_dict().items())
