"""How the decoder's candidates are scored: a :class:`Scorer` protocol and the two built-in scorers.

A scorer maps ``(clip, images [N, 3, H, W] in [-1, 1], prompts [N])`` to one score per image,
higher is better; the candidate choice (:mod:`unclip.sampling.candidates`) keeps each image's
best. :class:`CosineScorer` (the default) scores the cosine between the CLIP embeddings of the
image and of its prompt, as DALL-E's reranking did. :class:`ContrastScorer` scores
``log p(prompt | image)`` among the prompt and its alternatives (a function ``prompt ->
[prompt, *alternatives]``): the CLIP's retrieval task, which it is trained for, rather than how
close the image is to the caption in absolute terms (an image close to every caption of its kind
scores high on the cosine whatever it shows).

Scorers are named by the decoder's ``rerank_contrast`` setting through :data:`RERANK_CONTRASTS`:
packages register theirs as ``unclip.rerank_contrasts`` entry points (the shapes world's are in
``pyproject.toml``), so the core never imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional, Protocol, Union, runtime_checkable

import torch
import torch.nn.functional as F

from unclip.sampling.utils import stage_kind
from unclip.utils.registry import EntryPointRegistry

__all__ = [
    "Scorer",
    "CosineScorer",
    "ContrastScorer",
    "as_scorer",
    "RERANK_CONTRASTS",
    "RERANK_CONTRAST_ENTRY_POINTS",
    "register_rerank_contrast",
    "check_rerank_contrast",
]


@runtime_checkable
class Scorer(Protocol):
    """Scores candidate images against their prompts: ``score(clip, images, prompts) -> [N]``
    (``images [N, 3, H, W]`` in [-1, 1], one prompt per image; higher is better). The scores of
    one prompt's candidates are compared with each other only."""

    def score(self, clip, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


def image_text_cosines(clip, images: torch.Tensor, text_embed: torch.Tensor) -> torch.Tensor:
    """Cosine ``[B]`` between ``clip``'s embeddings of images ``[B, 3, H, W]`` in [-1, 1] and text
    embeddings ``[B, D]``."""
    img = F.normalize(clip.encode_image(images), dim=-1)
    return (img * F.normalize(text_embed.to(img), dim=-1)).sum(-1)


class CosineScorer:
    """The cosine between the CLIP embeddings of each image and of its prompt."""

    def score(self, clip, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return image_text_cosines(clip, images, clip.encode_text(list(prompts)).text_embed)

    def __repr__(self) -> str:
        return "CosineScorer()"


class ContrastScorer:
    """``log p(caption | image)`` among ``alternatives(prompt)`` (the prompt's caption first, then
    what a wrong image would show instead): a softmax of the CLIP's logits, ``logit_scale ×
    cosine``. A prompt with fewer than two captions (e.g. one the function cannot parse) is scored
    by the plain cosine. Subclasses add a per-prompt term with :meth:`extra`; calling the scorer
    with a prompt gives its captions."""

    def __init__(self, alternatives: Callable[[str], Sequence[str]]):
        if not callable(alternatives):
            raise TypeError(
                f"ContrastScorer(alternatives): a function prompt -> [caption, *alternatives], "
                f"got {type(alternatives).__name__}"
            )
        self.alternatives = alternatives

    def captions(self, prompt: str) -> list[str]:
        return list(self.alternatives(prompt))

    def __call__(self, prompt: str) -> list[str]:
        """The prompt's caption set (a contrast is also the function it scores with)."""
        return self.captions(prompt)

    def extra(self, clip, images: torch.Tensor, prompt: str) -> Optional[torch.Tensor]:
        """A term ``[n]`` added to the contrast scores of ``images`` (one prompt's candidates,
        only for prompts scored by the contrast), or None."""
        return None

    def score(self, clip, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        prompts = list(prompts)
        sets = {p: self.captions(p) for p in dict.fromkeys(prompts)}  # each distinct prompt once
        img = F.normalize(clip.encode_image(images), dim=-1)
        scores = torch.empty(len(prompts), device=img.device)
        for prompt, captions in sets.items():
            rows = torch.tensor(
                [i for i, p in enumerate(prompts) if p == prompt], device=img.device
            )
            txt = F.normalize(clip.encode_text(captions or [prompt]).text_embed.to(img), dim=-1)
            cos = img[rows] @ txt.T
            if len(captions) < 2:
                # log-probabilities added to a cosine would not compare across candidates, so a
                # prompt scored by the cosine gets no extra term either
                scores[rows] = cos[:, 0].to(scores)
                continue
            scores[rows] = (cos.float() * clip.logit_scale).log_softmax(-1)[:, 0].to(scores)
            more = self.extra(clip, images[rows.to(images.device)], prompt)
            if more is not None:
                scores[rows] += more.to(scores)
        return scores

    def __repr__(self) -> str:
        name = getattr(self.alternatives, "__name__", type(self.alternatives).__name__)
        return f"{type(self).__name__}({name})"


#: entry point group of rerank contrasts: name = the decoder's ``rerank_contrast`` setting, value
#: = a :class:`Scorer` or a function ``prompt -> [caption, *alternatives]``
RERANK_CONTRAST_ENTRY_POINTS = "unclip.rerank_contrasts"

#: The decoder's ``rerank_contrast`` names: name → a :class:`Scorer`, or a function ``prompt ->
#: captions`` (scored by :class:`ContrastScorer`), the first caption standing for the prompt and
#: the rest for what a wrong image would show instead.
RERANK_CONTRASTS = EntryPointRegistry(RERANK_CONTRAST_ENTRY_POINTS)


def register_rerank_contrast(name: str, fn: Union[Scorer, Callable[[str], list[str]]]) -> None:
    """Make a :class:`Scorer`, or ``fn(prompt) -> [caption, *alternatives]``, available as the
    decoder's ``rerank_contrast = name``; packages can declare the same as an
    ``unclip.rerank_contrasts`` entry point instead."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"rerank_contrast names are non-empty strings, got {name!r}")
    if not (isinstance(fn, Scorer) or callable(fn)):
        raise TypeError(
            f"register_rerank_contrast({name!r}, fn): fn must be a Scorer or callable, got "
            f"{type(fn).__name__}"
        )
    # the registry is typed for callables; this one also holds Scorers (resolved on lookup)
    RERANK_CONTRASTS[name] = fn  # type: ignore[assignment]


def check_rerank_contrast(stage: str, name) -> None:
    """A ``ValueError`` unless ``name`` is None or a registered contrast of the decoder."""
    if name is None:
        return
    if stage_kind(stage) != "decoder":
        raise ValueError(
            f"{stage}: rerank_contrast is a decoder setting (how its best_of candidates are "
            f"scored); remove it from {stage}'s settings"
        )
    if not isinstance(name, str) or name not in RERANK_CONTRASTS:
        raise ValueError(
            f"{stage}: rerank_contrast must be one of {sorted(RERANK_CONTRASTS)} or None, got "
            f"{name!r} (unclip.sampling.scorers.register_rerank_contrast adds one)"
        )


COSINE = CosineScorer()


def as_scorer(contrast: Union[str, Scorer, Callable[[str], list[str]], None]) -> Scorer:
    """The scorer a ``rerank_contrast`` value names: None → :class:`CosineScorer`; a registered
    name → its scorer; a :class:`Scorer` as is; a function ``prompt -> captions`` →
    :class:`ContrastScorer` of it."""
    if contrast is None:
        return COSINE
    if isinstance(contrast, str):
        check_rerank_contrast("decoder", contrast)
        contrast = RERANK_CONTRASTS[contrast]
    # an entry point's object is imported here, on the lookup of ``score``
    if callable(getattr(contrast, "score", None)):
        return contrast  # type: ignore[return-value]
    if callable(contrast):
        return ContrastScorer(contrast)
    raise TypeError(
        f"rerank contrast must be a registered name, a Scorer or a function, got "
        f"{type(contrast).__name__}"
    )
