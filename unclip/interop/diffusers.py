"""Karlo / diffusers unCLIP interop: import a diffusers ``UnCLIPPipeline`` folder, export to one.

    pipe = load_diffusers_unclip("karlo-v1-alpha")  # fp32, as diffusers computes it
    pipe = UnCLIPPipeline.from_pretrained("karlo-v1-alpha")  # the same, with the fast defaults
    export_diffusers(pipe, "out/karlo-diffusers")   # diffusers' UnCLIPPipeline loads it
    convert("karlo-v1-alpha", "karlo-unclip")       # both in one call, as `unclip convert` does

    unclip convert karlo-v1-alpha karlo-unclip            # diffusers/Karlo → native unclip folder
    unclip convert my-unclip my-diffusers --to diffusers  # native unclip → diffusers folder

Component mapping (diffusers → unclip):

* ``text_encoder`` (CLIPTextModelWithProjection) → open_clip text tower (:mod:`unclip.interop.clip`)
* ``tokenizer`` (CLIPTokenizer) → :class:`~unclip.clip.CompatTokenizer` (checked: same BPE)
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

import inspect
import json
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
from diffusers import PriorTransformer, UnCLIPScheduler, UNet2DConditionModel, UNet2DModel

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import make_scheduler
from unclip.interop.clip import (
    bpe_vocab,
    clip_from_transformers,
    text_config_to_transformers,
    text_state_to_transformers,
)
from unclip.io.card import read_card_info
from unclip.io.hub import is_repo_id, resolve_folder
from unclip.io.weights import check_state, load_weights, read_json
from unclip.nets.ar_prior import UnCLIPARPrior
from unclip.nets.clip_tokenizer import CompatTokenizer
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.sampling.settings import SamplingConfig

__all__ = ["load_diffusers_unclip", "export_diffusers", "export_problems", "convert", "TEXT_PROJ"]

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
    out = {"decoder": {}, "text_proj": {}}
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
        sampling[stage] = SamplingConfig(
            scheduler="unclip", steps=steps, guidance_scale=scale, best_of=1
        )
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


# =========================================================================================== export
_TEXT_CFG_DEFAULTS = {
    "ls_init_value": None,
    "embed_cls": False,
    "no_causal_mask": False,
    "final_ln_after_pool": False,
    "pool_type": "argmax",
    "proj_bias": False,
    "proj_type": "linear",
    "act_kwargs": None,
    "norm_kwargs": None,
    "block_type": None,
    "qk_norm": False,
    "scaled_cosine_attn": False,
    "scale_heads": False,
    "scale_attn_inner": False,
    "scale_attn": False,
    "scale_fc": False,
    "hf_model_name": None,
    "hf_tokenizer_name": None,
    "tokenizer_mode": None,
    "tokenizer_kwargs": None,
    "vocab_size": 49408,
}


def export_problems(pipe: UnCLIPPipeline) -> list[str]:
    """Everything in ``pipe`` that diffusers' ``UnCLIPPipeline`` cannot express (empty:
    exportable)."""
    from open_clip.model import CLIP as OpenCLIPModel
    from open_clip.tokenizer import SimpleTokenizer

    out = []
    clip = pipe.clip
    if not isinstance(clip.model, OpenCLIPModel) or not isinstance(clip.tokenizer, SimpleTokenizer):
        out.append(
            "clip: only open_clip CLIP text towers with the CLIP BPE tokenizer map onto "
            "transformers' CLIPTextModelWithProjection"
        )
    for key, default in _TEXT_CFG_DEFAULTS.items():
        value = clip.model_cfg.get("text_cfg", {}).get(key, default)
        if value != default:
            out.append(
                f"clip: text_cfg.{key} = {value!r} has no transformers CLIP equivalent (needs "
                f"{default!r})"
            )
    if clip.normalize_embeds:
        out.append(
            "clip: normalize_embeds=True (L2-normalised CLIP embeddings); diffusers' "
            "UnCLIPPipeline feeds the raw projected text embeddings to the prior and decoder, as "
            "Karlo does"
        )
    if pipe.prior is None:
        out.append("prior: the pipeline has no prior (diffusers' UnCLIPPipeline needs one)")
    elif isinstance(pipe.prior, UnCLIPARPrior):
        out.append(
            "prior: an autoregressive prior (prior.type: ar); diffusers' UnCLIPPipeline and Karlo "
            "have only the diffusion prior (PriorTransformer), so export a pipeline with a "
            "diffusion prior"
        )
    elif not isinstance(pipe.prior.text_token_proj, torch.nn.Identity):
        out.append(
            f"prior: text_token_proj projects the CLIP text width {clip.text_width} to the "
            f"embedding size {clip.embed_dim}; diffusers' PriorTransformer takes text states at "
            "the embedding size"
        )
    if pipe.prior is not None:
        pc = pipe.prior.config
        if getattr(pc, "normformer", False) or getattr(pc, "ff_activation", "gelu") != "gelu":
            out.append(
                f"prior: normformer={pc.normformer}, ff_activation={pc.ff_activation} (DALL-E "
                "Mega's transformer blocks); diffusers' PriorTransformer has "
                "BasicTransformerBlocks only (GELU feed-forward, no NormFormer norms or head "
                "scales)"
            )
    dc = pipe.decoder.config
    if dc.text_encoder != "clip":
        out.append(
            f"decoder: text_encoder={dc.text_encoder} (the decoder's own caption transformer); "
            "diffusers' UnCLIPPipeline conditions the decoder on CLIP token states"
        )
    elif not dc.use_text_tokens:
        out.append(
            "decoder: use_text_tokens=False; diffusers' text_proj always adds the caption token "
            "states"
        )
    elif dc.text_width != dc.embed_dim:
        out.append(
            f"decoder: text tokens are {dc.text_width} wide but the CLIP embedding is "
            f"{dc.embed_dim}; diffusers' UnCLIPTextProjModel projects text states of the embedding "
            "width"
        )
    if dc.coord_channels:
        out.append(
            "decoder: coord_channels=True (x/y coordinate input channels); diffusers' "
            "UnCLIPPipeline decoder takes the 3-channel image only"
        )
    if dc.embed_scale != 1.0:
        out.append(
            f"decoder: embed_scale={dc.embed_scale} (embeddings scaled before projection); "
            f"diffusers' UnCLIPTextProjModel projects them unscaled"
        )
    if not dc.learned_variance:
        out.append(
            "decoder: learned_variance=False; diffusers' UnCLIPPipeline splits the decoder output "
            "into mean and variance (out_channels=6, learned_range)"
        )
    if len(pipe.upsamplers) != 1:
        names = ", ".join(pipe.upsampler_names) or "none"
        out.append(
            f"upsamplers: diffusers' UnCLIPPipeline has exactly one upsampling stage "
            f"(super_res_first/super_res_last); this pipeline has {len(pipe.upsamplers)} ({names})"
        )
    for name, up in zip(pipe.upsampler_names, pipe.upsamplers):
        if up.config.noise_level_conditioning or up.config.noise_level:
            out.append(
                f"{name}: noise-level conditioning (noise_level_conditioning / noise_level) does "
                f"not exist in diffusers' super-res UNets"
            )
        if up.config.clamp_low_res:
            out.append(
                f"{name}: clamp_low_res=True; diffusers does not clamp the bicubic-upsampled "
                "low-res image"
            )
    for stage, d in pipe.diffusion.items():
        if d.beta_schedule != "squaredcos_cap_v2" or d.prediction_type not in ("epsilon", "sample"):
            out.append(
                f"{stage}: {d.beta_schedule} / {d.prediction_type} cannot be sampled by "
                f"UnCLIPScheduler (squaredcos_cap_v2 with epsilon or sample prediction only)"
            )
    return out


def export_diffusers(pipe: UnCLIPPipeline, out_dir: Union[str, Path]) -> Path:
    """Write ``pipe`` as a diffusers ``UnCLIPPipeline`` folder (needs ``transformers``); returns
    ``out_dir``.

    Raises ``ValueError`` listing every part of ``pipe`` that diffusers cannot express (see module
    doc).
    """
    pipe._refuse_unmerged_lora("export_diffusers")  # peft's layer names are not diffusers'
    problems = export_problems(pipe)
    if problems:
        raise ValueError(
            "cannot export to a diffusers UnCLIPPipeline:\n  - " + "\n  - ".join(problems)
        )
    try:
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer
    except ImportError as exc:
        raise ImportError(
            "exporting to diffusers needs transformers: pip install transformers"
        ) from exc
    from diffusers import UnCLIPPipeline as DiffusersUnCLIPPipeline
    from diffusers.pipelines.deprecated.unclip.text_proj import UnCLIPTextProjModel

    clip, dec, up = pipe.clip, pipe.decoder, pipe.upsamplers[0]
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**text_config_to_transformers(clip)))
    text_state = text_state_to_transformers(
        clip.model.state_dict(), int(clip.model_cfg["text_cfg"].get("layers", 12))
    )
    missing, unexpected = text_encoder.load_state_dict(text_state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("position_ids")]:
        raise AssertionError(f"text encoder export: missing {missing}, unexpected {unexpected}")
    pad = (
        clip.tokenizer.pad_token if isinstance(clip.tokenizer, CompatTokenizer) else "<|endoftext|>"
    )
    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges = bpe_vocab()
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab))
        (Path(tmp) / "merges.txt").write_text(
            "#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8"
        )
        tokenizer = CLIPTokenizer.from_pretrained(
            tmp, pad_token=pad, model_max_length=clip.context_length
        )
    unet = dec.unet.config
    text_proj = UnCLIPTextProjModel(
        clip_extra_context_tokens=dec.config.num_image_tokens,
        clip_embeddings_dim=dec.config.embed_dim,
        time_embed_dim=unet.block_out_channels[0] * 4,
        cross_attention_dim=unet.cross_attention_dim,
    )
    text_proj.load_state_dict(decoder_to_diffusers(dec.state_dict())["text_proj"], strict=True)
    sr = pipe.upsampler_names[0]

    def scheduler(stage, clip_range=1.0, learned=False):
        return make_scheduler(
            "unclip", pipe.diffusion[stage], clip_sample_range=clip_range, learned_variance=learned
        )

    out = DiffusersUnCLIPPipeline(
        prior=pipe.prior.transformer,
        decoder=dec.unet,
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        text_proj=text_proj.eval(),
        super_res_first=up.unet,
        super_res_last=up.final_unet if up.final_unet is not None else up.unet,
        prior_scheduler=scheduler("prior", pipe.prior_clip_range),
        decoder_scheduler=scheduler("decoder", learned=True),
        super_res_scheduler=scheduler(sr),
    )
    out_dir = Path(out_dir)
    out.save_pretrained(str(out_dir), safe_serialization=True)
    # diffusers >= 0.2x records text_proj as ("diffusers", ...) which its loader cannot resolve (the
    # class is not exported at top level); name its module, which diffusers resolves once its
    # UnCLIPPipeline is imported
    index_file = out_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    index["text_proj"] = [type(text_proj).__module__, type(text_proj).__name__]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir


# ========================================================================================== convert
def convert(
    src: Union[str, Path],
    dst: Union[str, Path],
    to: str = "unclip",
    overwrite: bool = False,
    *,
    revision: Optional[str] = None,
    cache_dir: Union[str, Path, None] = None,
    local_files_only: Optional[bool] = None,
) -> UnCLIPPipeline:
    """Convert the pipeline folder ``src`` into ``dst`` and return the converted pipeline.

    ``to="unclip"``: ``src`` is a diffusers/Karlo folder (with ``model_index.json``), ``dst``
    becomes a native unclip pipeline folder. ``to="diffusers"``: ``src`` is any folder
    ``UnCLIPPipeline.from_pretrained`` loads, ``dst`` becomes a diffusers ``UnCLIPPipeline``
    folder. ``src`` may also be a Hub repo id (``org/name``) of either kind, fetched at
    ``revision`` into ``cache_dir`` (:func:`unclip.hub.resolve_folder`). ``dst`` is created; it
    must be empty unless ``overwrite``.
    """
    if to not in ("unclip", "diffusers"):
        raise ValueError(f"to must be 'unclip' or 'diffusers', got {to!r}")
    hub = {"revision": revision, "cache_dir": cache_dir, "local_files_only": local_files_only}
    repo_id = str(src) if is_repo_id(str(src)) and not Path(src).is_dir() else None
    src, dst = resolve_folder(src, what="source", **hub), Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise ValueError(
            f"output {dst} exists and is not an empty folder; pass --overwrite to write into it"
        )
    if src.resolve() == dst.resolve():
        raise ValueError("source and output folders must differ")
    if to == "diffusers":
        pipe = UnCLIPPipeline.from_pretrained(src)
        export_diffusers(pipe, dst)
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
