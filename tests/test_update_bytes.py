"""The update's byte floor (aot/update_bytes.py) on a case worked by hand."""
import pytest

from astarpo_jax.aot import update_bytes
from astarpo_jax.aot.run_shape import RunShape
from astarpo_jax.model.config import ModelConfig

# V 10, D 4, F 6, L 2, N 2 heads, K 1 kv head, H 2, untied, no biases; bf16 compute (c = 2), fp32 params (m = 4).
CFG = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=2, qkv_bias=False, tie_embeddings=False, dtype="bfloat16", param_dtype="float32")
# M 2 micro-batches, r 3 rows of S 5, h 2 response rows of R 3 in chunks of 2 (C = 2), n 2 batch ways, t 1.
SHAPE = update_bytes.UpdateShape(micro_batches=2, rows=3, head_rows=2, seq_len=5, response_len=3, logp_chunk=2,
                                 batch_ways=2)


def test_update_bytes_of_a_hand_worked_case():
  # a layer: q 4x2x2 + o 2x2x4 = 32, k and v 4x1x2 each = 16, mlp 3 x 4x6 = 72, two norms 8: 128; x 2 layers = 256
  # + embedding 40 + lm_head 40 + final norm 4 = P 340; DV = VD = 40; P_L = 340 - 80 = 260
  assert CFG.num_params == 340
  got = update_bytes.update_bytes(CFG, SHAPE)
  want = {
      "copy": (4 + 2 * 2) * 340 / 2 + 2 * 340,  # 2040
      "weights": 2 * (3 * 2 * 260 + 3 * 2 * 2 * 40),  # 4080
      "gradients": 2 * (2 * 260 + 2 * 40 + 2 * 2 * 2 * 40),  # 1840
      "accumulate": 2 * (2 * 340 + 2 * 4 * 340 / 2),  # 4080
      "optimizer": 8 * 4 * 340 / 2,  # 5440
      "activations": 2 * 5 * 2 * 3 * 5 * 4 * 2,  # 2400
      "logits": 2 * (16 + 3 * 2) * 2 * 3 * 10,  # 2640
  }
  assert {k: got[k] for k in want} == pytest.approx(want)
  assert got["total"] == pytest.approx(22520)


def test_an_accumulator_whole_on_each_device_reads_and_writes_it_whole():
  got = update_bytes.update_bytes(CFG, update_bytes.UpdateShape(**{**SHAPE.__dict__, "acc_ways": 1}))
  assert got["accumulate"] == pytest.approx(2 * (2 * 340 + 2 * 4 * 340))  # 6800


def test_of_run_splits_a_runs_rows_over_the_batch_shards():
  run = RunShape(prompt_len=4, response_len=6, rollout_batch=8, micro_batch=4, sample_batch=8, logp_chunk=4,
                 rows_per_prompt=2, mini_batch=8)  # 8 rows a micro-batch, 16 a step
  shape = update_bytes.of_run(CFG, run, (1, 4, 1), packed_rows=1)
  assert (shape.micro_batches, shape.rows, shape.head_rows, shape.seq_len, shape.batch_ways) == (2, 1, 2, 10, 4)
  with pytest.raises(ValueError, match="does not split over 3 batch shards"):
    update_bytes.of_run(CFG, run, (1, 3, 1))
  with pytest.raises(ValueError, match="UpdateShape.rows=0"):
    update_bytes.update_bytes(CFG, update_bytes.UpdateShape(**{**SHAPE.__dict__, "rows": 0}))


def test_hlo_cost_counts_data_movement_apart_from_arithmetic():
  """A concatenation of two 256 x 256 fp32 arrays reads 2 x 256 KiB and writes 512 KiB, all of it movement; the
  sum beside it (reads two arrays, writes one) is arithmetic and counts nowhere in `moved`."""
  import jax
  import jax.numpy as jnp

  from astarpo_jax.aot import hlo_cost
  a = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  text = jax.jit(lambda x, y: (jnp.concatenate([x, y]), x + y)).lower(a, a).compile().as_text()
  cost, _ = hlo_cost.analyze(text)
  assert sum(cost.moved.values()) == 4 * 256 * 256 * 4
  assert cost.hbm_bytes == 4 * 256 * 256 * 4 + 3 * 256 * 256 * 4
