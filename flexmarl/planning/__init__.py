"""Planning between iterations: one `planner.Planner` for every runtime, priced by the host's
`demand` (the simulator's cost model, or a real runtime's measurements)."""
