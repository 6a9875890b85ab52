"""Kandinsky 2.2's prior: prompts → CLIP image embeddings, and the negative embeddings its decoder
guides away from, step for step as diffusers' ``KandinskyV22PriorPipeline`` computes them.

    image_embed, negative_embed = sample_prior_embeds(
        prior, scheduler, clip, ["a red cat"], num_inference_steps=25, guidance_scale=4.0,
        generator=torch.Generator().manual_seed(0))          # each [B·n, D]

``prior`` is diffusers' ``PriorTransformer`` (it predicts the clean embedding, normalised by its
``clip_mean``/``clip_std``), ``scheduler`` its ``UnCLIPScheduler`` (or another diffusers
scheduler), ``clip`` the :class:`~unclip.nets.clip.CLIP` holding the prior's text and image towers.
The conditioning is the CLIP text embedding ``[B, D]`` and the final-layer token states
``[B, L, W]`` under the attention mask of the real tokens (start token through the first end
token). Guidance runs for ``guidance_scale > 1`` against the empty prompt, or against
``negative_prompt``.

The negative image embedding, diffusers' rule: without a negative prompt it is the image tower's
embedding of an all-zero input (the CLIP of "no image"); with one, the negative prompts are sampled
in the same batch as the prompts (after them, guided against themselves, so unguided in effect)
and their embeddings are the negatives. The initial noise is then drawn for both halves at once.

``autocast_dtype`` runs the prior's calls under ``torch.autocast`` (``None``, the default: exact).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional, Union

import torch

from unclip.diffusion.loop import Generator, denoise_steps, initial_noise
from unclip.nets.clip import CLIP
from unclip.nets.text_encoding import TextEncoding
from unclip.sampling.latent import Callback, loop_guidance

__all__ = ["prior_text", "zero_image_embed", "sample_prior_embeds"]

Prompts = Union[str, Sequence[str]]


def _prompt_list(prompts: Prompts, name: str) -> list[str]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) for p in prompts):
        return list(prompts)
    raise TypeError(f"{name} must be a string or a non-empty list of strings, got {prompts!r}")


@torch.no_grad()
def prior_text(clip: CLIP, prompts: Sequence[str]) -> TextEncoding:
    """The prior's conditioning for ``prompts``: ``text_embed [B, D]`` (the projected pooled
    state), ``text_tokens [B, L, W]`` (final-layer states after the last layer norm) and
    ``text_mask [B, L]`` (True from the start token through the first end token: the tokenizer's
    attention mask, which ``CLIP.encode_text`` does not give for pad tokens that occur in a
    prompt)."""
    ids = clip.tokenize(list(prompts)).to(clip.device)
    enc = clip.encode_text(ids)
    # the end token is the vocabulary's largest id (CLIP pools there), so its first position is
    # the first maximum; padding (or repeated end tokens) comes after it
    last = ids.argmax(dim=-1)
    mask = torch.arange(ids.shape[1], device=ids.device)[None] <= last[:, None]
    return TextEncoding(enc.text_embed, enc.text_tokens, mask)


@torch.no_grad()
def zero_image_embed(clip: CLIP, batch: int) -> torch.Tensor:
    """``[batch, D]``: the image tower's embedding of an all-zero (already normalised) input, the
    negative image embedding of a prompt without a negative prompt."""
    if not clip.has_vision:
        raise ValueError(
            "the prior's CLIP has no image tower, which gives the negative image embedding; load "
            "the prior folder with its image_encoder/"
        )
    param = next(clip.model.visual.parameters())
    zeros = torch.zeros(1, 3, clip.image_size, clip.image_size, device=param.device)
    return clip.model.encode_image(zeros.to(param.dtype)).float().repeat(batch, 1)


def _repeat(enc: TextEncoding, n: int) -> TextEncoding:
    return enc._map(lambda x: x.repeat_interleave(n, dim=0))


@torch.no_grad()
def sample_prior_embeds(
    prior,
    scheduler,
    clip: CLIP,
    prompt: Prompts,
    negative_prompt: Optional[Prompts] = None,
    *,
    num_images_per_prompt: int = 1,
    num_inference_steps: int = 25,
    guidance_scale: float = 4.0,
    generator: Generator = None,
    latents: Optional[torch.Tensor] = None,
    progress: bool = True,
    callback: Callback = None,
    autocast_dtype: Optional[torch.dtype] = None,
    on_stage: Optional[Callable[[str], None]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image_embed, negative_image_embed)``, each ``[B·n, D]`` for ``B`` prompts and ``n =
    num_images_per_prompt`` (images of one prompt adjacent). ``negative_prompt``: one per prompt
    (a string for a single prompt). ``latents``: the initial noise ``[B·n, D]`` (``[2·B·n, D]``
    with a negative prompt: the negatives' rows after the prompts') instead of a draw from
    ``generator``. ``callback(i, t, x)`` as in :func:`~unclip.diffusion.loop.denoise_steps`.
    ``on_stage(name)`` is called before ``"clip"`` or ``"prior"`` runs (a pipeline's model
    offload brings that component in)."""
    prompts = _prompt_list(prompt, "prompt")
    negatives = (
        None if negative_prompt is None else _prompt_list(negative_prompt, "negative_prompt")
    )
    if negatives is not None and len(negatives) != len(prompts):
        raise ValueError(
            f"{len(negatives)} negative prompts for {len(prompts)} prompts; give one per prompt"
        )
    if (
        isinstance(num_images_per_prompt, bool)
        or not isinstance(num_images_per_prompt, int)
        or num_images_per_prompt < 1
    ):
        raise ValueError(
            f"num_images_per_prompt must be an integer >= 1, got {num_images_per_prompt!r}"
        )
    if (
        isinstance(num_inference_steps, bool)
        or not isinstance(num_inference_steps, int)
        or num_inference_steps < 1
    ):
        raise ValueError(
            f"num_inference_steps must be an integer >= 1, got {num_inference_steps!r}"
        )
    scale = loop_guidance(guidance_scale)
    n = num_images_per_prompt
    if (
        negatives is not None
        and isinstance(generator, (list, tuple))
        and len(generator) == len(prompts) * n
    ):
        # one generator per image: the negatives' rows draw from their prompts' generators
        generator = list(generator) * 2
    # diffusers samples the negative prompts beside the prompts, each guided against the negative
    rows = prompts + negatives if negatives is not None else prompts
    uncond_rows = 2 * negatives if negatives is not None else [""] * len(rows)
    stage = on_stage or (lambda name: None)
    stage("clip")
    text = _repeat(prior_text(clip, rows), n)
    if scale != 1:
        uncond = _repeat(prior_text(clip, uncond_rows), n)
        text = TextEncoding(*(torch.cat([u, c]) for u, c in zip(_fields(uncond), _fields(text))))
    b = len(rows) * n
    zero = zero_image_embed(clip, b) if negatives is None else None
    stage("prior")
    param = next(prior.parameters())
    device, dtype = param.device, param.dtype
    embed = text.text_embed.to(device, dtype)
    tokens = text.text_tokens.to(device, dtype)
    mask = text.text_mask.to(device)

    def denoise(x_in: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return prior(
            x_in,
            timestep=t,
            proj_embedding=embed,
            encoder_hidden_states=tokens,
            attention_mask=mask,
        ).predicted_image_embedding

    scheduler.set_timesteps(num_inference_steps, device=device)
    x = initial_noise((b, prior.config.embedding_dim), scheduler, generator, latents, device, dtype)
    x = denoise_steps(
        denoise,
        x,
        scheduler,
        guidance_scale=scale,
        generator=generator,
        progress=progress,
        desc="prior",
        callback=callback,
        autocast_dtype=autocast_dtype,
    )
    image_embed = prior.post_process_latents(x)
    if negatives is not None:
        image_embed, negative = image_embed.chunk(2)
        return image_embed, negative
    assert zero is not None
    return image_embed, zero.to(image_embed.device, image_embed.dtype)


def _fields(enc: TextEncoding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return enc.text_embed, enc.text_tokens, enc.text_mask
