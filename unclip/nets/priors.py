"""The two prior types, by name: ``diffusion`` (:class:`~unclip.nets.prior.UnCLIPPrior`) and ``ar``
(:class:`~unclip.nets.ar_prior.UnCLIPARPrior`), and loading a prior folder as the type it holds.

A prior folder's ``config.json`` records its class (``_class_name``, written by diffusers'
``save_pretrained``), so a pipeline or component folder loads the prior it was saved with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from unclip.nets.ar_prior import UnCLIPARPrior
from unclip.nets.prior import UnCLIPPrior

__all__ = ["PRIOR_CLASSES", "prior_type", "load_prior"]

#: ``_class_name`` in a prior folder's config.json → (prior type, class)
PRIOR_CLASSES = {
    "UnCLIPPrior": ("diffusion", UnCLIPPrior),
    "UnCLIPARPrior": ("ar", UnCLIPARPrior),
}


def prior_type(prior) -> str:
    """``"ar"`` for an autoregressive prior, ``"diffusion"`` for the diffusion prior."""
    return "ar" if isinstance(prior, UnCLIPARPrior) else "diffusion"


def load_prior(folder: Union[str, Path], **kwargs) -> Union[UnCLIPPrior, UnCLIPARPrior]:
    """The prior saved in ``folder`` (its config.json names the class; a config without a class
    name, as older exports wrote, is the diffusion prior)."""
    from unclip.io.weights import read_json

    folder = Path(folder)
    name = read_json(folder / "config.json", "prior").get("_class_name", "UnCLIPPrior")
    if name not in PRIOR_CLASSES:
        known = ", ".join(PRIOR_CLASSES)
        raise ValueError(
            f"prior: {folder}/config.json names the class {name!r}, which is not a prior "
            f"({known}); pass a prior folder"
        )
    return PRIOR_CLASSES[name][1].from_pretrained(folder, **kwargs)
