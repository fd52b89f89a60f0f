"""The benchmarks' shared code, one module per concept; the runnable scripts are bench_*.py beside it.

model (the decoder stack), modes (its checkpointing modes), timing (timed steps, round-robin, noise),
measure (untimed check / inspection / profiled steps, gradient checks), lengths (the varying-length
pass), budget (--budget's plan), hf (the transformers path), savings, targets, report (tables and
number formats), hardware (the machine a run was on), plots.
"""
