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

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Optional, Union

import torch

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import Generator
from unclip.io.card import check_card_fields, read_card_info, write_card
from unclip.io.hub import push_folder
from unclip.nets.clip import CLIP, TextEncoding, check_prompts
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior
from unclip.nets.priors import prior_type
from unclip.pipeline.edit_ops import EditOutput, Inversion
from unclip.pipeline.editing import EditingMixin
from unclip.pipeline.folders import (
    PIPELINE_FILE,
    bundled_model_path,
    folder_format_reader,
    load_components,
    read_pipeline_folder,
    resolve_pipeline_folder,
    write_pipeline_folder,
)
from unclip.pipeline.lora import LoraMixin
from unclip.pipeline.memory import MemoryMixin
from unclip.pipeline.offload import OffloadMixin
from unclip.pipeline.output import UnCLIPOutput
from unclip.sampling.candidates import (
    CandidateSelection,
    check_rerank_at,
    rerank_candidates,
    sample_decoder_candidates,
)
from unclip.sampling.scorers import image_text_cosines
from unclip.sampling.settings import (
    DEFAULT_DIFFUSION,
    DEFAULT_SAMPLING,
    EVERY_UPSAMPLER,
    SAMPLING_FIELDS,
    StageSampling,
    resolve_sampling,
    stage_settings,
)
from unclip.sampling.stages import (
    StepCallback,
    sample_decoder,
    sample_prior,
    sample_upsampler,
    stage_callback,
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
from unclip.utils.images import as_image_input, to_output
from unclip.utils.offload import releases_gpu
from unclip.utils.precision import parse_autocast, parse_dtype, resolve_autocast

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


def negatives_per_row(negative, rows: int, what: str) -> list[str]:
    """Negative prompts as one per row: one string (or a one-item list) serves every row, else
    there must be one per row (``what`` names the rows in the error: prompts, images)."""
    captions = check_prompts(negative, "negative_prompt")
    if len(captions) == 1:
        captions = captions * rows
    if len(captions) != rows:
        raise ValueError(
            f"negative_prompt: {len(captions)} for {rows} {what}; give one string for all, or one "
            "per prompt"
        )
    return captions


def _generators_by_group(
    generator: Generator, prompts: int, n: int, groups: dict[int, list[int]], decoder
) -> dict[int, Generator]:
    """The generators of each group of prompts (:meth:`UnCLIPPipeline.__call__`): a single one is
    shared (drawn on group by group, in order of first appearance); a list of one per prompt or
    one per image is cut to the group's prompts."""
    if generator is None or isinstance(generator, torch.Generator) or len(groups) == 1:
        return dict.fromkeys(groups, generator)
    gens = list(generator)
    if len(gens) == prompts:
        return {k: [gens[i] for i in rows] for k, rows in groups.items()}
    if len(gens) == prompts * n:
        return {k: [gens[i * n + j] for i in rows for j in range(n)] for k, rows in groups.items()}
    raise ValueError(
        f"generator: got {len(gens)} generators for {prompts} prompts × {n} images (the decoder "
        f"draws {decoder.best_of} candidates per image, or {decoder.best_of_contrasted} for a "
        "prompt its rerank_contrast has alternatives for); pass one generator, one per prompt, "
        "or one per image"
    )


def _joined(parts: list[tuple], order: list[int]) -> tuple:
    """The outputs of the groups of :meth:`UnCLIPPipeline.__call__` put back in prompt order
    (``order``: each output row's position among all the prompts' images); timings summed."""
    if len(parts) == 1:
        return parts[0]
    back = torch.tensor(order).argsort()

    def cat(values):
        return torch.cat(values)[back.to(values[0].device)]

    final, embeds, text_embeds, stages, _ = zip(*parts)
    timings: dict[str, float] = {}
    for part in parts:
        for stage, seconds in part[4].items():
            timings[stage] = timings.get(stage, 0.0) + seconds
    stage_images = {name: cat([p[name] for p in stages]) for name in stages[0]}
    return cat(list(final)), cat(list(embeds)), cat(list(text_embeds)), stage_images, timings


class UnCLIPPipeline(EditingMixin, MemoryMixin, OffloadMixin, LoraMixin):
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

    @property
    def device(self) -> torch.device:
        """Where sampling runs: the components' device, or the execution device of
        :meth:`enable_model_cpu_offload` (the components then wait on the CPU)."""
        if self._offloader is not None:
            return self._offloader.device
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
    def rerank_clip(self) -> CLIP:
        """The CLIP that scores decoder candidates in :meth:`rerank`: the ``reranker`` component if
        the pipeline has one, else the conditioning CLIP (``clip``)."""
        return self.reranker if self.reranker is not None else self.clip

    def to(self, device=None, dtype=None, memory_format=None) -> UnCLIPPipeline:
        """Move every component: ``pipe.to("cuda")``, ``pipe.to(torch.float16)``,
        ``pipe.to("cuda", torch.bfloat16)``. Casting to float16/bfloat16 keeps the tensors the
        numerics need in float32 (:mod:`unclip.precision`). ``memory_format=torch.channels_last``
        stores the image networks' conv weights NHWC, which makes their activations NHWC too
        (faster convolutions on CPUs with oneDNN, same results to float rounding; see
        benchmarks/README.md). With model offload on, a device ends it (every component then
        moves there); a dtype alone casts the waiting components and keeps it."""
        if isinstance(device, torch.dtype):  # pipe.to(torch.float16), as diffusers' pipelines
            device, dtype = None, device if dtype is None else dtype
        if self._offloader is not None:
            if device is not None:
                self.disable_model_cpu_offload()
            else:
                self._offloader.offload_all()  # cast the CPU copies, not a device copy
        dtype = parse_dtype(dtype, "dtype")
        kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        for m in self.modules().values():
            m.to(**kwargs)
        if memory_format is not None:
            for m in [self.decoder, *self.upsamplers]:
                m.to(memory_format=memory_format)
        self._null_text = None
        self._auto_xformers()
        return self

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The dtype every denoising network call runs in under ``torch.autocast`` on the
        pipeline's device, or ``None`` (full precision). Weights, latents, guidance and the
        scheduler stay in the pipeline's dtype.

        Set it to ``None``, ``torch.bfloat16``/``torch.float16`` (or their names) or ``"auto"``:
        float16 on a GPU, bfloat16 on a CPU that runs it natively (AVX512-BF16/AMX), else
        ``None``, and ``None`` with float16/bfloat16 weights
        (:func:`unclip.precision.resolve_autocast`); ``"auto"`` follows the pipeline when it moves
        or is cast. A constructed pipeline starts at ``None``; :meth:`from_pretrained` and
        :meth:`from_components` start at ``"auto"``. Reduced precision is faster and changes
        images slightly (benchmarks/README.md measures both, docs/shapes_model.md the shapes
        evaluator's figures); :attr:`autocast_setting` is what was set."""
        return resolve_autocast(self._autocast_dtype, self.device, self.dtype)

    @autocast_dtype.setter
    def autocast_dtype(self, dtype) -> None:
        self._autocast_dtype = parse_autocast(dtype)

    @property
    def autocast_setting(self):
        """What :attr:`autocast_dtype` was set to: ``None``, ``"auto"`` or a dtype."""
        return self._autocast_dtype

    def denoisers(self) -> dict[str, torch.nn.Module]:
        """The networks of every sampling step (prior transformer, decoder UNet, upsampler UNets),
        which the speed and memory options act on. The prior's sampler runs its transformer's
        blocks itself, over the text positions once and three positions per step
        (:meth:`~unclip.prior.UnCLIPPrior.conditioned`), unless the transformer is compiled."""
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

    # ------------------------------------------------------------------ persistence
    def save_pretrained(
        self,
        path: Union[str, os.PathLike],
        safe_serialization: bool = True,
        model_card: Optional[Mapping] = None,
    ) -> None:
        """Write the self-describing folder: ``unclip.json`` + one subfolder per component, and
        ``README.md``, a model card in the Hub's format (:mod:`unclip.card`) from the pipeline
        and :attr:`card_info` updated with ``model_card`` (fields in
        :data:`unclip.card.CARD_FIELDS`: license, training, evaluation, ...). Refused while LoRA
        adapters are loaded unmerged (:meth:`merge_lora` them first)."""
        self._refuse_unmerged_lora("save_pretrained")
        info = {**self.card_info, **check_card_fields(model_card)}
        write_pipeline_folder(
            path,
            clip=self.clip,
            prior=self.prior,
            decoder=self.decoder,
            upsamplers=dict(zip(self.upsampler_names, self.upsamplers)),
            reranker=self.reranker,
            diffusion=self.diffusion,
            sampling=self.sampling,
            prior_clip_range=self.prior_clip_range,
        )
        write_card(path, self, info)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: Optional[str] = None,
        private: Optional[bool] = None,
        token: Union[str, bool, None] = None,
        revision: Optional[str] = None,
        create_pr: bool = False,
        model_card: Optional[Mapping] = None,
    ):
        """Upload the folder :meth:`save_pretrained` writes (with its model card, whose loading
        example names ``repo_id``) to the Hub model repo ``repo_id``, created if needed; returns
        ``huggingface_hub``'s ``CommitInfo``. ``token``: default, the one ``hf auth login``
        stored."""
        return push_folder(
            self._push_writer(repo_id, model_card),
            repo_id,
            commit_message=commit_message,
            private=private,
            token=token,
            revision=revision,
            create_pr=create_pr,
        )

    def _push_writer(self, repo_id: str, model_card: Optional[Mapping] = None):
        """What :meth:`push_to_hub` uploads: a function writing :meth:`save_pretrained`'s folder
        with a card whose loading example names ``repo_id`` (see
        :func:`unclip.hub.upload_folder_of`)."""
        card = {"repo_id": repo_id, **check_card_fields(model_card)}
        return lambda folder: self.save_pretrained(folder, model_card=card)

    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, os.PathLike, None] = None,
        *,
        revision: Optional[str] = None,
        cache_dir: Union[str, os.PathLike, None] = None,
        local_files_only: Optional[bool] = None,
        torch_dtype: Union[torch.dtype, str, None] = None,
        variant: Optional[str] = None,
        autocast_dtype="auto",
        memory_format: Optional[torch.memory_format] = torch.channels_last,
    ) -> UnCLIPPipeline:
        """Load a folder written by :meth:`save_pretrained`, a diffusers ``UnCLIPPipeline``
        folder, or either from the Hugging Face Hub by repo id (``"org/name"``).

        ``path=None`` or ``"shapes"`` loads the bundled offline shapes model. A repo id is
        fetched once into the Hub cache (``cache_dir``, default ``HF_HUB_CACHE``) at ``revision``
        (branch, tag or commit; default ``main``), safetensors weights only
        (:mod:`unclip.hub`); ``local_files_only=True`` or ``HF_HUB_OFFLINE=1`` use the cache only.
        ``torch_dtype`` (``torch.float16``/``bfloat16``/``float32`` or its name): cast the weights
        as :meth:`to` does. ``variant`` (e.g. ``"fp16"``): read ``*.fp16.safetensors`` weights.

        The defaults sample fast: ``autocast_dtype="auto"`` runs the denoising networks in
        float16 on a GPU and bfloat16 on a CPU that runs it natively (:attr:`autocast_dtype`;
        ``None``: full precision, as diffusers computes), and the image networks
        store their weights channels-last (``memory_format``; ``None`` keeps the default
        layout; results equal to float rounding). benchmarks/README.md measures what each buys.
        """
        dtype = parse_dtype(torch_dtype)
        autocast = parse_autocast(autocast_dtype)
        hub = {"revision": revision, "cache_dir": cache_dir, "local_files_only": local_files_only}
        path = resolve_pipeline_folder(path, variant=variant, **hub)
        reader = folder_format_reader(path)
        if reader is not None:
            pipe = reader(path, variant=variant) if variant else reader(path)
        else:
            pipe = cls._frozen(**read_pipeline_folder(path, variant=variant))
        pipe.card_info = read_card_info(path)
        return pipe._loaded_defaults(autocast, memory_format, dtype)

    @classmethod
    def from_components(
        cls,
        clip: Union[str, os.PathLike],
        decoder: Union[str, os.PathLike],
        prior: Union[str, os.PathLike, None] = None,
        upsamplers: Sequence[Union[str, os.PathLike]] = (),
        reranker: Union[str, os.PathLike, None] = None,
        *,
        autocast_dtype="auto",
        memory_format: Optional[torch.memory_format] = torch.channels_last,
    ) -> UnCLIPPipeline:
        """Assemble a pipeline from component folders exported by the training commands
        (``<output_dir>/final/<name>``, each with ``config.json``, weights and
        ``unclip_stage.json``); ``reranker``: a CLIP folder (e.g. ``unclip train-clip``'s
        ``<output_dir>/clip``) that scores decoder candidates instead of the conditioning CLIP.
        ``autocast_dtype``, ``memory_format``: as in :meth:`from_pretrained`."""
        autocast = parse_autocast(autocast_dtype)
        parts = load_components(
            clip, decoder, prior, upsamplers, DEFAULT_DIFFUSION, DEFAULT_SAMPLING
        )
        pipe = cls._frozen(
            *parts, reranker=CLIP.from_pretrained(reranker) if reranker is not None else None
        )
        return pipe._loaded_defaults(autocast, memory_format)

    def _loaded_defaults(self, autocast, memory_format, dtype=None) -> UnCLIPPipeline:
        """The sampling defaults of a pipeline that was loaded (it owns its modules, so changing
        their layout changes nothing outside it): the autocast setting, the image networks'
        memory format, the weights' dtype."""
        self._autocast_dtype = autocast
        if dtype is not None or memory_format is not None:
            self.to(dtype=dtype, memory_format=memory_format)
        return self

    @classmethod
    def _frozen(cls, *args, **kwargs) -> UnCLIPPipeline:
        pipe = cls(*args, **kwargs)
        for m in pipe.modules().values():
            m.eval().requires_grad_(False)
        return pipe

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

    def _encode_each(self, captions: Sequence[str]) -> TextEncoding:
        """Each distinct caption encoded on its own, so that the empty caption as a negative
        prompt is bit for bit the usual unconditional input (a batch's rows can differ in the last
        bits from the same caption encoded alone)."""
        enc = {c: self.clip.encode_text([c]) for c in dict.fromkeys(captions)}
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

    def _decoder_inputs(self, image_embed, text, sampling, negative_prompt) -> tuple:
        """The leading arguments of :func:`~unclip.sampling.sample_decoder` (and of
        :func:`~unclip.sampling.sample_decoder_reranked`) for :meth:`decode`'s inputs, checked,
        with the decoder brought in."""
        s = self._stage_settings("decoder", sampling)
        image_embed = check_embeds(image_embed, self.clip.embed_dim)
        b = image_embed.shape[0]
        text, null = self._decoder_captions(text, b)
        if negative_prompt is not None:
            null = self._decoder_negative(negative_prompt, b)
        self._onload("decoder")
        if len(text) != b:
            raise ValueError(f"decode: {b} image embeddings but {len(text)} captions")
        return self.decoder, image_embed, text, null, s, self.diffusion["decoder"]

    def _decoder_run(self, generator, progress, callback_on_step_end) -> dict:
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
    ):
        """Upsamplers: ``[B, 3, h, w]`` in [-1, 1] → ``[B, 3, H, W]`` through each upsampler in turn
        (or only those named in ``stages``)."""
        if not isinstance(images, torch.Tensor) or images.ndim != 4:
            raise TypeError("upsample: images must be a tensor [B, 3, h, w] in [-1, 1]")
        out, inter = images.to(self.device).float(), {}
        for name, up in zip(self.upsampler_names, self.upsamplers):
            if stages is not None and name not in stages:
                continue
            self._onload(name)
            out = sample_upsampler(
                up,
                out,
                self._stage_settings(name, sampling),
                self.diffusion[name],
                generator=generator,
                progress=progress,
                autocast_dtype=self.autocast_dtype,
                callback=stage_callback(self, name, callback_on_step_end),
            )
            inter[name] = out
        return (out, inter) if return_intermediates else out

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
        sampling: Optional[dict] = None,
        output_type: str = "pil",
        return_intermediates: bool = False,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
        image_embeds: Optional[torch.Tensor] = None,
        last_stage: Optional[str] = None,
        negative_prompt: Union[str, Sequence[str], None] = None,
    ) -> UnCLIPOutput:
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
        ``output_type``: ``pil``, ``np`` (uint8 ``[N, H, W, 3]``) or ``pt`` (float ``[N, 3, H, W]``
        in [0, 1]).

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
        selection = CandidateSelection.of(settings["decoder"])
        groups = selection.groups(prompts)
        if any(selection.early(k) for k in groups):
            # every group's sampler check before the first group samples
            dec = settings["decoder"]
            check_rerank_at(dec, self.diffusion["decoder"], self.decoder.config.learned_variance)
        gens = _generators_by_group(generator, len(prompts), n, groups, settings["decoder"])
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
                )
            )
            order += [i * n + j for i in rows for j in range(n)]
        final, embeds, text_embeds, stage_images, timings = _joined(parts, order)
        if not return_intermediates:
            stage_images = {}
        return UnCLIPOutput(
            to_output(final, output_type), embeds, text_embeds, stage_images, timings
        )

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
    ) -> tuple:
        """One group of prompts that draw ``k`` decoder candidates per image, through every stage:
        encode → prior → decoder candidates → upsamplers. Returns ``(final images, image embeds,
        text embeds, {stage: images}, {stage: seconds})``."""
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
            *inputs, choose, k, **self._decoder_run(gen, progress, callback_on_step_end)
        )
        embeds, text_k = embeds[keep], text_k[keep]
        timings["decoder"] = self._now() - t0
        gen = gen[::k] if isinstance(gen, list) else gen
        final, stage_images = small, {"decoder": small}
        for name in upsamplers:
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

    @releases_gpu
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
        text = [caption] * n if caption is not None else None
        gen = expand_generator(generator, 1, n, "generator")
        cb = {"progress": progress, "callback_on_step_end": callback_on_step_end}
        small = self.decode(embeds, text, gen, sampling, **cb)
        final = self.upsample(small, gen, sampling, **cb)
        return UnCLIPOutput(to_output(final, output_type), embeds)

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
