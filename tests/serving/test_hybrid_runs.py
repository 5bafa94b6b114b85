"""`flexmarl serve` on a hybrid run's folder: its network agents are named, not served."""

import pytest
import yaml

from flexmarl.serving.agents import ServeError, load_run
from tests.orchestrator.test_hybrid import _raw


def test_a_network_agent_is_refused_by_name_with_the_llm_agents_offered(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(_raw()))
    with pytest.raises(ServeError, match=r"agent 'walker0' is a network policy: .*\(caller\)"):
        load_run(tmp_path)
