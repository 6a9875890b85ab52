"""Each stage of an :class:`~unclip.pipeline.pipeline.UnCLIPPipeline` usable alone: the text
encoding, the prior (``sample_image_embeds``), the decoder (``decode``) and the upsamplers
(``upsample``); ``__call__`` chains them, and ``interpolate`` decodes the slerp between two
embeddings through them."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import Generator
from unclip.nets.decoder import Caption, UnCLIPDecoder
from unclip.nets.text_encoding import TextEncoding, check_prompts
from unclip.pipeline.base import PipelineBase
from unclip.pipeline.batching import negatives_per_row
from unclip.pipeline.output import UnCLIPOutput
from unclip.sampling.settings import (
    ARPriorSampling,
    DecoderSampling,
    PriorSampling,
    UpsamplerSampling,
)
from unclip.sampling.stages import (
    StepCallback,
    sample_decoder,
    sample_prior,
    sample_upsampler,
    stage_callback,
)
from unclip.sampling.utils import (
    check_count,
    check_embeds,
    check_output_type,
    expand_generator,
    slerp,
)
from unclip.utils.images import as_image_input, to_output
from unclip.utils.offload import releases_gpu

#: the leading arguments of the decoder's samplers: decoder, image_embed, text, null text, settings,
#: diffusion
DecoderInputs = tuple[
    UnCLIPDecoder, torch.Tensor, Caption, Callable[[int], Caption], DecoderSampling, DiffusionConfig
]


class StagesMixin(PipelineBase):
    """The stages of the cascade as methods: encode_text, sample_image_embeds, decode, upsample."""

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
            **self._decoder_run(generator, progress, callback_on_step_end),
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
    def upsample(
        self,
        images: torch.Tensor,
        generator: Generator = None,
        sampling: Optional[dict] = None,
        stages: Optional[Sequence[str]] = None,
        return_intermediates: bool = False,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
        latents: Optional[torch.Tensor] = None,
    ):
        """Upsamplers: ``[B, 3, h, w]`` in [-1, 1] → ``[B, 3, H, W]`` through each upsampler in turn
        (or only those named in ``stages``). ``latents [B, 3, H, W]``: the first upsampler's
        initial noise."""
        if not isinstance(images, torch.Tensor) or images.ndim != 4:
            raise TypeError("upsample: images must be a tensor [B, 3, h, w] in [-1, 1]")
        out = images.to(self.device).float()
        inter: dict[str, torch.Tensor] = {}
        for name, up in zip(self.upsampler_names, self.upsamplers):
            if stages is not None and name not in stages:
                continue
            s = self._stage_settings(name, sampling)
            assert isinstance(s, UpsamplerSampling)
            self._onload(name)
            out = sample_upsampler(
                up,
                out,
                s,
                self.diffusion[name],
                generator=generator,
                progress=progress,
                autocast_dtype=self.autocast_dtype,
                callback=stage_callback(self, name, callback_on_step_end),
                latents=latents if not inter else None,
            )
            inter[name] = out
        return (out, inter) if return_intermediates else out

    @releases_gpu
    @torch.no_grad()
    def interpolate(
        self,
        start,
        end,
        num_steps: int = 5,
        generator: Optional[torch.Generator] = None,
        sampling: Optional[dict] = None,
        output_type: str = "pil",
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
    ) -> UnCLIPOutput:
        """Slerp between the CLIP image embeddings of two images or two prompts (paper §3.2).

        ``start``, ``end``: an image (a path to an existing file, a ``Path``, a PIL image, an
        array or a tensor) or a prompt (any other string). Prompts go through the prior first.
        Every frame is decoded from the same initial noise so
        the frames differ only by the embedding. ``callback_on_step_end``: see :meth:`__call__`.
        """
        check_output_type(output_type)
        if check_count(num_steps, "num_steps") < 2:
            raise ValueError("interpolate: num_steps must be >= 2")
        seed_gen = generator if generator is not None else torch.Generator().manual_seed(0)
        cb: dict[str, Any] = {"progress": progress, "callback_on_step_end": callback_on_step_end}
        ends = []
        for x in (start, end):
            if isinstance(x, str) and not os.path.isfile(x):
                ends.append(self.sample_image_embeds(x, 1, seed_gen, sampling, **cb))
            else:
                ends.append(self.clip.encode_image(as_image_input(x)))
        ws = torch.linspace(0, 1, num_steps)
        embeds = torch.cat([slerp(ends[0], ends[1], float(w)) for w in ws])
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=seed_gen))
        gens = [torch.Generator().manual_seed(seed) for _ in range(num_steps)]
        small = self.decode(embeds, None, gens, sampling, **cb)
        final = self.upsample(small, gens, sampling, **cb)
        return UnCLIPOutput(to_output(final, output_type), embeds)
