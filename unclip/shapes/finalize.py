"""Finish an assembled shapes pipeline for shipping: default sampling settings + fp16 weights.

    unclip shapes-finalize runs/shapes/pipeline --sampling configs/shapes/sampling.yaml

Sets ``unclip.json``'s ``sampling`` from the YAML (``{stage: {scheduler, steps, guidance_scale,
best_of}}``; stages ``prior``, ``decoder``, ``sr64``, ..., or ``upsampler`` for every upsampler;
fields not given keep the pipeline's current values) and, with ``--dtype float16`` (default),
stores every component's safetensors in fp16, halving the size. Loading upcasts: diffusers'
``ModelMixin.from_pretrained`` builds the model in fp32 and casts the loaded tensors, and
``CLIP.from_pretrained`` copies them into an fp32 model, so the pipeline runs in fp32 as
usual.

``--closed-vocabulary reranker`` (repeatable; ``clip`` or ``reranker``) stores only the rows of that
CLIP's token-embedding table that shapes captions can use
(:func:`unclip.shapes.world.caption_vocabulary`): 6.3 MB less per CLIP, the same embeddings for
every shapes caption (checked before writing).
"""

from __future__ import annotations

from pathlib import Path

import torch

from unclip.nets.clip import CLIP, closed_vocabulary_ids
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.shapes.world import ShapesWorld, caption_vocabulary
from unclip.utils.config import load_yaml_file
from unclip.utils.files import check_output_folder, recover_folder, write_folder


def _check_same_text_embeddings(full: CLIP, closed: CLIP, name: str, num: int = 500) -> None:
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


def finalize(
    pipeline,
    sampling,
    *,
    dtype: str = "float16",
    closed_vocabulary=(),
    out=None,
    overwrite: bool = False,
) -> Path:
    """Rewrite the pipeline folder ``pipeline`` (or write ``out``) with the default sampling
    settings of the YAML file ``sampling`` (overrides per stage, as ``pipe(sampling=...)`` takes
    them), weights stored in ``dtype`` and the CLIPs named in ``closed_vocabulary`` (``clip``,
    ``reranker``) restricted to the shapes caption vocabulary; returns the written folder.

    ``out`` must be a missing or empty folder unless ``overwrite``. Either folder is written whole
    and swapped in only when complete (the old one is moved aside first and removed last), so an
    interruption leaves the old or the new pipeline, never a mix; a swap cut short between its two
    renames is undone by the next run."""
    if dtype not in ("float16", "float32"):
        raise ValueError(f"dtype must be 'float16' or 'float32', got {dtype!r}")
    recover_folder(Path(pipeline))
    if not Path(pipeline).is_dir():  # before reading the settings: the folder is the first mistake
        raise ValueError(
            f"pipeline folder not found: {pipeline}; give the folder `unclip assemble` or the "
            "recipe's assemble step wrote"
        )
    if out is not None:
        check_output_folder(out, overwrite=overwrite, option="--out")
    settings = load_yaml_file(sampling, "--sampling")
    pipe = UnCLIPPipeline.from_pretrained(pipeline)
    closed: dict[str, CLIP] = {}
    for name in closed_vocabulary:
        if name not in ("clip", "reranker"):
            raise ValueError(f"closed_vocabulary: {name!r} is not 'clip' or 'reranker'")
        clip = pipe.modules().get(name)
        if not isinstance(clip, CLIP):
            raise ValueError(f"--closed-vocabulary {name}: this pipeline has no {name} component")
        # saved as a closed table
        clip.kept_token_ids = closed_vocabulary_ids(clip, caption_vocabulary())
        closed[name] = clip
    try:
        pipe.sampling = pipe.sampling_settings(settings)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{sampling}: {e}") from None
    if dtype == "float16":
        for m in pipe.modules().values():
            m.to(torch.float16)
    out = Path(out or pipeline)

    def write(tmp: Path) -> None:
        pipe.save_pretrained(tmp)
        for name, clip in closed.items():
            _check_same_text_embeddings(clip, CLIP.from_pretrained(tmp / name), name)

    write_folder(out, write)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(
        f"wrote {out} ({size / 1e6:.1f} MB, {dtype}); sampling: "
        + ", ".join(f"{k}={vars(v)}" for k, v in pipe.sampling.items())
    )
    return out
