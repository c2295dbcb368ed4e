"""The main job: `zerodp train` / `python -m zerodp.train` trains a GPT with ZeRO (see loop.py).

model.py is the GPT, data.py the corpus and per-rank batches, loop.py the launcher and training loop.
"""


def main(argv: list[str] | None = None) -> None:
    from .loop import main as run  # imported on use: `import zerodp.train.model` stays light

    run(argv)
