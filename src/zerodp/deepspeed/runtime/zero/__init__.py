"""`deepspeed.runtime.zero`, which DeepSpeed also exposes as `deepspeed.zero`: the same names.

  partition_parameters.py  ZeroParamStatus, GatheredParameters and Init, where scripts import them from.
"""

from zerodp.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
