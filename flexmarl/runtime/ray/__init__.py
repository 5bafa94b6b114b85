"""The ``ray`` runtime: the local runtime's workers in Ray actors (`transport`), placed by pool
in placement groups (`placement`), driven by the same orchestrator and supervisor."""
