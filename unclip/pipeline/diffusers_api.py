"""diffusers' call and loading keywords, as a pipeline family checks and maps them.

A pipeline is not a :class:`diffusers.DiffusionPipeline`: that class loads and saves
``model_index.json`` folders whose components are diffusers, transformers or library classes
registered by name, while an unclip folder holds its own component types (an open_clip CLIP, an
autoregressive prior, upsamplers of any number) and sampling defaults per stage. Instead the
pipeline answers what a diffusers user types: the flat keywords of diffusers' ``UnCLIPPipeline``
(:func:`flat_sampling`), ``callback_on_step_end_tensor_inputs``, the initial latents and
``from_pretrained``'s keywords, checked here; ``return_dict``, ``components``,
``set_progress_bar_config``, ``from_pipe`` and the offload methods are the pipeline base's
(:mod:`unclip.pipeline.base`). diffusers folders load through ``from_pretrained`` as they are
(:mod:`unclip.interop`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Optional, Union

import torch

#: diffusers' UnCLIPPipeline keywords → (stage key of ``sampling=``, setting)
FLAT_KEYWORDS = {
    "prior_num_inference_steps": ("prior", "steps"),
    "decoder_num_inference_steps": ("decoder", "steps"),
    "super_res_num_inference_steps": ("upsampler", "steps"),
    "prior_guidance_scale": ("prior", "guidance_scale"),
    "decoder_guidance_scale": ("decoder", "guidance_scale"),
}

#: the tensors a step callback can be given (``callback_on_step_end_tensor_inputs``)
CALLBACK_TENSOR_INPUTS = ("latents",)


def flat_sampling(sampling: Optional[Mapping], **flat) -> Optional[Mapping]:
    """``sampling`` with diffusers' flat keywords (:data:`FLAT_KEYWORDS`; None: not given) folded
    in. A setting given both ways with two values is a ``ValueError``."""
    given = {k: v for k, v in flat.items() if v is not None}
    if not given:
        return sampling  # checked where it is resolved (a wrong type is a TypeError there)
    if sampling is not None and not isinstance(sampling, Mapping):
        raise TypeError(
            f"sampling must be a dict {{stage: {{setting: value}}}}, got {type(sampling).__name__}"
        )
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (sampling or {}).items()}
    for keyword, value in given.items():
        stage, setting = FLAT_KEYWORDS[keyword]
        values = out.setdefault(stage, {})
        if not isinstance(values, dict):  # a settings object: its fields as a dict
            values = out[stage] = {k: getattr(values, k) for k in vars(values)}
        if setting in values and values[setting] != value:
            raise ValueError(
                f"{keyword}={value!r} and sampling[{stage!r}][{setting!r}]={values[setting]!r} "
                "disagree; give one of them"
            )
        values[setting] = value
    return out


def check_callback_inputs(names: Sequence[str]) -> None:
    if isinstance(names, str) or any(n not in CALLBACK_TENSOR_INPUTS for n in names):
        raise ValueError(
            f"callback_on_step_end_tensor_inputs: the step callback can be given "
            f"{list(CALLBACK_TENSOR_INPUTS)} (each stage's x_t), got {names!r}"
        )


def check_latents_fit(latents: dict, groups: dict, settings: dict, embeds_given: bool) -> None:
    """diffusers' ``*_latents`` are one row of noise per output image: they need one decoder
    candidate per image (and one prior candidate), which is what diffusers samples."""
    if any(k != 1 for k in groups):
        counts = ", ".join(str(k) for k in groups)
        raise ValueError(
            f"prior_latents / decoder_latents / super_res_latents: one row of noise per image "
            f"needs one decoder candidate per image, but the decoder draws {counts}; pass "
            "sampling={'decoder': {'best_of': 1}} (or decoder's noise through the candidates' "
            "generators instead)"
        )
    if "prior" in latents:
        if embeds_given:
            raise ValueError("prior_latents with image_embeds: the prior does not run")
        if settings["prior"].best_of != 1:
            raise ValueError(
                f"prior_latents: one row of noise per image needs the prior's best_of 1, got "
                f"{settings['prior'].best_of}; pass sampling={{'prior': {{'best_of': 1}}}}"
            )


def check_from_pretrained_options(
    token: Union[str, bool, None],
    use_safetensors: Optional[bool],
    low_cpu_mem_usage: Optional[bool],
    device_map: Union[str, torch.device, None],
) -> tuple[dict, Optional[torch.device]]:
    """diffusers' ``from_pretrained`` keywords as ``(hub options, device to move to)``."""
    if use_safetensors is False:
        raise ValueError(
            "use_safetensors=False: unclip loads safetensors weights only (pickles can run code); "
            "convert the weights, or leave use_safetensors at its default"
        )
    if low_cpu_mem_usage is not None and not isinstance(low_cpu_mem_usage, bool):
        raise TypeError(f"low_cpu_mem_usage must be a bool, got {low_cpu_mem_usage!r}")
    device = None
    if device_map is not None:
        if isinstance(device_map, Mapping) or device_map in ("auto", "balanced"):
            raise ValueError(
                f"device_map={device_map!r}: a pipeline is placed whole on one device "
                "(device_map='cuda', 'cpu', ...), or per stage while it runs with "
                "enable_model_cpu_offload()"
            )
        device = torch.device(device_map)
    hub = {} if token is None else {"token": token}
    if isinstance(token, (str, os.PathLike)) and not str(token):
        raise ValueError("token: an empty string; pass a Hugging Face token or leave it out")
    return hub, device
