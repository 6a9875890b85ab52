"""``unclip train-tokenizer``: train an image tokenizer, DALL-E's dVAE or DALL-E Mega's VQGAN
(see :mod:`unclip.train.tokens`).

unclip train-tokenizer configs/tiny/dvae.yaml train.max_steps=200
"""

from __future__ import annotations

import sys

from unclip.cli.train_prior import run_config_command


def main(argv=None) -> int:
    return run_config_command(
        "unclip train-tokenizer",
        "train an image tokenizer: DALL-E's dVAE or DALL-E Mega's VQGAN",
        "YAML with tokenizer:, data:, train: sections (see configs/tiny/dvae.yaml)",
        argv,
        load="unclip.train.token_config:load_tokenizer_train_config",
        train="unclip.train.tokens:train_tokenizer",
    )


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip train-tokenizer", main, sys.argv[1:]))
