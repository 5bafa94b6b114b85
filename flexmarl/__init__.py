"""FlexMARL: rollout-training co-design for LLM-based multi-agent RL."""

__version__ = "0.1.0"
