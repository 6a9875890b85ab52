"""Import a diffusers ``UnCLIPPipeline`` (Karlo) or ``UnCLIPImageVariationPipeline`` folder as an
:class:`~unclip.pipeline.pipeline.UnCLIPPipeline`, and the weight-name mapping that export shares.

The component mapping and the conventions kept are described in :mod:`unclip.interop.diffusers`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional, Union

from diffusers.models import PriorTransformer, UNet2DConditionModel, UNet2DModel
from diffusers.schedulers.scheduling_unclip import UnCLIPScheduler

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import make_scheduler
from unclip.interop.clip import clip_from_transformers
from unclip.io.weights import check_state, load_weights, read_json
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior
from unclip.pipeline.pipeline import UnCLIPPipeline

__all__ = [
    "load_diffusers_unclip",
    "decoder_to_diffusers",
    "decoder_from_diffusers",
    "TEXT_PROJ",
    "LAYOUTS",
    "DIFFUSERS_SAMPLING",
]

# UnCLIPDecoder glue ↔ diffusers UnCLIPTextProjModel parameter prefixes
TEXT_PROJ = (
    ("null_image_embed", "learned_classifier_free_guidance_embeddings"),
    ("text_to_time.", "embedding_proj."),
    ("image_to_time.", "clip_image_embeddings_project_to_time_embeddings."),
    ("image_to_tokens.", "clip_extra_context_tokens_proj."),
    ("text_tokens_proj.", "encoder_hidden_states_proj."),
    ("text_tokens_norm.", "text_encoder_hidden_states_norm."),
)

_TOKENIZERS = ("CLIPTokenizer", "CLIPTokenizerFast")
_COMMON = {
    "decoder": ("UNet2DConditionModel",),
    "text_proj": ("UnCLIPTextProjModel",),
    "text_encoder": ("CLIPTextModelWithProjection",),
    "tokenizer": _TOKENIZERS,
    "super_res_first": ("UNet2DModel",),
    "super_res_last": ("UNet2DModel",),
    "decoder_scheduler": ("UnCLIPScheduler",),
    "super_res_scheduler": ("UnCLIPScheduler",),
}
_VISION = {
    "image_encoder": ("CLIPVisionModelWithProjection",),
    "feature_extractor": ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPFeatureExtractor"),
}
LAYOUTS = {  # class name → (required components, optional components)
    "UnCLIPPipeline": (
        {**_COMMON, "prior": ("PriorTransformer",), "prior_scheduler": ("UnCLIPScheduler",)},
        _VISION,
    ),
    "UnCLIPImageVariationPipeline": ({**_COMMON, **_VISION}, {}),
}
DIFFUSERS_SAMPLING = {
    "prior": (25, 4.0),
    "decoder": (25, 8.0),
    "upsampler": (7, 1.0),
}  # diffusers' defaults


# ========================================================================================== helpers
def _norm(v):
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    return v


def _with_defaults(cls, cfg: dict) -> dict:
    """``cfg`` completed with the ``__init__`` defaults of the diffusers class ``cls``."""
    params = inspect.signature(cls.__init__).parameters
    full = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    full.update({k: v for k, v in cfg.items() if not k.startswith("_")})
    return full


def _check_config(component: str, src: dict, built, what: str) -> None:
    """Every setting of the module unclip built must equal the source config's (defaults filled
    in)."""
    for key, value in built.items():
        if key.startswith("_") or key not in src:
            continue
        if _norm(src[key]) != _norm(value):
            raise ValueError(
                f"{component}: config {key} = {src[key]!r} cannot be expressed by {what} "
                f"(it needs {value!r})"
            )


def _square(component: str, size) -> int:
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise ValueError(f"{component}: non-square sample_size {size} is not supported")
        size = size[0]
    return int(size)


def decoder_to_diffusers(state: dict) -> dict[str, dict]:
    """``UnCLIPDecoder`` state → ``{"decoder": UNet2DConditionModel state, "text_proj":
    UnCLIPTextProjModel state}``."""
    out: dict[str, dict] = {"decoder": {}, "text_proj": {}}
    for key, value in state.items():
        if key.startswith("unet."):
            out["decoder"][key[5:]] = value
            continue
        for ours, theirs in TEXT_PROJ:
            if key.startswith(ours):
                out["text_proj"][theirs + key[len(ours) :]] = value
                break
        else:
            raise AssertionError(f"unmapped decoder weight {key}")
    return out


def decoder_from_diffusers(parts: dict[str, dict]) -> dict:
    state = {"unet." + k: v for k, v in parts["decoder"].items()}
    for key, value in parts["text_proj"].items():
        ours, theirs = next((o, t) for o, t in TEXT_PROJ if key.startswith(t))
        state[ours + key[len(theirs) :]] = value
    return state


def _load_parts(
    root: Path, expected: dict[str, dict], variant: Optional[str] = None
) -> dict[str, dict]:
    parts = {}
    for comp, exp in expected.items():
        got = load_weights(root / comp, comp, variant)
        check_state(comp, exp, got, root / comp)
        parts[comp] = got
    return parts


# =========================================================================================== import
def _read_index(root: Path) -> tuple[str, set]:
    index = read_json(root / "model_index.json", "model_index.json")
    kind = index.get("_class_name")
    if str(kind).startswith("KandinskyV22"):
        raise ValueError(
            f"{root} is a Kandinsky 2.2 folder ({kind}), another family: load the decoder folder "
            "with unclip.pipeline.auto.load_pipeline or KandinskyPipeline.from_pretrained "
            "(unclip.pipeline.kandinsky), giving the prior folder as prior="
        )
    if kind not in LAYOUTS:
        raise ValueError(
            f"{root} is not a diffusers unCLIP pipeline: model_index.json names {kind!r}; expected "
            f"UnCLIPPipeline (Karlo) or UnCLIPImageVariationPipeline"
        )
    required, optional = LAYOUTS[kind]
    present = set()
    for name, entry in index.items():
        if name.startswith("_"):
            continue
        if name not in required and name not in optional:
            raise ValueError(
                f"model_index.json: unexpected component {name!r} for {kind} (expected "
                f"{', '.join(sorted(required))})"
            )
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2) or entry[1] is None:
            continue
        allowed = {**required, **optional}[name]
        if entry[1] not in allowed:
            raise ValueError(
                f"{name}: model_index.json gives class {entry[1]!r}; expected "
                f"{' or '.join(allowed)}"
            )
        present.add(name)
    for name in required:
        if name not in present:
            raise ValueError(
                f"{name}: component is missing from model_index.json of {root} (a {kind} needs "
                f"{', '.join(sorted(required))})"
            )
    for name in present:
        if not (root / name).is_dir():
            raise ValueError(f"{name}: component folder {root / name} is missing")
    if ("image_encoder" in present) != ("feature_extractor" in present):
        raise ValueError("image_encoder and feature_extractor must come together")
    return kind, present


def _check_clip_widths(component: str, key: str, dim: int, clip, why: str) -> None:
    """``dim`` (the component's config ``key``) must be both the CLIP embedding size and the text
    width; ``why`` ends the message when the text width differs."""
    if dim != clip.embed_dim:
        raise ValueError(
            f"{component}: config {key} = {dim} but the text_encoder projection_dim is "
            f"{clip.embed_dim}"
        )
    if clip.text_width != dim:
        raise ValueError(
            f"{component}: config {key} = {dim} but the text_encoder hidden_size is "
            f"{clip.text_width}{why}"
        )


def _load_prior(root: Path, clip, variant: Optional[str] = None) -> UnCLIPPrior:
    cfg = _with_defaults(PriorTransformer, read_json(root / "prior" / "config.json", "prior"))
    dim, ctx = int(cfg["embedding_dim"]), int(cfg["num_embeddings"])
    why = "; diffusers' prior consumes the text states at the embedding width"
    _check_clip_widths("prior", "embedding_dim", dim, clip, why)
    if ctx != clip.context_length:
        raise ValueError(
            f"prior: config num_embeddings = {ctx} but the text context length is "
            f"{clip.context_length}"
        )
    prior = UnCLIPPrior(
        embed_dim=dim,
        text_width=clip.text_width,
        context_length=ctx,
        num_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        attention_head_dim=cfg["attention_head_dim"],
        dropout=cfg["dropout"],
    )
    _check_config("prior", cfg, prior.transformer.config, "UnCLIPPrior")
    parts = _load_parts(root, {"prior": prior.transformer.state_dict()}, variant)
    prior.transformer.load_state_dict(parts["prior"], strict=True)
    return prior


def _load_decoder(root: Path, clip, variant: Optional[str] = None) -> UnCLIPDecoder:
    cfg = _with_defaults(
        UNet2DConditionModel, read_json(root / "decoder" / "config.json", "decoder")
    )
    from diffusers.pipelines.deprecated.unclip.text_proj import UnCLIPTextProjModel

    tp = _with_defaults(
        UnCLIPTextProjModel, read_json(root / "text_proj" / "config.json", "text_proj")
    )
    dim = int(tp["clip_embeddings_dim"])
    why = f" (diffusers projects the text states with a {dim}-wide layer)"
    _check_clip_widths("text_proj", "clip_embeddings_dim", dim, clip, why)
    if cfg["out_channels"] not in (3, 6) or cfg["in_channels"] != 3:
        raise ValueError(
            f"decoder: config in_channels/out_channels = "
            f"{cfg['in_channels']}/{cfg['out_channels']}; expected 3/6 (learned variance) or 3/3"
        )
    kwargs = dict(
        embed_dim=dim,
        text_width=clip.text_width,
        sample_size=_square("decoder", cfg["sample_size"]),
        block_out_channels=tuple(cfg["block_out_channels"]),
        layers_per_block=cfg["layers_per_block"],
        down_block_types=tuple(cfg["down_block_types"]),
        up_block_types=tuple(cfg["up_block_types"]),
        mid_block_type=cfg["mid_block_type"],
        attention_head_dim=cfg["attention_head_dim"],
        num_image_tokens=int(tp["clip_extra_context_tokens"]),
        norm_num_groups=cfg["norm_num_groups"],
        cross_attention_dim=cfg["cross_attention_dim"],
        use_text_tokens=True,
        learned_variance=cfg["out_channels"] == 6,
    )
    try:
        decoder = UnCLIPDecoder(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"decoder: config cannot be built as an UnCLIPDecoder: {exc}") from exc
    _check_config("decoder", cfg, decoder.unet.config, "UnCLIPDecoder")
    unet = decoder.unet.config
    _check_config(
        "text_proj",
        tp,
        {
            "clip_extra_context_tokens": kwargs["num_image_tokens"],
            "clip_embeddings_dim": dim,
            "time_embed_dim": unet.block_out_channels[0] * 4,
            "cross_attention_dim": unet.cross_attention_dim,
        },
        "the decoder's glue",
    )
    parts = _load_parts(root, decoder_to_diffusers(decoder.state_dict()), variant)
    decoder.load_state_dict(decoder_from_diffusers(parts), strict=True)
    return decoder


def _load_upsampler(
    root: Path, decoder: UnCLIPDecoder, variant: Optional[str] = None
) -> UnCLIPUpsampler:
    first = _with_defaults(
        UNet2DModel, read_json(root / "super_res_first" / "config.json", "super_res_first")
    )
    last = _with_defaults(
        UNet2DModel, read_json(root / "super_res_last" / "config.json", "super_res_last")
    )
    kwargs = dict(
        sample_size=_square("super_res_first", first["sample_size"]),
        low_res_size=decoder.config.sample_size,
        block_out_channels=tuple(first["block_out_channels"]),
        layers_per_block=first["layers_per_block"],
        down_block_types=tuple(first["down_block_types"]),
        up_block_types=tuple(first["up_block_types"]),
        norm_num_groups=first["norm_num_groups"],
        noise_level_conditioning=False,
        noise_level=0,
        final_step_model=True,
        resnet_time_scale_shift=first["resnet_time_scale_shift"],
        add_attention=first["add_attention"],
        clamp_low_res=False,
    )
    if first["attention_head_dim"] is not None:  # None (one head per block) fails the check below
        kwargs["attention_head_dim"] = first["attention_head_dim"]
    try:
        up = UnCLIPUpsampler(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"super_res_first: config cannot be built as an UnCLIPUpsampler: {exc}"
        ) from exc
    _check_config("super_res_first", first, up.unet.config, "UnCLIPUpsampler")
    _check_config(
        "super_res_last",
        last,
        up.final_unet.config,
        "UnCLIPUpsampler (same architecture as super_res_first)",
    )
    parts = _load_parts(
        root,
        {"super_res_first": up.unet.state_dict(), "super_res_last": up.final_unet.state_dict()},
        variant,
    )
    up.unet.load_state_dict(parts["super_res_first"], strict=True)
    up.final_unet.load_state_dict(parts["super_res_last"], strict=True)
    return up


def _load_scheduler(root: Path, component: str, stage: str, learned: bool):
    """(DiffusionConfig, clip range) of a scheduler folder; the settings must be what
    ``make_scheduler`` builds."""
    folder = root / component
    file = folder / "scheduler_config.json"
    cfg = _with_defaults(UnCLIPScheduler, read_json(file, component))
    if (
        cfg["prediction_type"] not in ("epsilon", "sample")
        or cfg["beta_schedule"] != "squaredcos_cap_v2"
    ):
        raise ValueError(
            f"{component}: prediction_type {cfg['prediction_type']!r} / beta_schedule "
            f"{cfg['beta_schedule']!r} are not supported by UnCLIPScheduler"
        )
    diffusion = DiffusionConfig(
        num_train_timesteps=int(cfg["num_train_timesteps"]),
        beta_schedule="squaredcos_cap_v2",
        prediction_type=cfg["prediction_type"],
    )
    clip_range = (
        (float(cfg["clip_sample_range"]) if cfg["clip_sample"] else None)
        if stage == "prior"
        else 1.0
    )
    built = make_scheduler(
        "unclip", diffusion, clip_sample_range=clip_range, learned_variance=learned
    )
    _check_config(component, cfg, built.config, f"unclip's {stage} sampler")
    return diffusion, clip_range


def load_diffusers_unclip(path: Union[str, Path], variant: Optional[str] = None) -> UnCLIPPipeline:
    """A diffusers ``UnCLIPPipeline`` (Karlo) or ``UnCLIPImageVariationPipeline`` folder →
    :class:`UnCLIPPipeline` (``variant``: read the ``*.<variant>.safetensors`` weights).

    Raises ``ValueError`` naming the component (and config key or weight) when the folder is not an
    unCLIP pipeline, a component is missing or unexpected, or a config/weight cannot be expressed.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"diffusers pipeline folder not found: {root}")
    _, present = _read_index(root)
    vision = "image_encoder" in present
    fe = None
    if vision:
        fe_file = root / "feature_extractor" / "preprocessor_config.json"
        fe = read_json(fe_file, "feature_extractor")
    clip = clip_from_transformers(root, vision, fe, variant)
    prior = _load_prior(root, clip, variant) if "prior" in present else None
    decoder = _load_decoder(root, clip, variant)
    up = _load_upsampler(root, decoder, variant)
    sr = f"sr{up.config.sample_size}"
    diffusion, sampling, prior_range = {}, {}, None
    stages = [("decoder", "decoder_scheduler", "decoder"), (sr, "super_res_scheduler", "upsampler")]
    if prior is not None:
        stages.insert(0, ("prior", "prior_scheduler", "prior"))
    for stage, component, kind_ in stages:
        learned = kind_ == "decoder" and decoder.config.learned_variance
        diffusion[stage], clip_range = _load_scheduler(root, component, kind_, learned)
        if kind_ == "prior":
            prior_range = clip_range
        steps, scale = DIFFUSERS_SAMPLING[kind_]
        sampling[stage] = {"scheduler": "unclip", "steps": steps, "guidance_scale": scale}
    pipe = UnCLIPPipeline(
        clip,
        prior,
        decoder,
        [up],
        diffusion=diffusion,
        sampling=sampling,
        prior_clip_range=prior_range if prior is not None else 10.0,
    )
    for m in pipe.modules().values():
        m.eval().requires_grad_(False)
    return pipe
