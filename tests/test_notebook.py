"""The Colab notebook's code cells run top to bottom (offline, on the CPU)."""
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_notebook_cells_run_and_print_the_vstar_table(capsys):
  nb = json.load(open(os.path.join(ROOT, "notebooks", "explore.ipynb")))
  cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
  ns: dict = {}
  for src in cells:
    exec(compile(src.replace("WARM_STEPS = 150", "WARM_STEPS = 20"), "notebook", "exec"), ns)
  out = capsys.readouterr().out
  assert "V* for k correct of 8" in out
  assert "0.2935" in out and "0.9428" in out
  assert ns["rewards_PN"].shape == (6, 8)
