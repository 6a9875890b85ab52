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
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
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

__all__ = [
    "UnCLIPPipeline",
    "UnCLIPOutput",
    "slerp",
    "PIPELINE_FILE",
    "DEFAULT_SAMPLING",
    "SAMPLING_FIELDS",
    "EVERY_UPSAMPLER",
    "generate_to_folder",
]

FORMAT_VERSION = 1

DEFAULT_SAMPLING = {
    "prior": SamplingConfig(scheduler="ddim", steps=25, guidance_scale=4.0, best_of=2),
    "decoder": SamplingConfig(scheduler="ddim", steps=25, guidance_scale=4.0),
    "upsampler": SamplingConfig(scheduler="ddim", steps=10, guidance_scale=1.0),
}
#: the fields a ``sampling=`` override may set for a stage
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingConfig))
#: the ``sampling=`` key whose settings apply to every upsampler (a stage's own key wins)
EVERY_UPSAMPLER = "upsampler"

#: ``callback_on_step_end(pipe, step, timestep, callback_kwargs) -> dict | None``
StepCallback = Callable[["UnCLIPPipeline", int, torch.Tensor, dict], Optional[dict]]

DEFAULT_DIFFUSION = {
    "prior": DiffusionConfig(prediction_type="sample"),
    "decoder": DiffusionConfig(prediction_type="epsilon"),
    "upsampler": DiffusionConfig(prediction_type="epsilon"),
}


@dataclass
class UnCLIPOutput:
    """Result of a pipeline call.

    ``images``: PIL list, ``np.ndarray [N, H, W, 3]`` uint8, or a tensor ``[N, 3, H, W]`` in [0, 1];
    ``image_embeds [N, D]`` the CLIP image embeddings decoded (the prior's chosen ones, or those
    given); ``text_embeds [N, D]``; ``stage_images``: ``{stage: tensor [N, 3, h, w] in [-1, 1]}``
    when intermediates were requested; ``timings``: wall-clock seconds per stage that ran (``prior``
    includes the text encoding when the prior runs, ``decoder`` includes reranking).
    """

    images: Any
    image_embeds: torch.Tensor
    text_embeds: Optional[torch.Tensor] = None
    stage_images: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    def save(
        self,
        folder: Union[str, os.PathLike],
        prompts: Sequence[str],
        record: Optional[dict] = None,
        grid_cols: Optional[int] = None,
        seeds: Optional[Sequence[int]] = None,
    ) -> dict:
        """Write ``NNN_MM.png`` (prompt ``NNN``, image ``MM`` of it), ``grid.png`` and, with
        ``record``, ``generate.json`` (``record`` plus the file list, with each prompt's seed from
        ``seeds``) to ``folder``; returns the record. ``images`` must be PIL images in prompt order
        (``output_type="pil"``)."""
        from unclip.images import image_grid

        if not isinstance(self.images, list):
            raise TypeError(
                "UnCLIPOutput.save needs PIL images (call the pipeline with output_type='pil')"
            )
        prompts = list(prompts)
        if not prompts or len(self.images) % len(prompts):
            raise ValueError(
                f"save: {len(self.images)} images do not split over {len(prompts)} prompts"
            )
        per = len(self.images) // len(prompts)
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        files = []
        for i, prompt in enumerate(prompts):
            for j in range(per):
                f = folder / f"{i:03d}_{j:02d}.png"
                self.images[i * per + j].save(f)
                entry = {"file": f.name, "prompt": prompt}
                if seeds is not None:
                    entry["seed"] = seeds[i]
                files.append({**entry, "index": j})
        image_grid(self.images, cols=grid_cols).save(folder / "grid.png")
        out = {**(record or {}), "files": files, "grid": "grid.png"}
        if record is not None:
            (folder / "generate.json").write_text(json.dumps(out, indent=2))
        return out


def _cosines(clip: FrozenCLIP, images: torch.Tensor, text_embed: torch.Tensor) -> torch.Tensor:
    """Cosine ``[B]`` between ``clip``'s embeddings of images ``[B, 3, H, W]`` and text embeddings
    ``[B, D]``."""
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
        # a CLIP used only to score decoder candidates (rerank); None: the conditioning CLIP scores
        # them
        self.reranker = reranker
        # the prior sampler clips predicted x_0 (normalised embedding) to [-r, r]; None disables
        # (Karlo: 5)
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
        """The CLIP that scores decoder candidates in :meth:`rerank`: the ``reranker`` component if
        the pipeline has one, else the conditioning CLIP (``clip``)."""
        return self.reranker if self.reranker is not None else self.clip

    def to(self, device=None, dtype=None, memory_format=None) -> UnCLIPPipeline:
        """Move every component; ``memory_format=torch.channels_last`` stores the image networks'
        conv weights NHWC, which makes their activations NHWC too (faster convolutions on CPUs with
        oneDNN, same results to float rounding; see benchmarks/README.md)."""
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
        """``None`` (default: full precision) or ``torch.bfloat16``/``torch.float16``: run every
        denoising network call under ``torch.autocast`` in that dtype. Weights, latents, guidance
        and the scheduler stay in the pipeline's dtype. On CPUs with native bf16 (AVX512-BF16/AMX)
        this is faster and changes images slightly (see benchmarks/README.md)."""
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
        """The networks called once per sampling step (prior transformer, decoder UNet, upsampler
        UNets)."""
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
        """``torch.compile`` every network in :meth:`denoisers` in place (``kwargs`` go to
        ``torch.compile``, e.g. ``mode="max-autotune"``); weights and state-dict names are
        unchanged. The first call of each stage compiles (minutes for a mid-size UNet on a CPU); see
        benchmarks/README.md for when it pays."""
        for net in self.denoisers().values():
            net.compile(**kwargs)
        return self

    def _check_components(self) -> None:
        d, w, L = self.clip.embed_dim, self.clip.text_width, self.clip.context_length
        if self.prior is not None:
            pc = self.prior.config
            if pc.embed_dim != d:
                raise ValueError(
                    f"prior embed_dim {pc.embed_dim} != CLIP embed_dim {d} "
                    f"(clip: {self.clip.model_name})"
                )
            if pc.text_width != w:
                raise ValueError(f"prior text_width {pc.text_width} != CLIP text width {w}")
            if pc.context_length != L:
                raise ValueError(
                    f"prior context_length {pc.context_length} != CLIP context length {L}"
                )
        if self.reranker is not None and not self.reranker.has_vision:
            raise ValueError(
                f"reranker CLIP {self.reranker.model_name!r} has no image tower, so it cannot "
                "score candidates; use a CLIP with image-tower weights"
            )
        dc = self.decoder.config
        if dc.embed_dim != d:
            raise ValueError(
                f"decoder embed_dim {dc.embed_dim} != CLIP embed_dim {d} "
                f"(clip: {self.clip.model_name})"
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
        """Load a folder written by :meth:`save_pretrained`, or a diffusers ``UnCLIPPipeline``
        folder.

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
        (``<output_dir>/final/<name>``, each with ``config.json``, weights and
        ``unclip_stage.json``); ``reranker``: a CLIP folder (e.g. ``unclip train-clip``'s
        ``<output_dir>/clip``) that scores decoder candidates instead of the conditioning CLIP."""
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
    def sampling_settings(self, sampling: Optional[Mapping] = None) -> dict[str, SamplingConfig]:
        """The settings every stage samples with: ``{stage: SamplingConfig}`` for
        :attr:`stage_names`.

        ``sampling``: overrides ``{key: {field: value}}``; a key is a stage name or ``"upsampler"``
        (every upsampler; an upsampler's own key wins), a field one of :data:`SAMPLING_FIELDS`. A
        value may also be a :class:`SamplingConfig`. ``"prior"`` and ``"upsampler"`` may be given
        for a pipeline without that stage (they are checked, then unused). Unknown keys or fields
        and invalid values are a ``ValueError`` naming them; the result is a copy (changing it
        changes nothing)."""
        over = self._check_overrides(sampling)
        out = {}
        for stage in self.stage_names:
            s = copy.deepcopy(self.sampling[stage])
            merged = dict(over.get(EVERY_UPSAMPLER, {})) if stage_kind(stage) == "upsampler" else {}
            merged.update(over.get(stage, {}))
            for k, v in merged.items():
                setattr(s, k, v)
            check_sampling_args(stage, s.scheduler, s.steps, s.guidance_scale)
            if isinstance(s.best_of, bool) or not isinstance(s.best_of, int) or s.best_of < 1:
                raise ValueError(f"{stage}: best_of must be an integer >= 1, got {s.best_of!r}")
            if stage_kind(stage) == "upsampler" and s.best_of != 1:
                raise ValueError(
                    f"{stage}: best_of must be 1 for an upsampler (candidates are chosen by the "
                    f"prior's and the decoder's best_of), got {s.best_of}"
                )
            out[stage] = s
        return out

    def _check_overrides(self, sampling: Optional[Mapping]) -> dict[str, dict]:
        if sampling is None:
            return {}
        if not isinstance(sampling, Mapping):
            raise TypeError(
                f"sampling must be a dict {{stage: {{setting: value}}}}, got "
                f"{type(sampling).__name__}"
            )
        # "prior" and "upsampler" are accepted (and checked) where the pipeline lacks that stage,
        # so that one set of overrides serves every pipeline
        valid = [*self.stage_names, EVERY_UPSAMPLER]
        if self.prior is None:
            valid.append("prior")
        out = {}
        for key, values in sampling.items():
            if key not in valid:
                if key == "upsamplers":
                    hint = f"; use {EVERY_UPSAMPLER!r} for every upsampler"
                else:
                    close = difflib.get_close_matches(str(key), valid, n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"sampling: unknown stage {key!r}{hint} (valid: {', '.join(valid)})"
                )
            if isinstance(values, SamplingConfig):
                values = to_dict(values)
            if not isinstance(values, Mapping):
                raise TypeError(
                    f"sampling[{key!r}] must be a dict of settings, got {type(values).__name__}"
                )
            unknown = [k for k in values if k not in SAMPLING_FIELDS]
            if unknown:
                raise ValueError(
                    f"sampling[{key!r}]: unknown sampling setting {unknown[0]!r} "
                    f"(valid: {', '.join(SAMPLING_FIELDS)})"
                )
            out[key] = dict(values)
        return out

    def _stage_settings(self, stage: str, sampling: Optional[Mapping]) -> SamplingConfig:
        return self.sampling_settings(sampling)[stage]

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
        """Prompts → :class:`TextEncoding` (``text_embed [B,D]``, ``text_tokens [B,L,W]``,
        ``text_mask [B,L]``)."""
        return self.clip.encode_text(check_prompts(prompt))

    def null_text(self, batch: int) -> TextEncoding:
        """The unconditional caption (CLIP encoding of ``""``) repeated ``batch`` times."""
        if self._null_text is None:
            self._null_text = self.clip.encode_text([""])
        return self._null_text.repeat_interleave(batch)

    def _as_text(self, text) -> TextEncoding:
        return text if isinstance(text, TextEncoding) else self.encode_text(text)

    def _step_callback(self, stage: str, callback_on_step_end: Optional[StepCallback]):
        """Adapt a pipeline-level ``callback_on_step_end`` to :func:`sample_loop`'s ``callback``."""
        if callback_on_step_end is None:
            return None
        if not callable(callback_on_step_end):
            raise TypeError(
                f"callback_on_step_end must be callable, got {type(callback_on_step_end).__name__}"
            )

        def step(i, t, x):
            out = callback_on_step_end(self, i, t, {"stage": stage, "latents": x})
            if out is None:
                return None
            if not isinstance(out, Mapping):
                raise TypeError(
                    f"callback_on_step_end must return None or a dict, got {type(out).__name__}"
                )
            return out.get("latents")

        return step

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
    ):
        """Prior: prompts or a :class:`TextEncoding` ``[B]`` → CLIP image embeddings ``[B·n, D]``.

        With ``best_of = N > 1`` it samples N candidates per image and keeps the one with the
        highest dot product with the text embedding (paper §2.2). ``return_candidates`` also returns
        the candidates ``[B·n, N, D]``. ``callback_on_step_end``: see :meth:`__call__`.
        """
        if self.prior is None:
            raise ValueError(
                "this pipeline has no prior; pass image embeddings (pipe(..., image_embeds=...) or "
                "decode()) instead"
            )
        s = self._stage_settings("prior", sampling)
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
            callback=self._step_callback("prior", callback_on_step_end),
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
        callback_on_step_end: Optional[StepCallback] = None,
    ) -> torch.Tensor:
        """Decoder: ``image_embed [B, D]`` (+ optional captions/TextEncoding with B rows) →
        ``[B, 3, s, s]`` in [-1, 1] at the decoder's resolution. Without text the empty caption is
        used."""
        s = self._stage_settings("decoder", sampling)
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
            callback=self._step_callback("decoder", callback_on_step_end),
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
        callback_on_step_end: Optional[StepCallback] = None,
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
            s = self._stage_settings(name, sampling)
            out = self._upsample_one(name, up, out, s, generator, progress, callback_on_step_end)
            inter[name] = out
        return (out, inter) if return_intermediates else out

    def _upsample_one(self, name, up, low, s, generator, progress, callback_on_step_end=None):
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
            callback=self._step_callback(name, callback_on_step_end),
        )
        return x.float().clamp(-1, 1)

    # ------------------------------------------------------------------ composed
    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, Sequence[str]],
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        sampling: Optional[dict] = None,
        output_type: str = "pil",
        return_intermediates: bool = False,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
        image_embeds: Optional[torch.Tensor] = None,
        last_stage: Optional[str] = None,
    ) -> UnCLIPOutput:
        """Text → images through every stage.

        ``generator``: one ``torch.Generator``, one per prompt, or one per image. ``sampling``:
        per-stage overrides (see :meth:`sampling_settings`), e.g. ``{"prior": {"steps": 10},
        "decoder": {"guidance_scale": 3, "best_of": 4}, "upsampler": {"steps": 5}}``. With the
        decoder's ``best_of = K > 1`` it decodes K base-resolution candidates per image and keeps
        the one :attr:`rerank_clip` scores closest to the prompt before upsampling (as DALL-E did).
        ``output_type``: ``pil``, ``np`` (uint8 ``[N, H, W, 3]``) or ``pt`` (float ``[N, 3, H, W]``
        in [0, 1]).

        ``callback_on_step_end(pipe, step, timestep, callback_kwargs)`` runs after every denoising
        step of every stage, as in diffusers; ``callback_kwargs`` is ``{"stage": name, "latents":
        x_t}`` (``x_t`` holds every candidate of that stage's batch) and a returned dict's
        ``"latents"`` replaces ``x_t``. ``image_embeds [N, D]`` (one per output image,
        prompt-major): decode these CLIP image embeddings instead of sampling the prior.
        ``last_stage``: stop after this stage (``"decoder"`` or an upsampler's name; default: the
        last). Seconds per stage are returned in ``UnCLIPOutput.timings``.
        """
        prompts = check_prompts(prompt)
        check_output_type(output_type)
        n = check_count(num_images_per_prompt)
        settings = self.sampling_settings(sampling)  # validate everything before any compute
        k = settings["decoder"].best_of
        ups = self._stages_until(last_stage)
        if image_embeds is not None:
            image_embeds = check_embeds(image_embeds, self.clip.embed_dim)
            if image_embeds.shape[0] != len(prompts) * n:
                raise ValueError(
                    f"image_embeds: {image_embeds.shape[0]} embeddings for {len(prompts)} prompts "
                    "× "
                    f"{n} images; give one per output image"
                )
        timings: dict[str, float] = {}
        t0 = self._now()
        text = self.encode_text(prompts)
        gen = expand_generator(generator, len(prompts), n * k, "generator")
        text_k = text.repeat_interleave(n * k)
        if image_embeds is None:
            embeds = self.sample_image_embeds(
                text_k,
                1,
                gen,
                sampling,
                progress=progress,
                callback_on_step_end=callback_on_step_end,
            )
            timings["prior"] = self._now() - t0
            t0 = self._now()
        else:
            embeds = image_embeds.to(self.device).repeat_interleave(k, dim=0)
        small = self.decode(
            embeds,
            text_k,
            gen,
            sampling,
            progress=progress,
            callback_on_step_end=callback_on_step_end,
        )
        keep = self.rerank(small, [p for p in prompts for _ in range(n * k)], k)
        small, embeds, text_k = small[keep], embeds[keep], text_k[keep]
        timings["decoder"] = self._now() - t0
        gen = gen[::k] if isinstance(gen, list) else gen
        final, inter = small, {}
        for name in ups:
            t0 = self._now()
            final = self.upsample(
                final,
                gen,
                sampling,
                stages=[name],
                progress=progress,
                callback_on_step_end=callback_on_step_end,
            )
            timings[name] = self._now() - t0
            inter[name] = final
        stage_images = {"decoder": small, **inter} if return_intermediates else {}
        return UnCLIPOutput(
            to_output(final, output_type), embeds, text_k.text_embed, stage_images, timings
        )

    def _stages_until(self, last_stage: Optional[str]) -> list[str]:
        """The upsamplers to run when stopping after ``last_stage`` (None: every upsampler)."""
        names = self.upsampler_names
        if last_stage is None:
            return names
        if last_stage == "decoder":
            return []
        if last_stage not in names:
            raise ValueError(
                f"last_stage must be 'decoder' or one of this pipeline's upsamplers "
                f"{names}, got {last_stage!r}"
            )
        return names[: names.index(last_stage) + 1]

    @torch.no_grad()
    def rerank(
        self, images: torch.Tensor, prompts: Union[str, Sequence[str]], k: int
    ) -> torch.Tensor:
        """Indices ``[B]`` of the best of each consecutive group of ``k`` candidates
        (``images [B·k, 3, H, W]`` in [-1, 1]) by the cosine between :attr:`rerank_clip`'s
        embeddings of the image and of its prompt. ``prompts``: one per image (``B·k``), one per
        group (``B``), or one string for all; ``k = 1`` keeps every image."""
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
        """Cosine similarity ``[B]`` between images ``[B, 3, H, W]`` in [-1, 1] and text embeddings
        ``[B, D]``."""
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
        callback_on_step_end: Optional[StepCallback] = None,
    ) -> UnCLIPOutput:
        """Image → CLIP image embedding → ``num_images`` decodings (paper §3.1).
        ``callback_on_step_end``: see :meth:`__call__`."""
        check_output_type(output_type)
        n = check_count(num_images, "num_images")
        embed = self.clip.encode_image(as_image_input(image))
        if embed.shape[0] != 1:
            raise ValueError("variations takes one image; call it once per image")
        embeds = embed.repeat(n, 1)
        text = self.encode_text([caption] * n) if caption is not None else None
        gen = expand_generator(generator, 1, n, "generator")
        cb = {"progress": progress, "callback_on_step_end": callback_on_step_end}
        small = self.decode(embeds, text, gen, sampling, **cb)
        final = self.upsample(small, gen, sampling, **cb)
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
        callback_on_step_end: Optional[StepCallback] = None,
    ) -> UnCLIPOutput:
        """Slerp between the CLIP image embeddings of two images or two prompts (paper §3.2).

        Prompts go through the prior first. Every frame is decoded from the same initial noise so
        the frames differ only by the embedding. ``callback_on_step_end``: see :meth:`__call__`.
        """
        check_output_type(output_type)
        if check_count(num_steps, "num_steps") < 2:
            raise ValueError("interpolate: num_steps must be >= 2")
        seed_gen = generator if generator is not None else torch.Generator().manual_seed(0)
        cb = {"progress": progress, "callback_on_step_end": callback_on_step_end}
        ends = []
        for x in (start, end):
            if isinstance(x, str):
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


def generate_to_folder(
    model: Union[str, os.PathLike, UnCLIPPipeline, None],
    prompts: Sequence[str],
    folder: Union[str, os.PathLike],
    *,
    num_images_per_prompt: int = 1,
    seed: int = 0,
    sampling: Optional[dict] = None,
    device: Union[str, torch.device] = "cpu",
    progress: bool = True,
    tiny: bool = False,
    command: Optional[Sequence[str]] = None,
) -> dict:
    """Sample ``prompts`` and write the images, ``grid.png`` and ``generate.json`` to ``folder``.

    ``model``: a pipeline, a folder for :meth:`UnCLIPPipeline.from_pretrained` or None (the bundled
    model); ``tiny``: a random untrained tiny pipeline instead (a smoke test). Prompt ``i`` is
    sampled with its own generator seeded ``seed + i``. ``generate.json`` records every setting
    needed to reproduce the images (prompts, seeds, model, resolved per-stage sampling settings,
    versions, ``command``); it is also returned."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        unclip_version = version("unclip")
    except PackageNotFoundError:  # running from a source tree that is not installed
        unclip_version = None
    prompts = check_prompts(prompts)
    n = check_count(num_images_per_prompt)
    if tiny:
        from unclip.tiny import tiny_pipeline

        pipe, name = tiny_pipeline(), "tiny (random, untrained)"
    elif isinstance(model, UnCLIPPipeline):
        pipe, name = model, "in-memory pipeline"
    else:
        pipe, name = UnCLIPPipeline.from_pretrained(model), str(model or DEFAULT_MODEL)
    pipe.to(device)
    settings = pipe.sampling_settings(sampling)  # fails on a bad override before any compute
    seeds = [seed + i for i in range(len(prompts))]
    gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    t0 = time.perf_counter()
    out = pipe(
        prompts, num_images_per_prompt=n, generator=gens, sampling=sampling, progress=progress
    )
    seconds = time.perf_counter() - t0
    record = {
        "model": name,
        "prompts": prompts,
        "seeds": seeds,
        "num_images_per_prompt": n,
        "rerank_clip": "reranker" if pipe.reranker is not None else "clip",
        "device": str(device),
        "resolution": pipe.resolution,
        "sampling": {k: to_dict(v) for k, v in settings.items()},
        "seconds": round(seconds, 3),
        "seconds_per_stage": {k: round(v, 3) for k, v in out.timings.items()},
        "versions": {"unclip": unclip_version, "torch": torch.__version__},
        "command": list(command) if command is not None else None,
    }
    return out.save(folder, prompts, record, grid_cols=n if len(prompts) > 1 else None, seeds=seeds)
