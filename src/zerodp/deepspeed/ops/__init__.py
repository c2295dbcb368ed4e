"""`deepspeed.ops`: the optimizer classes scripts import from it (`ops.adam`), over torch.optim.

  adam.py  FusedAdam and DeepSpeedCPUAdam.
"""

from zerodp.deepspeed.ops import adam

__all__ = ["adam"]
