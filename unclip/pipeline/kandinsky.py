"""Kandinsky 2.2 (the unCLIP family in its latent form): a prior from text to a CLIP image
embedding, a UNet over MoVQ latents conditioned on it, and MoVQ's decoder.

    pipe = KandinskyPipeline.from_pretrained("kandinsky-2-2-decoder", prior="kandinsky-2-2-prior")
    image = pipe("a red cat, 4k photo", generator=torch.Generator().manual_seed(0)).images[0]

    load_pipeline("kandinsky-2-2-decoder")     # the same; the prior its model card names

``__call__`` takes diffusers' ``KandinskyV22CombinedPipeline`` keywords with its defaults (prior:
25 steps, guidance 4; decoder: 100 steps, guidance 4; 512 × 512) and draws from one generator in
the same order (prior, then decoder), so a seed gives diffusers' images. One difference:
diffusers' combined pipeline hands ``latents`` to the prior; here ``latents`` are the decoder's
initial latents, as ``KandinskyV22Pipeline`` takes them, and ``prior_latents`` the prior's.

The components are diffusers' and unclip's own networks: ``decoder`` a
:class:`~unclip.nets.latent_decoder.LatentDecoder` (UNet + MoVQ) with its diffusers ``scheduler``;
``prior`` diffusers' ``PriorTransformer`` with its ``prior_scheduler`` and the ``clip``
(:class:`~unclip.nets.clip.CLIP`, text and image towers) it reads. A pipeline without a prior
decodes given image embeddings (:meth:`KandinskyPipeline.decode`). Folders are read by the
``unclip.pipeline_readers`` entry point ``kandinsky`` (:mod:`unclip.interop.kandinsky`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch

from unclip.diffusion.loop import Generator
from unclip.nets.clip import CLIP
from unclip.nets.latent_decoder import LatentDecoder
from unclip.nets.text_encoding import check_prompts
from unclip.pipeline.base import BasePipeline, ResolvedSampling
from unclip.pipeline.kandinsky_edits import KandinskyEdits
from unclip.pipeline.lora import LoraMixin
from unclip.pipeline.memory import MemoryMixin
from unclip.pipeline.output import UnCLIPOutput
from unclip.sampling.kandinsky import prior_text, sample_prior_embeds, zero_image_embed
from unclip.sampling.latent import (
    img2img_inputs,
    img2img_latents,
    inpaint_inputs,
    inpaint_latents,
    sample_latents,
)
from unclip.sampling.stages import StepCallback, stage_callback
from unclip.sampling.utils import check_count, check_output_type, expand_generator
from unclip.utils.images import to_output
from unclip.utils.offload import releases_gpu
from unclip.utils.registry import EntryPointRegistry

__all__ = [
    "KandinskyPipeline",
    "KandinskySampling",
    "KANDINSKY_DEFAULTS",
    "PIPELINE_READERS",
    "PIPELINE_WRITERS",
]

#: entry point group of folder readers by family: ``kandinsky`` = reader(folder, variant=None)
#: returning ``{"kind": "prior" | "decoder", ...components}``
PIPELINE_READERS = EntryPointRegistry("unclip.pipeline_readers")
#: entry point group of folder writers by family: ``kandinsky`` = writer(folder, decoder,
#: scheduler, prior=None, clip=None, prior_scheduler=None)
PIPELINE_WRITERS = EntryPointRegistry("unclip.pipeline_writers")


#: the most candidates per image a stage draws (as the native stages' ``best_of``)
MAX_BEST_OF = 512
#: decoder candidates decoded and scored at a time when reranking
RERANK_CHUNK = 8


@dataclasses.dataclass(frozen=True)
class KandinskySampling:
    """One stage's settings: ``steps`` (``num_inference_steps``), ``guidance_scale``
    (classifier-free guidance runs only above 1, as in diffusers) and ``scheduler``: ``None``
    for the folder's own, else a diffusers scheduler by alias (``"ddim"``, ``"euler_a"``,
    ``"unipc"``, ...) or class name, built from the folder's scheduler config as diffusers users
    swap one in (``DDIMScheduler.from_config(pipe.scheduler.config)``). ``best_of``: candidates
    per image, the one whose CLIP image embedding is closest (cosine) to the prompt's CLIP text
    embedding kept — prior embeddings (the paper's prior reranking, wherever the prior samples:
    text-to-image and the edits that take a prompt), or decoded images scored by the image tower
    (text-to-image calls only); 1, the default, draws as diffusers."""

    steps: int
    guidance_scale: float
    scheduler: Optional[str] = None
    best_of: int = 1

    def __post_init__(self) -> None:
        if self.scheduler is not None:
            if not isinstance(self.scheduler, str):
                raise TypeError(
                    f"scheduler must be a scheduler name (e.g. 'ddim') or None, got "
                    f"{self.scheduler!r}"
                )
            _scheduler_class(self.scheduler)  # an unknown name fails here, naming the choices
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {self.steps!r}")
        g = self.guidance_scale
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not g == g or g < 0:
            raise ValueError(f"guidance_scale must be a number >= 0, got {g!r}")
        k = self.best_of
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_BEST_OF:
            raise ValueError(f"best_of must be an integer in 1 … {MAX_BEST_OF}, got {k!r}")


#: diffusers' defaults (KandinskyV22CombinedPipeline)
KANDINSKY_DEFAULTS = {
    "prior": KandinskySampling(25, 4.0),
    "decoder": KandinskySampling(100, 4.0),
}


class KandinskyPipeline(LoraMixin, MemoryMixin, KandinskyEdits, BasePipeline):
    """Kandinsky 2.2's prior and latent decoder (see the module doc). ``sampling``: per-stage
    defaults, ``{"prior": {"steps": 25, "guidance_scale": 4.0}, "decoder": {...}}``. Beside
    text-to-image: :meth:`img2img`, :meth:`inpaint` (with an inpainting decoder),
    :meth:`variations` and :meth:`mix` (weighted prompts and images, diffusers' ``interpolate``),
    :meth:`interpolate`, :meth:`invert` and :meth:`text_diff` (DDIM inversion of the decoder),
    the attention-memory options, and LoRA adapters on the prior and the decoder's UNet
    (``load_lora`` of an adapter a ``train.lora`` fine-tuning run exported, ``fuse_lora``, ...)."""

    family = "kandinsky"

    def __init__(
        self,
        decoder: LatentDecoder,
        scheduler,
        prior: Optional[torch.nn.Module] = None,
        clip: Optional[CLIP] = None,
        prior_scheduler=None,
        sampling: Optional[Mapping[str, Any]] = None,
        resolution: int = 512,
    ):
        """``resolution``: the side of the images a call makes when it gives no ``height`` /
        ``width`` (diffusers' 512 by default)."""
        self._init_base()
        if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1:
            raise ValueError(f"resolution must be a positive integer, got {resolution!r}")
        self.resolution = resolution
        if not isinstance(decoder, LatentDecoder):
            raise TypeError(f"decoder must be a LatentDecoder, got {type(decoder).__name__}")
        parts = {"prior": prior, "clip": clip, "prior_scheduler": prior_scheduler}
        given = [k for k, v in parts.items() if v is not None]
        if given and len(given) != len(parts):
            missing = [k for k, v in parts.items() if v is None]
            raise ValueError(
                f"a prior needs prior, clip and prior_scheduler together; {', '.join(missing)} "
                "missing (or pass none of them to decode given image embeddings)"
            )
        if clip is not None and clip.embed_dim != decoder.embed_dim:
            raise ValueError(
                f"the prior gives {clip.embed_dim}-wide image embeddings but the decoder reads "
                f"{decoder.embed_dim}; pass the prior made for this decoder"
            )
        self.decoder, self.scheduler = decoder, scheduler
        self.prior, self.clip, self.prior_scheduler = prior, clip, prior_scheduler
        self.upsamplers = []
        self.diffusion = {}
        self.sampling = dict(self._resolve(KANDINSKY_DEFAULTS, sampling))

    # ------------------------------------------------------------------ what the base asks
    def modules(self) -> dict[str, torch.nn.Module]:
        mods: dict[str, torch.nn.Module] = {"decoder": self.decoder}
        if self.prior is not None:
            assert self.clip is not None
            mods["clip"], mods["prior"] = self.clip, self.prior
        return mods

    def denoisers(self) -> dict[str, torch.nn.Module]:
        nets: dict[str, torch.nn.Module] = {"decoder": self.decoder.unet}
        if self.prior is not None:
            nets["prior"] = self.prior
        return nets

    @property
    def stage_names(self) -> list[str]:
        return (["prior"] if self.prior is not None else []) + ["decoder"]

    def _adaptable_stages(self) -> dict[str, torch.nn.Module]:
        # an adapter adapts the trained network itself: the UNet, not the MoVQ beside it
        return self.denoisers()

    def sampling_settings(self, sampling: Optional[Mapping] = None) -> ResolvedSampling:
        return self._resolve(self.sampling, sampling)

    def _anchor(self) -> torch.nn.Module:
        return self.decoder.unet

    def _init_kwargs(self) -> dict[str, Any]:
        return {
            "decoder": self.decoder,
            "scheduler": self.scheduler,
            "prior": self.prior,
            "clip": self.clip,
            "prior_scheduler": self.prior_scheduler,
            "sampling": {k: dataclasses.asdict(v) for k, v in self.sampling.items()},
            "resolution": self.resolution,
        }

    def _scheduler(self, stage: str, settings: KandinskySampling):
        """The stage's scheduler: the folder's own, or the one ``settings`` names built from its
        config (a fresh one per call)."""
        base = self.prior_scheduler if stage == "prior" else self.scheduler
        if settings.scheduler is None:
            return base
        return _scheduler_class(settings.scheduler).from_config(base.config)

    def _size(self, height: Optional[int], width: Optional[int]) -> tuple[int, int]:
        return (height or self.resolution), (width or self.resolution)

    def _image_networks(self) -> list[torch.nn.Module]:
        return [self.decoder]

    def _resolve(self, base: Mapping, sampling: Optional[Mapping]) -> ResolvedSampling:
        if isinstance(sampling, ResolvedSampling):
            return sampling
        out = ResolvedSampling(base)
        for stage, values in (sampling or {}).items():
            if stage not in KANDINSKY_DEFAULTS:
                raise ValueError(
                    f"sampling: no stage {stage!r} in a Kandinsky pipeline (stages: prior, decoder)"
                )
            if isinstance(values, KandinskySampling):
                out[stage] = values
                continue
            if not isinstance(values, Mapping):
                raise TypeError(f"sampling[{stage!r}] must be a dict of settings, got {values!r}")
            unknown = sorted(set(values) - {"steps", "guidance_scale", "scheduler", "best_of"})
            if unknown:
                raise ValueError(
                    f"sampling[{stage!r}]: unknown setting {unknown[0]!r} (a Kandinsky stage has "
                    "steps, guidance_scale, scheduler and best_of)"
                )
            try:
                out[stage] = dataclasses.replace(out[stage], **values)
            except ValueError as exc:
                raise ValueError(f"sampling[{stage!r}]: {exc}") from None
        return out

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, os.PathLike],
        prior: Union[str, os.PathLike, None, bool] = None,
        *,
        torch_dtype: Union[torch.dtype, str, None] = None,
        dtype: Union[torch.dtype, str, None] = None,
        variant: Optional[str] = None,
        revision: Optional[str] = None,
        cache_dir: Union[str, os.PathLike, None] = None,
        local_files_only: Optional[bool] = None,
        token: Union[str, bool, None] = None,
        sampling: Optional[Mapping[str, Any]] = None,
        autocast_dtype=None,
    ) -> KandinskyPipeline:
        """The pipeline of a Kandinsky 2.2 decoder folder (text-to-image, image-to-image or
        inpainting layout) or Hub id, with its prior: ``prior`` (a prior folder or Hub id), else
        the one the decoder's model card names (``prior: [...]`` in ``README.md``), as diffusers'
        ``AutoPipelineForText2Image`` finds it; ``prior=False`` loads the decoder alone. A prior
        folder given as ``path`` needs the decoder's: pass the decoder and ``prior=``.
        ``torch_dtype`` casts the weights; ``autocast_dtype`` (``None``: exact, ``"auto"``,
        ``torch.bfloat16``...) as :attr:`autocast_dtype`; ``variant`` reads
        ``*.<variant>.safetensors``;
        ``revision``, ``cache_dir``, ``local_files_only`` and ``token`` apply to Hub ids;
        ``dtype`` is diffusers' newer name of ``torch_dtype``."""
        from unclip.io.hub import resolve_folder
        from unclip.pipeline.loading import one_dtype
        from unclip.utils.precision import parse_dtype

        weights_dtype = parse_dtype(one_dtype(torch_dtype, dtype))

        def read(source, what: str) -> tuple[dict, Any]:
            folder = resolve_folder(
                source,
                what=what,
                variant=variant,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                token=token,
            )
            try:
                reader = PIPELINE_READERS["kandinsky"]
            except KeyError:
                raise ValueError(
                    "no Kandinsky folder reader is installed (the unclip.pipeline_readers entry "
                    "point); reinstall unclip (pip install -e . in a checkout)"
                ) from None
            return reader(folder, variant=variant), folder

        parts, folder = read(path, "Kandinsky decoder")
        if parts.pop("kind") != "decoder":
            raise ValueError(
                f"{path} is a Kandinsky 2.2 prior folder; load the decoder folder and pass this "
                f"one as prior=, e.g. KandinskyPipeline.from_pretrained(<decoder>, prior={path!r})"
            )
        prior_source = prior
        if prior is None and _holds_prior(folder / "prior"):
            prior_source = folder / "prior"  # save_pretrained's layout: the prior beside
        elif prior is None:
            prior_source = parts.pop("card_prior", None)
        parts.pop("card_prior", None)
        if prior_source not in (None, False):
            prior_parts, _ = read(prior_source, "Kandinsky prior")
            if prior_parts.pop("kind") != "prior":
                raise ValueError(
                    f"prior={prior_source!r} is a Kandinsky 2.2 decoder folder, not a prior one"
                )
            prior_parts.pop("card_prior", None)
            parts.update(prior_parts)
        pipe = cls(**parts, sampling=sampling)._freeze()
        if weights_dtype is not None:
            pipe.to(dtype=weights_dtype)
        pipe.autocast_dtype = autocast_dtype
        return pipe

    def _write_folder(self, path, model_card: Mapping) -> None:
        """diffusers' layouts (:func:`unclip.interop.kandinsky.write_kandinsky_folder`): the
        decoder's at ``path``, the prior's in ``path/prior``; :meth:`from_pretrained` reads both
        back. The pipeline's sampling defaults and resolution are not stored (diffusers' folders
        have no place for them): a reloaded pipeline has diffusers' defaults. A model card is not
        written: ``model_card=`` is refused rather than dropped."""
        fields = sorted(set(model_card) - {"repo_id"})  # repo_id: push_to_hub's own
        if fields:
            raise ValueError(
                "save_pretrained: a Kandinsky folder is written in diffusers' layouts, without a "
                f"model card; leave model_card out (got {', '.join(fields)})"
            )
        try:
            writer = PIPELINE_WRITERS["kandinsky"]
        except KeyError:
            raise ValueError(
                "no Kandinsky folder writer is installed (the unclip.pipeline_writers entry "
                "point); reinstall unclip (pip install -e . in a checkout)"
            ) from None
        writer(
            path,
            self.decoder,
            self.scheduler,
            prior=self.prior,
            clip=self.clip,
            prior_scheduler=self.prior_scheduler,
        )

    # ------------------------------------------------------------------ sampling
    @releases_gpu
    @torch.no_grad()
    def sample_image_embeds(
        self,
        prompt: Union[str, Sequence[str]],
        negative_prompt: Union[str, Sequence[str], None] = None,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        latents: Optional[torch.Tensor] = None,
        sampling: Optional[Mapping] = None,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(image_embeds, negative_image_embeds)`` ``[B·n, D]`` from the prior
        (:func:`~unclip.sampling.kandinsky.sample_prior_embeds`)."""
        if self.prior is None:
            raise ValueError(
                "this Kandinsky pipeline has no prior: load it with prior=<prior folder> or pass "
                "image embeddings to decode()"
            )
        assert self.clip is not None
        s = self.sampling_settings(sampling)["prior"]
        k = s.best_of
        if k > 1 and latents is not None:
            raise ValueError(
                "prior best_of > 1 draws its own candidates: give latents= or best_of, not both"
            )
        embeds, negative = sample_prior_embeds(
            self.prior,
            self._scheduler("prior", s),
            self.clip,
            prompt,
            negative_prompt,
            num_images_per_prompt=num_images_per_prompt * k,
            num_inference_steps=s.steps,
            guidance_scale=s.guidance_scale,
            generator=_per_candidate(generator, k),
            latents=latents,
            progress=self._progress(progress),
            callback=stage_callback(self, "prior", callback_on_step_end),
            autocast_dtype=self.autocast_dtype,
            on_stage=self._onload,
        )
        if k == 1:
            return embeds, negative
        best = self._best(embeds, prompt, num_images_per_prompt, k)
        return _pick(embeds, best, k), _pick(negative, best, k)

    def _best(self, image_embeds: torch.Tensor, prompt, n: int, k: int) -> torch.Tensor:
        """The index ``[B·n]`` of each image's candidate (of ``k`` adjacent rows of
        ``image_embeds``) closest in cosine to its prompt's CLIP text embedding."""
        assert self.clip is not None
        self._onload("clip")
        text = prior_text(self.clip, check_prompts(prompt)).text_embed
        text = text.repeat_interleave(n * k, dim=0).to(image_embeds)
        cos = torch.nn.functional.cosine_similarity(image_embeds.float(), text.float(), dim=-1)
        return cos.view(-1, k).argmax(dim=1)

    @releases_gpu
    @torch.no_grad()
    def decode(
        self,
        image_embeds: torch.Tensor,
        negative_image_embeds: torch.Tensor,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        latents: Optional[torch.Tensor] = None,
        sampling: Optional[Mapping] = None,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
        output_type: str = "latent",
    ):
        """Images of ``image_embeds [B, D]`` guided away from ``negative_image_embeds [B, D]``:
        latents ``[B·n, C, h, w]`` for ``output_type="latent"``, else decoded by MoVQ and
        returned as :func:`~unclip.utils.images.to_output` gives them."""
        check_output_type(output_type)
        height, width = self._size(height, width)
        if self.decoder.inpaint:
            raise ValueError(
                "this is an inpainting decoder (kandinsky-2-2-decoder-inpaint): it repaints "
                "masked images and cannot draw from noise alone"
            )
        s = self.sampling_settings(sampling)["decoder"]
        self._onload("decoder")
        x = sample_latents(
            self.decoder,
            self._scheduler("decoder", s),
            image_embeds.to(self.device),
            negative_image_embeds.to(self.device),
            height=height,
            width=width,
            num_inference_steps=s.steps,
            guidance_scale=s.guidance_scale,
            num_images_per_prompt=num_images_per_prompt,
            generator=generator,
            latents=latents,
            progress=self._progress(progress),
            callback=stage_callback(self, "decoder", callback_on_step_end),
            autocast_dtype=self.autocast_dtype,
        )
        if output_type == "latent":
            return x
        return to_output(self.decoder.decode(x), output_type)

    @releases_gpu
    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, Sequence[str]],
        negative_prompt: Union[str, Sequence[str], None] = None,
        num_inference_steps: Optional[int] = None,
        guidance_scale: Optional[float] = None,
        num_images_per_prompt: int = 1,
        height: Optional[int] = None,
        width: Optional[int] = None,
        prior_guidance_scale: Optional[float] = None,
        prior_num_inference_steps: Optional[int] = None,
        generator: Generator = None,
        latents: Optional[torch.Tensor] = None,
        prior_latents: Optional[torch.Tensor] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
        sampling: Optional[Mapping] = None,
        progress: bool = True,
    ):
        """Images for ``prompt`` (a string or a list), ``num_images_per_prompt`` each, of
        ``height × width`` pixels. Steps and guidance default to the pipeline's settings
        (diffusers': prior 25 / 4.0, decoder 100 / 4.0); the keywords or ``sampling={"prior":
        {...}, "decoder": {...}}`` override them. ``negative_prompt``: one per prompt.
        ``latents [B·n, C, h, w]``: the decoder's initial latents; ``prior_latents``: the
        prior's (see :func:`~unclip.sampling.kandinsky.sample_prior_embeds`).
        ``callback_on_step_end(pipe, step, timestep, {"stage", "latents"})`` runs after every
        step of both stages. Returns an :class:`~unclip.pipeline.output.UnCLIPOutput` (images as
        ``output_type`` says: ``"pil"``, ``"np"``, ``"pt"`` in [0, 1], ``"uint8"``, or
        ``"latent"``: the decoder's latents), or with ``return_dict=False`` the tuple
        ``(images,)``."""
        check_output_type(output_type)
        height, width = self._size(height, width)
        overrides = _editable(sampling)
        for stage, key, value in (
            ("prior", "steps", prior_num_inference_steps),
            ("prior", "guidance_scale", prior_guidance_scale),
            ("decoder", "steps", num_inference_steps),
            ("decoder", "guidance_scale", guidance_scale),
        ):
            if value is not None:
                overrides.setdefault(stage, {})[key] = value
        settings = self.sampling_settings(overrides)
        if isinstance(generator, (list, tuple)):
            # one generator per prompt (or per image): one per row of the stages' batches
            rows = len(check_prompts(prompt))
            generator = expand_generator(generator, rows, num_images_per_prompt, "generator")
        image_embeds, negative = self.sample_image_embeds(
            prompt,
            negative_prompt,
            num_images_per_prompt=num_images_per_prompt,
            generator=generator,
            latents=prior_latents,
            sampling=settings,
            progress=progress,
            callback_on_step_end=callback_on_step_end,
        )
        k = settings["decoder"].best_of
        if k > 1 and latents is not None:
            raise ValueError(
                "decoder best_of > 1 draws its own candidates: give latents= or best_of, not both"
            )
        images = self.decode(
            image_embeds.repeat_interleave(k, dim=0),
            negative.repeat_interleave(k, dim=0),
            height=height,
            width=width,
            generator=_per_candidate(generator, k),
            latents=latents,
            sampling=settings,
            progress=progress,
            callback_on_step_end=callback_on_step_end,
            output_type=output_type if k == 1 else "latent",
        )
        if k > 1:
            images = self._rerank_images(images, prompt, num_images_per_prompt, k, output_type)
        if not return_dict:
            return (images,)
        return UnCLIPOutput(images=images, image_embeds=image_embeds)

    def _rerank_images(self, latents, prompt, n: int, k: int, output_type: str):
        """Of ``k`` adjacent candidate latents per image, the one whose decoded image the CLIP's
        image tower puts closest to the prompt's text embedding, as ``output_type`` says."""
        assert self.clip is not None
        # scored a few candidates at a time, keeping only their embeddings: a large best_of at
        # full size would otherwise hold every decoded candidate at once; the winners are
        # decoded again (one decode per image more)
        embeds = []
        for rows in latents.split(RERANK_CHUNK):
            self._onload("decoder")
            images = self.decoder.decode(rows).float().clamp(-1, 1)
            self._onload("clip")
            embeds.append(self.clip.encode_image(images.to(self.clip.device)))
        best = self._best(torch.cat(embeds), prompt, n, k)
        chosen = _pick(latents, best, k)
        if output_type == "latent":
            return chosen
        self._onload("decoder")
        return to_output(self.decoder.decode(chosen).float().clamp(-1, 1), output_type)

    # ------------------------------------------------------------------ editing
    def _overrides(self, sampling, **flat) -> ResolvedSampling:
        """``sampling`` with diffusers' flat keywords (``stage_key=value``) folded in, resolved."""
        overrides = _editable(sampling)
        for name, value in flat.items():
            if value is not None:
                stage, key = name.split("__")
                overrides.setdefault(stage, {})[key] = value
        return self.sampling_settings(overrides)

    def _embeds(
        self, prompt, negative_prompt, image_embeds, negative_image_embeds, n, generator,
        settings, progress, callback_on_step_end,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The decoder's conditioning: the prior's embeddings of ``prompt`` (``n`` per prompt),
        or ``image_embeds`` given (``[B·n, D]``) with ``negative_image_embeds`` (default: the
        image tower's embedding of no image, as diffusers' prior gives without a negative
        prompt)."""
        if image_embeds is not None:
            if prompt is not None or negative_prompt is not None:
                raise ValueError(
                    "give prompt (and negative_prompt) or image_embeds, not both: the embeddings "
                    "replace the prior's"
                )
            if not isinstance(image_embeds, torch.Tensor) or image_embeds.ndim != 2:
                raise TypeError("image_embeds must be a [B, D] tensor")
            if negative_image_embeds is None:
                if self.clip is None:
                    raise ValueError(
                        "negative_image_embeds are needed with image_embeds on a pipeline "
                        "without a prior (its CLIP gives the default)"
                    )
                self._onload("clip")  # under model offload: the image tower makes it
                negative_image_embeds = zero_image_embed(self.clip, image_embeds.shape[0])
            if negative_image_embeds.shape != image_embeds.shape:
                raise ValueError(
                    f"negative_image_embeds {tuple(negative_image_embeds.shape)} must match "
                    f"image_embeds {tuple(image_embeds.shape)}"
                )
            return image_embeds.to(self.device), negative_image_embeds.to(self.device)
        if prompt is None:
            raise TypeError("give prompt, or image_embeds")
        return self.sample_image_embeds(
            prompt,
            negative_prompt,
            num_images_per_prompt=n,
            generator=generator,
            sampling=settings,
            progress=progress,
            callback_on_step_end=callback_on_step_end,
        )

    def _edit_conditioning(
        self, prompt, negative_prompt, image_embeds, negative_image_embeds, n, generator,
        sampling, flat, progress, callback_on_step_end,
    ):  # fmt: skip
        """An edit's resolved settings (``flat``: diffusers' decoder and prior steps and
        guidance), progress setting, conditioning (:meth:`_embeds`) and generator(s): a list of
        one per prompt (or per image) becomes one per row."""
        steps, guidance, prior_steps, prior_guidance = flat
        if isinstance(generator, (list, tuple)):
            rows = len(check_prompts(prompt)) if image_embeds is None else len(image_embeds)
            generator = expand_generator(generator, rows, n, "generator")
        settings = self._overrides(
            sampling,
            decoder__steps=steps,
            decoder__guidance_scale=guidance,
            prior__steps=prior_steps,
            prior__guidance_scale=prior_guidance,
        )
        progress = self._progress(progress)
        embeds, negative = self._embeds(
            prompt, negative_prompt, image_embeds, negative_image_embeds,
            n if image_embeds is None else 1, generator, settings, progress, callback_on_step_end,
        )  # fmt: skip
        return settings, progress, embeds, negative, generator

    def _finish(self, latents, output_type: str, return_dict: bool, embeds):
        images = latents if output_type == "latent" else to_output(
            self.decoder.decode(latents), output_type
        )  # fmt: skip
        if not return_dict:
            return (images,)
        return UnCLIPOutput(images=images, image_embeds=embeds)

    @releases_gpu
    @torch.no_grad()
    def img2img(
        self,
        image,
        prompt: Union[str, Sequence[str], None] = None,
        negative_prompt: Union[str, Sequence[str], None] = None,
        *,
        strength: float = 0.3,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: Optional[int] = None,
        guidance_scale: Optional[float] = None,
        prior_num_inference_steps: Optional[int] = None,
        prior_guidance_scale: Optional[float] = None,
        num_images_per_prompt: int = 1,
        image_embeds: Optional[torch.Tensor] = None,
        negative_image_embeds: Optional[torch.Tensor] = None,
        generator: Generator = None,
        sampling: Optional[Mapping] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
    ):
        """``image`` (one per prompt: PIL images or ``[B, 3, H, W]`` tensors in [-1, 1]) redrawn
        towards ``prompt``, as diffusers' ``KandinskyV22Img2ImgCombinedPipeline``: resized to
        ``height × width``, its latents noised ``strength`` of the way back (0.3: close to the
        image; 1: from noise) and denoised. ``image_embeds`` (``[B, D]``) replace the prior's."""
        check_output_type(output_type)
        height, width = self._size(height, width)
        n = check_count(num_images_per_prompt)
        flat = (
            num_inference_steps,
            guidance_scale,
            prior_num_inference_steps,
            prior_guidance_scale,
        )
        settings, progress, embeds, negative, generator = self._edit_conditioning(
            prompt, negative_prompt, image_embeds, negative_image_embeds, n, generator, sampling,
            flat, progress, callback_on_step_end,
        )  # fmt: skip
        dec = self.decoder
        if dec.inpaint:
            raise ValueError(
                "this is an inpainting decoder (kandinsky-2-2-decoder-inpaint): use inpaint(); "
                "image-to-image needs the text-to-image decoder"
            )
        pictures = img2img_inputs(image, height, width, dec.scale_factor, dec.latent_channels)
        per = _per_image(pictures, embeds, n, image_embeds is None, "img2img")
        s = settings["decoder"]
        self._onload("decoder")
        # the prior drew n rows per prompt; the decoder takes one image per embedding row
        latents = img2img_latents(
            dec,
            self._scheduler("decoder", s),
            embeds,
            negative,
            pictures.to(self.device).repeat_interleave(per, dim=0),
            strength=strength,
            num_inference_steps=s.steps,
            guidance_scale=s.guidance_scale,
            num_images_per_prompt=1 if image_embeds is None else n,
            generator=generator,
            progress=progress,
            callback=stage_callback(self, "decoder", callback_on_step_end),
            autocast_dtype=self.autocast_dtype,
        )
        return self._finish(latents, output_type, return_dict, embeds)

    @releases_gpu
    @torch.no_grad()
    def inpaint(
        self,
        image,
        mask_image,
        prompt: Union[str, Sequence[str], None] = None,
        negative_prompt: Union[str, Sequence[str], None] = None,
        *,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: Optional[int] = None,
        guidance_scale: Optional[float] = None,
        prior_num_inference_steps: Optional[int] = None,
        prior_guidance_scale: Optional[float] = None,
        num_images_per_prompt: int = 1,
        image_embeds: Optional[torch.Tensor] = None,
        negative_image_embeds: Optional[torch.Tensor] = None,
        generator: Generator = None,
        latents: Optional[torch.Tensor] = None,
        sampling: Optional[Mapping] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
    ):
        """Repaint ``image`` where ``mask_image`` is white (1) towards ``prompt`` and keep it where
        it is black (0), diffusers' convention since 0.19, with an inpainting decoder
        (``kandinsky-2-2-decoder-inpaint``); the inputs as
        :func:`~unclip.sampling.latent.inpaint_inputs` takes them, one per prompt."""
        check_output_type(output_type)
        height, width = self._size(height, width)
        if not self.decoder.inpaint:
            raise ValueError(
                "inpainting needs an inpainting decoder: load kandinsky-2-2-decoder-inpaint (its "
                "UNet reads the masked image too) with this prior"
            )
        n = check_count(num_images_per_prompt)
        flat = (
            num_inference_steps,
            guidance_scale,
            prior_num_inference_steps,
            prior_guidance_scale,
        )
        settings, progress, embeds, negative, generator = self._edit_conditioning(
            prompt, negative_prompt, image_embeds, negative_image_embeds, n, generator, sampling,
            flat, progress, callback_on_step_end,
        )  # fmt: skip
        pictures, repaint = inpaint_inputs(image, mask_image, height, width)
        per = _per_image(pictures, embeds, n, image_embeds is None, "inpaint")
        s = settings["decoder"]
        self._onload("decoder")
        out = inpaint_latents(
            self.decoder,
            self._scheduler("decoder", s),
            embeds,
            negative,
            pictures.to(self.device).repeat_interleave(per, dim=0),
            repaint.to(self.device).repeat_interleave(per, dim=0),
            height=height,
            width=width,
            num_inference_steps=s.steps,
            guidance_scale=s.guidance_scale,
            num_images_per_prompt=1 if image_embeds is None else n,
            generator=generator,
            latents=latents,
            progress=progress,
            callback=stage_callback(self, "decoder", callback_on_step_end),
            autocast_dtype=self.autocast_dtype,
        )
        return self._finish(out, output_type, return_dict, embeds)

    def _image_embed(self, image) -> torch.Tensor:
        """The prior's image tower's embedding ``[B, D]`` of PIL image(s) or a ``[B, 3, H, W]``
        tensor in [-1, 1] (what the prior was trained to produce)."""
        if self.clip is None:
            raise ValueError(
                "this Kandinsky pipeline has no prior, so no image tower to embed images with: "
                "load it with prior=<prior folder>"
            )
        self._onload("clip")
        return self.clip.encode_image(image).to(self.device)

    @releases_gpu
    @torch.no_grad()
    def variations(
        self,
        image,
        num_images: int = 1,
        *,
        height: Optional[int] = None,
        width: Optional[int] = None,
        generator: Generator = None,
        sampling: Optional[Mapping] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
    ):
        """``num_images`` new images of each input image (PIL image(s) or a tensor in [-1, 1]):
        its image-tower embedding decoded from noise (the paper's variations), guided away from
        the embedding of no image."""
        check_output_type(output_type)
        n = check_count(num_images, "num_images")
        embeds = self._image_embed(image)
        return self._decode_embeds(
            embeds.repeat_interleave(n, dim=0), height, width, generator, sampling, output_type,
            return_dict, progress, callback_on_step_end,
        )  # fmt: skip

    @releases_gpu
    @torch.no_grad()
    def mix(
        self,
        images_and_prompts: Sequence[Any],
        weights: Sequence[float],
        num_images: int = 1,
        *,
        height: Optional[int] = None,
        width: Optional[int] = None,
        generator: Generator = None,
        sampling: Optional[Mapping] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
    ):
        """Images of a weighted mix of prompts and images (diffusers' prior ``interpolate``): each
        prompt's prior embedding and each image's image-tower embedding, summed with ``weights``
        (one each, as given: weights summing to 1 keep the embedding's scale), then decoded
        ``num_images`` times, guided away from the embedding of no image. The prior draws each
        prompt's embedding from ``generator`` first, in order."""
        check_output_type(output_type)
        n = check_count(num_images, "num_images")
        items, ws = list(images_and_prompts), [float(w) for w in weights]
        if not items or len(items) != len(ws):
            raise ValueError(
                f"mix: {len(items)} images/prompts and {len(ws)} weights; give one weight each"
            )
        if not all(w == w and abs(w) != float("inf") for w in ws):
            raise ValueError(f"mix: weights must be finite numbers, got {ws}")
        settings = self.sampling_settings(sampling)
        progress = self._progress(progress)
        parts = []
        for item in items:
            if isinstance(item, str):
                embed, _ = self.sample_image_embeds(
                    item, generator=generator, sampling=settings, progress=progress,
                    callback_on_step_end=callback_on_step_end,
                )  # fmt: skip
            else:
                embed = self._image_embed(item)
                if embed.shape[0] != 1:
                    raise ValueError("mix: give each image on its own (one image per entry)")
            parts.append(embed)
        mixed = sum(w * e for w, e in zip(ws, parts))
        assert isinstance(mixed, torch.Tensor)
        return self._decode_embeds(
            mixed.repeat_interleave(n, dim=0), height, width, generator, settings, output_type,
            return_dict, progress, callback_on_step_end,
        )  # fmt: skip

    def _decode_embeds(
        self, embeds, height, width, generator, sampling, output_type, return_dict, progress,
        callback_on_step_end,
    ):  # fmt: skip
        assert self.clip is not None  # the callers embedded with it
        self._onload("clip")  # under model offload: the image tower makes it
        negative = zero_image_embed(self.clip, embeds.shape[0]).to(embeds)
        images = self.decode(
            embeds,
            negative,
            height=height,
            width=width,
            generator=generator,
            sampling=sampling,
            progress=progress,
            callback_on_step_end=callback_on_step_end,
            output_type=output_type,
        )
        if not return_dict:
            return (images,)
        return UnCLIPOutput(images=images, image_embeds=embeds)


def _per_candidate(generator: Generator, k: int) -> Generator:
    """A generator list of one per image made one per candidate row (each image's ``k``
    candidates draw in turn from its generator); a single generator (or None) as it is."""
    if k == 1 or not isinstance(generator, (list, tuple)):
        return generator
    return [g for g in generator for _ in range(k)]


def _pick(rows: torch.Tensor, best: torch.Tensor, k: int) -> torch.Tensor:
    """Row ``best[i]`` of each group of ``k`` adjacent rows of ``rows``."""
    grouped = rows.view(-1, k, *rows.shape[1:])
    return grouped[torch.arange(grouped.shape[0], device=grouped.device), best.to(grouped.device)]


def _holds_prior(folder) -> bool:
    """Whether ``folder`` holds a diffusers Kandinsky 2.2 prior layout (its model_index.json)."""
    import json
    from pathlib import Path

    index = Path(folder) / "model_index.json"
    if not index.is_file():
        return False
    try:
        return str(json.loads(index.read_text()).get("_class_name", "")).startswith(
            "KandinskyV22Prior"
        )
    except (ValueError, OSError):
        return False


def _per_image(
    pictures: torch.Tensor, embeds: torch.Tensor, n: int, sampled: bool, what: str
) -> int:
    """Embedding rows per input image (the prior drew ``n`` per prompt when ``sampled``), after
    checking that there is one image per prompt."""
    rows = embeds.shape[0] // (n if sampled else 1)
    if pictures.shape[0] != rows:
        raise ValueError(f"{what}: {pictures.shape[0]} images for {rows} prompts; give one each")
    return embeds.shape[0] // rows


def _scheduler_class(name: str) -> Any:
    from unclip.diffusion.schedulers import scheduler_class

    return scheduler_class(name)


def _editable(sampling: Optional[Mapping]) -> dict[str, Any]:
    """``sampling`` as ``{stage: {setting: value}}`` that diffusers' flat keywords can be folded
    into (a stage given as a :class:`KandinskySampling` becomes its fields)."""
    if sampling is not None and not isinstance(sampling, Mapping):
        raise TypeError(f"sampling must be a dict of stages, got {type(sampling).__name__}")
    out: dict[str, Any] = {}
    for stage, values in (sampling or {}).items():
        if isinstance(values, KandinskySampling):
            out[stage] = dataclasses.asdict(values)
        elif isinstance(values, Mapping):
            out[stage] = dict(values)
        else:
            out[stage] = values  # refused by the resolution, naming the stage
    return out
