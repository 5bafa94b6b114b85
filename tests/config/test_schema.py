from pathlib import Path

import pytest

from flexmarl.config.schema import ConfigError, load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_examples_load_and_overrides_apply():
    cfg = load_config(EXAMPLES / "referential_game.yaml",
                      ["pipeline.mode=sync", "runtime.deterministic=true", "train.iterations=3",
                       "seed=1"])
    assert cfg.pipeline.mode == "sync" and cfg.runtime.deterministic is True
    assert cfg.train.iterations == 3 and cfg.seed == 1
    assert set(load_config(EXAMPLES / "relay_chain.yaml").agents) == {"speaker", "relay",
                                                                       "listener"}


def test_malformed_yaml_names_file_and_line(tmp_path):
    p = _write(tmp_path, "task: {builder: x\nagents: [")
    with pytest.raises(ConfigError, match=rf"{p}: malformed YAML \(line \d+, column \d+\)"):
        load_config(p)


def test_unknown_key_is_named(tmp_path):
    p = _write(tmp_path, "task: {builder: a:b}\nagents: {x: {optim: {lrr: 1}}}\n")
    with pytest.raises(ConfigError, match=r"agents\.x\.optim\.lrr: unknown key"):
        load_config(p)


def test_wrong_type_is_named(tmp_path):
    p = _write(tmp_path, "task: {builder: a:b}\nagents: {x: {}}\ntrain: {iterations: many}\n")
    with pytest.raises(ConfigError, match=r"train\.iterations: Input should be a valid integer"):
        load_config(p)


def test_bad_override(tmp_path):
    p = _write(tmp_path, "task: {builder: a:b}\nagents: {x: {}}\n")
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(p, ["pipeline.mode"])
    with pytest.raises(ConfigError, match=r"pipeline\.mode: Input should be 'sync', 'async' or "
                                          r"'one_step_off'"):
        load_config(p, ["pipeline.mode=sometimes"])


def test_missing_file_and_missing_section(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
    p = _write(tmp_path, "agents: {x: {}}\n")
    with pytest.raises(ConfigError, match="task / env: a run trains on a task's graph .* give "
                                          "exactly one"):
        load_config(p)


def test_sim_runtime_is_refused_in_a_run_config(tmp_path):
    p = _write(tmp_path, "task: {builder: a:b}\nagents: {x: {}}\nruntime: {kind: sim}\n")
    with pytest.raises(ConfigError, match=r"runtime\.kind: 'sim'.*flexmarl simulate"):
        load_config(p)
    q = _write(tmp_path, "task: {builder: a:b}\nagents: {x: {}}\n")
    with pytest.raises(ConfigError, match=str(q)):
        load_config(q, ["runtime.kind=sim"])
