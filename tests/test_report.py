"""report.png of `zerodp train`: loss, memory, throughput, lr and gradient-norm panels, resumes
marked (drawn in-process from metrics records; the job itself is tested in test_train.py)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from zerodp.train.report import report_figure  # noqa: E402

LINES = ([{"kind": "eval", "step": 0, "val_loss": 5.0}]
         + [{"kind": "train", "step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3 * s, "tokens_per_s": 1000.0 + s,
             "grad_norm": 1.0 / s, "loss_scale": 1.0} for s in range(1, 9)]
         + [{"kind": "memory", "step": 8, "ranks": [{"gradients": 2**20}, {"gradients": 2**20}]},
            {"kind": "resume", "step": 3}])


def test_report_has_throughput_lr_and_grad_norm_panels_and_marks_the_resume():
    fig = report_figure(LINES)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert {"loss", "throughput (whole job)", "learning rate", "gradient norm"} <= panels.keys()
    assert list(panels["learning rate"].lines[0].get_ydata()) == [1e-3 * s for s in range(1, 9)]
    assert list(panels["throughput (whole job)"].lines[0].get_ydata()) == [1000.0 + s for s in range(1, 9)]
    for title in ("loss", "throughput (whole job)", "learning rate", "gradient norm"):
        marks = [line for line in panels[title].lines if line.get_label() == "resumed"]
        assert len(marks) == 1 and list(marks[0].get_xdata()) == [3, 3]

