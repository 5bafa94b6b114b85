"""Classic MARL: config and the driver that trains network policies on PettingZoo envs."""
