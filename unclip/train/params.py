"""Parameter counts of stage configs as built, without allocating the weights.

    python -m unclip.train.params configs/prior_vit_l14.yaml configs/decoder_64.yaml \\
        configs/sr256.yaml configs/sr1024.yaml

The network (and the CLIP it is sized for, without its pretrained weights) is built on PyTorch's
``meta`` device, so a 3.5B-parameter decoder is counted in a second on any machine. The table puts
each count beside the paper's (Ramesh et al. 2022, Appendix C).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Optional

import torch

from unclip.nets.clip import CLIP
from unclip.train.config import StageConfig, load_stage_config

__all__ = ["PAPER_PARAMETERS", "build_on_meta", "count_parameters", "stage_name", "main"]

#: DALL-E 2's parameter counts per stage (Ramesh et al. 2022, Table 3 and Appendix C)
PAPER_PARAMETERS = {"prior": 1.0e9, "decoder": 3.5e9, "sr256": 700e6, "sr1024": 300e6}


def stage_name(cfg: StageConfig) -> str:
    """``prior``, ``decoder`` or ``sr<size>`` for an upsampler config."""
    return f"sr{cfg.upsampler_section.sample_size}" if cfg.stage == "upsampler" else cfg.stage


def build_on_meta(cfg: StageConfig) -> torch.nn.Module:
    """The network ``cfg`` describes, built on the meta device (shapes only, no storage)."""
    with torch.device("meta"):
        # the CLIP only supplies the widths: its architecture without the pretrained weights
        clip = CLIP.from_config(dataclasses.replace(cfg.clip, pretrained=None))
        if cfg.stage == "upsampler":
            return cfg.upsampler_section.build()
        return cfg.model.build(clip)


def count_parameters(cfg: StageConfig) -> int:
    """Number of parameters of the network ``cfg`` describes (the frozen CLIP not included)."""
    return sum(p.numel() for p in build_on_meta(cfg).parameters())


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m unclip.train.params",
        description="Parameter count of each stage config as built, beside the paper's.",
    )
    parser.add_argument("configs", nargs="+", help="stage config YAML files")
    args = parser.parse_args(argv)
    print(f"{'config':<32} {'stage':<8} {'built':>8} {'paper':>8}")
    for path in args.configs:
        cfg = load_stage_config(path)
        name = stage_name(cfg)
        paper = PAPER_PARAMETERS.get(name)
        paper_text = f"{paper / 1e9:.2f}B" if paper else "-"
        print(f"{path:<32} {name:<8} {count_parameters(cfg) / 1e9:>7.2f}B {paper_text:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
