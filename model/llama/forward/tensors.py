"""The tensors of a Hugging Face Llama checkpoint: which names and shapes it must hold, one block's weights.

Every loader of the family (safetensors, GGUF) ends in :meth:`model.llama.forward.model.Llama.from_tensors`,
which checks its tensors here first.

Source: transformers `modeling_llama.py` (the parameter names of ``LlamaForCausalLM``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model.llama.forward.config import LlamaConfig

# Buffers some checkpoints carry that the forward pass recomputes instead.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True, eq=False)
class LayerWeights:
    """One transformer block's read-only float32 weights (``[out, in]`` matrices).

    Attributes:
        rms_att: ``(dim,)`` RMSNorm weight before attention (``input_layernorm``).
        wq: ``(n_heads * head_dim, dim)`` query projection.
        wk: ``(n_kv_heads * head_dim, dim)`` key projection.
        wv: ``(n_kv_heads * head_dim, dim)`` value projection.
        wo: ``(dim, n_heads * head_dim)`` attention output projection.
        rms_ffn: ``(dim,)`` RMSNorm weight before the MLP (``post_attention_layernorm``).
        w1: ``(hidden_dim, dim)`` SwiGLU gate (``gate_proj``).
        w2: ``(dim, hidden_dim)`` SwiGLU down projection (``down_proj``).
        w3: ``(hidden_dim, dim)`` SwiGLU up projection (``up_proj``).
    """

    rms_att: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    rms_ffn: np.ndarray
    w1: np.ndarray
    w2: np.ndarray
    w3: np.ndarray


def tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Return every tensor a Hugging Face Llama checkpoint must hold, with its shape.

    ``lm_head.weight`` is included only when the head is not tied to the embedding.
    """
    c = config
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.dim)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.dim,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, c.dim)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, c.dim)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, c.dim)
        shapes[p + "self_attn.o_proj.weight"] = (c.dim, q_dim)
        shapes[p + "post_attention_layernorm.weight"] = (c.dim,)
        shapes[p + "mlp.gate_proj.weight"] = (c.hidden_dim, c.dim)
        shapes[p + "mlp.down_proj.weight"] = (c.dim, c.hidden_dim)
        shapes[p + "mlp.up_proj.weight"] = (c.hidden_dim, c.dim)
    shapes["model.norm.weight"] = (c.dim,)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.dim)
    return shapes


def check_tensors(
    tensors: dict[str, np.ndarray], config: LlamaConfig, where: str
) -> dict[str, np.ndarray]:
    """Check names and shapes against the config; return exactly the tensors the model uses.

    Raises:
        ValueError: Naming the first missing tensor, a tensor with the wrong shape, or a
            tensor the architecture does not have (``lm_head.weight`` is tolerated and unused
            when the head is tied).
    """
    shapes = tensor_shapes(config)
    for name, shape in shapes.items():
        if name not in tensors:
            raise ValueError(f"{where}: missing tensor {name!r}")
        if tensors[name].shape != shape:
            raise ValueError(
                f"{where}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                f"expected {list(shape)}"
            )
    for name in tensors:
        tolerated = name.endswith(_IGNORED_SUFFIXES) or name == "lm_head.weight"
        if name not in shapes and not tolerated:
            raise ValueError(f"{where}: unexpected tensor {name!r} (not part of a Llama model)")
    return {name: tensors[name] for name in shapes}


def layer_weights(tensors: dict[str, np.ndarray], prefix: str) -> LayerWeights:
    """Collect one block's tensors (names prefixed ``prefix``, e.g. ``model.layers.3.``)."""
    return LayerWeights(
        rms_att=tensors[prefix + "input_layernorm.weight"],
        wq=tensors[prefix + "self_attn.q_proj.weight"],
        wk=tensors[prefix + "self_attn.k_proj.weight"],
        wv=tensors[prefix + "self_attn.v_proj.weight"],
        wo=tensors[prefix + "self_attn.o_proj.weight"],
        rms_ffn=tensors[prefix + "post_attention_layernorm.weight"],
        w1=tensors[prefix + "mlp.gate_proj.weight"],
        w2=tensors[prefix + "mlp.down_proj.weight"],
        w3=tensors[prefix + "mlp.up_proj.weight"],
    )
