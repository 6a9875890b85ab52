"""Finish an assembled shapes pipeline for shipping: default sampling settings + fp16 weights.

    python -m unclip.shapes.finalize runs/shapes/pipeline --sampling configs/shapes/sampling.yaml

Sets ``unclip.json``'s ``sampling`` from the YAML (``{stage: {scheduler, steps, guidance_scale,
best_of}}``; stages ``prior``, ``decoder``, ``sr64``, ...) and, with ``--dtype float16`` (default),
stores every component's safetensors in fp16, halving the size. Loading upcasts: diffusers'
``ModelMixin.from_pretrained`` builds the model in fp32 and casts the loaded tensors, and
``FrozenCLIP.from_pretrained`` copies them into an fp32 model, so the pipeline runs in fp32 as usual.

``--closed-vocabulary reranker`` (repeatable; ``clip`` or ``reranker``) stores only the rows of that CLIP's
token-embedding table that shapes captions can use (:func:`unclip.shapes.world.caption_vocabulary`): 6.3 MB
less per CLIP, the same embeddings for every shapes caption (checked before writing).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
import yaml

from unclip.clip import FrozenCLIP, closed_vocabulary_ids
from unclip.config import SamplingConfig, from_dict
from unclip.pipeline import UnCLIPPipeline
from unclip.shapes.world import ShapesWorld, caption_vocabulary


def _check_same_text_embeddings(
    full: FrozenCLIP, closed: FrozenCLIP, name: str, num: int = 500
) -> None:
    """The closed-vocabulary copy must encode shapes captions exactly as the full CLIP does."""
    worlds = [
        ShapesWorld(32, seed=0, split=split, two_object_prob=0.5) for split in ("train", "heldout")
    ]
    captions = [worlds[i % 2][i].caption for i in range(num)]
    a, b = full.encode_text(captions), closed.to(full.dtype).encode_text(captions)
    if not (torch.equal(a.text_embed, b.text_embed) and torch.equal(a.text_tokens, b.text_tokens)):
        raise AssertionError(
            f"{name}: the closed-vocabulary token table changed the text embeddings"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m unclip.shapes.finalize", description=__doc__.splitlines()[0]
    )
    p.add_argument("pipeline", help="assembled pipeline folder (rewritten in place unless --out)")
    p.add_argument(
        "--sampling", required=True, help="YAML with the default sampling settings per stage"
    )
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    p.add_argument(
        "--closed-vocabulary",
        action="append",
        default=[],
        choices=("clip", "reranker"),
        help="store this CLIP's token table for the shapes caption vocabulary only (repeatable)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    pipe = UnCLIPPipeline.from_pretrained(args.pipeline)
    closed = {}
    for name in args.closed_vocabulary:
        clip = pipe.modules().get(name)
        if clip is None:
            raise ValueError(f"--closed-vocabulary {name}: this pipeline has no {name} component")
        clip.kept_token_ids = closed_vocabulary_ids(
            clip, caption_vocabulary()
        )  # saved as a closed table
        closed[name] = clip
    settings = yaml.safe_load(Path(args.sampling).read_text()) or {}
    for stage, values in settings.items():
        if stage not in pipe.sampling:
            raise ValueError(
                f"{args.sampling}: unknown stage {stage!r}; this pipeline has {pipe.stage_names}"
            )
        pipe.sampling[stage] = from_dict(SamplingConfig, values, source=args.sampling, prefix=stage)
    if args.dtype == "float16":
        for m in pipe.modules().values():
            m.to(torch.float16)
    out = Path(args.out or args.pipeline)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    for name, clip in closed.items():
        _check_same_text_embeddings(clip, FrozenCLIP.from_pretrained(tmp / name), name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(
        f"wrote {out} ({size / 1e6:.1f} MB, {args.dtype}); sampling: "
        + ", ".join(f"{k}={vars(v)}" for k, v in pipe.sampling.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
