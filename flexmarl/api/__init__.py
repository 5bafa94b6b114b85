"""Small contracts between the parts (AReaL-lite's lesson): what the orchestrator, the training
hosts and telemetry may rely on of a runtime (`api.runtime`), with no implementation in them.
Torch-free data contracts are `flexmarl.types`."""
