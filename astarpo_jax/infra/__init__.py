"""The ground floor: what every layer above uses and nothing here knows of models or methods.

  sharding     the (data, fsdp, tensor) mesh, the logical-axis -> mesh-axis rule table, the sampling mesh
  multihost    per-process rows of global arrays, gathers to every host
  files        local or bucket (gs://) paths, atomic writes
  checkpoint   Orbax checkpoints of the train state and the data iterator's position
  metrics      tensorboardX + JSONL + text logs, optionally Weights & Biases
  masks        masked reductions and the shape/finiteness checks of the losses
  platforms    the platforms JAX tries: a TPU that is not attached left out (no libtpu start-up errors)
  preemption   SIGTERM / SIGINT: the step in flight finishes and is saved (all processes the same one), exit 75

May import: nothing.
"""
