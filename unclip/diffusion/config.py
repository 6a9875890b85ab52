"""The noise-schedule settings a stage is trained with (:class:`DiffusionConfig`), the built-in
sampler names, and what of them is saved beside a stage's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from unclip.utils.config import ConfigError, _without_defaults


@dataclass
class DiffusionConfig:
    """Noise schedule and training target shared by every stage.

    ``vlb_weight``: λ of the Improved-DDPM hybrid loss ``L_simple + λ·L_vlb`` (paper: 0.001) that
    trains a decoder's learned variance (``decoder.learned_variance``); 0 trains ``L_simple`` only.
    ``timestep_shift``: s > 1 draws training timesteps more often at high noise, where the
    conditioning decides the image, s < 1 at low noise (``t/T = s·u / (1 + (s − 1)·u)``,
    ``u ~ U(0, 1)``, Stable Diffusion 3's shift formula); 1 (default) draws them uniformly. The
    autoregressive prior draws no timesteps and ignores it.
    """

    num_train_timesteps: int = 1000
    beta_schedule: Literal["squaredcos_cap_v2", "linear", "scaled_linear"] = "squaredcos_cap_v2"
    prediction_type: Literal["epsilon", "sample", "v_prediction"] = "epsilon"
    min_snr_gamma: Optional[float] = None
    vlb_weight: float = 0.0
    timestep_shift: float = 1.0

    def __post_init__(self) -> None:
        if not (0.0 < self.timestep_shift < float("inf")):
            raise ConfigError(
                f"diffusion.timestep_shift must be a finite number > 0 (1 draws timesteps "
                f"uniformly, > 1 favours high noise), got {self.timestep_shift!r}"
            )
        if not (0.0 <= self.vlb_weight < float("inf")):
            raise ConfigError(
                f"diffusion.vlb_weight must be a finite number >= 0 (paper: 0.001), got "
                f"{self.vlb_weight!r}"
            )


#: the samplers configured by the library itself (``SamplingConfig.scheduler``); any other
#: diffusers scheduler works too, by alias, class name or instance (see unclip/schedulers.py)
SCHEDULERS = ("ddpm", "ddim", "dpm++", "unclip")


#: training-only DiffusionConfig settings newer than the library versions that refuse unknown
#: keys: files written for sampling (a pipeline's unclip.json, a component's unclip_stage.json)
#: leave them out at their defaults, so that a folder written by this version loads there too
#: (min_snr_gamma, also training-only, is older and always written)
TRAINING_ONLY_DIFFUSION = ("vlb_weight", "timestep_shift")


def diffusion_to_save(diffusion: Any) -> Any:
    """``diffusion`` (a :class:`DiffusionConfig` or its dict) as saved with weights: without the
    :data:`TRAINING_ONLY_DIFFUSION` settings that are at their defaults."""
    return _without_defaults(diffusion, DiffusionConfig, TRAINING_ONLY_DIFFUSION)
