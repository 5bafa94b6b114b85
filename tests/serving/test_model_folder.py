"""`flexmarl serve-model`'s loading: one model folder as a one-agent served run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from flexmarl.config.schema import RolloutConfig
from flexmarl.policy.model import ModelLoadError
from flexmarl.serving.agents import ServedConfig, ServeError, load_model_folder
from flexmarl.serving.toy import make_tokenizer, save_llama


def test_a_model_folder_is_one_agent_named_after_it(tmp_path: Path) -> None:
    folder = tmp_path / "judge"
    tok = make_tokenizer(folder)
    save_llama(folder, len(tok), seed=0)
    run = load_model_folder(folder, device="cpu")
    assert list(run.agents) == ["judge"] and run.task is None
    spec = run.agents["judge"]
    assert spec.vocab == len(tok) and spec.tokenizer is not None
    assert spec.version.source == str(folder)


def test_a_folder_without_a_model_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match="is not a model folder \\(no config.json\\)"):
        load_model_folder(tmp_path)


def test_a_bad_field_in_the_folders_config_is_refused_naming_the_file_and_field(
        tmp_path: Path) -> None:
    folder = tmp_path / "judge"
    tok = make_tokenizer(folder)
    save_llama(folder, len(tok), seed=0)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    with pytest.raises(ModelLoadError, match=r"judge/config\.json: .*'hidden_size'"):
        load_model_folder(folder, device="cpu")


def test_the_folders_agent_config_is_validated() -> None:
    """No unvalidated run config: the task-less config is a `ServedConfig`, checked like a
    run's (a section it does not have is refused, naming the field)."""
    with pytest.raises(ValidationError, match="task"):
        ServedConfig.model_validate({"agents": {"a": {}}, "task": {"builder": "x"}})
    assert ServedConfig.model_validate({"agents": {"a": {}}}).rollout == RolloutConfig()
