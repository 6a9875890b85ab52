"""``unclip train-tokens``: train a token transformer (DALL-E or DALL-E Mega) over a frozen
tokenizer (see :mod:`unclip.train.tokens`).

unclip train-tokens configs/tiny/dalle.yaml tokenizer=runs/tiny-dvae/final/tokenizer
"""

from __future__ import annotations

import sys

from unclip.cli.train_prior import run_config_command


def main(argv=None) -> int:
    return run_config_command(
        "unclip train-tokens",
        "train a token transformer (DALL-E or DALL-E Mega) over a frozen tokenizer",
        "YAML with transformer:, tokenizer:, data:, train:, sampling: sections "
        "(see configs/tiny/dalle.yaml)",
        argv,
        load="unclip.train.token_config:load_token_model_train_config",
        train="unclip.train.tokens:train_token_model",
    )


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip train-tokens", main, sys.argv[1:]))
