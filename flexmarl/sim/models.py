"""The model registry of the simulator: a decoder-only transformer's shape (`ModelSpec`), as much
as its costs need, and the Qwen2.5 presets a workload names ("7B", "qwen2.5-14b")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt

__all__ = ["MODEL_PRESETS", "ModelSpec", "UnknownModelError", "get_model", "known_models"]


class UnknownModelError(ValueError, LookupError):
    """A model preset name that does not exist (the message lists the known ones)."""


class ModelSpec(BaseModel):
    """The shape of a decoder-only transformer, as much as its cost needs.

    ``params`` is the total parameter count (embeddings included: decoding reads them too).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    params: PositiveFloat
    layers: PositiveInt
    hidden: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    bytes_per_param: PositiveFloat = 2.0  # BF16 weights
    kv_bytes_per_elem: PositiveFloat = 2.0  # BF16 KV cache

    @property
    def weight_bytes(self) -> float:
        """Bytes of the weights: what a decode step reads and a weight sync moves."""
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one token occupies across all layers (K and V)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem


def _qwen25(size: str, params: float, layers: int, hidden: int, kv_heads: int, head_dim: int):
    return ModelSpec(
        name=f"qwen2.5-{size.lower()}",
        params=params,
        layers=layers,
        hidden=hidden,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )


# Qwen2.5 shapes: layers, hidden size and KV heads from the Qwen2.5 technical report
# (arXiv:2412.15115, Table 1) and each model's config.json on Hugging Face; head_dim =
# hidden / attention heads; parameter counts from the model cards.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _qwen25("0.5B", 0.49e9, 24, 896, 2, 64),  # 14 query heads
        _qwen25("1.5B", 1.54e9, 28, 1536, 2, 128),  # 12 query heads
        _qwen25("3B", 3.09e9, 36, 2048, 2, 128),  # 16 query heads
        _qwen25("7B", 7.61e9, 28, 3584, 4, 128),  # 28 query heads
        _qwen25("14B", 14.7e9, 48, 5120, 8, 128),  # 40 query heads
        _qwen25("32B", 32.5e9, 64, 5120, 8, 128),  # 40 query heads
        _qwen25("72B", 72.7e9, 80, 8192, 8, 128),  # 64 query heads
    )
}


def known_models() -> list[str]:
    """Preset names :func:`get_model` accepts (``"7B"`` works as well as ``"qwen2.5-7b"``)."""
    return list(MODEL_PRESETS)


def get_model(name: str) -> ModelSpec:
    """Look a model preset up by name, e.g. ``"7B"``, ``"7b"`` or ``"qwen2.5-7b"``."""
    key = name.strip().lower()
    spec = MODEL_PRESETS.get(key) or MODEL_PRESETS.get(f"qwen2.5-{key}")
    if spec is None:
        raise UnknownModelError(
            f"unknown model preset {name!r}; known: {', '.join(known_models())} "
            "(or give a custom spec with params, layers, hidden, kv_heads, head_dim)"
        )
    return spec
