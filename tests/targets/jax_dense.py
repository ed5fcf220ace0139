"""A dense layer for the JAX targets (kept in its own file: the HLO map must name this file)."""
import jax
import jax.numpy as jnp


def dense(x, w, b):
    y = x @ w  # DENSE_MATMUL
    return jax.nn.relu(y + b)  # DENSE_ACT
