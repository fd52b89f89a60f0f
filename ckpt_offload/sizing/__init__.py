"""Sizing a training step: the estimate on the meta device (`estimate`) and its recipe (`recipe`,
`recipe_files`), the budgets read off the device and the node (`budget`, `hostmem`, `nvidia`), and
the `estimate` command (`cli`). The public names are ckpt_offload's own (`estimate_memory`,
`plan_memory`); nothing is imported here, so that the engine can use `budget` and `hostmem` alone.
"""
