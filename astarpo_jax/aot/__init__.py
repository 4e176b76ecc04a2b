"""Compile-and-cost tools: every phase of a run compiled ahead of time for a TPU slice or GPUs, on a
machine without one, with its memory, FLOPs, bytes and a roofline time. Nothing on the training path
imports this package.

  phases       the one table of calls into the library (PHASES): each phase's jitted function and abstract args
  compiling    a phase compiled for a topology and read: memory, FLOPs, bytes, roofline (PhaseResult)
  layouts      meshes over compile-only devices; the sampling layout and the settings that fit, by compiling
  run_shape    RunShape (a run's shapes as the compiles see them, LoRA's adapter too) and resident bytes
  memory_plan  per-device memory of any method before compiling; refuses runs that do not fit
  projection   whole-run hours from the compiled phases (rollout, reference, update)
  method_runs  every method's whole run from the phases they share and their own updates
  decode_roofline  a compiled decode step against the bytes it must move and the slice's memory roofline
  fixed_costs  what a roofline leaves out, read from the compile: Pallas grid steps, collectives the schedule
               can not hide, GPU launches; the modeled time beside the roofline; the engine's host trips
  hlo_cost     FLOPs, HBM and collective bytes read from compiled HLO, loop trip counts included
  hlo_text     the HLO text parser hlo_cost reads
  chips        the chip table (peak FLOP/s, HBM and interconnect bandwidth) and compile-only topologies
  measure      a compiled phase timed on this process's devices beside its projection

May import: methods, training, sampling, model, infra.
"""
