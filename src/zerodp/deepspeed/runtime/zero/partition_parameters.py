"""`deepspeed.runtime.zero.partition_parameters`, where scripts import ZeroParamStatus from (to test
`p.ds_status == ZeroParamStatus.NOT_AVAILABLE`), and GatheredParameters and Init: zero.py's."""

from zerodp.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
