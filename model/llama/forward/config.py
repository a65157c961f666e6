"""Read and validate the ``config.json`` of a Hugging Face Llama model directory.

Only what the numpy forward pass implements is accepted; anything else (biases, another
activation, RoPE scaling) is refused at start-up with a ``ValueError`` naming the field.

Source: transformers `LlamaConfig` (field names and defaults).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Self

# transformers' LlamaConfig defaults for fields a config may leave out.
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_MAX_POSITIONS = 2048


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The hyper-parameters of a Llama model, with llama2.c / nanoGPT names.

    Attributes:
        dim: Residual width (``hidden_size``).
        hidden_dim: SwiGLU inner width (``intermediate_size``).
        n_layers: Transformer blocks (``num_hidden_layers``).
        n_heads: Query heads (``num_attention_heads``).
        n_kv_heads: Key/value heads (``num_key_value_heads``), dividing ``n_heads``.
        head_dim: Width of one head (``head_dim``, default ``dim // n_heads``), even.
        vocab_size: Token ids.
        max_seq_len: Context length in tokens (``max_position_embeddings``).
        norm_eps: RMSNorm epsilon (``rms_norm_eps``).
        rope_theta: RoPE base (``rope_theta``, or ``rope_parameters.rope_theta``).
        tie_embeddings: Whether the output head is the token embedding (``tie_word_embeddings``).
        bos_id: ``bos_token_id``, or None.
        eos_ids: Every id in ``eos_token_id`` (an int or a list).
    """

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_seq_len: int
    norm_eps: float
    rope_theta: float
    tie_embeddings: bool
    bos_id: int | None
    eos_ids: frozenset[int]

    @classmethod
    def from_hf(cls, config: dict[str, Any], where: str = "config.json") -> Self:
        """Validate a parsed Hugging Face ``config.json`` and convert it.

        Args:
            config: The JSON object.
            where: The file name, for error messages.

        Returns:
            The config.

        Raises:
            ValueError: If ``model_type`` is not ``"llama"``; a size is missing, not a positive
                integer or inconsistent; or a value is one the forward pass does not implement
                (``hidden_act`` other than silu, ``attention_bias``/``mlp_bias`` true,
                ``rope_scaling`` or a ``rope_type`` other than default). The message names the
                field.
        """
        if config.get("model_type") != "llama":
            raise ValueError(
                f"{where}: model_type must be 'llama', got {config.get('model_type')!r}"
            )
        _check_supported(config, where)
        n_heads = _positive_int(config, "num_attention_heads", where)
        dim = _positive_int(config, "hidden_size", where)
        n_kv_heads = _positive_int(config, "num_key_value_heads", where, default=n_heads)
        if n_heads % n_kv_heads:
            raise ValueError(
                f"{where}: num_key_value_heads={n_kv_heads} must divide "
                f"num_attention_heads={n_heads}"
            )
        if config.get("head_dim") is None and dim % n_heads:
            raise ValueError(f"{where}: hidden_size={dim} is not a multiple of {n_heads} heads")
        head_dim = _positive_int(config, "head_dim", where, default=dim // n_heads)
        if head_dim % 2:
            raise ValueError(f"{where}: head_dim={head_dim} must be even for RoPE")
        vocab_size = _positive_int(config, "vocab_size", where)
        bos_id = token_id_field(config, "bos_token_id", where)
        eos_ids = token_ids_field(config, "eos_token_id", where)
        for token_id in eos_ids | ({bos_id} - {None}):
            if token_id >= vocab_size:
                raise ValueError(f"{where}: token id {token_id} is outside vocab_size={vocab_size}")
        return cls(
            dim=dim,
            hidden_dim=_positive_int(config, "intermediate_size", where),
            n_layers=_positive_int(config, "num_hidden_layers", where),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            vocab_size=vocab_size,
            max_seq_len=_positive_int(
                config, "max_position_embeddings", where, default=DEFAULT_MAX_POSITIONS
            ),
            norm_eps=_positive_float(config, "rms_norm_eps", where, DEFAULT_RMS_NORM_EPS),
            rope_theta=_rope_theta(config, where),
            tie_embeddings=_bool(config, "tie_word_embeddings", where, default=False),
            bos_id=bos_id,
            eos_ids=eos_ids,
        )


def _check_supported(config: dict[str, Any], where: str) -> None:
    """Refuse config values that change the computation in ways this model does not implement."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act must be 'silu', got {act!r}")
    for name in ("attention_bias", "mlp_bias"):
        if _bool(config, name, where, default=False):
            raise ValueError(f"{where}: {name}=true is not supported")
    if config.get("rope_scaling") is not None:
        raise ValueError(f"{where}: rope_scaling {config['rope_scaling']!r} is not supported")


def _rope_theta(config: dict[str, Any], where: str) -> float:
    """Return the RoPE base from ``rope_theta`` or transformers 5's ``rope_parameters``."""
    params = config.get("rope_parameters")
    if params is None:
        return _positive_float(config, "rope_theta", where, DEFAULT_ROPE_THETA)
    if not isinstance(params, dict):
        raise ValueError(f"{where}: rope_parameters must be an object, got {params!r}")
    if params.get("rope_type", "default") != "default":
        raise ValueError(
            f"{where}: rope_parameters.rope_type {params['rope_type']!r} is not supported"
        )
    default = _positive_float(config, "rope_theta", where, DEFAULT_ROPE_THETA)
    return _positive_float(params, "rope_theta", f"{where}: rope_parameters", default)


def _positive_int(config: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    """Return a required (or defaulted) positive integer field."""
    value = config.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"{where}: missing field {name!r}")
        return default
    if type(value) is not int or value <= 0:
        raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value


def _positive_float(config: dict[str, Any], name: str, where: str, default: float) -> float:
    """Return a positive, finite number field (JSON ints allowed), or the default."""
    value = config.get(name)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {name} must be a positive number, got {value!r}")
    return float(value)


def _bool(config: dict[str, Any], name: str, where: str, default: bool) -> bool:
    """Return a boolean field, or the default."""
    value = config.get(name)
    if value is None:
        return default
    if type(value) is not bool:
        raise ValueError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def token_id_field(config: dict[str, Any], name: str, where: str) -> int | None:
    """Return a single non-negative token id field, or None when absent.

    Raises:
        ValueError: If the value is not a non-negative integer.
    """
    value = config.get(name)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise ValueError(f"{where}: {name} must be a token id, got {value!r}")
    return value


def token_ids_field(config: dict[str, Any], name: str, where: str) -> frozenset[int]:
    """Return the ids of a field holding one token id or a list of them (empty when absent).

    Raises:
        ValueError: If the value is neither a token id nor a list of token ids.
    """
    value = config.get(name)
    if value is None:
        return frozenset()
    values = value if isinstance(value, list) else [value]
    if not all(type(v) is int and v >= 0 for v in values):
        raise ValueError(f"{where}: {name} must be a token id or a list of them, got {value!r}")
    return frozenset(values)
