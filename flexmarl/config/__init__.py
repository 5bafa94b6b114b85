"""Run configuration."""

from flexmarl.config.schema import ConfigError, RunConfig, config_from_dict, load_config

__all__ = ["ConfigError", "RunConfig", "config_from_dict", "load_config"]
