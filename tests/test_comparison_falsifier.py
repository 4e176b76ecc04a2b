"""The falsifier's selection and normalisation (astarpo_jax/comparison/falsifier.py), hand-worked."""
import math

import numpy as np
import pytest

from astarpo_jax.comparison import falsifier


def test_never_solved_in_128_takes_prompts_that_fail_the_first_32_and_the_96_drawn_after():
  """Held-out passes as coverage() builds them: 32 samples each, 96 more only where the 32 all failed (the rest
  padded with passes). Prompt a passes at sample 3, b at sample 40 (in the extra 96), c never, d never: the
  never-solved-in-128 set is c, d; at N = 32 it is b, c, d; a limit keeps the first ones in order."""
  full = np.ones((4, 128), bool)
  full[:, :32] = False
  full[0, 3] = True
  full[1:, 32:] = False
  full[1, 40] = True
  prompts = ["a", "b", "c", "d"]
  assert falsifier.never_solved(prompts, full, 128, 10) == ["c", "d"]
  assert falsifier.never_solved(prompts, full, 32, 10) == ["b", "c", "d"]
  assert falsifier.never_solved(prompts, full, 128, 1) == ["c"]
  assert falsifier.never_solved_share(full, 128) == 0.5


def test_a_gain_is_normalised_by_the_policys_overall_gain():
  # +0.02 on the never-solved prompts by a policy that gained +0.10 overall: a fifth of its gain there
  assert falsifier.normalised(0.02, 0.10) == pytest.approx(0.2)
  assert math.isnan(falsifier.normalised(0.02, 0.0)) and math.isnan(falsifier.normalised(0.02, -0.01))
