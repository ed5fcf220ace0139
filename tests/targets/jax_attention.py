"""A single-head attention block for the JAX targets (its own file, see jax_dense.py)."""
import jax
import jax.numpy as jnp


def attention(h, wq, wk, wv):
    q, k, v = h @ wq, h @ wk, h @ wv  # ATTN_PROJ
    s = q @ k.T / jnp.sqrt(q.shape[-1]).astype(q.dtype)  # ATTN_SCORES
    p = jax.nn.softmax(s, axis=-1)  # ATTN_SOFTMAX
    return p @ v  # ATTN_VALUES
