"""Per-stage sampling settings: one type per kind of stage, each holding only its own settings.

:class:`PriorSampling` (diffusion prior), :class:`ARPriorSampling` (autoregressive prior),
:class:`DecoderSampling` (the 64 px decoder, with its candidate choice) and
:class:`UpsamplerSampling` share the settings of :class:`SamplingConfig` where they have them.
A pipeline holds one per stage; ``sampling={stage: {setting: value}}`` overrides them per call
(:func:`resolve_sampling`). A setting a stage does not have is refused with the stages that do
have it. Folders written when every stage shared one type of thirteen settings still load: a
setting another stage owns is dropped when it holds that type's default (``None``, or
``best_of`` 1 for an upsampler), and the autoregressive prior drops ``scheduler`` and ``steps``,
which it never used (:func:`sampling_for`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, TypeVar, Union

from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import check_sampling_args
from unclip.sampling.scorers import check_rerank_contrast
from unclip.sampling.utils import stage_kind
from unclip.utils.config import ConfigError, _without_defaults, from_dict, to_dict

__all__ = [
    "SamplingConfig",
    "PriorSampling",
    "ARPriorSampling",
    "DecoderSampling",
    "UpsamplerSampling",
    "StageSampling",
    "sampling_for",
    "stage_settings",
    "resolve_sampling",
    "sampling_to_save",
    "DEFAULT_SAMPLING",
    "DEFAULT_DIFFUSION",
    "SAMPLING_FIELDS",
    "AR_SAMPLING_FIELDS",
    "EVERY_UPSAMPLER",
]


def _count(stage: str, name: str, value, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{stage}: {name} must be an integer >= 1, got {value!r}")


class _Settings:
    """Settings objects hold their own fields only: setting another attribute is an error rather
    than a value nothing reads."""

    def __setattr__(self, name: str, value) -> None:
        if name not in {f.name for f in dataclasses.fields(self)}:  # type: ignore[arg-type]
            mine = ", ".join(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]
            raise AttributeError(
                f"{type(self).__name__} has no setting {name!r} (its settings: {mine})"
            )
        object.__setattr__(self, name, value)


@dataclass
class SamplingConfig(_Settings):
    """The settings every diffusion stage samples with: scheduler name, number of steps, guidance
    scale.

    ``scheduler`` is one of ``ddpm``, ``ddim``, ``dpm++`` (DPM-Solver++ multistep), ``unclip``,
    an alias such as ``euler``, ``heun`` or ``unipc``, a diffusers scheduler class name, or a
    diffusers scheduler instance (:mod:`unclip.diffusion.schedulers`).
    """

    scheduler: str = "ddim"
    steps: int = 25
    guidance_scale: float = 4.0

    def check(self, stage: str) -> None:
        """A ``ValueError`` naming ``stage`` and the setting for a value out of range."""
        check_sampling_args(stage, self.scheduler, self.steps, self.guidance_scale)


@dataclass
class UpsamplerSampling(SamplingConfig):
    """An upsampler's settings (:class:`SamplingConfig`'s; candidates are chosen earlier)."""

    steps: int = 10
    guidance_scale: float = 1.0


@dataclass
class PriorSampling(SamplingConfig):
    """The diffusion prior's settings. ``best_of``: that many embedding candidates per image,
    keeping the one with the highest dot product with the text embedding (paper: 2)."""

    best_of: int = 1

    def check(self, stage: str) -> None:
        super().check(stage)
        _count(stage, "best_of", self.best_of)


@dataclass
class ARPriorSampling(_Settings):
    """The autoregressive prior's settings. It samples codes, not noise, so it has no scheduler
    or steps. ``guidance_scale`` mixes its logits; ``best_of`` as :class:`PriorSampling`;
    ``temperature`` (default 1), ``top_k`` and ``top_p`` (default: off);
    ``dot_product_quantile``: the quantile of the training text–image cosines its dot-product
    token asks for (default: drawn from the top half for each sample, as the paper samples)."""

    guidance_scale: float = 4.0
    best_of: int = 1
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    dot_product_quantile: Optional[float] = None

    def check(self, stage: str) -> None:
        g = self.guidance_scale
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
            raise ValueError(f"{stage}: guidance scale must be a finite number >= 0, got {g!r}")
        _count(stage, "best_of", self.best_of)

        def number(name, ok, valid):
            v = getattr(self, name)
            if v is None:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                raise ValueError(f"{stage}: {name} must be {valid}, got {v!r}")

        number("temperature", lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
        number("top_k", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1 (null: off)")
        number("top_p", lambda v: 0 < v <= 1, "in (0, 1] (null or 1: off)")
        number("dot_product_quantile", lambda v: 0 <= v <= 1, "in [0, 1] (null: the top half)")


@dataclass
class DecoderSampling(SamplingConfig):
    """The decoder's settings, with how it draws and chooses candidates
    (:class:`~unclip.sampling.candidates.CandidateSelection` reads them).

    ``best_of``: that many base-resolution images per prompt (each from its own prior sample),
    keeping the one the reranking CLIP scores best before upsampling (CLIP reranking, as DALL-E).
    ``rerank_at``: choose after this many of the ``steps``, from each candidate's predicted final
    image at that step, and denoise only the chosen ones to the end: ``best_of × rerank_at + steps
    − rerank_at`` network calls per image instead of ``best_of × steps``; ``None`` (default), or
    ``steps`` or more, chooses among the finished images. It takes samplers with one network call
    per step (not Heun or DPM2).
    ``prune_at`` and ``prune_keep`` (with ``rerank_at`` below ``steps``): after step ``prune_at``
    (below ``rerank_at``) keep only each image's ``prune_keep`` best candidates by the same score,
    and choose one of them after ``rerank_at`` (successive halving). With ``best_of`` at or below
    ``prune_keep`` nothing is pruned. Both or neither are set (default: neither).
    ``rerank_contrast``: score the candidates with a registered scorer
    (:data:`~unclip.sampling.scorers.RERANK_CONTRASTS`, e.g. ``"shapes"``: how much the CLIP
    prefers the prompt over its one-attribute variants) instead of the plain cosine (``None``).
    ``best_of_contrasted``: candidates per image for a prompt that ``rerank_contrast`` has
    alternatives for, while the other prompts take ``best_of``; ``None`` (default): ``best_of``
    for every prompt. An override that sets ``best_of`` alone resets it, so ``{"decoder":
    {"best_of": 4}}`` draws 4 for every prompt.
    """

    best_of: int = 1
    rerank_at: Optional[int] = None
    rerank_contrast: Optional[str] = None
    best_of_contrasted: Optional[int] = None
    prune_at: Optional[int] = None
    prune_keep: Optional[int] = None

    def check(self, stage: str) -> None:
        super().check(stage)
        _count(stage, "best_of", self.best_of)
        r = self.rerank_at
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(
                f"{stage}: rerank_at must be an integer >= 1 (a step number; steps or more, "
                f"or None, choose among the finished images), got {r!r}"
            )
        check_rerank_contrast(stage, self.rerank_contrast)
        _count(stage, "best_of_contrasted", self.best_of_contrasted, none_ok=True)
        self._check_prune(stage, self.best_of)
        if self.best_of_contrasted is not None and self.rerank_contrast is not None:
            try:
                self._check_prune(stage, self.best_of_contrasted)
            except ValueError as exc:
                raise ValueError(
                    f"{exc} (for the {self.best_of_contrasted} candidates of best_of_contrasted)"
                ) from None

    def _check_prune(self, stage: str, best_of: int) -> None:
        given = {f: getattr(self, f) for f in ("prune_at", "prune_keep")}
        given = {f: v for f, v in given.items() if v is not None}
        if not given:
            return
        clear = (
            "sampling={'decoder': {'prune_at': None, 'prune_keep': None}}, --decoder-prune-at none"
        )
        for field, value in given.items():
            _count(stage, field, value)
        if len(given) == 1:
            missing = "prune_keep" if "prune_at" in given else "prune_at"
            raise ValueError(
                f"{stage}: {next(iter(given))} needs {missing} too (after step prune_at keep each "
                f"image's prune_keep best candidates), or neither ({clear})"
            )
        assert self.prune_at is not None and self.prune_keep is not None  # both given
        if best_of <= self.prune_keep:
            return  # nothing to prune: a smaller best_of than the model's defaults keeps working
        if (
            self.rerank_at is None
            or self.rerank_at >= self.steps
            or self.prune_at >= self.rerank_at
        ):
            raise ValueError(
                f"{stage}: prune_at {self.prune_at} needs the final choice later, part-way: "
                f"rerank_at above it and below steps ({self.steps}), got rerank_at "
                f"{self.rerank_at!r}; set rerank_at, or stop pruning ({clear})"
            )


StageSampling = Union[PriorSampling, ARPriorSampling, DecoderSampling, UpsamplerSampling]

#: the settings type of each kind of stage ("ar_prior": a prior with ``prior.type: ar``)
TYPES: dict[str, type[StageSampling]] = {
    "prior": PriorSampling,
    "ar_prior": ARPriorSampling,
    "decoder": DecoderSampling,
    "upsampler": UpsamplerSampling,
}

#: how errors name each kind of stage
KIND_LABELS = {
    "prior": "the diffusion prior",
    "ar_prior": "the autoregressive prior",
    "decoder": "the decoder",
    "upsampler": "an upsampler",
}

#: every setting of some stage (a ``sampling=`` override may set the ones its stage has)
SAMPLING_FIELDS = tuple(
    dict.fromkeys(f.name for tp in TYPES.values() for f in dataclasses.fields(tp))
)

#: the settings only the autoregressive prior has
AR_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "dot_product_quantile")

#: settings of the one shared type of earlier versions that a stage without them dropped at this
#: value (the old defaults), so folders written then load
_LEGACY_DEFAULTS = {"best_of": 1}

#: settings the autoregressive prior never used (it has no noise schedule)
_AR_IGNORED = ("scheduler", "steps")

#: decoder settings newer than the library versions that refuse unknown keys: saved files leave
#: them out at their defaults for the same reason
NEWER_SAMPLING = ("prune_at", "prune_keep", "best_of_contrasted")


def settings_kind(stage: str, ar: bool = False) -> str:
    kind = stage_kind(stage)
    return "ar_prior" if kind == "prior" and ar else kind


def _owners(name: str) -> list[str]:
    return [kind for kind, tp in TYPES.items() if name in {f.name for f in dataclasses.fields(tp)}]


def _filtered(kind: str, values: Mapping, where: str, legacy: bool) -> dict:
    """``values`` with the settings ``kind`` lacks removed where that is safe (see module doc);
    any other setting it lacks is a ``ValueError`` naming who has it."""
    mine = {f.name for f in dataclasses.fields(TYPES[kind])}
    out = {}
    for name, value in values.items():
        if name in mine:
            out[name] = value
            continue
        if kind == "ar_prior" and name in _AR_IGNORED:
            continue
        if legacy and (value is None or _LEGACY_DEFAULTS.get(name, object()) == value):
            continue
        owners = _owners(name)
        if not owners:
            close = difflib.get_close_matches(str(name), sorted(mine), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{where}: unknown sampling setting {name!r}{hint} (its settings: "
                f"{', '.join(sorted(mine))})"
            )
        who = ", ".join(KIND_LABELS[o] for o in owners)
        raise ValueError(
            f"{where}: {name} is not a setting of {KIND_LABELS[kind]} (its settings: "
            f"{', '.join(sorted(mine))}); it is one of {who}: remove it"
        )
    return out


def sampling_for(stage: str, value: Any, *, ar: bool = False, where: str = "") -> StageSampling:
    """``stage``'s settings type built from ``value``: a dict (as in ``unclip.json`` or a config
    file), a settings object of any stage, or None (the defaults of its kind), checked. ``ar``: the
    stage is an autoregressive prior."""
    kind = settings_kind(stage, ar)
    tp = TYPES[kind]
    where = where or stage
    if value is None:
        value = {}
    if isinstance(value, tp):
        out = copy.deepcopy(value)
    else:
        if dataclasses.is_dataclass(value):
            values = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        elif isinstance(value, Mapping):
            values = dict(value)
        else:
            raise TypeError(
                f"{where}: sampling settings must be a dict of settings, got {type(value).__name__}"
            )
        scheduler = values.get("scheduler")
        if scheduler is not None and not isinstance(scheduler, str):
            values.pop("scheduler")  # a diffusers scheduler instance: set after the strict load
        try:
            out = from_dict(tp, _filtered(kind, values, where, legacy=True), prefix=where)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if scheduler is not None and not isinstance(scheduler, str) and kind != "ar_prior":
            out.scheduler = scheduler
    out.check(stage)
    return out


_Kind = TypeVar("_Kind", PriorSampling, ARPriorSampling, DecoderSampling, UpsamplerSampling)


def sampling_as(kind: type[_Kind], stage: str, value: Any, *, where: str = "") -> _Kind:
    """:func:`sampling_for` for a caller that knows the settings type of ``stage`` (``kind``:
    :class:`ARPriorSampling` for an autoregressive prior)."""
    out = sampling_for(stage, value, ar=kind is ARPriorSampling, where=where)
    assert isinstance(out, kind), f"{stage} has {type(out).__name__}, not {kind.__name__}"
    return out


DEFAULT_SAMPLING = {
    "prior": PriorSampling(scheduler="ddim", steps=25, guidance_scale=4.0, best_of=2),
    "ar_prior": ARPriorSampling(guidance_scale=4.0, best_of=2),
    "decoder": DecoderSampling(scheduler="ddim", steps=25, guidance_scale=4.0),
    "upsampler": UpsamplerSampling(scheduler="ddim", steps=10, guidance_scale=1.0),
}

DEFAULT_DIFFUSION = {
    "prior": DiffusionConfig(prediction_type="sample"),
    "decoder": DiffusionConfig(prediction_type="epsilon"),
    "upsampler": DiffusionConfig(prediction_type="epsilon"),
}

#: the ``sampling=`` key whose settings apply to every upsampler (a stage's own key wins)
EVERY_UPSAMPLER = "upsampler"


def sampling_to_save(sampling: Any) -> Any:
    """A stage's settings (an object or its dict) as saved with weights: without the decoder's
    :data:`NEWER_SAMPLING` settings that are at their defaults."""
    return _without_defaults(sampling, DecoderSampling, NEWER_SAMPLING)


def stage_settings(
    stage_names: Sequence[str],
    diffusion: Optional[Mapping] = None,
    sampling: Optional[Mapping] = None,
    ar_stages: Collection[str] = (),
) -> tuple[dict[str, DiffusionConfig], dict[str, StageSampling]]:
    """``({stage: DiffusionConfig}, {stage: settings})`` for ``stage_names``: each stage's entry of
    ``diffusion``/``sampling`` (a config or a dict, as in ``unclip.json``) or else the defaults of
    its kind. Settings are copies, so changing them changes nothing given."""
    diffusion_out: dict[str, DiffusionConfig] = {}
    sampling_out: dict[str, StageSampling] = {}
    for name in stage_names:
        kind = stage_kind(name)
        d = (diffusion or {}).get(name, DEFAULT_DIFFUSION[kind])
        diffusion_out[name] = (
            d
            if isinstance(d, DiffusionConfig)
            else from_dict(DiffusionConfig, d, prefix=f"diffusion.{name}")
        )
        ar = name in ar_stages
        s = (sampling or {}).get(name, DEFAULT_SAMPLING[settings_kind(name, ar)])
        sampling_out[name] = sampling_for(name, s, ar=ar, where=f"sampling.{name}")
    return diffusion_out, sampling_out


def resolve_sampling(
    settings: Mapping[str, Any],
    sampling: Optional[Mapping] = None,
    ar_stages: Collection[str] = (),
) -> dict[str, StageSampling]:
    """``settings`` (``{stage: settings}``, a pipeline's stages in order) with the overrides
    ``sampling`` applied and every stage's result checked; a new dict of copies.

    ``sampling``: ``{key: {setting: value}}`` (or ``{key: settings object}``); a key is a stage of
    ``settings`` or ``"upsampler"`` (every upsampler; an upsampler's own key wins). ``"prior"``
    and ``"upsampler"`` are accepted (and checked) where ``settings`` has no such stage, so one set
    of overrides serves every pipeline. Unknown keys, settings a stage does not have and invalid
    values are a ``ValueError`` naming them. ``ar_stages``: the stages sampled by an
    autoregressive prior."""
    over = _check_overrides(sampling, list(settings))
    out = {}
    for stage, base in settings.items():
        ar = stage in ar_stages
        s = sampling_for(stage, base, ar=ar)
        kind = settings_kind(stage, ar)
        merged = dict(over.get(EVERY_UPSAMPLER, {})) if kind == "upsampler" else {}
        merged.update(over.get(stage, {}))
        merged = _filtered(kind, merged, stage, legacy=True)
        for k, v in merged.items():
            setattr(s, k, v)
        if isinstance(s, DecoderSampling) and "best_of" in merged:
            if "best_of_contrasted" not in merged:
                s.best_of_contrasted = None  # a count given alone is every prompt's count
        s.check(stage)
        out[stage] = s
    # an override of a stage the pipeline lacks ("prior", "upsampler") is still checked
    for key in ("prior", EVERY_UPSAMPLER):
        if key in over and not any(stage_kind(st) == key for st in settings):
            kind = settings_kind(key, key in ar_stages)
            merged = _filtered(kind, over[key], key, legacy=True)
            sampling_for(key, {**to_dict(DEFAULT_SAMPLING[kind]), **merged}, ar=key in ar_stages)
    return out


def _check_overrides(sampling: Optional[Mapping], stages: list[str]) -> dict[str, dict]:
    if sampling is None:
        return {}
    if not isinstance(sampling, Mapping):
        raise TypeError(
            f"sampling must be a dict {{stage: {{setting: value}}}}, got {type(sampling).__name__}"
        )
    valid = [*stages, EVERY_UPSAMPLER]
    if "prior" not in stages:
        valid.append("prior")
    out = {}
    for key, values in sampling.items():
        if key not in valid:
            if key == "upsamplers":
                hint = f"; use {EVERY_UPSAMPLER!r} for every upsampler"
            else:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"sampling: unknown stage {key!r}{hint} (valid: {', '.join(valid)})")
        if dataclasses.is_dataclass(values):
            values = {f.name: getattr(values, f.name) for f in dataclasses.fields(values)}
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
