"""Any diffusers scheduler as a stage's sampler.

A stage's ``SamplingConfig.scheduler`` is one of the built-in names (``ddim``, ``ddpm``, ``dpm++``,
``unclip``: :func:`unclip.diffusion.make_scheduler`), a short name of :data:`SCHEDULER_ALIASES`
(``euler``, ``heun``, ``unipc``, ...), the name of any diffusers scheduler class
(``"KDPM2DiscreteScheduler"``), or a scheduler instance, e.g. one built with ``from_config`` with
options of its own::

    from diffusers import EulerDiscreteScheduler
    pipe("a red circle", sampling={"decoder": {"scheduler": "unipc", "steps": 10}})
    euler = EulerDiscreteScheduler(use_karras_sigmas=True)
    pipe("a red circle", sampling={"decoder": {"scheduler": euler}})

Whatever is given, the stage's training facts win: the noise schedule (``num_train_timesteps``,
``beta_schedule``) and ``prediction_type`` come from the stage's
:class:`~unclip.diffusion.config.DiffusionConfig`; an instance keeps its other options (solver
order, Karras sigmas, ...). A scheduler that cannot serve the stage is refused with the reason: one
that samples another kind of model (flow matching), one that cannot use the stage's prediction type,
or one that needs a learned variance the model does not output. A saved pipeline or
``generate.json`` records an instance by its class name (its own options are not stored).
"""

from __future__ import annotations

import copy
import difflib
import inspect
from typing import Any

import torch
from diffusers.schedulers.scheduling_euler_ancestral_discrete import (
    EulerAncestralDiscreteScheduler as _EulerAncestral,
)

__all__ = [
    "SCHEDULER_ALIASES",
    "scheduler_class",
    "scheduler_label",
    "check_scheduler_spec",
    "build_scheduler",
    "is_builtin",
]

BUILTIN = ("ddpm", "ddim", "dpm++", "unclip")

#: short names of diffusers schedulers (any other diffusers scheduler class name works too)
SCHEDULER_ALIASES = {
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "heun": "HeunDiscreteScheduler",
    "unipc": "UniPCMultistepScheduler",
    "deis": "DEISMultistepScheduler",
    "dpm2": "KDPM2DiscreteScheduler",
    "dpm++2s": "DPMSolverSinglestepScheduler",
    "lms": "LMSDiscreteScheduler",
}

# options set for a scheduler built by name, where its class takes them: trailing spacing starts
# at the last training timestep (as the built-in samplers do) and a zero final sigma denoises fully
_NAMED_DEFAULTS = {
    "timestep_spacing": "trailing",
    "final_sigmas_type": "zero",
    "lower_order_final": True,
}


def is_builtin(spec: Any) -> bool:
    return isinstance(spec, str) and spec in BUILTIN


def _scheduler_base():
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    return SchedulerMixin


def _class(name: str):
    import diffusers

    cls_name = SCHEDULER_ALIASES.get(name, name)
    cls = getattr(diffusers, cls_name, None) if cls_name.endswith("Scheduler") else None
    if not (isinstance(cls, type) and issubclass(cls, _scheduler_base())):
        names = [*BUILTIN, *SCHEDULER_ALIASES]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown sampler {name!r}{hint}; choose one of {', '.join(names)}, the name of a "
            "diffusers scheduler class (e.g. 'KDPM2DiscreteScheduler') or a scheduler instance"
        )
    return cls


#: the diffusers class of each built-in name, for pipelines that build a scheduler from a
#: folder's scheduler config rather than from a stage's DiffusionConfig
BUILTIN_CLASSES = {
    "ddpm": "DDPMScheduler",
    "ddim": "DDIMScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "unclip": "UnCLIPScheduler",
}


def scheduler_class(name: str) -> type:
    """The diffusers scheduler class a built-in name (``"ddim"``, ...), an alias (``"euler"``,
    ...) or a class name names (the ancestral Euler sampler with float64 sigmas, see below);
    ``ValueError`` naming the choices."""
    cls = _class(BUILTIN_CLASSES.get(name, name))
    return EulerAncestralDiscreteScheduler if cls is _EulerAncestral else cls


class EulerAncestralDiscreteScheduler(_EulerAncestral):
    """diffusers' ancestral Euler sampler with its sigmas in float64 (the samples stay float32).

    Its step splits the move from ``sigma_from`` to ``sigma_to`` into ``sigma_down`` and
    ``sigma_up`` with ``sigma_down = sqrt(sigma_to² - sigma_up²)``. From ``t = T - 1`` of a
    squaredcos_cap_v2 schedule ``sigma_from`` is about 2e4, so ``sigma_up²`` equals ``sigma_to²``
    to within float32 rounding and the difference can come out negative: its square root is NaN
    (3 steps do it). In float64 the difference is ``sigma_to⁴ / sigma_from²``, small and
    positive, as it should be."""

    def set_timesteps(self, *args, **kwargs):
        super().set_timesteps(*args, **kwargs)
        self.sigmas = self.sigmas.to(torch.float64)


def scheduler_label(spec: Any) -> str:
    """How settings files name ``spec``: a name as given, an instance by its class name."""
    return spec if isinstance(spec, str) else type(spec).__name__


def check_scheduler_spec(spec: Any) -> None:
    """A clear ``ValueError`` unless ``spec`` is a known name or a diffusers scheduler."""
    if isinstance(spec, str):
        if spec not in BUILTIN:
            _class(spec)
        return
    if not isinstance(spec, _scheduler_base()):
        raise ValueError(
            f"a sampler must be a name or a diffusers scheduler instance, got {type(spec).__name__}"
        )


def build_scheduler(spec: Any, diffusion, *, learned_variance: bool = False):
    """A fresh scheduler for a stage trained with ``diffusion`` from a class name, an alias or an
    instance (the built-in names are :func:`unclip.diffusion.make_scheduler`'s)."""
    check_scheduler_spec(spec)
    cls = _class(spec) if isinstance(spec, str) else type(spec)
    if cls is _EulerAncestral:
        cls = EulerAncestralDiscreteScheduler
    facts = {
        "num_train_timesteps": diffusion.num_train_timesteps,
        "beta_schedule": diffusion.beta_schedule,
        "prediction_type": diffusion.prediction_type,
    }
    accepted = set(inspect.signature(cls.__init__).parameters)
    if isinstance(spec, str):
        options = {k: v for k, v in _NAMED_DEFAULTS.items() if k in accepted}
        if cls.__name__ == "DPMSolverSinglestepScheduler":
            options.pop("final_sigmas_type", None)  # its steps need a final sigma > 0
        if cls.__name__ == "HeunDiscreteScheduler":
            # its second-order correction of the first step, from sigma_max (about 1e4 at
            # t = 999 of a squaredcos_cap_v2 schedule) to a sigma of a few units, is far off and
            # the images come out as noise; leading spacing starts at a lower timestep
            options["timestep_spacing"] = "leading"
    else:
        options = {k: v for k, v in dict(spec.config).items() if not k.startswith("_")}
    missing = [k for k in ("prediction_type",) if k not in accepted]
    if missing:
        raise ValueError(
            f"{cls.__name__} takes no prediction_type, so it cannot sample this stage's "
            f"{diffusion.prediction_type!r} model"
        )
    try:
        sched = cls.from_config({**options, **{k: v for k, v in facts.items() if k in accepted}})
    except (ValueError, NotImplementedError) as exc:
        raise ValueError(f"{cls.__name__} cannot serve this stage: {exc}") from None
    _check_serves(sched, diffusion.prediction_type, learned_variance)
    return sched


def _check_serves(sched, prediction_type: str, learned_variance: bool) -> None:
    name = type(sched).__name__
    if not hasattr(sched, "alphas_cumprod"):
        raise ValueError(
            f"{name} samples another kind of model (no DDPM noise schedule, e.g. flow matching); "
            "the stages are DDPM-trained"
        )
    var = getattr(sched.config, "variance_type", None)
    if var == "learned":
        raise ValueError(
            f"{name} with variance_type='learned' is not supported (the decoders output the "
            "interpolation of variance_type='learned_range')"
        )
    if var == "learned_range" and not learned_variance:
        raise ValueError(
            f"{name} with variance_type={var!r} needs a model that outputs its variance; this "
            "stage's does not (set variance_type='fixed_small' or use another sampler)"
        )
    probe = copy.deepcopy(sched)
    try:  # one step on zeros: the scheduler's own checks of prediction_type run in step()
        probe.set_timesteps(2)
        x = torch.zeros(1, 2, 2, 2)
        t = probe.timesteps[0]
        out = torch.zeros(1, 4 if var == "learned_range" else 2, 2, 2)  # mean (+ variance)
        probe.step(out, t, probe.scale_model_input(x, t))
    except (ValueError, NotImplementedError, KeyError) as exc:
        raise ValueError(
            f"{name} cannot serve this stage (a model that predicts {prediction_type!r}): {exc}"
        ) from None
