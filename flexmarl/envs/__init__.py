"""Classic MARL environments (PettingZoo Parallel and AEC) as FlexMARL episodes."""
