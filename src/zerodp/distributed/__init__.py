"""What a rank owns besides its model: the process group and the device.

  comm.py       `Comm`, the few collectives zerodp uses on one group (in a world of one and on the fake
                backend computed here), the agreement that turns one rank's error into every rank's, the
                shard and replica groups, the bound on every wait; `init_distributed`, `init_fake`.
  groups.py     the process groups under it: a group's timeout and its bounded twin, hierarchical
                sharding's subgroups, a named device mesh's or an mpu's data- and tensor-parallel groups.
  waits.py      `WaitNotice`: a collective that keeps this rank waiting over wait_notice_s says so, and where
                the other ranks are, in one line at doubling intervals.
  plan.py       `CollectivePlan`: how each sharding collective runs on this backend (natively, or as an
                all-reduce), chosen by a probe at set-up on gloo; the torch rename of the flat collectives.
  failures.py   a peer's failure named: `PeerFailure`, a rank's `Failure` as the agreement reports it.
  traffic.py    what the collectives report: the bytes each moves (`Traffic`), comms_logger's `Watcher`.
  teardown.py   the groups freed at exit, before the interpreter finalizes.
  said_once.py  an agreed error said by rank 0 in one `zerodp:` line.
  device.py     the one place that talks to the accelerator, through torch.accelerator.
  accelerate.py a script's Accelerator (Hugging Face Accelerate): its process count against the world's.
"""
