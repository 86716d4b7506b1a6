"""Benchmarks of whole models (library code; the command lines are tools/benchmark.py,
tools/seg_benchmark.py and scripts/cuda_check.sh): :mod:`benchmarks.models` (classification:
saved activation bytes, peak memory, step time per mode), :mod:`benchmarks.seg` (segmentation
train steps), :mod:`benchmarks.gpu` (the GPU table against the paper's memory column). Op-level
timing helpers live in :mod:`mesa_ops.bench` (the planner uses them)."""
