"""Token-count distributions of simulated prompts and outputs, sampled deterministically (keyed
uniforms: the same draw for the same request whatever the order or the process)."""

from __future__ import annotations

import math
import statistics
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator

_STD_NORMAL = statistics.NormalDist()


def keyed_uniform(*parts: object) -> float:
    """A uniform number in (0, 1) that depends only on ``parts`` (stable across processes)."""
    # imported here: `flexmarl.policy.model` pulls in transformers, which a process that only
    # imports `flexmarl.sim` (the profiler's contention probes) should not pay for
    from flexmarl.policy.model import stable_seed

    return (stable_seed(*parts) >> 10 | 1) / float(1 << 53)


class LengthDistribution(BaseModel):
    """A distribution of token counts, sampled deterministically from a numpy Generator.

    ``mean`` is the mean *before* clipping to ``[min, max]``. Kinds:

    * ``fixed``: always ``mean``;
    * ``uniform``: uniform on ``mean * (1 - spread) .. mean * (1 + spread)``;
    * ``lognormal``: log-normal with log-space std ``sigma`` (p99/median = exp(2.33 sigma));
    * ``pareto``: Pareto with shape ``alpha`` > 1 (smaller alpha, heavier tail).

    A bare number stands for ``fixed`` (``prompt_length: 512``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["fixed", "uniform", "lognormal", "pareto"] = "fixed"
    mean: PositiveFloat
    sigma: PositiveFloat | None = None
    alpha: float | None = None
    spread: float | None = None
    min: PositiveInt = 1
    max: PositiveInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _number_is_fixed(cls, data: object) -> object:
        if isinstance(data, int | float) and not isinstance(data, bool):
            return {"kind": "fixed", "mean": data}
        return data

    @model_validator(mode="after")
    def _check_params(self) -> LengthDistribution:
        own = {"lognormal": "sigma", "pareto": "alpha", "uniform": "spread"}
        for kind, param in own.items():
            if getattr(self, param) is not None and self.kind != kind:
                raise ValueError(f"{param} only applies to kind {kind!r}, not {self.kind!r}")
        if self.alpha is not None and self.alpha <= 1.0:
            raise ValueError(f"pareto alpha must be > 1 (finite mean), got {self.alpha}")
        if self.spread is not None and not 0.0 <= self.spread <= 1.0:
            raise ValueError(f"uniform spread must be in [0, 1], got {self.spread}")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self

    @property
    def upper(self) -> float:
        """Largest value a sample can take (``inf`` when unclipped and unbounded)."""
        if self.max is not None:
            return float(self.max)
        if self.kind == "fixed":
            return float(max(self.min, round(self.mean)))
        if self.kind == "uniform":
            return float(max(self.min, math.ceil(self.mean * (1 + self._spread))))
        return math.inf

    @property
    def _spread(self) -> float:
        return 0.5 if self.spread is None else self.spread

    def sample(self, rng: np.random.Generator, size: int | None = None) -> np.ndarray:
        """Draw ``size`` integer lengths in ``[min, max]`` (a 0-d array when ``size`` is None)."""
        shape = () if size is None else (size,)
        if self.kind == "fixed":
            raw = np.full(shape, self.mean, dtype=float)
        elif self.kind == "uniform":
            half = self.mean * self._spread
            raw = rng.uniform(self.mean - half, self.mean + half, shape)
        elif self.kind == "lognormal":
            sigma = 1.0 if self.sigma is None else self.sigma
            raw = rng.lognormal(math.log(self.mean) - sigma**2 / 2, sigma, shape)
        else:
            alpha = 1.5 if self.alpha is None else self.alpha
            scale = self.mean * (alpha - 1) / alpha  # classic Pareto x_m for this mean
            raw = scale * (1.0 + rng.pareto(alpha, shape))
        upper = np.inf if self.max is None else self.max
        return np.clip(np.rint(raw), self.min, upper).astype(np.int64)

    def draw(self, u: float) -> int:
        """The length at quantile ``u`` in (0, 1) (inverse CDF), clipped to ``[min, max]``.

        One keyed uniform per request (see `keyed_uniform`) instead of a seeded Generator:
        the same request gets the same length in every simulated system, at ~1 us a draw.
        """
        if not 0.0 < u < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {u}")
        if self.kind == "fixed":
            raw = self.mean
        elif self.kind == "uniform":
            half = self.mean * self._spread
            raw = self.mean - half + 2 * half * u
        elif self.kind == "lognormal":
            sigma = 1.0 if self.sigma is None else self.sigma
            raw = math.exp(math.log(self.mean) - sigma**2 / 2 + sigma * _STD_NORMAL.inv_cdf(u))
        else:
            alpha = 1.5 if self.alpha is None else self.alpha
            raw = self.mean * (alpha - 1) / alpha * (1.0 - u) ** (-1.0 / alpha)
        upper = math.inf if self.max is None else self.max
        return int(min(max(round(raw), self.min), upper))

    def scaled(self, factor: float) -> LengthDistribution:
        """The same shape with ``factor`` times the mean (e.g. to express output-length skew)."""
        update: dict[str, float | int | None] = {"mean": self.mean * factor}
        if self.max is not None:
            update["max"] = max(self.min, round(self.max * factor))
        return self.model_copy(update=update)
