"""The main job: `zerodp train` / `python -m zerodp.train` trains a GPT with ZeRO (see loop.py).

The GPT is models/gpt.py; here data.py the corpus and per-rank batches, options.py the command line and config
layering, resume.py which checkpoint a resume continues and the batch it keeps, folder.py whose work
the --out folder holds (a fresh run never lands in another run's), build.py the
model/optimizer/schedule, launch.py the ranks (started here or by torchrun) and how the job ended, signals.py
who says a job was stopped (the launcher in set-up, rank 0 once training),
loop.py the training loop, report.py the metrics, memory figures and the report plot.
__main__.py is `python -m zerodp.train`; ds_sections.py what a --ds-config gives beyond the options
("auto" filled, the optimizer and scheduler sections).
"""


def main(argv: list[str] | None = None) -> None:
    from zerodp.train.launch import (
        main as run,  # imported on use: `import zerodp.models.gpt` stays light
    )

    run(argv)
