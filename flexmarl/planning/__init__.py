"""Resource planning between iterations (`planner.ResourcePlanner`)."""
