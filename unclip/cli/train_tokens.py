"""``unclip train-tokens``: train a token transformer (DALL-E or DALL-E Mega) over a frozen
tokenizer (see :mod:`unclip.train.tokens`).

unclip train-tokens configs/tiny/dalle.yaml tokenizer=runs/tiny-dvae/final/tokenizer
"""

from __future__ import annotations

import argparse
import sys

from unclip.cli.train_prior import add_run_arguments


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="unclip train-tokens",
        description="train a token transformer (DALL-E or DALL-E Mega) over a frozen tokenizer",
    )
    p.add_argument(
        "config",
        help="YAML with transformer:, tokenizer:, data:, train:, sampling: sections "
        "(see configs/tiny/dalle.yaml)",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=500")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_run_arguments(p)
    args = p.parse_intermixed_args(argv)
    from unclip.train.token_config import load_token_model_train_config
    from unclip.train.tokens import train_token_model
    from unclip.utils.config import to_yaml

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"train.output_dir={args.output_dir}")
    cfg = load_token_model_train_config(args.config, overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    return train_token_model(
        cfg,
        resume=args.resume,
        max_steps_this_run=args.max_steps_this_run,
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip train-tokens", main, sys.argv[1:]))
