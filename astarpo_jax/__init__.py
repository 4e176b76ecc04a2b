"""astarpo_jax: A*-PO (optimal advantage regression) for LLM reasoning, in JAX/Flax."""
__version__ = "0.1.0"
