"""Agent policies: models, sampling and log-probs."""
