"""`flexmarl serve-model`'s loading: one model folder as a one-agent served run."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexmarl.serving.agents import ServeError, load_model_folder
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
