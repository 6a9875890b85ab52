"""Read Kandinsky 2.2 folders as diffusers writes them (``save_pretrained`` of
``KandinskyV22PriorPipeline``, ``KandinskyV22Pipeline``, ``KandinskyV22Img2ImgPipeline``,
``KandinskyV22InpaintPipeline``; the layouts of ``kandinsky-community/kandinsky-2-2-prior``,
``-decoder`` and ``-decoder-inpaint``)::

    prior = read_kandinsky_prior("kandinsky-2-2-prior")    # {"prior", "clip", "prior_scheduler"}
    decoder = read_kandinsky_decoder("kandinsky-2-2-decoder")   # {"decoder", "scheduler"}

Component mapping (diffusers → unclip):

* prior folder: ``prior`` (``PriorTransformer``, with its ``clip_mean``/``clip_std``) as it is;
  ``text_encoder`` (``CLIPTextModelWithProjection``), ``tokenizer`` and ``image_encoder``
  (``CLIPVisionModelWithProjection``) → one :class:`~unclip.nets.clip.CLIP` (open_clip towers,
  :func:`~unclip.interop.clip.clip_from_transformers`), its ``image_processor`` checked against
  CLIP's preprocessing; ``scheduler`` (``UnCLIPScheduler``) as it is.
* decoder folder: ``unet`` (``UNet2DConditionModel`` with ``addition_embed_type="image"``; 9 input
  channels for inpainting) and ``movq`` (``VQModel``) → :class:`~unclip.nets.latent_decoder.
  LatentDecoder`; ``scheduler`` (``DDPMScheduler``, or any diffusers scheduler the folder names)
  as it is.

:func:`write_kandinsky_folder` writes the other way, diffusers' own layouts: the decoder's at the
folder's root and the prior's in its ``prior/`` subfolder, each loadable by diffusers as it is
(``KandinskyV22Pipeline.from_pretrained(folder)``,
``KandinskyV22PriorPipeline.from_pretrained(folder / "prior")``); ``KandinskyPipeline`` loads the
whole folder back.

Only safetensors weights are read. A folder of another pipeline, a missing or foreign component,
or widths that do not fit together are one-line ``ValueError``\\ s naming the component.
:func:`kandinsky_kind` tells a prior folder from a decoder folder; :func:`card_prior` reads the
prior a decoder folder's model card names, as diffusers' ``AutoPipelineForText2Image`` finds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union, cast

import diffusers
from diffusers.models import PriorTransformer, UNet2DConditionModel, VQModel
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from unclip.interop.clip import (
    clip_from_transformers,
    text_encoder_to_transformers,
    vision_state_to_transformers,
)
from unclip.io.weights import read_json, safe_model_from_pretrained
from unclip.nets.clip import CLIP
from unclip.nets.latent_decoder import LatentDecoder

__all__ = [
    "PRIOR_PIPELINES",
    "DECODER_PIPELINES",
    "kandinsky_kind",
    "read_kandinsky_prior",
    "read_kandinsky_decoder",
    "card_prior",
    "check_pair",
    "read_kandinsky_folder",
    "write_kandinsky_folder",
    "write_kandinsky_prior",
]

_TOKENIZERS = ("CLIPTokenizer", "CLIPTokenizerFast")
_PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPFeatureExtractor")
_ANY_SCHEDULER = ()  # any diffusers scheduler class

#: diffusers pipeline class → {component: accepted classes}
PRIOR_PIPELINES = {
    name: {
        "prior": ("PriorTransformer",),
        "text_encoder": ("CLIPTextModelWithProjection",),
        "tokenizer": _TOKENIZERS,
        "image_encoder": ("CLIPVisionModelWithProjection",),
        "image_processor": _PROCESSORS,
        "scheduler": _ANY_SCHEDULER,
    }
    for name in ("KandinskyV22PriorPipeline", "KandinskyV22PriorEmb2EmbPipeline")
}
DECODER_PIPELINES = {
    name: {"unet": ("UNet2DConditionModel",), "scheduler": _ANY_SCHEDULER, "movq": ("VQModel",)}
    for name in (
        "KandinskyV22Pipeline",
        "KandinskyV22Img2ImgPipeline",
        "KandinskyV22InpaintPipeline",
    )
}


def kandinsky_kind(folder: Union[str, Path]) -> Optional[str]:
    """``"prior"`` or ``"decoder"`` for a Kandinsky 2.2 folder (by the pipeline class its
    ``model_index.json`` names), else ``None``."""
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        return None
    name = read_json(index, "model_index.json").get("_class_name")
    if name in PRIOR_PIPELINES:
        return "prior"
    if name in DECODER_PIPELINES:
        return "decoder"
    return None


def _read_index(root: Path, layouts: dict[str, dict], what: str) -> dict[str, str]:
    """{component: class name} of ``root``'s ``model_index.json``, checked against ``layouts``."""
    if not root.is_dir():
        raise FileNotFoundError(f"Kandinsky 2.2 {what} folder not found: {root}")
    index = read_json(root / "model_index.json", "model_index.json")
    kind = index.get("_class_name")
    if kind not in layouts:
        raise ValueError(
            f"{root} is not a Kandinsky 2.2 {what} folder: model_index.json names {kind!r}; "
            f"expected {' or '.join(layouts)}"
        )
    layout = layouts[kind]
    classes = {}
    for name, entry in index.items():
        if name.startswith("_"):
            continue
        if name not in layout:
            raise ValueError(
                f"model_index.json of {root}: unexpected component {name!r} for {kind} "
                f"(expected {', '.join(layout)})"
            )
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2) or entry[1] is None:
            continue
        allowed = layout[name]
        if allowed and entry[1] not in allowed:
            raise ValueError(
                f"{name}: model_index.json of {root} gives class {entry[1]!r}; expected "
                f"{' or '.join(allowed)}"
            )
        classes[name] = str(entry[1])
    for name in layout:
        if name not in classes:
            raise ValueError(
                f"{name}: component is missing from model_index.json of {root} (a {kind} needs "
                f"{', '.join(layout)})"
            )
        if not (root / name).is_dir():
            raise ValueError(f"{name}: component folder {root / name} is missing")
    return classes


def _scheduler(root: Path, component: str, class_name: str):
    """The diffusers scheduler ``class_name`` built from ``root/component``'s config."""
    cls = getattr(diffusers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, SchedulerMixin)):
        raise ValueError(
            f"{component}: model_index.json names {class_name!r}, which is not a diffusers "
            "scheduler class"
        )
    config = read_json(root / component / "scheduler_config.json", component)
    return cast(Any, cls).from_config(config)


def _model(cls, root: Path, component: str, variant: Optional[str]):
    return safe_model_from_pretrained(
        cls.from_pretrained, root / component, component, variant=variant
    ).eval()


def read_kandinsky_prior(folder: Union[str, Path], variant: Optional[str] = None) -> dict[str, Any]:
    """The parts of a Kandinsky 2.2 prior folder: ``prior`` (``PriorTransformer``), ``clip``
    (:class:`~unclip.nets.clip.CLIP` with the text and image towers) and ``prior_scheduler``.
    ``variant``: read the ``*.<variant>.safetensors`` weights."""
    root = Path(folder)
    classes = _read_index(root, PRIOR_PIPELINES, "prior")
    processor = read_json(root / "image_processor" / "preprocessor_config.json", "image_processor")
    clip = clip_from_transformers(root, True, processor, variant)
    prior = _model(PriorTransformer, root, "prior", variant)
    cfg = prior.config
    # the states are projected from embedding_dim ("linear") or read at the transformer's width
    width = (
        cfg.embedding_dim
        if cfg.encoder_hid_proj_type == "linear"
        else cfg.num_attention_heads * cfg.attention_head_dim
    )
    checks = [
        ("num_embeddings", cfg.num_embeddings, clip.context_length, "the tokenizer's length"),
        (
            "embedding_proj_dim",
            cfg.embedding_proj_dim or cfg.embedding_dim,
            clip.embed_dim,
            "the text_encoder's projection_dim",
        ),
        ("embedding_dim", cfg.embedding_dim, clip.embed_dim, "the image_encoder's projection_dim"),
        (
            "embedding_dim" if cfg.encoder_hid_proj_type == "linear" else "inner width",
            width,
            clip.text_width,
            "the text_encoder's hidden_size",
        ),
    ]
    for key, got, want, what in checks:
        if int(got) != int(want):
            raise ValueError(f"prior: config {key} = {got} but {what} is {want}")
    return {
        "prior": prior.requires_grad_(False),
        "clip": clip,
        "prior_scheduler": _scheduler(root, "scheduler", classes["scheduler"]),
    }


def read_kandinsky_decoder(
    folder: Union[str, Path], variant: Optional[str] = None
) -> dict[str, Any]:
    """The parts of a Kandinsky 2.2 decoder folder (text-to-image, image-to-image or inpainting):
    ``decoder`` (:class:`~unclip.nets.latent_decoder.LatentDecoder`) and ``scheduler``.
    ``variant``: read the ``*.<variant>.safetensors`` weights."""
    root = Path(folder)
    classes = _read_index(root, DECODER_PIPELINES, "decoder")
    unet_cfg = read_json(root / "unet" / "config.json", "unet")
    for key, want in (("addition_embed_type", "image"), ("encoder_hid_dim_type", "image_proj")):
        if unet_cfg.get(key) != want:
            raise ValueError(
                f"unet: config {key} = {unet_cfg.get(key)!r}, but a Kandinsky 2.2 decoder is "
                f"conditioned on the image embedding ({key} = {want!r})"
            )
    unet = _model(UNet2DConditionModel, root, "unet", variant)
    movq = _model(VQModel, root, "movq", variant)
    decoder = LatentDecoder(unet, movq).requires_grad_(False)
    return {"decoder": decoder, "scheduler": _scheduler(root, "scheduler", classes["scheduler"])}


def check_pair(clip: CLIP, decoder: LatentDecoder) -> None:
    """A prior's CLIP and a decoder fit together when the decoder reads embeddings of the CLIP's
    width."""
    if clip.embed_dim != decoder.embed_dim:
        raise ValueError(
            f"the prior gives {clip.embed_dim}-wide image embeddings but the decoder's unet reads "
            f"{decoder.embed_dim} (encoder_hid_dim); pass the prior trained with this decoder"
        )


def card_prior(folder: Union[str, Path]) -> Optional[str]:
    """The prior a decoder folder's model card (``README.md``) names in its metadata (``prior:
    [kandinsky-community/kandinsky-2-2-prior]``), where diffusers' ``AutoPipelineForText2Image``
    looks for it; ``None`` when it names none."""
    readme = Path(folder) / "README.md"
    if not readme.is_file():
        return None
    from huggingface_hub import ModelCard

    prior = getattr(ModelCard.load(readme).data, "prior", None)
    if isinstance(prior, str):
        return prior
    if isinstance(prior, (list, tuple)) and prior and isinstance(prior[0], str):
        return prior[0]
    if prior is not None:
        raise ValueError(
            f"{readme}: the model card's prior entry {prior!r} is not a repo id or folder; write "
            "e.g. 'prior: [kandinsky-community/kandinsky-2-2-prior]'"
        )
    return None


def read_kandinsky_folder(folder: Union[str, Path], variant: Optional[str] = None) -> dict:
    """A Kandinsky 2.2 folder's parts for :class:`~unclip.pipeline.kandinsky.KandinskyPipeline`
    (the ``kandinsky`` entry point of ``unclip.pipeline_readers``): ``{"kind": "prior", "prior",
    "clip", "prior_scheduler"}`` or ``{"kind": "decoder", "decoder", "scheduler",
    "card_prior"}`` (the prior its model card names, or None)."""
    kind = kandinsky_kind(folder)
    if kind == "prior":
        return {"kind": "prior", **read_kandinsky_prior(folder, variant)}
    if kind == "decoder":
        parts = read_kandinsky_decoder(folder, variant)
        return {"kind": "decoder", **parts, "card_prior": card_prior(folder)}
    raise ValueError(
        f"{folder} is not a Kandinsky 2.2 folder: its model_index.json must name "
        f"{' or '.join([*PRIOR_PIPELINES, *DECODER_PIPELINES])}"
    )


def _vision_config(clip: CLIP) -> dict:
    """``CLIPVisionConfig`` kwargs for the open_clip image tower of ``clip`` (the inverse of
    :func:`~unclip.interop.clip.clip_model_cfg`'s reading)."""
    vc = clip.model_cfg["vision_cfg"]
    width = int(vc["width"])
    return dict(
        hidden_size=width,
        intermediate_size=int(width * float(vc.get("mlp_ratio", 4.0))),
        projection_dim=clip.embed_dim,
        num_hidden_layers=int(vc["layers"]),
        num_attention_heads=width // int(vc.get("head_width", 64)),
        image_size=int(vc["image_size"]),
        patch_size=int(vc["patch_size"]),
        num_channels=3,
        layer_norm_eps=1e-5,
        hidden_act="quick_gelu" if clip.model_cfg.get("quick_gelu") else "gelu",
    )


def _prior_pipeline(parts: dict):
    """diffusers' ``KandinskyV22PriorPipeline`` over a prior's parts (``prior``, ``clip`` with
    both towers, ``prior_scheduler``)."""
    from diffusers import KandinskyV22PriorPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    clip: CLIP = parts["clip"]
    if not clip.has_vision:
        raise ValueError("the prior's CLIP has no image tower; a Kandinsky prior folder needs one")
    text, tokenizer = text_encoder_to_transformers(clip)
    vision = CLIPVisionModelWithProjection(CLIPVisionConfig(**_vision_config(clip)))
    layers = int(clip.model_cfg["vision_cfg"]["layers"])
    weights = vision_state_to_transformers(clip.model.state_dict(), layers)
    missing, unexpected = vision.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if not k.endswith("position_ids")]:
        raise AssertionError(f"image_encoder export: missing {missing}, unexpected {unexpected}")
    size = int(clip.model_cfg["vision_cfg"]["image_size"])
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size=size)
    return KandinskyV22PriorPipeline(
        prior=parts["prior"],
        image_encoder=vision.eval(),
        text_encoder=text.eval(),
        tokenizer=tokenizer,
        scheduler=parts["prior_scheduler"],
        image_processor=processor,
    )


def write_kandinsky_folder(
    folder: Union[str, Path],
    decoder: LatentDecoder,
    scheduler,
    prior=None,
    clip: Optional[CLIP] = None,
    prior_scheduler=None,
) -> Path:
    """Write a Kandinsky pipeline's parts in diffusers' layouts (see the module doc): the
    decoder (``KandinskyV22Pipeline``, or ``KandinskyV22InpaintPipeline`` for an inpainting UNet)
    at ``folder``, the prior (when given) in ``folder / "prior"``; safetensors weights. The
    entry point ``kandinsky`` of ``unclip.pipeline_writers``."""
    from diffusers import KandinskyV22InpaintPipeline, KandinskyV22Pipeline

    root = Path(folder)
    cls = KandinskyV22InpaintPipeline if decoder.inpaint else KandinskyV22Pipeline
    pipe: Any = cls(unet=decoder.unet, scheduler=scheduler, movq=decoder.movq)
    pipe.save_pretrained(str(root), safe_serialization=True)
    if prior is not None:
        write_kandinsky_prior(root / "prior", prior, clip, prior_scheduler)
    return root


def write_kandinsky_prior(folder: Union[str, Path], prior, clip: Optional[CLIP], scheduler) -> Path:
    """Write a prior (``PriorTransformer``), its CLIP's text and image towers and its scheduler
    as diffusers' ``KandinskyV22PriorPipeline`` folder at ``folder``; safetensors weights."""
    if clip is None or scheduler is None:
        raise ValueError("a Kandinsky prior folder needs the prior's clip and scheduler too")
    parts = {"prior": prior, "clip": clip, "prior_scheduler": scheduler}
    _prior_pipeline(parts).save_pretrained(str(folder), safe_serialization=True)
    return Path(folder)
