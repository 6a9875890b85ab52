"""Karlo / diffusers unCLIP interop: import a diffusers ``UnCLIPPipeline`` folder, export to one.

    pipe = load_diffusers_unclip("karlo-v1-alpha")  # fp32, as diffusers computes it
    pipe = UnCLIPPipeline.from_pretrained("karlo-v1-alpha")  # the same, with the fast defaults
    export_diffusers(pipe, "out/karlo-diffusers")   # diffusers' UnCLIPPipeline loads it
    convert("karlo-v1-alpha", "karlo-unclip")       # both in one call, as `unclip convert` does

    unclip convert karlo-v1-alpha karlo-unclip            # diffusers/Karlo → native unclip folder
    unclip convert my-unclip my-diffusers --to diffusers  # native unclip → diffusers folder

Component mapping (diffusers → unclip):

* ``text_encoder`` (CLIPTextModelWithProjection) → open_clip text tower (:mod:`unclip.interop.clip`)
* ``tokenizer`` (CLIPTokenizer) → :class:`~unclip.nets.clip_tokenizer.CompatTokenizer` (checked:
same BPE)
* ``image_encoder`` (variations layout only) → open_clip vision tower; otherwise a placeholder and
  ``CLIP.has_vision=False``
* ``prior`` (PriorTransformer, clip_mean/std) → ``UnCLIPPrior.transformer``
  (``text_token_proj`` = identity)
* ``decoder`` (UNet2DConditionModel) → ``UnCLIPDecoder.unet``
* ``text_proj`` (UnCLIPTextProjModel) → ``UnCLIPDecoder`` glue (see :data:`TEXT_PROJ`)
* ``super_res_first`` / ``super_res_last`` → ``UnCLIPUpsampler.unet`` / ``.final_unet`` (no
  noise-level input)
* ``*_scheduler`` (UnCLIPScheduler) → ``diffusion``/``sampling`` settings with sampler ``unclip``
  and ``prior_clip_range``

Converted pipelines keep Karlo's conventions (raw, un-normalised CLIP embeddings; no clamping of the
upsampled low-res image) and sample with the ``unclip`` sampler using diffusers' default steps and
guidance, so ``pipe(prompts, generator=torch.Generator().manual_seed(s))`` reproduces diffusers'
images for the same seed (one generator is drawn from in the same order: prior, decoder, super-res).

Export writes exactly what diffusers' ``UnCLIPPipeline`` can express: one prior, a learned-variance
decoder whose text width equals the CLIP embedding size, and exactly ONE upsampling stage without
noise-level conditioning (``super_res_last`` is the upsampler's ``final_unet``, or a copy of its
``unet``). Anything else raises ``ValueError`` listing every part that cannot be expressed. Sampling
defaults (steps, guidance, ``best_of``, ``rerank_at``, ``rerank_contrast``) are not part of a
diffusers folder. The exported tokenizer cleans text like transformers' ``CLIPTokenizer`` (NFC, no
ftfy), which differs from open_clip's only for rare inputs (curly quotes, HTML entities, mojibake)
of natively trained pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from unclip._compat import package_getattr
from unclip.interop.diffusers_export import export_diffusers, export_problems
from unclip.interop.diffusers_import import TEXT_PROJ, load_diffusers_unclip
from unclip.interop.kandinsky import kandinsky_kind
from unclip.io.card import read_card_info
from unclip.io.hub import is_repo_id, resolve_folder
from unclip.pipeline.folders import BUNDLED, bundled_model_path
from unclip.pipeline.pipeline import UnCLIPPipeline

if TYPE_CHECKING:
    from unclip.pipeline.kandinsky import KandinskyPipeline

__all__ = ["load_diffusers_unclip", "export_diffusers", "export_problems", "convert", "TEXT_PROJ"]


def convert(
    src: Union[str, Path],
    dst: Union[str, Path],
    to: str = "unclip",
    overwrite: bool = False,
    *,
    revision: Optional[str] = None,
    cache_dir: Union[str, Path, None] = None,
    local_files_only: Optional[bool] = None,
    parts: Optional[Sequence[str]] = None,
) -> Union[UnCLIPPipeline, KandinskyPipeline]:
    """Convert the pipeline folder ``src`` into ``dst`` and return the converted pipeline.

    ``to="unclip"``: ``src`` is a diffusers/Karlo folder (with ``model_index.json``), ``dst``
    becomes a native unclip pipeline folder. ``to="diffusers"``: ``src`` is any folder
    ``UnCLIPPipeline.from_pretrained`` loads, ``dst`` becomes a diffusers ``UnCLIPPipeline``
    folder. ``src`` may also be a Hub repo id (``org/name``) of either kind, fetched at
    ``revision`` into ``cache_dir`` (:func:`unclip.io.hub.resolve_folder`), or the name of a bundled
    model (``"shapes"``). ``dst`` is created; it must be empty unless ``overwrite``. ``parts``
    (``to="diffusers"`` only): export only those parts (:func:`export_diffusers`). A Kandinsky
    2.2 decoder folder (or Hub id) is written in its native layout either way: diffusers'
    decoder layout with the prior (from its model card) in ``dst/prior``.
    """
    if to not in ("unclip", "diffusers"):
        raise ValueError(f"to must be 'unclip' or 'diffusers', got {to!r}")
    if parts is not None and to != "diffusers":
        raise ValueError("parts applies to to='diffusers' only")
    repo_id = str(src) if is_repo_id(str(src)) and not Path(src).is_dir() else None
    if str(src) in BUNDLED and not Path(src).is_dir():
        # the bundled model's name, as `generate` and `serve` take it
        src = bundled_model_path(str(src))
    src = resolve_folder(
        src,
        what="source",
        revision=revision,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
    )
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise ValueError(
            f"output {dst} exists and is not an empty folder; pass --overwrite to write into it"
        )
    if src.resolve() == dst.resolve():
        raise ValueError("source and output folders must differ")
    if kandinsky_kind(src) is not None:
        # Kandinsky 2.2: its native folder is diffusers' layouts (the decoder's with the prior in
        # prior/), the same either way
        if parts is not None:
            raise ValueError(
                "--parts applies to unCLIP pipelines; a Kandinsky folder is written whole"
            )
        from unclip.pipeline.kandinsky import KandinskyPipeline

        if kandinsky_kind(src) == "prior":
            raise ValueError(
                f"{src} is a Kandinsky 2.2 prior folder; convert the decoder folder (its prior is "
                "found from its model card, or sits in its prior/ subfolder)"
            )
        kandinsky = KandinskyPipeline.from_pretrained(src)
        kandinsky.save_pretrained(dst)
        return kandinsky
    if to == "diffusers":
        pipe = UnCLIPPipeline.from_pretrained(src)
        export_diffusers(pipe, dst, parts=parts)
        return pipe
    if not (src / "model_index.json").is_file():
        raise ValueError(
            f"{src} has no model_index.json, so it is not a diffusers/Karlo folder; to export a "
            f"native unclip folder use --to diffusers"
        )
    pipe = load_diffusers_unclip(src)
    # the converted folder's model card keeps the source card's license and names the source
    pipe.card_info = read_card_info(src)
    if repo_id is not None:
        pipe.card_info.setdefault("base_model", repo_id)
    pipe.save_pretrained(dst)
    return pipe


# names that moved out of this module keep their old import path, with a one-time FutureWarning
__getattr__ = package_getattr(__name__)
