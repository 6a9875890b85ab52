"""The web demo's handlers (:mod:`unclip.demo`): each tab's work as a plain function of the
pipeline, testable without a browser.

Each handler (:func:`generate`, :func:`variations`, :func:`interpolate`, :func:`inpaint`,
:func:`img2img`, :func:`text_diff`) takes the pipeline and the form's values (numbers may come as
floats such as ``4.0`` from sliders, empty text boxes as ``""``) plus ``sampling=`` overrides, and
returns PIL images. ``progress`` (a ``gr.Progress`` in the app, any ``progress(fraction,
desc=...)`` callable elsewhere) is fed from the pipeline's ``callback_on_step_end``. A bad input
(an empty prompt, a mask of another size, a setting out of range) is a ``gr.Error`` with a message
the page shows, never a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Optional

# Before gradio is imported: a local demo never reports usage to gradio's servers or checks them
# for a newer version (Blocks reads this when it is built; build_demo also passes
# analytics_enabled=False).
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import gradio as gr  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from unclip.sampling.tokens import TokenSampling  # noqa: E402

__all__ = [
    "MAX_IMAGES",
    "StepProgress",
    "editor_image_and_mask",
    "generate",
    "img2img",
    "inpaint",
    "interpolate",
    "sampling_plan",
    "text_diff",
    "variations",
    "whole_number",
]

#: most images (or frames) one request may ask for: a CPU takes seconds per image
MAX_IMAGES = 16
Progress = Optional[Callable[..., Any]]


# ------------------------------------------------------------------------------ progress
def sampling_plan(pipe, sampling: Optional[Mapping], stages: Sequence[str]) -> list[tuple]:
    """``[(stage, steps)]`` in the order ``stages`` run with the resolved ``sampling``; a token
    pipeline's ``transformer`` takes one step per image token."""
    settings = pipe.sampling_settings(sampling)
    return [
        (s, pipe.num_image_tokens if isinstance(settings[s], TokenSampling) else settings[s].steps)
        for s in stages
        if s in settings
    ]


class StepProgress:
    """A pipeline ``callback_on_step_end`` that reports each denoising step (or a token
    pipeline's image token) to ``progress`` as the fraction of all steps in ``plan``
    (``[(stage, steps)]``) done so far, and the stage's own step in ``desc``. Counting calls
    rather than reading step indices keeps the bar moving forward when a stage runs twice
    (interpolation samples the prior for both ends)."""

    def __init__(self, progress: Callable[..., Any], plan: Sequence[tuple]):
        self.progress = progress
        self.steps = dict(plan)
        self.total = max(1, sum(n for _, n in plan))
        self.done = 0

    def __call__(self, pipe, step: int, timestep, callback_kwargs: dict):
        self.done += 1
        stage = callback_kwargs["stage"]
        of = self.steps.get(stage)
        unit = "token" if stage == "transformer" else "step"
        desc = f"{stage}: {unit} {step + 1}" + (f"/{of}" if of else "")
        self.progress(min(1.0, self.done / self.total), desc=desc)
        return None

    def note(self, desc: str) -> None:
        """Report a phase that has no denoising steps of its own (e.g. an inversion)."""
        self.progress(min(1.0, self.done / self.total), desc=desc)


def _latent(pipe) -> bool:
    """A Kandinsky 2.2 pipeline: its edits take diffusers' keywords (``num_images_per_prompt``)
    and its decoder reads no caption."""
    return getattr(pipe, "family", None) == "kandinsky"


def _callback(progress: Progress, plan) -> Optional[StepProgress]:
    return None if progress is None else StepProgress(progress, plan)


# ------------------------------------------------------------------------------ inputs
def _user_error(message: str) -> gr.Error:
    """What the page shows for a bad input; the server's console gets no traceback for it (the
    message says all there is to say)."""
    return gr.Error(message, print_exception=False)


@contextmanager
def _shown_to_user():
    """The pipeline's own checks (``ValueError``/``TypeError`` naming what was wrong) become a
    ``gr.Error``, which the page shows as a message instead of a generic failure."""
    try:
        yield
    except gr.Error:
        raise
    except (ValueError, TypeError) as exc:
        raise _user_error(str(exc)) from exc


def whole_number(value, what: str, low: int, high: Optional[int] = None) -> int:
    """A form number (sliders send floats such as ``4.0``) as an int in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _user_error(f"{what} must be a whole number, got {value!r}")
    if isinstance(value, float):  # ints stay exact: a float would round a large seed
        if not value.is_integer():
            raise _user_error(f"{what} must be a whole number, got {value!r}")
        value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise _user_error(f"{what} must be {bound}, got {value}")
    return value


def _text(value, what: str) -> str:
    text = _optional_text(value) or ""
    if not text:
        raise _user_error(f"Enter {what}.")
    return text


def _optional_text(value) -> Optional[str]:
    """A text box's value, ``None`` when empty or blank."""
    if value is not None and not isinstance(value, str):
        raise _user_error(f"expected text, got {type(value).__name__}")
    return (value or "").strip() or None


def _generator(seed) -> torch.Generator:
    return torch.Generator().manual_seed(whole_number(seed, "seed", 0, 2**63 - 1))


def _image(value, what: str = "an image") -> Image.Image:
    if value is None:
        raise _user_error(f"Upload {what}.")
    if isinstance(value, np.ndarray):
        value = Image.fromarray(value.astype(np.uint8))
    if not isinstance(value, Image.Image):
        raise _user_error(f"{what} must be an image, got {type(value).__name__}")
    return value.convert("RGB")


def editor_image_and_mask(value) -> tuple[Image.Image, Optional[np.ndarray]]:
    """An image editor's value (``{"background", "layers", "composite"}`` with RGBA layers) or a
    plain image → ``(image, mask)``: the background in RGB and a bool ``[H, W]`` mask of every
    pixel painted on any layer (``None`` when nothing was painted)."""
    if isinstance(value, Mapping):
        image = _image(value.get("background"), "an image to inpaint")
        mask = None
        for layer in value.get("layers") or []:
            alpha = np.asarray(layer.convert("RGBA"))[..., 3] > 0
            mask = alpha if mask is None else _union(mask, alpha)
        return image, (mask if mask is not None and mask.any() else None)
    return _image(value, "an image to inpaint"), None


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.shape != b.shape:
        raise _user_error(f"the painted layers differ in size ({a.shape} and {b.shape})")
    return a | b


def _pil(out) -> list[Image.Image]:
    return list(out.images)


# ------------------------------------------------------------------------------ handlers
def generate(
    pipe,
    prompt: str,
    negative_prompt: str = "",
    num_images: int = 1,
    seed: int = 0,
    sampling: Optional[Mapping] = None,
    progress: Progress = None,
) -> list[Image.Image]:
    """Text → ``num_images`` images at ``pipe.resolution`` through every stage (any family; a
    token pipeline has no negative prompt and says so if given one)."""
    prompt = _text(prompt, "a prompt")
    n = whole_number(num_images, "number of images", 1, MAX_IMAGES)
    gen = _generator(seed)
    with _shown_to_user():
        plan = sampling_plan(pipe, sampling, pipe.stage_names)
        out = pipe(
            prompt,
            num_images_per_prompt=n,
            generator=gen,
            sampling=sampling,
            negative_prompt=_optional_text(negative_prompt),
            progress=False,
            callback_on_step_end=_callback(progress, plan),
        )
    return _pil(out)


def variations(
    pipe,
    image,
    num_images: int = 1,
    seed: int = 0,
    caption: str = "",
    sampling: Optional[Mapping] = None,
    progress: Progress = None,
) -> list[Image.Image]:
    """An image → its CLIP image embedding → ``num_images`` decodings (``caption``, optional,
    conditions the decoder)."""
    image = _image(image)
    n = whole_number(num_images, "number of images", 1, MAX_IMAGES)
    gen = _generator(seed)
    with _shown_to_user():
        plan = sampling_plan(pipe, sampling, ["decoder", *pipe.upsampler_names])
        given = _optional_text(caption)
        extra = {}
        if _latent(pipe):
            if given is not None:  # Kandinsky's decoder reads the image embedding alone
                raise _user_error("This model's decoder reads no caption: leave it empty.")
        else:
            extra["caption"] = given
        out = pipe.variations(
            image,
            num_images=n,
            generator=gen,
            sampling=sampling,
            progress=False,
            callback_on_step_end=_callback(progress, plan),
            **extra,
        )
    return _pil(out)


def interpolate(
    pipe,
    start: str,
    end: str,
    num_frames: int = 5,
    seed: int = 0,
    sampling: Optional[Mapping] = None,
    progress: Progress = None,
) -> list[Image.Image]:
    """``num_frames`` frames along the slerp between the prior's embeddings of two prompts, all
    decoded from the same noise."""
    start, end = _text(start, "a start prompt"), _text(end, "an end prompt")
    n = whole_number(num_frames, "number of frames", 2, MAX_IMAGES)
    gen = _generator(seed)
    with _shown_to_user():
        plan = sampling_plan(pipe, sampling, ["prior"]) * 2
        plan += sampling_plan(pipe, sampling, ["decoder", *pipe.upsampler_names])
        out = pipe.interpolate(
            start,
            end,
            num_steps=n,
            generator=gen,
            sampling=sampling,
            progress=False,
            callback_on_step_end=_callback(progress, plan),
        )
    return _pil(out)


def inpaint(
    pipe,
    image,
    mask,
    prompt: str,
    negative_prompt: str = "",
    num_images: int = 1,
    seed: int = 0,
    resample: int = 4,
    sampling: Optional[Mapping] = None,
    progress: Progress = None,
) -> list[Image.Image]:
    """Regenerate the masked region of ``image`` to ``prompt``. ``image``: an image or an image
    editor's value whose painted layers are the mask; ``mask``: an image of the same size (white =
    regenerate) that, when given, is used instead of the painted layers."""
    picture, painted = editor_image_and_mask(image)
    if mask is not None:
        mask = _image(mask, "a mask").convert("L")  # white = regenerate
    elif painted is not None:
        mask = painted
    else:
        raise _user_error(
            "Paint over the region to regenerate, or upload a mask (white = regenerate)."
        )
    prompt = _text(prompt, "a prompt describing the edited image")
    n = whole_number(num_images, "number of images", 1, MAX_IMAGES)
    passes = whole_number(resample, "resampling passes", 1, 16)
    gen = _generator(seed)
    with _shown_to_user():
        plan = sampling_plan(pipe, sampling, pipe.stage_names)
        # Kandinsky's inpainting decoder repaints in one pass and counts images per prompt
        count = (
            {"num_images_per_prompt": n} if _latent(pipe) else {"num_images": n, "resample": passes}
        )
        out = pipe.inpaint(
            picture,
            mask,
            prompt,
            **count,
            generator=gen,
            sampling=sampling,
            negative_prompt=_optional_text(negative_prompt),
            progress=False,
            callback_on_step_end=_callback(progress, plan),
        )
    return _pil(out)


def img2img(
    pipe,
    image,
    prompt: str,
    strength: float = 0.6,
    negative_prompt: str = "",
    num_images: int = 1,
    seed: int = 0,
    sampling: Optional[Mapping] = None,
    progress: Progress = None,
) -> list[Image.Image]:
    """The image noised part of the way (``strength`` in (0, 1]) and denoised to ``prompt``."""
    image = _image(image)
    prompt = _text(prompt, "a prompt")
    n = whole_number(num_images, "number of images", 1, MAX_IMAGES)
    gen = _generator(seed)
    with _shown_to_user():
        plan = sampling_plan(pipe, sampling, pipe.stage_names)
        count = {"num_images_per_prompt" if _latent(pipe) else "num_images": n}
        out = pipe.img2img(
            image,
            prompt,
            strength=strength,
            **count,
            generator=gen,
            sampling=sampling,
            negative_prompt=_optional_text(negative_prompt),
            progress=False,
            callback_on_step_end=_callback(progress, plan),
        )
    return _pil(out)


def text_diff(
    pipe,
    image,
    source_caption: str,
    target_caption: str,
    num_frames: int = 5,
    max_theta: float = 0.5,
    inversion_steps: int = 50,
    seed: int = 0,
    sampling: Optional[Mapping] = None,
    progress: Progress = None,
) -> list[Image.Image]:
    """The image's embedding turned from ``source_caption`` towards ``target_caption`` in
    ``num_frames`` frames (θ from 0 to ``max_theta``), each decoded from the image's DDIM
    inversion."""
    image = _image(image)
    source = _text(source_caption, "a caption of the image as it is")
    target = _text(target_caption, "a caption of the image as it should become")
    n = whole_number(num_frames, "number of frames", 1, MAX_IMAGES)
    steps = whole_number(inversion_steps, "inversion steps", 1, 1000)
    with _shown_to_user():
        callback = _callback(progress, sampling_plan(pipe, sampling, pipe.upsampler_names))
        if callback is not None:  # the inversion and the diff's decode report no steps
            callback.note("inverting the image and decoding the frames")
        if _latent(pipe):  # frames decoded deterministically at the page's size: no upsamplers
            out = pipe.text_diff(
                image, source, target, num_steps=n, max_theta=max_theta, steps=steps,
                progress=False,
            )  # fmt: skip
            return _pil(out)
        out = pipe.text_diff(
            image,
            source,
            target,
            num_steps=n,
            max_theta=max_theta,
            steps=steps,
            generator=_generator(seed),
            sampling=sampling,
            progress=False,
            callback_on_step_end=callback,
        )
    return _pil(out)
