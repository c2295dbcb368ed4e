"""`zerodp estimate --offload nvme`: what a run with its optimizer states on disk (offload_optimizer "nvme",
engine/stepping/disk.py) needs per rank, for each world size and stage: the bytes on disk (the fp32 master and
AdamW's two moments of its 1/N: formulas.on_disk), the host buffers the step streams them through
(--buffer-count buffers of at most --sub-group-size fp32 elements), what stays on the device (the working
parameters and gradients: formulas.placed with the optimizer off the device), and the disk bandwidth one rank
needs for a step of --step-time seconds to carry its traffic (the file read and written once per step) without
waiting for the disk. A node of R ranks needs R times that, from its own disks. At stage 3 a second row puts the
parameter shards on disk too (offload_param "nvme", formulas.params_on_disk): their bytes, the host buffers they
pass through (--param-buffer-count buffers of at most --param-buffer-size elements), and their traffic (each
shard read for every forward and backward, written once per step) added to the bandwidth.
"""

from __future__ import annotations

import argparse


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("optimizer states on disk (--offload nvme)")
    g.add_argument("--offload", choices=["nvme"], help="print what offload_optimizer \"nvme\" needs per rank: disk "
                   "bytes, host buffers, device bytes and the disk bandwidth a step time needs")
    g.add_argument("--step-time", type=float, default=1.0, metavar="SECONDS",
                   help="--offload nvme: the target step time the disk bandwidth is for (default 1)")
    g.add_argument("--sub-group-size", type=int, default=100_000_000, metavar="ELEMENTS",
                   help="--offload nvme: zero_optimization.sub_group_size (default 1e8)")
    g.add_argument("--buffer-count", type=int, default=4,
                   help="--offload nvme: offload_optimizer.buffer_count (default 4: one AdamW sub-group)")
    g.add_argument("--param-buffer-count", type=int, default=5,
                   help="--offload nvme at stage 3: offload_param.buffer_count (default 5, DeepSpeed's)")
    g.add_argument("--param-buffer-size", type=int, default=100_000_000, metavar="ELEMENTS",
                   help="--offload nvme at stage 3: offload_param.buffer_size (default 1e8)")


def render(args: argparse.Namespace, plan_model, console) -> None:
    """estimate's section hook (estimate.SECTION_MODULES): with --offload nvme, the table below."""
    if args.offload != "nvme":
        return
    if args.step_time <= 0 or args.sub_group_size < 1 or args.buffer_count < 4:
        raise SystemExit("zerodp estimate: --step-time must be positive, --sub-group-size at least 1 and "
                         "--buffer-count at least 4 (an AdamW sub-group: master, gradient, two moments)")
    if args.param_buffer_count < 1 or args.param_buffer_size < 1:
        raise SystemExit("zerodp estimate: --param-buffer-count and --param-buffer-size must be at least 1")
    console.print(table(plan_model.num_params(), args))


def table(psi: int, args: argparse.Namespace):
    from rich import box
    from rich.table import Table

    from zerodp.plan.formulas import on_disk, placed
    from zerodp.plan.units import human
    t = Table(title=f"Optimizer states on disk (offload_optimizer \"nvme\", AdamW, {args.dtype}), per rank",
              caption=f"disk: fp32 master + 2 moments of the rank's partition; host buffers: {args.buffer_count} x "
                      f"min(sub_group_size {args.sub_group_size:,}, partition) fp32; bandwidth: the file read and "
                      f"written once in {args.step_time:g} s; stage 3 \"+ params\": the parameter shards on disk too "
                      f"({args.param_buffer_count} buffers of at most {args.param_buffer_size:,} elements; each shard "
                      "read for every forward and backward, written once)",
              box=box.SIMPLE_HEAD, title_justify="left", caption_justify="left")
    for c in ("N", "stage", "on disk", "disk", "host buffers", "device", "traffic/step", "disk GB/s needed"):
        t.add_column(c, justify="right")
    for world in args.world:
        for stage in args.stage:
            d = on_disk(psi, world, stage, "adam", args.sub_group_size, args.buffer_count)
            device = placed(psi, world, stage, args.dtype, "adam", args.gas, offload_optimizer=True)["device"]
            t.add_row(str(world), str(stage), "states", human(d["disk"]), human(d["host_buffers"]), human(device),
                      human(d["traffic"]), f"{d['traffic'] / args.step_time / 1e9:.2f}")
            if stage == 3:
                t.add_row(*_with_params(psi, world, args, d))
    return t


def _with_params(psi: int, world: int, args: argparse.Namespace, states: dict[str, int]) -> list[str]:
    """Stage 3's row with the parameter shards on disk beside the states (offload_param "nvme")."""
    from zerodp.plan.formulas import params_on_disk, placed
    from zerodp.plan.units import human
    p = params_on_disk(psi, world, args.dtype, args.param_buffer_count, args.param_buffer_size, args.gas)
    device = placed(psi, world, 3, args.dtype, "adam", args.gas, offload_optimizer=True, offload_param=True)["device"]
    traffic = states["traffic"] + p["traffic"]
    return [str(world), "3", "+ params", human(states["disk"] + p["disk"]),
            human(states["host_buffers"] + p["host_buffers"]), human(device), human(traffic),
            f"{traffic / args.step_time / 1e9:.2f}"]
