"""IPPO (de Witt et al., 2020): independent PPO, each critic on the agent's own observation.

Everything else is MAPPO's (`mappo.py`): GAE, value normalisation, clipped surrogate, clipped
value loss, epochs x mini-batches over one iteration's rows. The only difference is the
critic's input, which the rollout (flexmarl/marl/policies.py: `critic_x`) chooses from
`critic_features`: MAPPO the global state or the concatenated observations, IPPO the local
observation. Comparing the two on the same budget isolates what centralisation buys.
"""

from __future__ import annotations

import numpy as np

from flexmarl.training.algorithms.mappo import (
    METRICS,
    PolicyBatch,
    ValueNorm,
    compute_advantages,
    gae,
    policy_loss,
    update,
    value_loss,
)


def critic_features(name: str, critic_input: str | None, own_obs: np.ndarray,
                    state: np.ndarray, all_obs: list[np.ndarray]) -> np.ndarray:
    """[E, C] critic input for one agent: IPPO its observation, MAPPO the state or the
    concatenated observations of every agent."""
    if name == "ippo":
        return own_obs
    if critic_input == "concat_obs":
        return np.concatenate(all_obs, axis=-1)
    return state


__all__ = ["METRICS", "PolicyBatch", "ValueNorm", "compute_advantages", "critic_features",
           "gae", "policy_loss", "update", "value_loss"]
