"""``UnCLIPPipeline``: text → CLIP text encoding → prior → image embedding → decoder → upsamplers → image.

Each stage is a public method, and everything else composes from them::

    pipe = UnCLIPPipeline.from_pretrained("path/to/pipeline")        # or a diffusers/Karlo folder
    out = pipe(["a red circle", "a blue square"], num_images_per_prompt=2, generator=torch.Generator().manual_seed(0))
    out.images                      # list of PIL images at the last stage's resolution
    text = pipe.encode_text("a red circle")                     # TextEncoding [B, D], [B, L, W], [B, L]
    emb = pipe.sample_image_embeds(text)                        # [B, D] CLIP image embeddings
    small = pipe.decode(emb, text)                              # [B, 3, 64, 64] in [-1, 1]
    big = pipe.upsample(small)                                  # through every upsampler
    pipe.variations(pil_image, num_images=4)                    # image → CLIP embedding → decode
    pipe.interpolate("a red circle", "a blue square", num_steps=5)
    keep = pipe.rerank(small, ["a red circle"] * 4, k=4)         # best of each group of 4 by CLIP score

A pipeline may carry a second CLIP, ``reranker``, used only to choose among decoder candidates
(reranking); without one, the conditioning CLIP scores them. A pipeline folder is self-describing:
``unclip.json`` names the components and the default sampling settings; each component has its own
subfolder with ``config.json`` and safetensors weights.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from unclip.clip import FrozenCLIP, TextEncoding, check_prompts
from unclip.config import DiffusionConfig, SamplingConfig, from_dict, to_dict
from unclip.decoder import UnCLIPDecoder, UnCLIPUpsampler, upsample_low_res
from unclip.diffusion import (
    Generator,
    check_sampling_args,
    is_guided,
    make_scheduler,
    sample_loop,
    training_scheduler,
)
from unclip.images import as_image_input, to_output
from unclip.io import (
    BUNDLED,
    DEFAULT_MODEL,
    FOLDER_FORMATS,
    PIPELINE_FILE,
    bundled_model_path,
    load_components,
)
from unclip.pipeline_utils import (
    check_count,
    check_embeds,
    check_output_type,
    expand_generator,
    slerp,
    stage_kind,
)
from unclip.prior import UnCLIPPrior

__all__ = ["UnCLIPPipeline", "UnCLIPOutput", "slerp", "PIPELINE_FILE", "DEFAULT_SAMPLING"]

FORMAT_VERSION = 1

DEFAULT_SAMPLING = {
    "prior": SamplingConfig(scheduler="ddim", steps=25, guidance_scale=4.0, best_of=2),
    "decoder": SamplingConfig(scheduler="ddim", steps=25, guidance_scale=4.0),
    "upsampler": SamplingConfig(scheduler="ddim", steps=10, guidance_scale=1.0),
}
DEFAULT_DIFFUSION = {
    "prior": DiffusionConfig(prediction_type="sample"),
    "decoder": DiffusionConfig(prediction_type="epsilon"),
    "upsampler": DiffusionConfig(prediction_type="epsilon"),
}


@dataclass
class UnCLIPOutput:
    """Result of a pipeline call.

    ``images``: PIL list, ``np.ndarray [N, H, W, 3]`` uint8, or a tensor ``[N, 3, H, W]`` in [0, 1];
    ``image_embeds [N, D]`` the CLIP image embeddings decoded; ``text_embeds [N, D]``;
    ``stage_images``: ``{stage: tensor [N, 3, h, w] in [-1, 1]}`` when intermediates were requested.
    """

    images: Any
    image_embeds: torch.Tensor
    text_embeds: Optional[torch.Tensor] = None
    stage_images: dict = field(default_factory=dict)


def _cosines(clip: FrozenCLIP, images: torch.Tensor, text_embed: torch.Tensor) -> torch.Tensor:
    """Cosine ``[B]`` between ``clip``'s embeddings of images ``[B, 3, H, W]`` and text embeddings ``[B, D]``."""
    img = F.normalize(clip.encode_image(images), dim=-1)
    return (img * F.normalize(text_embed.to(img), dim=-1)).sum(-1)


class UnCLIPPipeline:
    """The unCLIP cascade (see module doc). Build from components or :meth:`from_pretrained`."""

    def __init__(
        self,
        clip: FrozenCLIP,
        prior: Optional[UnCLIPPrior],
        decoder: UnCLIPDecoder,
        upsamplers: Sequence[UnCLIPUpsampler] = (),
        diffusion: Optional[dict] = None,
        sampling: Optional[dict] = None,
        prior_clip_range: Optional[float] = 10.0,
        reranker: Optional[FrozenCLIP] = None,
    ):
        self.clip = clip
        if reranker is not None and not isinstance(reranker, FrozenCLIP):
            raise TypeError(
                f"reranker must be a FrozenCLIP (or None), got {type(reranker).__name__}"
            )
        # a CLIP used only to score decoder candidates (rerank); None: the conditioning CLIP scores them
        self.reranker = reranker
        # the prior sampler clips predicted x_0 (normalised embedding) to [-r, r]; None disables (Karlo: 5)
        self.prior_clip_range = None if prior_clip_range is None else float(prior_clip_range)
        self.prior = prior
        self.decoder = decoder
        self.upsamplers = list(upsamplers)
        self.diffusion: dict[str, DiffusionConfig] = {}
        self.sampling: dict[str, SamplingConfig] = {}
        for name in self.stage_names:
            kind = stage_kind(name)
            d = (diffusion or {}).get(name, DEFAULT_DIFFUSION[kind])
            s = (sampling or {}).get(name, DEFAULT_SAMPLING[kind])
            self.diffusion[name] = (
                d
                if isinstance(d, DiffusionConfig)
                else from_dict(DiffusionConfig, d, prefix=f"diffusion.{name}")
            )
            self.sampling[name] = (
                copy.deepcopy(s)
                if isinstance(s, SamplingConfig)
                else from_dict(SamplingConfig, s, prefix=f"sampling.{name}")
            )
        self._check_components()
        for m in self.modules().values():
            m.eval()
        self._null_text: Optional[TextEncoding] = None
        self._autocast_dtype: Optional[torch.dtype] = None

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

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    def modules(self) -> dict[str, torch.nn.Module]:
        mods = {"clip": self.clip, "decoder": self.decoder}
        if self.prior is not None:
            mods["prior"] = self.prior
        mods.update(zip(self.upsampler_names, self.upsamplers))
        if self.reranker is not None:
            mods["reranker"] = self.reranker
        return mods

    @property
    def rerank_clip(self) -> FrozenCLIP:
        """The CLIP that scores candidates in :meth:`rerank`: the ``reranker`` if the pipeline has one, else
        the conditioning CLIP."""
        return self.reranker if self.reranker is not None else self.clip

    def to(self, device=None, dtype=None, memory_format=None) -> UnCLIPPipeline:
        """Move every component; ``memory_format=torch.channels_last`` stores the image networks' conv
        weights NHWC, which makes their activations NHWC too (faster convolutions on CPUs with oneDNN,
        same results to float rounding; see benchmarks/README.md)."""
        kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        for m in self.modules().values():
            m.to(**kwargs)
        if memory_format is not None:
            for m in [self.decoder, *self.upsamplers]:
                m.to(memory_format=memory_format)
        self._null_text = None
        return self

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """``None`` (default: full precision) or ``torch.bfloat16``/``torch.float16``: run every denoising
        network call under ``torch.autocast`` in that dtype. Weights, latents, guidance and the scheduler
        stay in the pipeline's dtype. On CPUs with native bf16 (AVX512-BF16/AMX) this is faster and changes
        images slightly (see benchmarks/README.md)."""
        return self._autocast_dtype

    @autocast_dtype.setter
    def autocast_dtype(self, dtype: Optional[torch.dtype]) -> None:
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"autocast_dtype must be None or a torch.dtype, got {type(dtype).__name__}"
            )
        if dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"autocast_dtype must be None, torch.bfloat16 or torch.float16, got {dtype}"
            )
        self._autocast_dtype = dtype

    def denoisers(self) -> dict[str, torch.nn.Module]:
        """The networks called once per sampling step (prior transformer, decoder UNet, upsampler UNets)."""
        nets = {}
        if self.prior is not None:
            nets["prior"] = self.prior.transformer
        nets["decoder"] = self.decoder.unet
        for name, up in zip(self.upsampler_names, self.upsamplers):
            nets[name] = up.unet
            if up.final_unet is not None:
                nets[f"{name}.final"] = up.final_unet
        return nets

    def compile(self, **kwargs) -> UnCLIPPipeline:
        """``torch.compile`` every network in :meth:`denoisers` in place (``kwargs`` go to ``torch.compile``,
        e.g. ``mode="max-autotune"``); weights and state-dict names are unchanged. The first call of each
        stage compiles (minutes for a mid-size UNet on a CPU); see benchmarks/README.md for when it pays."""
        for net in self.denoisers().values():
            net.compile(**kwargs)
        return self

    def _check_components(self) -> None:
        d, w, L = self.clip.embed_dim, self.clip.text_width, self.clip.context_length
        if self.prior is not None:
            pc = self.prior.config
            if pc.embed_dim != d:
                raise ValueError(
                    f"prior embed_dim {pc.embed_dim} != CLIP embed_dim {d} (clip: {self.clip.model_name})"
                )
            if pc.text_width != w:
                raise ValueError(f"prior text_width {pc.text_width} != CLIP text width {w}")
            if pc.context_length != L:
                raise ValueError(
                    f"prior context_length {pc.context_length} != CLIP context length {L}"
                )
        if self.reranker is not None and not self.reranker.has_vision:
            raise ValueError(
                f"reranker CLIP {self.reranker.model_name!r} has no image tower, so it cannot score "
                f"candidates; use a CLIP with image-tower weights"
            )
        dc = self.decoder.config
        if dc.embed_dim != d:
            raise ValueError(
                f"decoder embed_dim {dc.embed_dim} != CLIP embed_dim {d} (clip: {self.clip.model_name})"
            )
        if dc.use_text_tokens and dc.text_width != w:
            raise ValueError(f"decoder text_width {dc.text_width} != CLIP text width {w}")
        size = dc.sample_size
        for name, up in zip(self.upsampler_names, self.upsamplers):
            if up.config.low_res_size != size:
                raise ValueError(
                    f"upsampler {name} expects {up.config.low_res_size}px input but the previous "
                    f"stage makes {size}px images"
                )
            size = up.config.sample_size

    # ------------------------------------------------------------------ persistence
    def save_pretrained(
        self, path: Union[str, os.PathLike], safe_serialization: bool = True
    ) -> None:
        """Write the self-describing folder: ``unclip.json`` + one subfolder per component."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.clip.save_pretrained(path / "clip")
        if self.prior is not None:
            self.prior.save_pretrained(path / "prior", safe_serialization=True)
        self.decoder.save_pretrained(path / "decoder", safe_serialization=True)
        for name, up in zip(self.upsampler_names, self.upsamplers):
            up.save_pretrained(path / name, safe_serialization=True)
        if self.reranker is not None:
            self.reranker.save_pretrained(path / "reranker")
        index = {
            "format": "unclip-pipeline",
            "version": FORMAT_VERSION,
            "components": {
                "clip": "clip",
                "prior": "prior" if self.prior is not None else None,
                "decoder": "decoder",
                "upsamplers": self.upsampler_names,
                "reranker": "reranker" if self.reranker is not None else None,
            },
            "diffusion": {k: to_dict(v) for k, v in self.diffusion.items()},
            "sampling": {k: to_dict(v) for k, v in self.sampling.items()},
            "prior_clip_range": self.prior_clip_range,
        }
        (path / PIPELINE_FILE).write_text(json.dumps(index, indent=2))

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike, None] = None) -> UnCLIPPipeline:
        """Load a folder written by :meth:`save_pretrained`, or a diffusers ``UnCLIPPipeline`` folder.

        ``path=None`` or ``"shapes"`` loads the bundled offline shapes model.
        """
        if path is None or str(path) in BUNDLED:
            path = bundled_model_path(str(path or DEFAULT_MODEL))
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"pipeline folder not found: {path}")
        if not (path / PIPELINE_FILE).is_file():
            for marker, reader in FOLDER_FORMATS.items():
                if (path / marker).is_file():
                    return reader(path)
            known = "".join(f" nor a {m}" for m in FOLDER_FORMATS)
            raise ValueError(
                f"{path} is not an unclip pipeline folder: it has no {PIPELINE_FILE}{known}"
            )
        index = json.loads((path / PIPELINE_FILE).read_text())
        comps = index.get("components", {})

        def sub(name):
            folder = path / name
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(
                    f"pipeline component {name!r} is missing: expected {folder}/config.json "
                    f"and its weights"
                )
            return folder

        clip = FrozenCLIP.from_pretrained(sub(comps.get("clip", "clip")))
        prior = UnCLIPPrior.from_pretrained(sub(comps["prior"])) if comps.get("prior") else None
        decoder = UnCLIPDecoder.from_pretrained(sub(comps.get("decoder", "decoder")))
        ups = [UnCLIPUpsampler.from_pretrained(sub(n)) for n in comps.get("upsamplers", [])]
        reranker = (
            FrozenCLIP.from_pretrained(sub(comps["reranker"])) if comps.get("reranker") else None
        )
        pipe = cls(
            clip,
            prior,
            decoder,
            ups,
            diffusion=index.get("diffusion"),
            sampling=index.get("sampling"),
            prior_clip_range=index.get("prior_clip_range", 10.0),
            reranker=reranker,
        )
        for m in pipe.modules().values():
            m.eval().requires_grad_(False)
        return pipe

    @classmethod
    def from_components(
        cls,
        clip: Union[str, os.PathLike],
        decoder: Union[str, os.PathLike],
        prior: Union[str, os.PathLike, None] = None,
        upsamplers: Sequence[Union[str, os.PathLike]] = (),
        reranker: Union[str, os.PathLike, None] = None,
    ) -> UnCLIPPipeline:
        """Assemble a pipeline from component folders exported by the training commands
        (``<output_dir>/final/<name>``, each with ``config.json``, weights and ``unclip_stage.json``);
        ``reranker``: a CLIP folder (e.g. ``unclip train-clip``'s ``<output_dir>/clip``) that scores decoder
        candidates instead of the conditioning CLIP."""
        parts = load_components(
            clip, decoder, prior, upsamplers, DEFAULT_DIFFUSION, DEFAULT_SAMPLING
        )
        pipe = cls(
            *parts, reranker=FrozenCLIP.from_pretrained(reranker) if reranker is not None else None
        )
        for m in pipe.modules().values():
            m.eval().requires_grad_(False)
        return pipe

    # ------------------------------------------------------------------ settings
    def _settings(self, stage: str, overrides: Optional[dict]) -> SamplingConfig:
        s = copy.deepcopy(self.sampling[stage])
        over = dict((overrides or {}).get("upsamplers", {})) if stage.startswith("sr") else {}
        over.update((overrides or {}).get(stage, {}))
        for k, v in over.items():
            if not hasattr(s, k):
                raise ValueError(
                    f"unknown sampling setting {k!r} for stage {stage}; valid: "
                    f"{[f.name for f in dataclasses.fields(SamplingConfig)]}"
                )
            setattr(s, k, v)
        check_sampling_args(stage, s.scheduler, s.steps, s.guidance_scale)
        if isinstance(s.best_of, bool) or not isinstance(s.best_of, int) or s.best_of < 1:
            raise ValueError(f"{stage}: best_of must be an integer >= 1, got {s.best_of!r}")
        if stage.startswith("sr") and s.best_of != 1:
            raise ValueError(
                f"{stage}: best_of must be 1 for an upsampler (candidates are chosen by the prior's "
                f"and the decoder's best_of), got {s.best_of}"
            )
        return s

    def _scheduler(self, stage: str, s: SamplingConfig):
        kind = stage_kind(stage)
        learned = kind == "decoder" and self.decoder.config.learned_variance
        clip_range = self.prior_clip_range if kind == "prior" else 1.0
        return make_scheduler(
            s.scheduler,
            self.diffusion[stage],
            clip_sample_range=clip_range,
            learned_variance=learned,
        )

    # ------------------------------------------------------------------ stages
    def encode_text(self, prompt: Union[str, Sequence[str]]) -> TextEncoding:
        """Prompts → :class:`TextEncoding` (``text_embed [B,D]``, ``text_tokens [B,L,W]``, ``text_mask [B,L]``)."""
        return self.clip.encode_text(check_prompts(prompt))

    def null_text(self, batch: int) -> TextEncoding:
        """The unconditional caption (CLIP encoding of ``""``) repeated ``batch`` times."""
        if self._null_text is None:
            self._null_text = self.clip.encode_text([""])
        return self._null_text.repeat_interleave(batch)

    def _as_text(self, text) -> TextEncoding:
        return text if isinstance(text, TextEncoding) else self.encode_text(text)

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
    ):
        """Prior: prompts or a :class:`TextEncoding` ``[B]`` → CLIP image embeddings ``[B·n, D]``.

        With ``best_of = N > 1`` it samples N candidates per image and keeps the one with the highest dot
        product with the text embedding (paper §2.2). ``return_candidates`` also returns the candidates
        ``[B·n, N, D]``.
        """
        if self.prior is None:
            raise ValueError(
                "this pipeline has no prior; pass image embeddings to decode() directly"
            )
        s = self._settings("prior", sampling)
        text = self._as_text(text)
        n, N = check_count(num_images_per_prompt), s.best_of
        b = len(text)
        gen = expand_generator(generator, b, n * N, "sample_image_embeds")
        cond = text.repeat_interleave(n * N).to(device=self.device)
        batch = b * n * N
        if is_guided(s.guidance_scale):
            null = self.null_text(batch).to(device=self.device)
            cond = TextEncoding(
                torch.cat([null.text_embed, cond.text_embed]),
                torch.cat([null.text_tokens, cond.text_tokens]),
                torch.cat([null.text_mask, cond.text_mask]),
            )
        sched = self._scheduler("prior", s)
        x = sample_loop(
            lambda x_in, t: self.prior(x_in, t, cond),
            (batch, self.clip.embed_dim),
            sched,
            num_steps=s.steps,
            guidance_scale=s.guidance_scale,
            generator=gen,
            device=self.device,
            dtype=self.prior.dtype,
            latents=latents,
            progress=progress,
            desc="prior",
            autocast_dtype=self.autocast_dtype,
        )
        cands = self.prior.denormalize(x.float()).view(b * n, N, -1)
        text_embed = text.text_embed.repeat_interleave(n, dim=0).to(cands)
        scores = (F.normalize(cands, dim=-1) * text_embed[:, None]).sum(-1)  # [B·n, N]
        best = cands[torch.arange(b * n), scores.argmax(dim=1)]
        return (best, cands) if return_candidates else best

    @torch.no_grad()
    def decode(
        self,
        image_embed: torch.Tensor,
        text=None,
        generator: Generator = None,
        sampling: Optional[dict] = None,
        latents: Optional[torch.Tensor] = None,
        progress: bool = True,
    ) -> torch.Tensor:
        """Decoder: ``image_embed [B, D]`` (+ optional captions/TextEncoding with B rows) → ``[B, 3, s, s]``
        in [-1, 1] at the decoder's resolution. Without text the empty caption is used."""
        s = self._settings("decoder", sampling)
        image_embed = check_embeds(image_embed, self.clip.embed_dim)
        b = image_embed.shape[0]
        text = self.null_text(b) if text is None else self._as_text(text)
        if len(text) != b:
            raise ValueError(f"decode: {b} image embeddings but {len(text)} captions")
        text = text.to(device=self.device)
        image_embed = image_embed.to(self.device)
        drop = None
        if is_guided(s.guidance_scale):
            null = self.null_text(b).to(device=self.device)
            text = TextEncoding(
                torch.cat([null.text_embed, text.text_embed]),
                torch.cat([null.text_tokens, text.text_tokens]),
                torch.cat([null.text_mask, text.text_mask]),
            )
            image_embed = torch.cat([image_embed, image_embed])
            drop = torch.arange(2 * b, device=self.device) < b
        cond = self.decoder.condition(image_embed, text, drop)
        size = self.decoder.config.sample_size
        sched = self._scheduler("decoder", s)
        x = sample_loop(
            lambda x_in, t: self.decoder(x_in, t, cond=cond),
            (b, 3, size, size),
            sched,
            num_steps=s.steps,
            guidance_scale=s.guidance_scale,
            generator=generator,
            device=self.device,
            dtype=self.decoder.dtype,
            latents=latents,
            learned_variance=self.decoder.config.learned_variance,
            progress=progress,
            desc="decoder",
            autocast_dtype=self.autocast_dtype,
        )
        return x.float().clamp(-1, 1)

    @torch.no_grad()
    def upsample(
        self,
        images: torch.Tensor,
        generator: Generator = None,
        sampling: Optional[dict] = None,
        stages: Optional[Sequence[str]] = None,
        return_intermediates: bool = False,
        progress: bool = True,
    ):
        """Upsamplers: ``[B, 3, h, w]`` in [-1, 1] → ``[B, 3, H, W]`` through each upsampler in turn
        (or only those named in ``stages``)."""
        if not isinstance(images, torch.Tensor) or images.ndim != 4:
            raise TypeError("upsample: images must be a tensor [B, 3, h, w] in [-1, 1]")
        out, inter = images.to(self.device).float(), {}
        for name, up in zip(self.upsampler_names, self.upsamplers):
            if stages is not None and name not in stages:
                continue
            if out.shape[-1] != up.config.low_res_size:
                raise ValueError(
                    f"{name} expects {up.config.low_res_size}px input, got {out.shape[-1]}px"
                )
            s = self._settings(name, sampling)
            out = self._upsample_one(name, up, out, s, generator, progress)
            inter[name] = out
        return (out, inter) if return_intermediates else out

    def _upsample_one(self, name, up, low, s, generator, progress):
        b, size = low.shape[0], up.config.sample_size
        low_up = upsample_low_res(low, size, clamp=up.config.clamp_low_res)
        level = int(up.config.noise_level)
        levels = torch.full((b,), level, dtype=torch.long, device=self.device)
        if level > 0:
            from diffusers.utils.torch_utils import randn_tensor

            noise = randn_tensor(
                low_up.shape, generator=generator, device=self.device, dtype=low_up.dtype
            )
            low_up = training_scheduler(self.diffusion[name]).add_noise(low_up, noise, levels.cpu())
        guided = is_guided(s.guidance_scale)
        if guided:  # unconditional = no low-res information (zeros)
            low_up = torch.cat([torch.zeros_like(low_up), low_up])
            levels = torch.cat([levels, levels])
        sched = self._scheduler(name, s)

        def denoise(x_in, t):
            final = bool(t == sched.timesteps[-1])
            return up(x_in, t, low_up, levels, final_step=final)

        x = sample_loop(
            denoise,
            (b, 3, size, size),
            sched,
            num_steps=s.steps,
            guidance_scale=s.guidance_scale,
            generator=generator,
            device=self.device,
            dtype=up.dtype,
            progress=progress,
            desc=name,
            autocast_dtype=self.autocast_dtype,
        )
        return x.float().clamp(-1, 1)

    # ------------------------------------------------------------------ composed
    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, Sequence[str]],
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        sampling: Optional[dict] = None,
        output_type: str = "pil",
        rerank_candidates: Optional[int] = None,
        return_intermediates: bool = False,
        progress: bool = True,
    ) -> UnCLIPOutput:
        """Text → images through every stage.

        ``generator``: one ``torch.Generator``, one per prompt, or one per image. ``sampling``: per-stage
        overrides, e.g. ``{"prior": {"steps": 10}, "decoder": {"guidance_scale": 3}, "upsamplers": {...}}``.
        ``rerank_candidates = K > 1`` decodes K base-resolution candidates per image and keeps the one
        CLIP (:attr:`rerank_clip`) scores closest to the prompt before upsampling (as DALL-E did); ``None``
        uses the decoder's ``best_of`` sampling setting. ``output_type``: ``pil``, ``np`` (uint8
        ``[N, H, W, 3]``) or ``pt`` (float ``[N, 3, H, W]`` in [0, 1]).
        """
        prompts = check_prompts(prompt)
        check_output_type(output_type)
        n = check_count(num_images_per_prompt)
        for stage in self.stage_names:
            self._settings(stage, sampling)  # validate everything before any compute
        k = (
            self._settings("decoder", sampling).best_of
            if rerank_candidates is None
            else rerank_candidates
        )
        k = check_count(k, "rerank_candidates")
        text = self.encode_text(prompts)
        gen = expand_generator(generator, len(prompts), n * k, "generator")
        text_k = text.repeat_interleave(n * k)
        embeds = self.sample_image_embeds(text_k, 1, gen, sampling, progress=progress)
        small = self.decode(embeds, text_k, gen, sampling, progress=progress)
        keep = self.rerank(small, [p for p in prompts for _ in range(n * k)], k)
        small, embeds, text_k = small[keep], embeds[keep], text_k[keep]
        gen = gen[::k] if isinstance(gen, list) else gen
        final, inter = self.upsample(
            small, gen, sampling, return_intermediates=True, progress=progress
        )
        stage_images = {"decoder": small, **inter} if return_intermediates else {}
        return UnCLIPOutput(to_output(final, output_type), embeds, text_k.text_embed, stage_images)

    @torch.no_grad()
    def rerank(
        self, images: torch.Tensor, prompts: Union[str, Sequence[str]], k: int
    ) -> torch.Tensor:
        """Indices ``[B]`` of the best of each consecutive group of ``k`` candidates (``images [B·k, 3, H, W]``
        in [-1, 1]) by the cosine between :attr:`rerank_clip`'s embeddings of the image and of its prompt.
        ``prompts``: one per image (``B·k``), one per group (``B``), or one string for all; ``k = 1`` keeps
        every image."""
        k = check_count(k, "k")
        if images.shape[0] % k:
            raise ValueError(f"rerank: {images.shape[0]} images are not groups of {k} candidates")
        if k == 1:
            return torch.arange(images.shape[0])
        if isinstance(prompts, torch.Tensor):
            raise TypeError(
                "rerank takes the prompts (strings), not text embeddings: the reranking CLIP "
                "(pipe.rerank_clip) encodes them itself"
            )
        prompts = (
            [prompts] * images.shape[0] if isinstance(prompts, str) else check_prompts(prompts)
        )
        if len(prompts) == images.shape[0] // k:
            prompts = [p for p in prompts for _ in range(k)]
        if len(prompts) != images.shape[0]:
            raise ValueError(
                f"rerank: {len(prompts)} prompts for {images.shape[0]} images in groups of {k}; "
                f"give one prompt per image or one per group"
            )
        scorer = self.rerank_clip
        scores = _cosines(scorer, images, scorer.encode_text(prompts).text_embed).view(-1, k)
        return torch.arange(scores.shape[0]) * k + scores.argmax(1).cpu()

    @torch.no_grad()
    def clip_scores(self, images: torch.Tensor, text_embed: torch.Tensor) -> torch.Tensor:
        """Cosine similarity ``[B]`` between images ``[B, 3, H, W]`` in [-1, 1] and text embeddings ``[B, D]``."""
        return _cosines(self.clip, images, text_embed)

    @torch.no_grad()
    def variations(
        self,
        image,
        num_images: int = 1,
        generator: Generator = None,
        caption: Optional[str] = None,
        sampling: Optional[dict] = None,
        output_type: str = "pil",
        progress: bool = True,
    ) -> UnCLIPOutput:
        """Image → CLIP image embedding → ``num_images`` decodings (paper §3.1)."""
        check_output_type(output_type)
        n = check_count(num_images, "num_images")
        embed = self.clip.encode_image(as_image_input(image))
        if embed.shape[0] != 1:
            raise ValueError("variations takes one image; call it once per image")
        embeds = embed.repeat(n, 1)
        text = self.encode_text([caption] * n) if caption is not None else None
        gen = expand_generator(generator, 1, n, "generator")
        small = self.decode(embeds, text, gen, sampling, progress=progress)
        final = self.upsample(small, gen, sampling, progress=progress)
        return UnCLIPOutput(to_output(final, output_type), embeds)

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
    ) -> UnCLIPOutput:
        """Slerp between the CLIP image embeddings of two images or two prompts (paper §3.2).

        Prompts go through the prior first. Every frame is decoded from the same initial noise so the
        frames differ only by the embedding.
        """
        check_output_type(output_type)
        if check_count(num_steps, "num_steps") < 2:
            raise ValueError("interpolate: num_steps must be >= 2")
        seed_gen = generator if generator is not None else torch.Generator().manual_seed(0)
        ends = []
        for x in (start, end):
            if isinstance(x, str):
                ends.append(self.sample_image_embeds(x, 1, seed_gen, sampling, progress=progress))
            else:
                ends.append(self.clip.encode_image(as_image_input(x)))
        ws = torch.linspace(0, 1, num_steps)
        embeds = torch.cat([slerp(ends[0], ends[1], float(w)) for w in ws])
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=seed_gen))
        gens = [torch.Generator().manual_seed(seed) for _ in range(num_steps)]
        small = self.decode(embeds, None, gens, sampling, progress=progress)
        final = self.upsample(small, gens, sampling, progress=progress)
        return UnCLIPOutput(to_output(final, output_type), embeds)
