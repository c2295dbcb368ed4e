"""`zerodp consolidate DIR OUT`, and `python -m zerodp.checkpoint DIR OUT` the same: the command line of export.py,
torch-free until the arguments parse."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zerodp consolidate",
                                     description="write a sharded checkpoint as one full fp32 state dict, "
                                     "or as a Hugging Face model folder (--hf)")
    parser.add_argument("dir", help="a save_dir (its 'latest' tag is used) or a checkpoint tag directory")
    parser.add_argument("out", help="output file, .safetensors or .pt; with --hf, a directory")
    parser.add_argument("--tag", default=None, help="the tag to consolidate (default: latest)")
    parser.add_argument("--hf", action="store_true", help="write OUT as a Hugging Face model folder "
                        "(AutoModelForCausalLM.from_pretrained loads it)")
    parser.add_argument("--hf-config", metavar="PATH", help="with --hf: the model's HF folder or config.json "
                        "(default: the config a zerodp train checkpoint records; needed for DeepSpeed's)")
    args = parser.parse_args(argv)
    if args.hf_config and not args.hf:
        parser.error("--hf-config is used only with --hf")
    from zerodp.checkpoint.errors import CheckpointError
    from zerodp.checkpoint.export import write_consolidated, write_hf_folder

    try:
        if args.hf:
            for note in write_hf_folder(args.dir, args.out, args.tag, args.hf_config):
                print(f"note: {note}")
        else:
            write_consolidated(args.dir, args.out, args.tag)
    except CheckpointError as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
