"""What a rank owns besides its model: the process group (comm.py: the few collectives zerodp uses, the
agreement that turns one rank's error into every rank's, the shard and replica groups; teardown.py: the groups
freed at exit, before the interpreter finalizes) and the device (device.py: the one place that talks to the
accelerator, through torch.accelerator)."""
