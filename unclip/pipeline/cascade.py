"""The unCLIP cascade's components and its stages: text → CLIP text encoding → prior → image
embedding → decoder (with its candidates) → upsamplers.

:class:`UnCLIPCascade` holds the components and the stage methods every other way of sampling
composes from (``encode_text``, ``sample_image_embeds``, ``decode``, the base's ``upsample``,
``rerank``, and one group of prompts through every stage). It stands on the pipeline base
(:class:`~unclip.pipeline.base.BasePipeline`: devices, autocast, offload, settings, folders) with
the LoRA and attention-memory capabilities. The edits (:mod:`unclip.pipeline.editing`) and the
folder readers (:mod:`unclip.pipeline.loading`) take a cascade; :class:`~unclip.pipeline.pipeline.
UnCLIPPipeline`, the class users build and load, adds the text-to-image call, the edits as
methods and ``from_pretrained`` on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import torch

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import Generator
from unclip.nets.clip import CLIP
from unclip.nets.decoder import Caption, UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior
from unclip.nets.priors import prior_type
from unclip.nets.text_encoding import TextEncoding, check_prompts
from unclip.pipeline.base import BasePipeline, ResolvedSampling
from unclip.pipeline.batching import negatives_per_row
from unclip.pipeline.lora import LoraMixin
from unclip.pipeline.memory import MemoryMixin
from unclip.sampling.candidates import (
    rerank_candidates,
    sample_decoder_candidates,
)
from unclip.sampling.scorers import image_text_cosines
from unclip.sampling.settings import (
    ARPriorSampling,
    DecoderSampling,
    PriorSampling,
    resolve_sampling,
    stage_settings,
)
from unclip.sampling.stages import (
    StepCallback,
    sample_decoder,
    sample_prior,
    stage_callback,
)
from unclip.sampling.utils import (
    check_components,
    check_count,
    check_embeds,
    expand_generator,
)
from unclip.utils.offload import releases_gpu

__all__ = ["UnCLIPCascade", "DecoderInputs"]

#: the leading arguments of the decoder's samplers: decoder, image_embed, text, null text, settings,
#: diffusion
DecoderInputs = tuple[
    UnCLIPDecoder, torch.Tensor, Caption, Callable[[int], Caption], DecoderSampling, DiffusionConfig
]


class UnCLIPCascade(LoraMixin, MemoryMixin, BasePipeline):
    """The unCLIP cascade's components and stages (see the module doc); the pipeline users build
    is its subclass :class:`~unclip.pipeline.pipeline.UnCLIPPipeline`."""

    family = "unclip"

    def __init__(
        self,
        clip: CLIP,
        prior: Optional[UnCLIPPrior],
        decoder: UnCLIPDecoder,
        upsamplers: Sequence[UnCLIPUpsampler] = (),
        diffusion: Optional[dict] = None,
        sampling: Optional[dict] = None,
        prior_clip_range: Optional[float] = 10.0,
        reranker: Optional[CLIP] = None,
    ):
        self._init_base()
        self.clip = clip
        if reranker is not None and not isinstance(reranker, CLIP):
            raise TypeError(f"reranker must be a CLIP (or None), got {type(reranker).__name__}")
        # a CLIP used only to score decoder candidates (rerank); None: the conditioning CLIP scores
        # them
        self.reranker = reranker
        # the prior sampler clips predicted x_0 (normalised embedding) to [-r, r]; None disables
        # (Karlo: 5)
        self.prior_clip_range = None if prior_clip_range is None else float(prior_clip_range)
        self.prior = prior
        self.decoder = decoder
        self.upsamplers = list(upsamplers)
        self.diffusion: dict[str, DiffusionConfig]
        self.sampling: dict[str, Any]
        self.diffusion, self.sampling = stage_settings(
            self.stage_names, diffusion, sampling, ar_stages=self._ar_stages()
        )
        check_components(
            clip, prior, decoder, dict(zip(self.upsampler_names, self.upsamplers)), reranker
        )
        for m in self.modules().values():
            m.eval()
        self._null_text: Optional[TextEncoding] = None

    # ------------------------------------------------------------------ structure
    @property
    def stage_names(self) -> list[str]:
        return (["prior"] if self.prior is not None else []) + ["decoder"] + self.upsampler_names

    @property
    def resolution(self) -> int:
        """Side of the final images."""
        return (
            self.upsamplers[-1].config.sample_size
            if self.upsamplers
            else self.decoder.config.sample_size
        )

    def modules(self) -> dict[str, torch.nn.Module]:
        mods = {"clip": self.clip, "decoder": self.decoder}
        if self.prior is not None:
            mods["prior"] = self.prior
        mods.update(zip(self.upsampler_names, self.upsamplers))
        if self.reranker is not None:
            mods["reranker"] = self.reranker
        return mods

    @property
    def rerank_clip(self) -> CLIP:
        """The CLIP that scores decoder candidates in :meth:`rerank`: the ``reranker`` component if
        the pipeline has one, else the conditioning CLIP (``clip``)."""
        return self.reranker if self.reranker is not None else self.clip

    # ------------------------------------------------------------------ settings
    def sampling_settings(self, sampling: Optional[Mapping] = None) -> ResolvedSampling:
        """The settings every stage samples with: ``{stage: settings}`` for :attr:`stage_names`
        (:class:`~unclip.sampling.settings.PriorSampling` or ``ARPriorSampling``,
        ``DecoderSampling``, ``UpsamplerSampling``).

        ``sampling``: overrides ``{key: {setting: value}}``; a key is a stage name or
        ``"upsampler"`` (every upsampler; an upsampler's own key wins), a setting one the stage
        has. A value may also be a settings object. ``"prior"`` and ``"upsampler"`` may be given
        for a pipeline without that stage (they are checked, then unused). Unknown keys or fields
        and invalid values are a ``ValueError`` naming them; the result is a copy (changing it
        changes nothing)."""
        if isinstance(sampling, ResolvedSampling):
            return sampling
        return ResolvedSampling(
            resolve_sampling(
                {name: self.sampling[name] for name in self.stage_names},
                sampling,
                ar_stages=self._ar_stages(),
            )
        )

    def _ar_stages(self) -> tuple[str, ...]:
        return ("prior",) if self.prior is not None and prior_type(self.prior) == "ar" else ()

    # ------------------------------------------------------------------ the base's hooks
    def _anchor(self) -> torch.nn.Module:
        return self.decoder

    def _init_kwargs(self) -> dict[str, Any]:
        return {
            "clip": self.clip,
            "prior": self.prior,
            "decoder": self.decoder,
            "upsamplers": list(self.upsamplers),
            "diffusion": dict(self.diffusion),
            "sampling": dict(self.sampling),
            "prior_clip_range": self.prior_clip_range,
            "reranker": self.reranker,
        }

    def _image_networks(self) -> list[torch.nn.Module]:
        return [self.decoder, *self.upsamplers]

    def denoisers(self) -> dict[str, torch.nn.Module]:
        """The networks of every sampling step (prior transformer, decoder UNet, upsampler UNets),
        which the speed and memory options act on. The prior's sampler runs its transformer's
        blocks itself, over the text positions once and three positions per step
        (:meth:`~unclip.nets.prior.UnCLIPPrior.conditioned`), unless the transformer is
        compiled."""
        nets = {}
        if self.prior is not None:
            nets["prior"] = self.prior.transformer
        nets["decoder"] = self.decoder.unet
        for name, up in zip(self.upsampler_names, self.upsamplers):
            nets[name] = up.unet
            if up.final_unet is not None:
                nets[f"{name}.final"] = up.final_unet
        return nets

    def _forget_device_state(self) -> None:
        self._null_text = None  # encoded on the device the CLIP was on

    def _prepare_stage(self, name: str) -> None:
        if name in ("prior", "decoder") and self._null_text is None:
            # guidance encodes the empty caption lazily, mid-stage: encode it now, so the CLIP
            # does not swap in and out of the stage under model offload
            self.null_text(1)

    # ------------------------------------------------------------------ stages
    def encode_text(self, prompt: Union[str, Sequence[str]]) -> TextEncoding:
        """Prompts → :class:`TextEncoding` (``text_embed [B,D]``, ``text_tokens [B,L,W]``,
        ``text_mask [B,L]``, and ``caption_ids`` when the prior has its own caption
        transformer)."""
        prompts = check_prompts(prompt)
        return self._with_prior_ids(self.clip.encode_text(prompts), prompts)

    def _with_prior_ids(self, text: TextEncoding, prompts: list[str]) -> TextEncoding:
        """``text`` carrying the prior's caption token ids when the prior encodes captions itself
        (``prior.text_encoder: transformer``); unchanged otherwise."""
        if self.prior is None or not getattr(self.prior, "has_text_encoder", False):
            return text
        return text.with_caption_ids(self.prior.tokenize(prompts))

    def null_text(self, batch: int) -> TextEncoding:
        """The unconditional caption (CLIP encoding of ``""``) repeated ``batch`` times."""
        if self._null_text is None:
            self._null_text = self.encode_text([""])
        return self._null_text.repeat_interleave(batch)

    def _as_text(self, text) -> TextEncoding:
        return text if isinstance(text, TextEncoding) else self.encode_text(text)

    def _encode_each(self, captions: Sequence[str]) -> TextEncoding:
        """Each distinct caption encoded on its own, so that the empty caption as a negative
        prompt is bit for bit the usual unconditional input (a batch's rows can differ in the last
        bits from the same caption encoded alone)."""
        enc = {c: self.encode_text([c]) for c in dict.fromkeys(captions)}
        return TextEncoding.cat([enc[c] for c in captions])

    def _unconditional(self, negative, rows: int, what: str = "rows"):
        """The unconditional input of guidance for ``rows`` conditioned rows: the empty caption
        (``negative=None``), or the encoded ``negative`` prompts (:func:`negatives_per_row`) in its
        place, as a callable of the batch size (each row repeated to fill it, as the samplers
        repeat the conditioned rows)."""
        if negative is None:
            return self.null_text
        neg = self._encode_each(negatives_per_row(negative, rows, what))
        return lambda batch: neg.repeat_interleave(batch // rows)

    def _decoder_captions(self, text, b: int):
        """The decoder's caption input for ``b`` images and its unconditional one (a callable of
        the batch size): CLIP encodings, or token ids for a decoder with its own text encoder."""
        if self.decoder.has_text_encoder:
            return self.decoder.caption_ids(text, b), self.decoder.null_caption
        return (self.null_text(b) if text is None else self._as_text(text)), self.null_text

    def _decoder_negative(self, negative, b: int):
        if not self.decoder.has_text_encoder:
            return self._unconditional(negative, b, "images")
        ids = self.decoder.caption_ids(negatives_per_row(negative, b, "images"), b)
        return lambda batch: ids.repeat_interleave(batch // b, dim=0)

    @releases_gpu
    @torch.no_grad()
    def sample_image_embeds(
        self,
        text,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        sampling: Optional[dict] = None,
        latents: Optional[torch.Tensor] = None,
        return_candidates: bool = False,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
        negative_prompt=None,
    ):
        """Prior: prompts or a :class:`TextEncoding` ``[B]`` → CLIP image embeddings ``[B·n, D]``.

        With ``best_of = N > 1`` it samples N candidates per image and keeps the one with the
        highest dot product with the text embedding (paper §2.2). ``return_candidates`` also returns
        the candidates ``[B·n, N, D]``. ``callback_on_step_end``: see :meth:`__call__`.
        ``negative_prompt``: a caption (one for all, or one per row of ``text``) that takes the
        empty caption's place in classifier-free guidance, steering away from it.
        """
        if self.prior is None:
            raise ValueError(
                "this pipeline has no prior; pass image embeddings (pipe(..., image_embeds=...) or "
                "decode()) instead"
            )
        s = self._stage_settings("prior", sampling)
        assert isinstance(s, (PriorSampling, ARPriorSampling))
        progress = self._progress(progress)
        text = self._as_text(text)
        n = check_count(num_images_per_prompt)
        uncond = self._unconditional(negative_prompt, len(text))
        self._onload("prior")
        best, cands = sample_prior(
            self.prior,
            text.repeat_interleave(n),
            uncond,
            s,
            self.diffusion["prior"],
            generator=expand_generator(generator, len(text), n * s.best_of, "sample_image_embeds"),
            clip_range=self.prior_clip_range,
            latents=latents,
            progress=progress,
            autocast_dtype=self.autocast_dtype,
            callback=stage_callback(self, "prior", callback_on_step_end),
        )
        return (best, cands) if return_candidates else best

    @releases_gpu
    @torch.no_grad()
    def decode(
        self,
        image_embed: torch.Tensor,
        text=None,
        generator: Generator = None,
        sampling: Optional[dict] = None,
        latents: Optional[torch.Tensor] = None,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
        negative_prompt=None,
    ) -> torch.Tensor:
        """Decoder: ``image_embed [B, D]`` (+ optional captions/TextEncoding with B rows) →
        ``[B, 3, s, s]`` in [-1, 1] at the decoder's resolution. Without text the empty caption is
        used. A decoder with its own text encoder takes the captions as strings (or its token
        ids), not a CLIP TextEncoding. ``negative_prompt`` (one caption, or one per image) takes
        the empty caption's place in the unconditional branch of guidance (whose image embedding
        stays the learned null one)."""
        return sample_decoder(
            *self._decoder_inputs(image_embed, text, sampling, negative_prompt),
            **self._decoder_run(generator, self._progress(progress), callback_on_step_end),
            latents=latents,
        )

    def _decoder_inputs(self, image_embed, text, sampling, negative_prompt) -> DecoderInputs:
        """The leading arguments of :func:`~unclip.sampling.sample_decoder` (and of
        :func:`~unclip.sampling.sample_decoder_reranked`) for :meth:`decode`'s inputs, checked,
        with the decoder brought in."""
        s = self._stage_settings("decoder", sampling)
        assert isinstance(s, DecoderSampling)
        image_embed = check_embeds(image_embed, self.clip.embed_dim)
        b = image_embed.shape[0]
        text, null = self._decoder_captions(text, b)
        if negative_prompt is not None:
            null = self._decoder_negative(negative_prompt, b)
        self._onload("decoder")
        if len(text) != b:
            raise ValueError(f"decode: {b} image embeddings but {len(text)} captions")
        return self.decoder, image_embed, text, null, s, self.diffusion["decoder"]

    def _decoder_run(self, generator, progress, callback_on_step_end) -> dict[str, Any]:
        """The decoder sampler's run options (keyword arguments)."""
        return dict(
            generator=generator,
            progress=progress,
            autocast_dtype=self.autocast_dtype,
            callback=stage_callback(self, "decoder", callback_on_step_end),
        )

    @releases_gpu
    @torch.no_grad()
    def rerank(
        self,
        images: torch.Tensor,
        prompts: Union[str, Sequence[str]],
        k: int,
        contrast: Union[str, Callable[[str], list[str]], None] = None,
        keep: int = 1,
    ) -> torch.Tensor:
        """Indices ``[B]`` of the best of each consecutive group of ``k`` candidates
        (``images [B·k, 3, H, W]`` in [-1, 1]) by the cosine between :attr:`rerank_clip`'s
        embeddings of the image and of its prompt. ``prompts``: one per image (``B·k``), one per
        group (``B``), or one string for all; ``k = 1`` keeps every image. ``contrast`` (the
        decoder's ``rerank_contrast``): score by the CLIP's preference for the prompt over its
        alternatives instead; ``keep``: each group's ``keep`` best, ``[B·keep]``
        (:func:`~unclip.sampling.rerank_candidates`)."""
        return rerank_candidates(self.rerank_clip, images, prompts, k, contrast, keep)

    @releases_gpu
    @torch.no_grad()
    def clip_scores(self, images: torch.Tensor, text_embed: torch.Tensor) -> torch.Tensor:
        """Cosine similarity ``[B]`` between images ``[B, 3, H, W]`` in [-1, 1] and text embeddings
        ``[B, D]``."""
        return image_text_cosines(self.clip, images, text_embed)

    def _sample_group(
        self,
        prompts: list[str],
        n: int,
        k: int,
        generator: Generator,
        settings: ResolvedSampling,
        *,
        image_embeds: Optional[torch.Tensor],
        negatives: Optional[list[str]],
        upsamplers: list[str],
        progress: bool,
        callback_on_step_end: Optional[StepCallback],
        latents: Optional[dict] = None,
    ) -> tuple:
        """``prompts`` (``n`` images each, ``k`` decoder candidates per image) through every stage,
        with the settings the call resolved (every stage reads them as they are).
        Returns ``(final images, image embeds, text embeds, {stage: images}, {stage: seconds})``.
        ``latents``: initial noise per stage (``"prior"``, ``"decoder"``, ``"sr"``: the first
        upsampler's), one row per image; ``upsamplers``: the upsampler stages to run."""
        latents = latents or {}
        timings: dict[str, float] = {}
        t0 = self._now()
        text = self.encode_text(prompts)
        gen = expand_generator(generator, len(prompts), n * k, "generator", candidates=k)
        text_k = text.repeat_interleave(n * k)
        # the negative caption of each row (each distinct one is encoded once)
        neg_k = None if negatives is None else [c for c in negatives for _ in range(n * k)]
        if image_embeds is None:
            embeds = self.sample_image_embeds(
                text_k,
                1,
                gen,
                settings,
                progress=progress,
                callback_on_step_end=callback_on_step_end,
                negative_prompt=neg_k,
                latents=latents.get("prior"),
            )
            timings["prior"] = self._now() - t0
            t0 = self._now()
        else:
            embeds = image_embeds.to(self.device).repeat_interleave(k, dim=0)
        captions_k = [p for p in prompts for _ in range(n * k)]
        inputs = self._decoder_inputs(
            embeds, captions_k if self.decoder.has_text_encoder else text_k, settings, neg_k
        )
        small, keep = sample_decoder_candidates(
            *inputs,
            self.rerank_clip,
            captions_k[::k],
            k,
            **self._decoder_run(gen, progress, callback_on_step_end),
            latents=latents.get("decoder"),
        )
        embeds, text_k = embeds[keep], text_k[keep]
        timings["decoder"] = self._now() - t0
        gen = gen[::k] if isinstance(gen, list) else gen
        final, stage_images = small, {"decoder": small}
        for i, name in enumerate(upsamplers):
            t0 = self._now()
            final = self.upsample(
                final,
                gen,
                settings,
                stages=[name],
                progress=progress,
                callback_on_step_end=callback_on_step_end,
                latents=latents.get("sr") if i == 0 else None,
            )
            timings[name] = self._now() - t0
            stage_images[name] = final
        return final, embeds, text_k.text_embed, stage_images, timings
