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
    pipe.load_lora("runs/x/final/decoder_lora", scale=0.8)  # a LoRA adapter (unclip.nets.lora)

Sampling settings (:class:`~unclip.sampling.settings.SamplingConfig`: scheduler, steps,
guidance_scale, best_of) are stored per stage in ``pipe.sampling``; every sampling method takes
``sampling=`` overrides keyed by stage (``"prior"``, ``"decoder"``, an upsampler's name such as
``"sr64"``, or ``"upsampler"`` for every upsampler), resolved and checked by
:meth:`UnCLIPPipeline.sampling_settings`. The decoder's ``best_of`` is the number of base-resolution
candidates decoded per image; :meth:`UnCLIPPipeline.rerank` keeps the one that
:attr:`UnCLIPPipeline.rerank_clip` scores closest to the prompt.

A pipeline may carry a second CLIP, ``reranker``, used only to choose among decoder candidates
(reranking); without one, the conditioning CLIP scores them. A pipeline folder is self-describing:
``unclip.json`` names the components and the default sampling settings; each component has its own
subfolder with ``config.json`` and safetensors weights.

The class is the cascade's components and stages (:class:`~unclip.pipeline.cascade.UnCLIPCascade`,
on :class:`~unclip.pipeline.base.BasePipeline`: devices, autocast, offload, the upsampler chain,
settings resolution, folders and diffusers' surface, shared with every family) plus what composes
from them here: the text-to-image call, interpolation, the edits (functions in
:mod:`unclip.pipeline.editing`, carried as methods) and loading (:mod:`unclip.pipeline.loading`).
Each stage's sampling step and the settings types are in :mod:`unclip.sampling`, usable without a
pipeline.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Self, Union

import torch

from unclip.diffusion.loop import Generator
from unclip.nets.text_encoding import check_prompts
from unclip.pipeline import editing, loading
from unclip.pipeline.batching import generators_by_group, joined_outputs, negatives_per_row
from unclip.pipeline.cascade import UnCLIPCascade
from unclip.pipeline.diffusers_api import (
    check_callback_inputs,
    check_latents_fit,
    flat_sampling,
)
from unclip.pipeline.edit_ops import EditOutput, Inversion
from unclip.pipeline.folders import (
    PIPELINE_FILE,
    bundled_model_path,
)
from unclip.pipeline.limits import check_candidates_fit
from unclip.pipeline.output import UnCLIPOutput
from unclip.sampling.candidates import (
    CandidateSelection,
    check_rerank_at,
)
from unclip.sampling.settings import (
    DEFAULT_SAMPLING,
    EVERY_UPSAMPLER,
    SAMPLING_FIELDS,
    DecoderSampling,
)
from unclip.sampling.stages import (
    StepCallback,
)
from unclip.sampling.utils import (
    check_count,
    check_embeds,
    check_output_type,
    rows_of,
    slerp,
    stages_until,
)
from unclip.utils.images import as_image_input, to_output
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


class UnCLIPPipeline(UnCLIPCascade):
    """The unCLIP text-to-image pipeline (see the module doc). Build from components
    (``UnCLIPPipeline(clip, prior, decoder, upsamplers, ...)``) or :meth:`from_pretrained`."""

    # ------------------------------------------------------------------ folders
    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, os.PathLike, None] = None,
        *,
        revision: Optional[str] = None,
        cache_dir: Union[str, os.PathLike, None] = None,
        local_files_only: Optional[bool] = None,
        torch_dtype: Union[torch.dtype, str, None] = None,
        dtype: Union[torch.dtype, str, None] = None,
        variant: Optional[str] = None,
        autocast_dtype=None,
        memory_format: Optional[torch.memory_format] = torch.channels_last,
        token: Union[str, bool, None] = None,
        use_safetensors: Optional[bool] = None,
        low_cpu_mem_usage: Optional[bool] = None,
        device_map: Union[str, torch.device, None] = None,
        allow_external_components: bool = False,
    ) -> Self:
        """Load a folder written by :meth:`save_pretrained`, a diffusers ``UnCLIPPipeline``
        folder, or either from the Hugging Face Hub by repo id (``"org/name"``).

        ``path=None`` or ``"shapes"`` loads the bundled offline shapes model. A repo id is
        fetched once into the Hub cache (``cache_dir``, default ``HF_HUB_CACHE``) at ``revision``
        (branch, tag or commit; default ``main``), safetensors weights only
        (:mod:`unclip.io.hub`); ``local_files_only=True`` or ``HF_HUB_OFFLINE=1`` use the cache
        only. ``torch_dtype`` (or ``dtype``, diffusers' newer name; ``torch.float16``/
        ``bfloat16``/``float32`` or its name): cast the weights as :meth:`to` does. ``variant``
        (e.g. ``"fp16"``): read ``*.fp16.safetensors`` weights.

        Exact by default, as diffusers is: the networks compute in the weights' dtype (float32
        unless ``torch_dtype`` says otherwise). Faster arithmetic is asked for:
        ``autocast_dtype="auto"`` runs the denoising networks under float16 autocast on a GPU
        and bfloat16 on a CPU that runs it natively (:attr:`autocast_dtype`; ``"bf16"``,
        ``"fp16"``: that one). The image networks store their weights channels-last
        (``memory_format``; ``None`` keeps the default layout; results equal to float rounding).

        diffusers' keywords: ``token`` (a Hub token), ``use_safetensors`` (only safetensors are
        ever loaded; ``False`` is an error), ``low_cpu_mem_usage`` (accepted: components are
        built and then filled from their files), ``device_map`` (a device the whole pipeline
        moves to, e.g. ``"cuda"``).

        The components are read from inside the folder: a component name in ``unclip.json``
        that leads outside it (``../other/decoder``) is refused unless
        ``allow_external_components=True``.
        """
        return loading.load_unclip_pipeline(
            cls,
            path,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            torch_dtype=loading.one_dtype(torch_dtype, dtype),
            variant=variant,
            autocast_dtype=autocast_dtype,
            memory_format=memory_format,
            token=token,
            use_safetensors=use_safetensors,
            low_cpu_mem_usage=low_cpu_mem_usage,
            device_map=device_map,
            allow_external_components=allow_external_components,
        )

    @classmethod
    def from_components(
        cls,
        clip: Union[str, os.PathLike],
        decoder: Union[str, os.PathLike],
        prior: Union[str, os.PathLike, None] = None,
        upsamplers: Sequence[Union[str, os.PathLike]] = (),
        reranker: Union[str, os.PathLike, None] = None,
        *,
        autocast_dtype=None,
        memory_format: Optional[torch.memory_format] = torch.channels_last,
    ) -> Self:
        """Assemble a pipeline from component folders exported by the training commands
        (``<output_dir>/final/<name>``, each with ``config.json``, weights and
        ``unclip_stage.json``); ``reranker``: a CLIP folder (e.g. ``unclip train-clip``'s
        ``<output_dir>/clip``) that scores decoder candidates instead of the conditioning CLIP.
        ``autocast_dtype``, ``memory_format``: as in :meth:`from_pretrained`."""
        return loading.assemble_unclip_pipeline(
            cls,
            clip,
            decoder,
            prior,
            upsamplers,
            reranker,
            autocast_dtype=autocast_dtype,
            memory_format=memory_format,
        )

    def _write_folder(self, path, model_card: Mapping) -> None:
        loading.write_unclip_folder(self, path, model_card)

    # ------------------------------------------------------------------ edits (pipeline.editing)
    invert = editing.invert
    text_diff = editing.text_diff
    interpolate_inverted = editing.interpolate_inverted
    img2img = editing.img2img
    inpaint = editing.inpaint
    variations = editing.variations

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
        progress = self._progress(progress)
        sampling = self.sampling_settings(sampling)  # resolved once for every stage
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

    # ------------------------------------------------------------------ composed
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
        ``sampling``); ``prior_latents [N, D]``, ``decoder_latents [N, *decoder.sample_shape]`` and
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
        # resolved once, before any compute; every stage reads these objects
        settings = self.sampling_settings(sampling)
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
        # every candidate of a group's images is denoised at once: refuse what cannot fit first
        check_candidates_fit(self, settings, len(prompts) * n, cli=False)
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
                self._sample_group(
                    [prompts[i] for i in rows],
                    n,
                    k,
                    gens[k],
                    settings,
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
