"""`deepspeed.runtime`: the modules of DeepSpeed's runtime that scripts import names from.

  zero/  `deepspeed.runtime.zero` (partition_parameters).
"""
