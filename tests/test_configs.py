"""Every config loads and validates; the defaults are the official A*-PO settings."""
import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from astarpo_jax import run_config  # noqa: E402

CONFIGS = [("qwen1p5b", "math"), ("qwen1p5b", "gsm8k"), ("qwen3b", "math"), ("qwen7b", "gsm8k"), ("demo", "full"),
           ("demo", "tiny"), ("chains", "long"), ("chains", "paper")]


@pytest.mark.parametrize("name,variant", CONFIGS)
def test_config_loads_and_validates(name, variant):
  c = importlib.import_module(f"configs.{name}").get_config(variant)
  run_config.validate_config(c)


def test_defaults_reproduce_the_papers_settings():
  c = importlib.import_module("configs.qwen1p5b").get_config()
  assert c.model.name_or_path == "Qwen/Qwen2.5-1.5B"
  assert (c.stage1.n_samples, c.stage1.beta1) == (8, 0.5)
  assert (c.sampling.temperature, c.sampling.top_p, c.sampling.max_new_tokens) == (1.0, 1.0, 1024)
  assert (c.algo.name, c.algo.beta2, c.algo.entropy_coef) == ("astarpo", 1e-3, 1e-3)
  assert (c.optim.lr, c.optim.weight_decay, c.optim.grad_clip, c.optim.warmup_steps) == (1e-6, 0.01, 1.0, 0)
  assert (c.train.rollout_batch, c.train.mini_batch) == (256, 128)
  assert c.data.max_prompt_tokens == 256 and c.data.template == "boxed"
  assert (c.model.param_dtype, c.model.ref_param_dtype, c.model.dtype) == ("float32", "bfloat16", "bfloat16")


def test_unknown_variant_is_named():
  with pytest.raises(ValueError, match="unknown config variant 'gsm9k'"):
    importlib.import_module("configs.qwen3b").get_config("gsm9k")


@pytest.mark.parametrize("field,value,message", [
    ("algo.beta2", -1.0, "config.algo.beta2: must be > 0"),
    ("stage1.beta1", -0.5, "config.stage1.beta1"),
    ("train.mini_batch", 100, "config.train.mini_batch: rollout_batch=256 is not divisible by mini_batch=100"),
    ("reward.grader", "regex", "config.reward.grader"),
    ("mode", "serve", "config.mode"),
    ("model.attention_block", -64, "config.model.attention_block: must be an int >= 0"),
    ("train.score_micro_batches", 0, "config.train.score_micro_batches: must be an int >= 1"),
    ("mesh.sample_shape", (2, 4), "config.mesh.sample_shape: .* or 3 ints"),
    ("mesh.sample_shape", (0, -1, 1), "config.mesh.sample_shape"),
    ("train.micro_batch_per_device", 2, "config.train.micro_batch: 64 with train.micro_batch_per_device=2: set exactly one"),
    ("train.micro_batch", 0, "config.train.micro_batch: 0 with train.micro_batch_per_device=0: set exactly one"),
])
def test_invalid_values_are_refused_naming_the_field(field, value, message):
  c = importlib.import_module("configs.qwen1p5b").get_config()
  section, key = field.split(".") if "." in field else (None, field)
  (c[section] if section else c)[key] = value
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    run_config.validate_config(c)


@pytest.mark.parametrize("num_devices, shape, micro", [(4, (1, -1, 1), 4), (8, (1, -1, 1), 8), (32, (1, -1, 1), 32),
                                                       (8, (2, 2, 2), 4), (8, (1, 1, -1), 1)])
def test_qwen7b_takes_one_prompt_per_batch_shard_on_any_slice(num_devices, shape, micro):
  # the official MICRO_BATCH_SIZE_PER_DEVICE=1 (scripts/apo_math.sh): batch shards = data x fsdp
  c = importlib.import_module("configs.qwen7b").get_config()
  c.mesh.shape = shape
  run_config.validate_config(c)
  run_config.resolve_micro_batch(c, num_devices)
  assert c.train.micro_batch == micro


def test_a_per_device_micro_batch_that_does_not_divide_mini_batch_is_refused_naming_it():
  c = importlib.import_module("configs.qwen7b").get_config()
  c.train.micro_batch_per_device = 3
  with pytest.raises(ValueError, match="micro_batch_per_device: 3 x 8 batch shards = 24 prompts .* train.mini_batch=128"):
    run_config.resolve_micro_batch(c, 8)


def test_fit_search_settings_are_said_per_batch_shard_when_the_config_sizes_micro_batches_so():
  # configs/qwen7b.py (one prompt per batch shard) on a (1, 4, 1) mesh: the fit search's global sizes, restated
  assert run_config.micro_batch_override("train.micro_batch=8", 1, (1, 4, 1)) == "train.micro_batch_per_device=2"
  assert run_config.micro_batch_override("train.micro_batch=2", 1, (1, 4, 1)) == \
      "train.micro_batch_per_device=0 train.micro_batch=2"
  assert run_config.micro_batch_override("train.micro_batch=2", 0, (1, 4, 1)) == "train.micro_batch=2"  # global
  assert run_config.micro_batch_override("mesh.shape=(1, 2, 2)", 1, (1, 4, 1)) == "mesh.shape=(1, 2, 2)"
