"""`models:` (shared bases) and `agents.X.model.base`: resolution and one clear error per
mistake, naming the agent and the field."""

import pytest

from flexmarl.config.schema import ConfigError, RunConfig, config_from_dict


def _raw(**agents):
    return {"task": {"builder": "x:y"}, "models": {"smol": {"hidden_size": 32, "num_heads": 2}},
            "agents": agents or {"a": {"model": {"base": "smol"}, "lora": {"r": 4}},
                                 "b": {"model": {"base": "smol"}, "lora": {}},
                                 "c": {"model": {"hidden_size": 16}}}}


def test_base_fields_are_copied_into_the_agents_and_survive_a_round_trip():
    cfg = config_from_dict(_raw())
    assert cfg.agents["a"].model.base == "smol" and cfg.agents["a"].model.hidden_size == 32
    assert cfg.agents["b"].model == cfg.agents["a"].model
    assert cfg.agents["c"].model.base is None and cfg.agents["c"].model.hidden_size == 16
    # workers re-validate the dumped config
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg


@pytest.mark.parametrize("agent, message", [
    ({"model": {"base": "smoll"}, "lora": {}},
     "agents.a.model.base: 'smoll' names no entry of models (it has: smol)"),
    ({"model": {"base": "smol", "hidden_size": 64}, "lora": {}},
     "agents.a.model.hidden_size: set next to model.base 'smol'"),
    ({"model": {"base": "smol"}},
     "agents.a.lora: an agent on a shared base (model.base 'smol') trains a LoRA adapter"),
    ({"model": {"base": "smol"}, "lora": {}, "backend": {"kind": "vllm"}},
     "agents.a.backend.kind: an agent on a shared base"),
])
def test_bad_base_is_one_clear_error(agent, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(_raw(a=agent), "run.yaml")
    text = str(err.value)
    assert text.startswith("run.yaml: invalid configuration") and message in text, text


def test_base_without_a_models_section_and_unused_models():
    raw = _raw(a={"model": {"base": "smol"}, "lora": {}})
    del raw["models"]
    with pytest.raises(ConfigError, match="names no entry of models .it has: none"):
        config_from_dict(raw)
    raw = _raw(a={"model": {"hidden_size": 16}})
    with pytest.raises(ConfigError, match="models.smol: no agent uses it"):
        config_from_dict(raw)
    raw = _raw(a={"model": {"base": "smol"}, "lora": {}})
    raw["runtime"] = {"kind": "ray"}  # the Ray runtime hosts the local workers: supported
    assert config_from_dict(raw).agents["a"].model.base == "smol"


def test_frozen_agent_may_use_the_bare_base():
    cfg = config_from_dict(_raw(a={"model": {"base": "smol"}, "trainable": False}))
    assert cfg.agents["a"].lora is None and cfg.agents["a"].model.base == "smol"


def test_the_shipped_example_validates():
    from pathlib import Path

    from flexmarl.config.schema import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "shared_base.yaml")
    assert {a: c.model.base for a, c in cfg.agents.items()} == {
        "speaker": "base", "relay": None, "listener": "base"}
