"""`zerodp estimate`: a job's memory and communication, planned from one machine. estimate.py is the
command line (torch-free), tables.py its tables, models.py the models it plans for, peak.py the peak of
a step on fake tensors, measure.py one real step as rank 0 of N, communication.py the bytes per step by
collective and link.

  formulas.py          the paper's formulas, torch-free (formula, placed, on_disk, finetune, buckets,
                       activations).
  finetune.py          a fine-tune's memory: a frozen base, a small part trained.
  disk.py              --offload nvme: disk bytes, host buffers and the disk bandwidth a step time needs.
  optimizer_shares.py  each rank's share of a shape-aware optimizer's states (whole parameters).
  setup.py             the set-up peak (build, load, initialize) beside the step's.
  tensor_parallel.py   ZeRO over the data-parallel dimension of a tensor-parallel model (--tp).
  units.py             bytes printed and parsed, torch-free.
"""
