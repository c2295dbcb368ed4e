"""report.png of `zerodp train`: titled with the run, loss, memory, throughput, lr and gradient-norm
panels, none empty, resumes marked (drawn in-process from metrics records; the job itself is tested in
test_train.py)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from zerodp.train.report import report_figure  # noqa: E402

LINES = ([{"kind": "eval", "step": 0, "val_loss": 5.0}]
         + [{"kind": "train", "step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3 * s, "tokens_per_s": 1000.0 + s,
             "grad_norm": 1.0 / s, "loss_scale": 1.0} for s in range(1, 9)]
         + [{"kind": "memory", "step": 8, "ranks": [{"gradients": 2**20}, {"gradients": 2**20}]},
            {"kind": "resume", "step": 3}]
         + [{"kind": "run", "step": 0, "model": "tiny", "stage": 2, "dtype": "bf16", "ranks": 2},
            {"kind": "run", "step": 3, "model": "tiny", "stage": 2, "dtype": "bf16", "ranks": 4}])


def test_report_has_throughput_lr_and_grad_norm_panels_and_marks_the_resume():
    fig = report_figure(LINES)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert {"loss", "throughput (whole job)", "learning rate", "gradient norm"} <= panels.keys()
    assert list(panels["learning rate"].lines[0].get_ydata()) == [1e-3 * s for s in range(1, 9)]
    assert list(panels["throughput (whole job)"].lines[0].get_ydata()) == [1000.0 + s for s in range(1, 9)]
    for title in ("loss", "throughput (whole job)", "learning rate", "gradient norm"):
        marks = [line for line in panels[title].lines if line.get_label() == "resumed"]
        assert len(marks) == 1 and list(marks[0].get_xdata()) == [3, 3]



def _drawn(ax) -> bool:
    return ax.axison and bool(ax.lines or ax.patches or ax.collections)


def test_report_is_titled_with_model_stage_dtype_and_ranks_and_has_no_empty_panel():
    fig = report_figure(LINES)
    assert fig._suptitle.get_text() == "tiny, ZeRO stage 2, bf16, 2 rank(s); from step 3: 4 rank(s)"
    assert len(fig.axes) == 5 and all(_drawn(ax) for ax in fig.axes)


def test_a_series_with_no_points_gets_no_panel():
    lines = [{**r, "grad_norm": None} for r in LINES if r["kind"] != "memory"]
    fig = report_figure(lines)
    assert {ax.get_title() for ax in fig.axes} == {"loss", "throughput (whole job)", "learning rate"}
    assert all(_drawn(ax) for ax in fig.axes)


def test_progress_bar_shows_no_validation_loss_before_the_first_evaluation(tmp_path):
    from zerodp.train.report import Metrics, bar_text

    log = Metrics(tmp_path / "metrics.jsonl", rank=0, keep_until=0)
    memory = [{"gradients": 2**20}]
    assert log.last_val_loss is None  # --eval-every 0, or before step 0's evaluation
    text = bar_text(4.5, log.last_val_loss, 1234.0, 1e-3, 1.0, memory)
    assert text == "loss 4.500 1,234 tok/s lr 1.00e-03 scale 1 mem/rank 1 MiB" and "nan" not in text
    log.write(kind="eval", step=5, val_loss=3.25)
    assert "loss 4.500 val 3.250 1,234 tok/s" in bar_text(4.5, log.last_val_loss, 1234.0, 1e-3, 1.0, memory)


def test_a_resumed_run_shows_the_last_validation_loss_its_checkpoint_kept(tmp_path):
    from zerodp.train.report import Metrics

    path = tmp_path / "metrics.jsonl"
    first = Metrics(path, rank=0, keep_until=0)
    for step, val in ((0, 5.0), (4, 4.0), (8, 3.0)):  # the crashed run evaluated at 8, after its checkpoint at 6
        first.write(kind="eval", step=step, val_loss=val)
    assert Metrics(path, rank=0, keep_until=6).last_val_loss == 4.0  # until the resumed run's next evaluation
    assert Metrics(path, rank=1, keep_until=6).last_val_loss is None  # only rank 0 draws the bar
