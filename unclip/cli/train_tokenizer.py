"""``unclip train-tokenizer``: train an image tokenizer, DALL-E's dVAE or DALL-E Mega's VQGAN
(see :mod:`unclip.train.tokens`).

unclip train-tokenizer configs/tiny/dvae.yaml train.max_steps=200
"""

from __future__ import annotations

import argparse
import sys

from unclip.cli.train_prior import add_run_arguments


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="unclip train-tokenizer",
        description="train an image tokenizer: DALL-E's dVAE or DALL-E Mega's VQGAN",
    )
    p.add_argument(
        "config", help="YAML with tokenizer:, data:, train: sections (see configs/tiny/dvae.yaml)"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=500")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_run_arguments(p)
    args = p.parse_intermixed_args(argv)
    from unclip.train.token_config import load_tokenizer_train_config
    from unclip.train.tokens import train_tokenizer
    from unclip.utils.config import to_yaml

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"train.output_dir={args.output_dir}")
    cfg = load_tokenizer_train_config(args.config, overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    return train_tokenizer(
        cfg,
        resume=args.resume,
        max_steps_this_run=args.max_steps_this_run,
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip train-tokenizer", main, sys.argv[1:]))
