"""`deepspeed.runtime.zero`, which DeepSpeed also exposes as `deepspeed.zero`: the same names."""

from zerodp.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
