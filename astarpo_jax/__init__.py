"""astarpo_jax: A*-PO (optimal advantage regression) for LLM reasoning, in JAX/Flax.

Sub-packages by layer, data flowing one way (each __init__ says what it holds and what it may import):
infra -> model, rewards -> data, sampling -> training, stage1 -> methods -> aot; `experiment` and
`run_config` at the top wire a config into them; `comparison` runs experiments over them.
"""
__version__ = "0.1.0"

from astarpo_jax.infra import platforms as _platforms

_platforms.skip_absent_tpu()  # before any backend starts: no libtpu start-up errors where no TPU is attached
