"""Sizing a training step: the estimate on the meta device and its recipe, the budgets read off the
device and the node, plan_memory's entry point, and the `estimate` command. Nothing is imported here
(the public names are ckpt_offload's own), so that the engine can use `budget` and `hostmem` alone.
"""
