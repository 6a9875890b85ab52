"""Export an :class:`~unclip.pipeline.pipeline.UnCLIPPipeline` as a diffusers ``UnCLIPPipeline``
folder, and list what of a pipeline diffusers cannot express (see :mod:`unclip.interop.diffusers`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

import torch

from unclip.diffusion.loop import make_scheduler
from unclip.interop.clip import text_encoder_to_transformers
from unclip.interop.diffusers_import import decoder_to_diffusers
from unclip.nets.ar_prior import UnCLIPARPrior
from unclip.pipeline.pipeline import UnCLIPPipeline

__all__ = ["export_diffusers", "export_problems", "export_report", "PARTS"]

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
    elif getattr(pipe.prior, "has_text_encoder", False):
        out.append(
            "prior: text_encoder=transformer (the prior's own caption transformer); diffusers' "
            "UnCLIPPipeline conditions the prior on CLIP token states"
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
    space = pipe.decoder.latent_space
    if space is not None:
        out.append(
            f"decoder: a latent decoder (over a frozen {space.kind}); "
            "diffusers' UnCLIPPipeline decoder samples pixels"
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


#: the parts of a diffusers UnCLIPPipeline, each with the component folders it is written as
PARTS = {
    "text_encoder": ("text_encoder", "tokenizer"),
    "prior": ("prior", "prior_scheduler"),
    "decoder": ("decoder", "text_proj", "decoder_scheduler"),
    "super_res": ("super_res_first", "super_res_last", "super_res_scheduler"),
}


def _part_of(problem: str) -> str:
    """The part of :data:`PARTS` an :func:`export_problems` line is about, or ``"pipeline"`` for
    a convention of the whole cascade (the weights of every part still export)."""
    head = problem.split(":", 1)[0]
    if head == "clip":
        return "pipeline" if "normalize_embeds" in problem else "text_encoder"
    return head if head in ("prior", "decoder") else "super_res"


def export_report(pipe: UnCLIPPipeline) -> dict[str, list[str]]:
    """``{part: problems}`` for every part of :data:`PARTS` the pipeline has, plus ``"pipeline"``
    (cascade-wide conventions); an empty list: that part exports to diffusers as it is."""
    report: dict[str, list[str]] = {"pipeline": []}
    report.update({part: [] for part in PARTS if part != "prior" or pipe.prior is not None})
    if not pipe.upsamplers:
        report.pop("super_res")
    for problem in export_problems(pipe):
        report.setdefault(_part_of(problem), []).append(problem)
    return report


def _summary(report: dict[str, list[str]]) -> str:
    ok = [part for part, problems in report.items() if part != "pipeline" and not problems]
    bad = [part for part, problems in report.items() if part != "pipeline" and problems]
    text = f"cannot export: {', '.join(bad) or 'none'}; exports as is: {', '.join(ok) or 'none'}"
    if ok:
        text += (
            f". The closest exportable subset is written by `unclip convert SRC DST --to diffusers "
            f"--parts {','.join(ok)}` (export_diffusers(pipe, dst, parts=[...])): diffusers "
            "model folders, not a runnable diffusers pipeline"
        )
    return text


def _components(pipe: UnCLIPPipeline, parts) -> dict:
    """The diffusers components of ``parts`` (names of :data:`PARTS`), by component name."""
    from diffusers.pipelines.deprecated.unclip.text_proj import UnCLIPTextProjModel

    def scheduler(stage, clip_range=1.0, learned=False):
        return make_scheduler(
            "unclip", pipe.diffusion[stage], clip_sample_range=clip_range, learned_variance=learned
        )

    out = {}
    if "text_encoder" in parts:
        out["text_encoder"], out["tokenizer"] = text_encoder_to_transformers(pipe.clip)
    if "prior" in parts:
        assert pipe.prior is not None  # export_problems refuses a pipeline without one
        out["prior"] = pipe.prior.transformer
        out["prior_scheduler"] = scheduler("prior", pipe.prior_clip_range)
    if "decoder" in parts:
        dec = pipe.decoder
        unet = dec.unet.config
        text_proj = UnCLIPTextProjModel(
            clip_extra_context_tokens=dec.config.num_image_tokens,
            clip_embeddings_dim=dec.config.embed_dim,
            time_embed_dim=unet.block_out_channels[0] * 4,
            cross_attention_dim=unet.cross_attention_dim,
        )
        state = decoder_to_diffusers(dec.state_dict())["text_proj"]
        text_proj.load_state_dict(state, strict=True)
        out.update(decoder=dec.unet, text_proj=text_proj.eval())
        out["decoder_scheduler"] = scheduler("decoder", learned=True)
    if "super_res" in parts:
        up = pipe.upsamplers[0]
        out["super_res_first"] = up.unet
        out["super_res_last"] = up.final_unet if up.final_unet is not None else up.unet
        out["super_res_scheduler"] = scheduler(pipe.upsampler_names[0])
    return out


def export_diffusers(
    pipe: UnCLIPPipeline, out_dir: Union[str, Path], parts: Optional[Sequence[str]] = None
) -> Path:
    """Write ``pipe`` as a diffusers ``UnCLIPPipeline`` folder (needs ``transformers``); returns
    ``out_dir``.

    Raises ``ValueError`` listing every part of ``pipe`` that diffusers cannot express (see module
    doc), which parts do export, and how to write those. ``parts`` (names of :data:`PARTS`):
    write only those parts, each as diffusers component folders (``prior/`` loads with
    ``PriorTransformer.from_pretrained``, ...) and no ``model_index.json``; the cascade-wide
    conventions they assume (e.g. L2-normalised CLIP embeddings) are listed in
    ``unclip_export.json``.
    """
    pipe._check_savable("export_diffusers")  # peft's layer names are not diffusers'
    report = export_report(pipe)
    out_dir = Path(out_dir)
    if parts is not None:
        parts = list(parts)
        unknown = [p for p in parts if p not in report or p == "pipeline"]
        if unknown or not parts:
            raise ValueError(
                f"parts must name some of {', '.join(p for p in report if p != 'pipeline')}; "
                f"got {parts}"
            )
        bad = [problem for p in parts for problem in report[p]]
        if bad:
            raise ValueError(
                "cannot export these parts to diffusers:\n  - "
                + "\n  - ".join(bad)
                + "\n"
                + _summary(report)
            )
        components = _components(pipe, parts)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, component in components.items():
            component.save_pretrained(str(out_dir / name))
        note = {
            "parts": parts,
            "components": list(components),
            "not_exported": [p for p in report if p not in parts and p != "pipeline"],
            "conventions": report["pipeline"],
        }
        (out_dir / "unclip_export.json").write_text(json.dumps(note, indent=2) + "\n")
        return out_dir
    problems = [problem for part_problems in report.values() for problem in part_problems]
    if problems:
        raise ValueError(
            "cannot export to a diffusers UnCLIPPipeline:\n  - "
            + "\n  - ".join(problems)
            + "\n"
            + _summary(report)
        )
    from diffusers.pipelines.deprecated.unclip.pipeline_unclip import (
        UnCLIPPipeline as DiffusersUnCLIPPipeline,
    )

    components = _components(pipe, list(PARTS))
    out = DiffusersUnCLIPPipeline(**components)
    out.save_pretrained(str(out_dir), safe_serialization=True)
    # diffusers >= 0.2x records text_proj as ("diffusers", ...) which its loader cannot resolve (the
    # class is not exported at top level); name its module, which diffusers resolves once its
    # UnCLIPPipeline is imported
    index_file = out_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    text_proj = components["text_proj"]
    index["text_proj"] = [type(text_proj).__module__, type(text_proj).__name__]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir
