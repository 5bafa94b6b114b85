"""FP16 + Zstandard compression of continuous observation payloads: round trips within FP16
tolerance, bytes saved on real MPE observations, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("zstandard")

from flexmarl.errors import UserError  # noqa: E402
from flexmarl.store.compression import Codec, CompressionError  # noqa: E402


def test_round_trip_within_fp16_tolerance() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(0, 3, (25, 18)).astype(np.float32)
    payload, header = Codec().encode(x)
    assert payload.dtype == np.uint8 and header["shape"] == [25, 18]
    y = Codec.decode(payload, header)
    assert y.dtype == np.float32 and y.shape == x.shape
    # FP16 keeps 11 significant bits: relative error <= 2**-11 (normal range)
    np.testing.assert_allclose(y, x, rtol=2.0**-11, atol=2.0**-24)
    assert not np.array_equal(y, x)  # it is lossy: the tolerance above is what is promised
    z = np.zeros((0, 4), np.float64)
    assert Codec.decode(*Codec().encode(z)).shape == (0, 4)


def test_bytes_saved_on_real_mpe_observations() -> None:
    pytest.importorskip("mpe2")
    from flexmarl.envs.pettingzoo import VecParallelEnv

    venv = VecParallelEnv("mpe2.simple_spread_v3", {"max_cycles": 25}, 8, 0)
    venv.reset()
    rng = np.random.default_rng(0)
    obs = []
    for _ in range(25):
        obs.append(venv.obs["agent_0"].copy())
        venv.step({a: rng.integers(5, size=(8, 1)) for a in venv.agents})
    x = np.stack(obs)  # [25, 8, 18]: one agent's observations of one iteration
    payload, header = Codec().encode(x)
    assert payload.nbytes < 0.5 * x.nbytes  # FP16 halves it; zstd takes the zeros and repeats
    np.testing.assert_allclose(Codec.decode(payload, header), x, rtol=2.0**-11, atol=1e-7)


def test_values_fp16_cannot_hold_are_user_errors() -> None:
    with pytest.raises(CompressionError, match="agent 'a': obs: values beyond FP16"):
        Codec().encode(np.array([1e6], np.float32), "agent 'a': obs")
    with pytest.raises(CompressionError, match="not finite"):
        Codec().encode(np.array([np.nan], np.float32))
    with pytest.raises(CompressionError, match="dtype int64"):
        Codec().encode(np.array([1, 2]))
    assert issubclass(CompressionError, UserError)
