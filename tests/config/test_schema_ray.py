"""runtime.kind=ray settings: the address and the two pools' bundles are validated up front."""

from pathlib import Path

import pytest

from flexmarl.config.schema import ConfigError, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "referential_game.yaml"


def test_ray_address_and_bundles_load():
    cfg = load_config(EXAMPLE, [
        "runtime.kind=ray", "runtime.address=10.0.0.1:6379",
        "runtime.ray.rollout_bundle={cpus: 2, gpus: 1, resources: {rollout_node: 0.5}}",
        "runtime.ray.strategy=SPREAD",
    ])
    assert cfg.runtime.address == "10.0.0.1:6379"
    assert cfg.runtime.ray.rollout_bundle.gpus == 1
    assert cfg.runtime.ray.rollout_bundle.resources == {"rollout_node": 0.5}
    assert cfg.runtime.ray.train_bundle.cpus == 1
    assert load_config(EXAMPLE, ["runtime.kind=ray", "runtime.address=auto"]).runtime.address \
        == "auto"


@pytest.mark.parametrize("overrides,message", [
    (["runtime.address=10.0.0.1:6379"], r"runtime\.address: .*only used with runtime\.kind=ray"),
    (["runtime.kind=ray", "runtime.address=headnode"], r"runtime\.address: .*expected HOST:PORT"),
    (["runtime.kind=ray", "runtime.address=h:99999"], r"runtime\.address: .*expected HOST:PORT"),
    (["runtime.kind=ray", "runtime.ray.train_bundle.cpus=0"],
     r"runtime\.ray\.train_bundle: .*must ask for something"),
    (["runtime.kind=ray", "runtime.ray.rollout_bundle.resources={GPU: 1}"],
     r"runtime\.ray\.rollout_bundle: .*use cpus/gpus for GPU"),
    (["runtime.kind=ray", "runtime.ray.rollout_bundle.resources={n: 0}"],
     r"resources\.n: amount must be > 0"),
    (["runtime.kind=ray", "runtime.ray.strategy=pack"], r"runtime\.ray\.strategy"),
    (["runtime.kind=ray", "runtime.ray.bundles=3"], r"runtime\.ray\.bundles: unknown key"),
    (["runtime.kind=ray", f"runtime.ray.temp_dir=/tmp/{'x' * 60}"],
     r"runtime\.ray\.temp_dir: .*at most 48"),
])
def test_bad_ray_settings_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(EXAMPLE, overrides)


def test_an_elastic_rollout_pool_reads_back_as_min_and_max():
    rt = load_config(EXAMPLE, ["runtime.kind=ray",
                               "runtime.rollout_workers={min: 1, max: 4}"]).runtime
    assert (rt.rollout_workers, rt.rollout_workers_max) == (1, 4)
    again = load_config(EXAMPLE, [f"runtime.{k}={v}" for k, v in
                                  rt.model_dump(include={"kind", "rollout_workers",
                                                         "rollout_workers_max"}).items()])
    assert again.runtime.rollout_workers_max == 4  # a dumped config loads back the same
    fixed = load_config(EXAMPLE, ["runtime.rollout_workers=3"]).runtime
    assert (fixed.rollout_workers, fixed.rollout_workers_max) == (3, None)


@pytest.mark.parametrize("overrides,message", [
    (["runtime.kind=ray", "runtime.rollout_workers={min: 3, max: 2}"], r"max 2 is below min 3"),
    (["runtime.kind=ray", "runtime.rollout_workers={min: 1}"], r"a count or \{min: M, max: N\}"),
    (["runtime.rollout_workers={min: 1, max: 2}"], r"needs runtime\.kind=ray"),
])
def test_bad_elastic_bounds_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(EXAMPLE, overrides)


def test_a_classic_marl_run_refuses_an_elastic_pool():
    marl = Path(__file__).resolve().parents[2] / "examples" / "mpe_spread.yaml"
    with pytest.raises(ConfigError, match="rollout_workers_max"):
        load_config(marl, ["runtime.kind=ray", "runtime.rollout_workers={min: 1, max: 2}"])
