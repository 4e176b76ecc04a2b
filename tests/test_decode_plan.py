"""The host's decode plan: the slot ladder a run steps down, the attention windows a segment picks from, and
the cache layout each backend gets, against hand-worked cases."""
import pytest

from astarpo_jax.sampling import decode_plan


def test_slot_ladder_halves_down_to_the_minimum_on_mesh_multiples():
  assert decode_plan.slot_ladder(64) == [64, 32, 16, 8]
  assert decode_plan.slot_ladder(64, min_slots=16) == [64, 32, 16]
  assert decode_plan.slot_ladder(24, min_slots=4, ways=4) == [24, 12]  # 6 is not a multiple of 4
  assert decode_plan.slot_ladder(5) == [5]


def test_attention_windows_step_past_the_prompt_and_end_at_the_whole_cache():
  # P = 16, T = 10: cache columns 16 + 10 - 1 = 25; windows every 4 columns past the prompt.
  assert decode_plan.attention_windows(16, 10, 4) == [20, 24, 25]
  assert decode_plan.attention_windows(16, 10, None) == [25]
  assert decode_plan.attention_windows(16, 10, 10) == [25]
  # A slot with 5 tokens generated writes its next key at column 16 + 5 - 1 = 20: window 20 cannot
  # hold it; with 2 steps of headroom it needs columns up to 22 -> window 24.
  assert decode_plan.pick_window([20, 24, 25], 16, 5, 2) == 24
  assert decode_plan.pick_window([20, 24, 25], 16, 1, 2) == 20
  assert decode_plan.pick_window([20, 24, 25], 16, 9, 2) == 25  # the whole cache whatever the headroom
  assert decode_plan.default_window_step(1024) == 128 and decode_plan.default_window_step(512) == 64
  assert decode_plan.default_window_step(12) == 64
  assert decode_plan.default_window_step(1024, "tpu") is None
  assert decode_plan.default_window_step(1024, "gpu") is None


def test_the_cpu_gets_the_dense_layout_and_the_accelerators_the_paged_one():
  assert decode_plan.default_layout("cpu") == "dense"
  assert decode_plan.default_layout("tpu") == "paged" and decode_plan.default_layout("gpu") == "paged"


def test_a_window_step_below_one_is_refused_by_name():
  with pytest.raises(ValueError, match="window_step=0"):
    decode_plan.attention_windows(16, 10, 0)
