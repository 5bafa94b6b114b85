"""Calibrating the simulator against this machine (`flexmarl simulate --profile-local CONFIG`,
docs/calibration.md).

- `fits`: the profile's data: small named linear cost models and the profile JSON;
- `machine`: other users' CPU load and the machine's contention curve;
- `profile`: the profiler: a config's real models, workers and messages timed on this machine;
- `mirror`: the local runtime in virtual time over the profile (the production pools,
  balancer, slot allocator and replica scheduler over simulated worker processes);
- `calibrate`: profile, run for real, simulate, print measured against simulated.
"""
