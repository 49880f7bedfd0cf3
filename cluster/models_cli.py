"""``turnrl models``: pretrained models shipped in Python packages, as cached Hugging Face folders.

    turnrl models list                      # the packaged models and whether each is converted
    turnrl models convert smollm2           # GGUF -> .cache/turnrl/models/smollm2-135m-instruct
    turnrl models path smollm2              # print the folder (converting first if needed)
    turnrl models merge runs/NAME/checkpoints/step_N OUT   # a LoRA checkpoint + its base -> OUT

The conversion itself lives in ``learner/pretrained.py`` (the learner's policy bootstrap uses it
for ``policy.path: builtin:smollm2``); this module is its command line.
"""

from __future__ import annotations

import argparse
import functools
import sys

DEFAULT_DIR = ".cache/turnrl/models"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnrl models", description="Packaged pretrained models.")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("list", help="the packaged models and their cached folders")
    for action, help_line in (("convert", "convert NAME's GGUF into a Hugging Face folder (once)"),
                              ("path", "print NAME's folder, converting it first if needed")):
        p = sub.add_parser(action, help=help_line)
        p.add_argument("name", help="a packaged model (turnrl models list)")
    for p in sub.choices.values():
        p.add_argument("--dir", default=DEFAULT_DIR,
                       help=f"where converted folders are cached (default {DEFAULT_DIR}; policy.models_dir in a config)")
    merge = sub.add_parser("merge", help="write a LoRA checkpoint's base + adapter as a plain Hugging Face folder")
    merge.add_argument("checkpoint", help="a LoRA run's checkpoint folder (runs/NAME/checkpoints/step_N)")
    merge.add_argument("out", help="the folder to write (replaced if it exists)")
    return parser


def merge(checkpoint: str, out: str) -> int:
    """``turnrl models merge``: the merged folder's path on stdout."""
    from learner.lora import is_lora_checkpoint, merge_into

    if not is_lora_checkpoint(checkpoint):
        print(f"error: {checkpoint} is not a LoRA checkpoint (no turnrl_lora.json); a full fine-tuning "
              "run's checkpoints are plain Hugging Face folders already", file=sys.stderr)
        return 2
    try:
        print(merge_into(checkpoint, out))
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str]) -> int:
    from learner.pretrained import PACKAGED, cached_folder, convert

    args = build_parser().parse_args(argv[1:] if argv and argv[0] == "models" else argv)
    if args.action == "merge":
        return merge(args.checkpoint, args.out)
    if args.action == "list":
        for name, model in PACKAGED.items():
            folder = cached_folder(name, args.dir)
            print(f"{name}: {model.summary}; package {model.distribution}; "
                  f"{'converted: ' + str(folder) if folder else 'not converted'}")
        return 0
    try:  # progress to stderr: stdout is the folder alone, for $(turnrl models path NAME)
        folder = convert(args.name, args.dir, log=functools.partial(print, file=sys.stderr))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0
