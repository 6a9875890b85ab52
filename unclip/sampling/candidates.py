"""The decoder's candidate choice: how many candidates each prompt draws, when one is chosen, and
how they are scored, as one component.

:class:`CandidateSelection` reads a decoder's settings (``best_of``, ``best_of_contrasted``,
``rerank_at``, ``prune_at``/``prune_keep``, ``rerank_contrast``); :func:`sample_decoder_candidates`
samples and chooses in one pass of the one denoising loop: part-way through it (an ``on_step``
hook of :func:`~unclip.diffusion.loop.denoise_steps` keeps the chosen rows), or among the finished
images. Candidates are scored by a :class:`~unclip.sampling.scorers.Scorer`
(:func:`rerank_candidates`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import (
    Generator,
    StepState,
    is_guided,
    make_scheduler,
    training_scheduler,
)
from unclip.nets.clip import CLIP
from unclip.nets.decoder import Caption, UnCLIPDecoder
from unclip.nets.text_encoding import check_prompts
from unclip.sampling.scorers import Scorer, as_scorer, check_rerank_contrast, image_text_cosines
from unclip.sampling.settings import DecoderSampling, sampling_as
from unclip.sampling.stages import (
    LoopCallback,
    _sample,
    decoder_denoiser,
    sample_decoder,
    select_scheduler_rows,
)
from unclip.sampling.utils import check_count, check_finite

__all__ = [
    "CandidateSelection",
    "candidate_counts",
    "sample_decoder_candidates",
    "sample_decoder_reranked",
    "rerank_candidates",
    "check_rerank_at",
    "image_text_cosines",
]


@dataclass(frozen=True)
class CandidateSelection:
    """How the decoder draws and chooses candidates (from :class:`DecoderSampling`,
    :meth:`of`).

    ``best_of``: candidates per image; ``best_of_contrasted``: per image of a prompt the scorer has
    alternatives for (None: ``best_of`` for all); ``choose_at``: the step after which to choose
    (None: among the finished images); ``prune_at``/``prune_keep``: keep each image's
    ``prune_keep`` best after step ``prune_at`` first; ``contrast``: the ``rerank_contrast``
    (None: the cosine)."""

    best_of: int = 1
    best_of_contrasted: Optional[int] = None
    choose_at: Optional[int] = None
    prune_at: Optional[int] = None
    prune_keep: Optional[int] = None
    contrast: Union[str, Scorer, Callable[[str], list[str]], None] = None

    @classmethod
    def of(cls, settings: DecoderSampling) -> CandidateSelection:
        early = settings.rerank_at is not None and settings.rerank_at < settings.steps
        return cls(
            best_of=settings.best_of,
            best_of_contrasted=settings.best_of_contrasted,
            choose_at=settings.rerank_at if early else None,
            prune_at=settings.prune_at,
            prune_keep=settings.prune_keep,
            contrast=settings.rerank_contrast,
        )

    @property
    def scorer(self) -> Scorer:
        return as_scorer(self.contrast)

    def counts(self, prompts: Sequence[str]) -> list[int]:
        """Candidates per image for each of ``prompts``: ``best_of_contrasted`` where the contrast
        has alternatives for the prompt, ``best_of`` for the others."""
        if self.best_of_contrasted is None or self.contrast is None:
            return [self.best_of] * len(prompts)
        scorer = self.scorer
        captions = getattr(scorer, "captions", None)
        if captions is None:  # a scorer without caption sets scores every prompt alike
            return [self.best_of_contrasted] * len(prompts)
        has = {p: len(list(captions(p))) > 1 for p in dict.fromkeys(prompts)}
        return [self.best_of_contrasted if has[p] else self.best_of for p in prompts]

    def groups(self, prompts: Sequence[str]) -> dict[int, list[int]]:
        """``{count: [prompt index, ...]}``, counts in order of first appearance."""
        out: dict[int, list[int]] = {}
        for i, count in enumerate(self.counts(prompts)):
            out.setdefault(count, []).append(i)
        return out

    def with_count(self, count: int) -> CandidateSelection:
        return CandidateSelection(
            count, None, self.choose_at, self.prune_at, self.prune_keep, self.contrast
        )

    def pruning(self, count: Optional[int] = None) -> bool:
        """Whether ``count`` (default ``best_of``) candidates are pruned before the choice."""
        k = self.best_of if count is None else count
        if self.prune_at is None or self.choose_at is None:
            return False
        # DecoderSampling sets prune_at and prune_keep together
        assert self.prune_keep is not None, "prune_at is set without prune_keep"
        return k > self.prune_keep

    def early(self, count: Optional[int] = None) -> bool:
        """Whether the choice among ``count`` candidates is made part-way."""
        k = self.best_of if count is None else count
        return k > 1 and self.choose_at is not None


def check_rerank_at(
    settings: DecoderSampling, diffusion: DiffusionConfig, learned_variance: bool = False
) -> None:
    """Refuse a decoder sampler that ``rerank_at`` cannot stop part-way: one that makes two
    network calls per step (Heun, DPM2), whose steps are not the loop's, or one whose noise is a
    process over the whole batch (DPM-Solver SDE's Brownian tree), which cannot be cut to rows."""
    sched = make_scheduler(
        settings.scheduler, diffusion, clip_sample_range=1.0, learned_variance=learned_variance
    )
    sched.set_timesteps(settings.steps)
    name = type(sched).__name__
    if len(sched.timesteps) != settings.steps or "noise_sampler" in vars(sched):
        raise ValueError(
            f"decoder: rerank_at {settings.rerank_at} (choose among candidates after that step; "
            "a pipeline's sampling defaults may set it) needs a sampler with one network call per "
            f"step and per-sample noise; {name} does not fit ({len(sched.timesteps)} calls for "
            f"{settings.steps} steps, or batch-wide noise): use ddim, dpm++, unipc, euler or ddpm, "
            "or choose among finished candidates with rerank_at None "
            "(sampling={'decoder': {'rerank_at': None}}, --decoder-rerank-at none)"
        )


def _predicted_x0(state: StepState, scale: float, training, prediction_type: str) -> torch.Tensor:
    """The network's x_0 at the step that ``state`` reports, from its output at ``state.x_t``.
    ``scale``: the factor the sampler scaled ``x_t`` by before the network (``1/sqrt(1+σ²) =
    sqrt(ᾱ)`` for samplers in sigma space, Euler and LMS), which gives ᾱ at the sampler's own noise
    level; the others sample in x_t's scale, and ᾱ is the training schedule's at the (rounded)
    timestep: exact for the built-in samplers and UniPC/DPM-Solver++ by name, close for a solver
    given Karras sigmas."""
    x = (state.x_t * scale).float()
    if abs(scale - 1.0) > 1e-6:
        ac = torch.tensor(scale * scale, dtype=torch.float64)
    else:
        ac = training.alphas_cumprod.double()[int(torch.as_tensor(state.t).round().long())]
    a, s = float(ac.sqrt()), float((1 - ac).sqrt())
    out = state.out[:, : x.shape[1]].float()
    if prediction_type == "epsilon":
        return (x - s * out) / a
    if prediction_type == "v_prediction":
        return a * x - s * out
    return out  # "sample"


def _choosing_hook(d, diffusion: DiffusionConfig, guided: bool, decoder: UnCLIPDecoder, choices):
    """An ``on_step`` hook for the decoder's denoiser ``d`` that, after each step in ``choices``,
    keeps the rows ``choices[step](x0)`` names (``x0``: every row's predicted final image in
    [-1, 1]) with their conditioning rows, generators and scheduler state. Returns ``(hook,
    kept)``; ``kept()`` gives the indices of the rows left, into the rows the loop started with."""
    training = training_scheduler(diffusion)
    state = {"keep": torch.arange(d.shape[0]), "cond": d.cond}

    def hook(step: StepState) -> None:
        if step.i not in choices:
            return
        x0 = _predicted_x0(step, step.input_scale, training, diffusion.prediction_type)
        images = decoder.to_images(x0).clamp(-1, 1)  # a latent decoder's x0 is latents
        rows = torch.as_tensor(choices[step.i](images), dtype=torch.long).cpu()
        now = step.x.shape[0]
        step.x = step.x[rows.to(step.x.device)]
        state["keep"] = state["keep"][rows]
        select_scheduler_rows(d.scheduler, rows, now, step.x.ndim)
        if isinstance(step.generator, list):
            step.generator = [step.generator[j] for j in rows.tolist()]
        both = torch.cat([rows, rows + now]) if guided else rows  # [uncond; cond] halves
        cond = state["cond"] = tuple(c[both.to(c.device)] for c in state["cond"])

        def denoise(x_in, t, cond=cond):
            return decoder(x_in, t, cond=cond)

        step.denoise = denoise

    return hook, lambda: state["keep"]


def candidate_counts(settings: DecoderSampling, prompts: Sequence[str]) -> list[int]:
    """The decoder's candidates per image for each of ``prompts`` under its settings
    (:meth:`CandidateSelection.counts`)."""
    return CandidateSelection.of(sampling_as(DecoderSampling, "decoder", settings)).counts(prompts)


@torch.no_grad()
def sample_decoder_candidates(
    decoder: UnCLIPDecoder,
    image_embed: torch.Tensor,
    text: Caption,
    null_text: Callable[[int], Caption],
    settings: DecoderSampling,
    diffusion: DiffusionConfig,
    scorer: CLIP,
    prompts: Sequence[str],
    count: int,
    *,
    generator: Generator = None,
    latents: Optional[torch.Tensor] = None,
    progress: bool = True,
    autocast_dtype: Optional[torch.dtype] = None,
    callback: Optional[LoopCallback] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder over ``count`` consecutive candidates per image (the rows of ``image_embed``
    and ``text``; other arguments as :func:`~unclip.sampling.stages.sample_decoder`), keeping one
    per image: each image's best by :func:`rerank_candidates` with the CLIP ``scorer``, the
    image's prompt (``prompts``: one per image) and the settings' ``rerank_contrast``.

    With the settings' ``rerank_at`` below ``steps`` the choice is made after that step, from each
    candidate's predicted final image, and only the chosen rows are denoised on (after
    ``prune_at``, each image's ``prune_keep`` best first); otherwise among the finished images.
    Returns ``(images [B, 3, s, s] in [-1, 1], kept indices [B])`` into the candidates given."""
    settings = sampling_as(DecoderSampling, "decoder", settings)
    sel = CandidateSelection.of(settings)
    contrast = settings.rerank_contrast

    def choose(images: torch.Tensor, k: int, keep: int) -> torch.Tensor:
        # one prompt per image: each consecutive group of k candidates shares it
        return rerank_candidates(scorer, images, prompts, k, contrast, keep=keep)

    if not sel.early(count):
        images = sample_decoder(
            decoder, image_embed, text, null_text, settings, diffusion,
            generator=generator, latents=latents, progress=progress,
            autocast_dtype=autocast_dtype, callback=callback,
        )  # fmt: skip
        keep = torch.as_tensor(choose(images, count, 1), dtype=torch.long).cpu()
        return images[keep.to(images.device)], keep
    check_rerank_at(settings, diffusion, decoder.config.learned_variance)
    # with pruning, the final choice is among each image's prune_keep survivors
    choose_at, prune_at, prune_keep = sel.choose_at, sel.prune_at, sel.prune_keep
    assert choose_at is not None  # sel.early(count) checked it
    group = count
    choices = {}
    if sel.pruning(count):
        assert prune_at is not None and prune_keep is not None  # sel.pruning(count) checked them
        group = prune_keep
        choices[prune_at - 1] = lambda x0: choose(x0, count, group)
    choices[choose_at - 1] = lambda x0: choose(x0, group, 1)
    images, keep = _sample_choosing(
        decoder, image_embed, text, null_text, settings, diffusion, choices,
        generator=generator, latents=latents, progress=progress,
        autocast_dtype=autocast_dtype, callback=callback,
    )  # fmt: skip
    return images, keep


def _sample_choosing(
    decoder, image_embed, text, null_text, settings, diffusion, choices, **run
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's sampling loop with :func:`_choosing_hook` on it."""
    d = decoder_denoiser(decoder, image_embed, text, null_text, settings, diffusion)
    hook, kept = _choosing_hook(d, diffusion, is_guided(settings.guidance_scale), decoder, choices)
    x = _sample(
        d.fn, d.shape, d.scheduler, settings, decoder, "decoder",
        learned_variance=d.learned_variance, on_step=hook, **run,
    )  # fmt: skip
    x = check_finite("decoder", x, run.get("autocast_dtype"))
    if decoder.is_latent:
        x = check_finite("the decoder's autoencoder", decoder.to_images(x))
    return x.float().clamp(-1, 1), kept()


@torch.no_grad()
def sample_decoder_reranked(
    decoder: UnCLIPDecoder,
    image_embed: torch.Tensor,
    text: Caption,
    null_text: Callable[[int], Caption],
    settings: DecoderSampling,
    diffusion: DiffusionConfig,
    choose: Callable[[torch.Tensor], torch.Tensor],
    *,
    generator: Generator = None,
    latents: Optional[torch.Tensor] = None,
    progress: bool = True,
    autocast_dtype: Optional[torch.dtype] = None,
    callback: Optional[LoopCallback] = None,
    prune: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~unclip.sampling.stages.sample_decoder` over candidates that keeps only some of them
    part-way (the decoder's ``rerank_at``, which must be below ``steps``; arguments as
    ``sample_decoder``, the rows of ``image_embed`` and ``text`` are the candidates). After step
    ``rerank_at``, ``choose(x0)`` gets every candidate's predicted final image ``[N, 3, s, s]`` in
    [-1, 1] at that step and returns the indices of the rows to keep; only those are denoised to
    the end, with their own conditioning rows (guidance's unconditional ones included).
    ``callback`` sees every candidate up to that step and the kept rows after it. ``prune(x0)``:
    the same, earlier, after the decoder's ``prune_at`` step (used when it prunes); ``choose``
    then gets the rows it kept.

    Returns ``(images [M, 3, s, s] in [-1, 1], kept indices [M])``, the indices into the
    candidates given (through both choices when pruning). With a distinct generator per
    candidate (a list), each kept row finishes exactly as it would in a run of every candidate:
    its generator goes with it and the scheduler's per-sample state
    (:func:`~unclip.sampling.stages.select_scheduler_rows`) is cut to the kept rows. Samplers that
    cannot stop part-way are refused (:func:`check_rerank_at`)."""
    settings = sampling_as(DecoderSampling, "decoder", settings)
    m = settings.rerank_at
    if m is None or m >= settings.steps:
        raise ValueError(
            f"sample_decoder_reranked needs the decoder's rerank_at below steps ({settings.steps}),"
            f" got {m!r}; choose among finished images with sample_decoder and rerank_candidates"
        )
    check_rerank_at(settings, diffusion, decoder.config.learned_variance)
    choices = {m - 1: choose}
    if CandidateSelection.of(settings).pruning():
        prune_at = settings.prune_at
        assert prune_at is not None  # pruning() checked it
        if prune is None:
            raise ValueError(
                f"decoder: prune_at {prune_at} is set; give sample_decoder_reranked the "
                "prune function that keeps each image's prune_keep best candidates"
            )
        choices[prune_at - 1] = prune
    return _sample_choosing(
        decoder, image_embed, text, null_text, settings, diffusion, choices,
        generator=generator, latents=latents, progress=progress,
        autocast_dtype=autocast_dtype, callback=callback,
    )  # fmt: skip


@torch.no_grad()
def rerank_candidates(
    clip: CLIP,
    images: torch.Tensor,
    prompts: Union[str, Sequence[str]],
    k: int,
    contrast: Union[str, Callable[[str], list[str]], None] = None,
    keep: int = 1,
) -> torch.Tensor:
    """Indices ``[B]`` of the best of each consecutive group of ``k`` candidates
    (``images [B·k, 3, H, W]`` in [-1, 1]) by the cosine between ``clip``'s embeddings of the image
    and of its prompt (the decoder's ``best_of``). ``prompts``: one per image (``B·k``), one per
    group (``B``), or one string for all; ``k = 1`` keeps every image. ``keep``: the indices
    ``[B·keep]`` of each group's ``keep`` best instead, group by group and in their original order
    within a group, so they form consecutive groups of ``keep`` again (the decoder's
    ``prune_keep``); ``keep >= k`` keeps every image.

    ``contrast`` (the decoder's ``rerank_contrast``; a name in :data:`RERANK_CONTRASTS` or a
    function ``prompt -> [caption, *alternatives]``): score each candidate instead by how much the
    CLIP prefers the caption over its alternatives, ``log p(caption | image)`` among them — the
    CLIP's retrieval task, which it is trained for, rather than how close the image is to the
    caption in absolute terms (an image close to every caption of its kind scores high on the
    cosine whatever it shows). ``"shapes"``: the one-attribute variants and color/shape swaps of a
    shapes caption (:func:`unclip.shapes.world.caption_alternatives`); ``"shapes-pairs"``: the same
    for two-object captions only.

    A contrast function may also carry ``regions``, a function ``prompt -> [RegionPart, ...]``
    (empty: none for that prompt): each part is a phrase of the prompt read on one side of the
    image, the other side painted in the background (:func:`region_views`), and a candidate's score
    gains the parts' summed ``log p(caption | side)`` at the split that suits it best
    (:data:`REGION_SPLITS`). A CLIP that reads one object well but binds two objects' attributes
    less surely (which color or shape goes with which object) is then asked the easier question
    once per object. ``"shapes-pairs-regions"``: ``"shapes-pairs"`` with each object of a
    two-object caption as a part (:func:`unclip.shapes.world.region_parts`). A prompt whose
    contrast has fewer than two captions (scored by the plain cosine) gets no region term; with
    pruning (``keep > 1``) the region term counts at both choices."""
    k = check_count(k, "k")
    keep = check_count(keep, "keep")
    if isinstance(contrast, str):
        check_rerank_contrast("decoder", contrast)
    scorer = as_scorer(contrast)
    if images.shape[0] % k:
        raise ValueError(f"rerank: {images.shape[0]} images are not groups of {k} candidates")
    if k == 1 or keep >= k:
        return torch.arange(images.shape[0])
    if isinstance(prompts, torch.Tensor):
        raise TypeError(
            "rerank takes the prompts (strings), not text embeddings: the reranking CLIP "
            "(pipe.rerank_clip) encodes them itself"
        )
    prompts = [prompts] * images.shape[0] if isinstance(prompts, str) else check_prompts(prompts)
    if len(prompts) == images.shape[0] // k:
        prompts = [p for p in prompts for _ in range(k)]
    if len(prompts) != images.shape[0]:
        raise ValueError(
            f"rerank: {len(prompts)} prompts for {images.shape[0]} images in groups of {k}; "
            f"give one prompt per image or one per group"
        )
    if contrast is not None:
        # log-probabilities over different caption sets (or a cosine) do not compare
        if any(len(set(prompts[i : i + k])) > 1 for i in range(0, len(prompts), k)):
            raise ValueError(
                "rerank with a contrast: the k candidates of a group must share one prompt "
                "(give one prompt per group)"
            )
    scores = scorer.score(clip, images, prompts).view(-1, k).float().cpu()
    # NaN scores (NaN reranker weights) would silently keep candidate 0 of every group
    scores = check_finite("the reranking CLIP", scores)
    first = torch.arange(scores.shape[0]) * k
    if keep == 1:
        return first + scores.argmax(1)
    best = scores.topk(keep, dim=1).indices.sort(dim=1).values
    return (first[:, None] + best).flatten()
