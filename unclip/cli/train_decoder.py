"""``unclip train-decoder``: train the base decoder or one upsampler, chosen by the config's
``stage`` (see :mod:`unclip.train.decoder`).

    unclip train-decoder configs/tiny/decoder.yaml train.max_steps=200
    unclip train-decoder configs/tiny/sr32.yaml
    accelerate launch train_decoder.py configs/decoder_64.yaml --resume latest
    torchrun --nproc_per_node 2 -m unclip.cli.train_decoder configs/shapes/decoder.yaml
"""

from __future__ import annotations

import sys

from unclip.cli.train_prior import run_kandinsky, stage_config, stage_parser


def main(argv=None) -> int:
    parser = stage_parser(
        "unclip train-decoder",
        "train the base decoder or an upsampler (or fine-tune a Kandinsky 2.2 decoder: a config "
        "with a 'kandinsky:' section)",
    )
    args = parser.parse_intermixed_args(argv)
    from unclip.utils.config import to_yaml

    done = run_kandinsky(args, "decoder")
    if done is not None:
        return done
    cfg = stage_config(args, ("decoder", "upsampler"))
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    from unclip.train.decoder import train_decoder

    return train_decoder(
        cfg,
        resume=args.resume,
        max_steps_this_run=args.max_steps_this_run,
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    from unclip.cli.errors import run_main

    sys.exit(run_main("unclip train-decoder", main, sys.argv[1:]))
