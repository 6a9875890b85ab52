"""``UnCLIPPipeline``: text → CLIP text encoding → prior → image embedding → decoder → upsamplers.

Each stage is a public method, and everything else composes from them::

    pipe = UnCLIPPipeline.from_pretrained("path/to/pipeline")  # or a diffusers/Karlo folder
    gen = torch.Generator().manual_seed(0)
    out = pipe(["a red circle", "a blue square"], num_images_per_prompt=2, generator=gen)
    out.images                             # PIL images at the last stage's resolution
    text = pipe.encode_text("a red circle")  # TextEncoding [B, D], [B, L, W], [B, L]
    emb = pipe.sample_image_embeds(text)   # [B, D] CLIP image embeddings
    small = pipe.decode(emb, text)         # [B, 3, 64, 64] in [-1, 1]
    big = pipe.upsample(small)             # through every upsampler
    pipe.variations(pil_image, num_images=4)  # image → CLIP embedding → decode
    pipe.interpolate("a red circle", "a blue square", num_steps=5)
    keep = pipe.rerank(small, ["a red circle"] * 4, k=4)  # best of each group of 4 by CLIP score
    pipe.sampling_settings({"decoder": {"steps": 50}})  # {stage: SamplingConfig}, validated
    pipe.load_lora("runs/x/final/decoder_lora", scale=0.8)  # a LoRA adapter (unclip.lora)

Sampling settings (:class:`~unclip.config.SamplingConfig`: scheduler, steps, guidance_scale,
best_of) are stored per stage in ``pipe.sampling``; every sampling method takes ``sampling=``
overrides keyed by stage (``"prior"``, ``"decoder"``, an upsampler's name such as ``"sr64"``, or
``"upsampler"`` for every upsampler), resolved and checked by
:meth:`UnCLIPPipeline.sampling_settings`. The decoder's ``best_of`` is the number of base-resolution
candidates decoded per image; :meth:`UnCLIPPipeline.rerank` keeps the one that
:attr:`UnCLIPPipeline.rerank_clip` scores closest to the prompt.

A pipeline may carry a second CLIP, ``reranker``, used only to choose among decoder candidates
(reranking); without one, the conditioning CLIP scores them. A pipeline folder is self-describing:
``unclip.json`` names the components and the default sampling settings; each component has its own
subfolder with ``config.json`` and safetensors weights.

This module is the pipeline object; the work it delegates lives beside it: each stage's sampling
step and the settings resolution in :mod:`unclip.sampling` (usable without a pipeline), pipeline
folders in :mod:`unclip.io`, and :class:`UnCLIPOutput` with :func:`generate_to_folder` in
:mod:`unclip.output` (both re-exported here).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Optional, Union

import torch

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import Generator
from unclip.nets.clip import CLIP
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior
from unclip.nets.priors import prior_type
from unclip.nets.text_encoding import TextEncoding, check_prompts
from unclip.pipeline.batching import generators_by_group, joined_outputs, negatives_per_row
from unclip.pipeline.devices import DevicesMixin
from unclip.pipeline.diffusers_api import (
    DiffusersInterfaceMixin,
    check_callback_inputs,
    check_latents_fit,
    flat_sampling,
)
from unclip.pipeline.edit_ops import EditOutput, Inversion
from unclip.pipeline.editing import EditingMixin
from unclip.pipeline.folders import (
    PIPELINE_FILE,
    bundled_model_path,
)
from unclip.pipeline.loading import LoadingMixin
from unclip.pipeline.lora import LoraMixin
from unclip.pipeline.memory import MemoryMixin
from unclip.pipeline.offload import OffloadMixin
from unclip.pipeline.output import UnCLIPOutput
from unclip.pipeline.stages import StagesMixin
from unclip.sampling.candidates import (
    CandidateSelection,
    check_rerank_at,
    rerank_candidates,
    sample_decoder_candidates,
)
from unclip.sampling.scorers import image_text_cosines
from unclip.sampling.settings import (
    DEFAULT_SAMPLING,
    EVERY_UPSAMPLER,
    SAMPLING_FIELDS,
    DecoderSampling,
    StageSampling,
    resolve_sampling,
    stage_settings,
)
from unclip.sampling.stages import (
    StepCallback,
)
from unclip.sampling.utils import (
    check_components,
    check_count,
    check_embeds,
    check_output_type,
    expand_generator,
    rows_of,
    slerp,
    stages_until,
)
from unclip.utils.images import to_output
from unclip.utils.offload import releases_gpu

__all__ = [
    "UnCLIPPipeline",
    "UnCLIPOutput",
    "EditOutput",
    "Inversion",
    "slerp",
    "PIPELINE_FILE",
    "bundled_model_path",
    "DEFAULT_SAMPLING",
    "SAMPLING_FIELDS",
    "EVERY_UPSAMPLER",
]


class UnCLIPPipeline(
    StagesMixin,
    LoadingMixin,
    DevicesMixin,
    DiffusersInterfaceMixin,
    EditingMixin,
    MemoryMixin,
    OffloadMixin,
    LoraMixin,
):
    """The unCLIP cascade (see module doc). Build from components or :meth:`from_pretrained`."""

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
        self.sampling: dict[str, StageSampling]
        self.diffusion, self.sampling = stage_settings(
            self.stage_names, diffusion, sampling, ar_stages=self._ar_stages()
        )
        check_components(
            clip, prior, decoder, dict(zip(self.upsampler_names, self.upsamplers)), reranker
        )
        for m in self.modules().values():
            m.eval()
        self._null_text: Optional[TextEncoding] = None
        # None, "auto" or a dtype (autocast_dtype resolves it); from_pretrained sets "auto"
        self._autocast_dtype: Union[str, torch.dtype, None] = None
        # the model card fields save_pretrained writes (unclip.card.CARD_FIELDS); from_pretrained
        # reads them from the folder's README.md
        self.card_info: dict = {}

    # ------------------------------------------------------------------ structure
    @property
    def upsampler_names(self) -> list[str]:
        return [f"sr{u.config.sample_size}" for u in self.upsamplers]

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
    def sampling_settings(self, sampling: Optional[Mapping] = None) -> dict[str, StageSampling]:
        """The settings every stage samples with: ``{stage: settings}`` for :attr:`stage_names`
        (:class:`~unclip.sampling.settings.PriorSampling` or ``ARPriorSampling``,
        ``DecoderSampling``, ``UpsamplerSampling``).

        ``sampling``: overrides ``{key: {setting: value}}``; a key is a stage name or
        ``"upsampler"`` (every upsampler; an upsampler's own key wins), a setting one the stage
        has. A value may also be a settings object. ``"prior"`` and ``"upsampler"`` may be given
        for a pipeline without that stage (they are checked, then unused). Unknown keys or fields
        and invalid values are a ``ValueError`` naming them; the result is a copy (changing it
        changes nothing)."""
        return resolve_sampling(
            {name: self.sampling[name] for name in self.stage_names},
            sampling,
            ar_stages=self._ar_stages(),
        )

    def _ar_stages(self) -> tuple[str, ...]:
        return ("prior",) if self.prior is not None and prior_type(self.prior) == "ar" else ()

    def _stage_settings(self, stage: str, sampling: Optional[Mapping]) -> StageSampling:
        return self.sampling_settings(sampling)[stage]

    # ------------------------------------------------------------------ composed
    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @releases_gpu
    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, Sequence[str]],
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        sampling: Optional[Mapping] = None,
        output_type: str = "pil",
        return_intermediates: bool = False,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
        image_embeds: Optional[torch.Tensor] = None,
        last_stage: Optional[str] = None,
        negative_prompt: Union[str, Sequence[str], None] = None,
        *,
        prior_num_inference_steps: Optional[int] = None,
        decoder_num_inference_steps: Optional[int] = None,
        super_res_num_inference_steps: Optional[int] = None,
        prior_guidance_scale: Optional[float] = None,
        decoder_guidance_scale: Optional[float] = None,
        prior_latents: Optional[torch.Tensor] = None,
        decoder_latents: Optional[torch.Tensor] = None,
        super_res_latents: Optional[torch.Tensor] = None,
        return_dict: bool = True,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    ) -> Union[UnCLIPOutput, tuple]:
        """Text → images through every stage.

        ``generator``: one ``torch.Generator``, one per prompt, or one per image. ``sampling``:
        per-stage overrides (see :meth:`sampling_settings`), e.g. ``{"prior": {"steps": 10},
        "decoder": {"guidance_scale": 3, "best_of": 4}, "upsampler": {"steps": 5}}``. With the
        decoder's ``best_of = K > 1`` it decodes K base-resolution candidates per image and keeps
        the one :attr:`rerank_clip` scores closest to the prompt before upsampling (as DALL-E did);
        with the decoder's ``rerank_at = m`` below its steps it chooses after step ``m``, from each
        candidate's predicted final image, and denoises only the chosen ones on; with its
        ``prune_at = p`` and ``prune_keep = r`` as well, only each image's ``r`` best candidates
        go on after step ``p`` and the choice after step ``m`` is among them. With its
        ``best_of_contrasted = K2``, prompts its ``rerank_contrast`` has alternatives for draw K2
        candidates: the prompts of each count are sampled as one call, in order of first
        appearance (a shared generator is drawn on in that order), and the outputs come back in
        prompt order.
        ``output_type``: ``pil``, ``np`` (float32 ``[N, H, W, 3]`` in [0, 1], as diffusers), ``pt``
        (float ``[N, 3, H, W]`` in [0, 1]), ``latent`` (the last stage's ``[N, 3, H, W]`` in
        [-1, 1]) or ``uint8`` (``[N, H, W, 3]``, the PIL images' pixels).

        diffusers' keywords work as in its ``UnCLIPPipeline``: ``prior_num_inference_steps``,
        ``decoder_num_inference_steps``, ``super_res_num_inference_steps`` (every upsampler),
        ``prior_guidance_scale``, ``decoder_guidance_scale`` (each the same as that setting in
        ``sampling``); ``prior_latents [N, D]``, ``decoder_latents [N, 3, s, s]`` and
        ``super_res_latents [N, 3, S, S]`` (the first upsampler's) give the initial noise of
        each output image (with one candidate per image); ``return_dict=False`` returns
        ``(images,)``.

        ``callback_on_step_end(pipe, step, timestep, callback_kwargs)`` runs after every denoising
        step of every stage, as in diffusers; ``callback_kwargs`` is ``{"stage": name, "latents":
        x_t}`` (``x_t`` holds every candidate of that stage's batch; after the decoder's
        ``rerank_at`` step, the chosen ones) and a returned dict's
        ``"latents"`` replaces ``x_t``. ``image_embeds [N, D]`` (one per output image,
        prompt-major): decode these CLIP image embeddings instead of sampling the prior.
        ``last_stage``: stop after this stage (``"decoder"`` or an upsampler's name; default: the
        last). Seconds per stage are returned in ``UnCLIPOutput.timings``.
        ``negative_prompt``: one caption for all prompts, or one per prompt, that replaces the empty
        caption in the unconditional branch of guidance in the prior and the decoder (the images
        are steered away from it); it acts only in a stage whose guidance scale is not 1.
        """
        sampling = flat_sampling(
            sampling,
            prior_num_inference_steps=prior_num_inference_steps,
            decoder_num_inference_steps=decoder_num_inference_steps,
            super_res_num_inference_steps=super_res_num_inference_steps,
            prior_guidance_scale=prior_guidance_scale,
            decoder_guidance_scale=decoder_guidance_scale,
        )
        check_callback_inputs(callback_on_step_end_tensor_inputs)
        progress = self._progress(progress)
        prompts = check_prompts(prompt)
        negatives = None
        if negative_prompt is not None:
            negatives = negatives_per_row(negative_prompt, len(prompts), "prompts")
        check_output_type(output_type)
        n = check_count(num_images_per_prompt)
        settings = self.sampling_settings(sampling)  # validate everything before any compute
        ups = stages_until(self.upsampler_names, last_stage)
        if image_embeds is not None:
            image_embeds = check_embeds(image_embeds, self.clip.embed_dim)
            if image_embeds.shape[0] != len(prompts) * n:
                raise ValueError(
                    f"image_embeds: {image_embeds.shape[0]} embeddings for {len(prompts)} prompts "
                    f"× {n} images; give one per output image"
                )
        dec = settings["decoder"]
        assert isinstance(dec, DecoderSampling)
        selection = CandidateSelection.of(dec)
        groups = selection.groups(prompts)
        if any(selection.early(k) for k in groups):
            # every group's sampler check before the first group samples
            check_rerank_at(dec, self.diffusion["decoder"], self.decoder.config.learned_variance)
        gens = generators_by_group(generator, len(prompts), n, groups, dec)
        latents = {"prior": prior_latents, "decoder": decoder_latents, "sr": super_res_latents}
        latents = {k: v for k, v in latents.items() if v is not None}
        if latents:
            check_latents_fit(latents, groups, settings, image_embeds is not None)
        parts, order = [], []
        for k, rows in groups.items():
            parts.append(
                self._generate(
                    [prompts[i] for i in rows],
                    n,
                    k,
                    gens[k],
                    sampling,
                    image_embeds=rows_of(image_embeds, rows, n),
                    negatives=None if negatives is None else [negatives[i] for i in rows],
                    upsamplers=ups,
                    progress=progress,
                    callback_on_step_end=callback_on_step_end,
                    latents=latents,
                )
            )
            order += [i * n + j for i in rows for j in range(n)]
        final, embeds, text_embeds, stage_images, timings = joined_outputs(parts, order)
        if not return_intermediates:
            stage_images = {}
        images = to_output(final, output_type)
        if not return_dict:
            return (images,)
        return UnCLIPOutput(images, embeds, text_embeds, stage_images, timings)

    def _generate(
        self,
        prompts: list[str],
        n: int,
        k: int,
        generator: Generator,
        sampling: Optional[Mapping],
        *,
        image_embeds: Optional[torch.Tensor],
        negatives: Optional[list[str]],
        upsamplers: list[str],
        progress: bool,
        callback_on_step_end: Optional[StepCallback],
        latents: Optional[dict] = None,
    ) -> tuple:
        """One group of prompts that draw ``k`` decoder candidates per image, through every stage:
        encode → prior → decoder candidates → upsamplers. Returns ``(final images, image embeds,
        text embeds, {stage: images}, {stage: seconds})``. ``latents``: initial noise per stage
        (``"prior"``, ``"decoder"``, ``"sr"``: the first upsampler's), one row per image."""
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
                sampling,
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
            embeds, captions_k if self.decoder.has_text_encoder else text_k, sampling, neg_k
        )
        contrast = inputs[4].rerank_contrast

        def choose(images, group, keep):
            # one prompt per image: each consecutive group of candidates shares it
            return self.rerank(images, captions_k[::k], group, contrast, keep=keep)

        small, keep = sample_decoder_candidates(
            *inputs,
            choose,
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
                sampling,
                stages=[name],
                progress=progress,
                callback_on_step_end=callback_on_step_end,
                latents=latents.get("sr") if i == 0 else None,
            )
            timings[name] = self._now() - t0
            stage_images[name] = final
        return final, embeds, text_k.text_embed, stage_images, timings

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
