"""Train a small CLIP on the shapes world (contrastive image–caption loss), for the shapes recipe.

    unclip train-clip configs/shapes/clip.yaml --output-dir runs/shapes/clip train.max_steps=2000

The CLIP trains on the shared training loop (:class:`unclip.train.loop.TrainLoop`: Accelerate,
AdamW with linear warmup and cosine decay, clipping, optional EMA, checkpoints and exact resume with
``--resume latest``); its task is the contrastive loss (``open_clip.ClipLoss``) of an open_clip
model built from the config dict (``clip.model_cfg``). Images are shapes renders at the CLIP's input
size with a mild noise/blur augmentation (so embeddings of slightly grainy generated samples stay
meaningful); captions are the world's own.

Writes ``<output_dir>/final/clip`` (a :class:`~unclip.nets.clip.CLIP` folder, loadable with
``CLIP.from_pretrained`` or as ``clip.pretrained=<output_dir>/final/clip/model.safetensors``;
weights optionally stored in fp16, upcast to the fp32 model on load) and
``<output_dir>/retrieval.json`` (:func:`attribute_retrieval` on held-out renders).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch

from unclip.nets.clip import CLIP, ClipConfig
from unclip.sampling.utils import sample_seed
from unclip.train.checkpoint import disk_full_is_an_error
from unclip.train.config import (
    TrainConfig,
    check_at_least,
    check_probability,
    check_range,
    load_config_naming_source,
)
from unclip.train.loop import TrainLoop
from unclip.train.run_folder import releases_folder
from unclip.utils.config import ConfigError
from unclip.utils.images import pil_to_tensor

__all__ = [
    "ClipTrainConfig",
    "ClipDataConfig",
    "ClipOptimConfig",
    "ClipOutputConfig",
    "ClipTask",
    "make_batch",
    "clip_batches",
    "attribute_retrieval",
    "load_clip_train_config",
    "train_clip",
]


@dataclass
class ClipDataConfig:
    """Shapes renders for contrastive training (``resolution``: render size; resized to the CLIP
    input). ``batch_size`` samples per process make one batch."""

    resolution: int = 32
    batch_size: int = 256
    seed: int = 0
    split: Literal["train", "heldout", "all"] = "train"
    two_object_prob: float = 0.3
    noise_prob: float = 0.5
    noise_std: float = 0.08
    blur_prob: float = 0.3
    #: Share of each batch made of hard negatives: scenes that differ from another scene of the
    #: batch in one attribute (mostly shape, and relation for two-object scenes; see
    #: :func:`unclip.shapes.world.contrast_truth`), so the contrastive loss must tell them apart.
    #: At most 0.5.
    hard_negatives: float = 0.0
    #: Which attribute a hard negative changes, with weights (``None``: the defaults of
    #: :data:`unclip.shapes.world.CONTRAST_SINGLE` / :data:`~unclip.shapes.world.CONTRAST_PAIR`).
    #: Pairs can also ``swap`` their two colors, which teaches which color goes with which shape.
    #: A scene that no allowed change keeps in its split gets a twin drawn with the defaults.
    single_negatives: Optional[dict[str, float]] = None
    pair_negatives: Optional[dict[str, float]] = None
    #: Probability that a (non-hard-negative) sample is replaced by its color-free view: the same
    #: scene with the objects in unnamed colors and a caption without color words
    #: (:func:`unclip.shapes.world.color_free_view`), so shape features cannot lean on color.
    color_free_prob: float = 0.0
    #: Named colors beyond the spec's six (``{name: [r, g, b]}``, the world's ``extra_colors``):
    #: objects draw their color from the larger palette and captions name it, so more color words
    #: are seen with every shape. The held-out combinations stay held out; a ``color`` hard
    #: negative still changes a color to one of the spec's six.
    extra_colors: Optional[dict[str, list[int]]] = None

    def __post_init__(self) -> None:
        """Range-check every number (:class:`~unclip.utils.config.ConfigError` naming the key)."""
        check_at_least("data.resolution", self.resolution, 1)
        check_at_least("data.batch_size", self.batch_size, 1)
        check_at_least("data.seed", self.seed, 0)
        for key in ("two_object_prob", "noise_prob", "blur_prob"):
            check_probability(f"data.{key}", getattr(self, key))
        check_range("data.noise_std", self.noise_std, self.noise_std >= 0, "a number >= 0")
        check_range(
            "data.hard_negatives",
            self.hard_negatives,
            0.0 <= self.hard_negatives <= 0.5,
            "in [0, 0.5] (a share of the batch)",
        )
        check_probability("data.color_free_prob", self.color_free_prob)
        if self.extra_colors is not None:
            from unclip.shapes.world import check_extra_colors

            try:
                check_extra_colors(self.extra_colors)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"data.extra_colors: {e}") from None
        from unclip.shapes.world import CONTRAST_ATTRIBUTES_PAIR, CONTRAST_ATTRIBUTES_SINGLE

        for key, allowed in (
            ("single_negatives", CONTRAST_ATTRIBUTES_SINGLE),
            ("pair_negatives", CONTRAST_ATTRIBUTES_PAIR),
        ):
            weights = getattr(self, key)
            if weights is None:
                continue
            check_range(
                f"data.{key}",
                weights,
                isinstance(weights, dict)
                and bool(weights)
                and set(weights) <= set(allowed)
                and all(
                    isinstance(w, (int, float))
                    and not isinstance(w, bool)
                    and math.isfinite(w)
                    and w >= 0
                    for w in weights.values()
                )
                and sum(weights.values()) > 0,
                f"a mapping of attributes among {list(allowed)} to weights >= 0, not all 0",
            )


@dataclass
class ClipOptimConfig(TrainConfig):
    """:class:`~unclip.train.config.TrainConfig` with defaults for a small contrastive CLIP."""

    output_dir: str = "runs/shapes-clip"
    max_steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_steps: int = 100
    weight_decay: float = 0.1
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    grad_accum_steps: int = 1
    mixed_precision: Literal["no", "fp16", "bf16", "auto"] = "no"
    ema: bool = False
    log_every: int = 50
    keep_last: int = 1
    trackers: list[str] = field(default_factory=list)


@dataclass
class ClipOutputConfig:
    """The exported CLIP: weight dtype of ``final/clip`` (loaded into an fp32 model either way) and
    the number of held-out renders per kind in the retrieval check."""

    save_dtype: Literal["float32", "float16"] = "float16"
    eval_samples: int = 300

    def __post_init__(self) -> None:
        check_at_least("output.eval_samples", self.eval_samples, 1)


@dataclass
class ClipTrainConfig:
    """``unclip train-clip`` config: the open_clip architecture, the data, the optimisation and the
    export."""

    clip: ClipConfig = field(default_factory=ClipConfig)
    data: ClipDataConfig = field(default_factory=ClipDataConfig)
    train: ClipOptimConfig = field(default_factory=ClipOptimConfig)
    output: ClipOutputConfig = field(default_factory=ClipOutputConfig)


def load_clip_train_config(path, overrides=()) -> ClipTrainConfig:
    """Load and check a ``train-clip`` config (YAML file or dict) with dotted ``overrides``."""
    cfg = load_config_naming_source(path, overrides, ClipTrainConfig)
    if cfg.clip.model_cfg is None:
        raise ValueError(
            "train-clip needs clip.model_cfg (an open_clip config dict: embed_dim, vision_cfg, "
            "text_cfg)"
        )
    return cfg


# --------------------------------------------------------------------------------------------------
def make_batch(world, step: int, n: int, aug: ClipDataConfig | None, rng: random.Random):
    """Images ``[n, 3, R, R]`` in [-1, 1] and captions for batch ``step``: ``n - m`` consecutive
    world samples (each replaced by its color-free view with probability ``aug.color_free_prob``),
    then
    ``m = round(n * aug.hard_negatives)`` one-attribute variants of the first ``m`` of them."""
    from unclip.shapes.world import color_free_view, contrast_truth, make_caption, render

    m = round(n * aug.hard_negatives) if aug is not None else 0
    start = step * (n - m)
    samples = [world[i] for i in range(start, start + n - m)]
    imgs = [pil_to_tensor(s.image) for s in samples]
    caps = [s.caption for s in samples]
    if aug is not None and aug.color_free_prob > 0:
        for j, (i, s) in enumerate(zip(range(start, start + n - m), samples)):
            view_rng = random.Random(f"color-free:{world.seed}:{world.split}:{i}")
            if view_rng.random() < aug.color_free_prob:
                image, caps[j] = color_free_view(
                    s.truth, view_rng, world.resolution, world.background_phrase_prob
                )
                imgs[j] = pil_to_tensor(image)
    for i, s in zip(range(start, start + m), samples):
        assert aug is not None  # m > 0 only with hard negatives configured
        twin_rng = random.Random(f"contrast:{world.seed}:{world.split}:{i}")
        weights = aug.pair_negatives if s.truth["relation"] is not None else aug.single_negatives
        try:
            truth, _ = contrast_truth(s.truth, twin_rng, world.split, weights)
        except ValueError:
            # no change these weights allow keeps this scene in its split (e.g. swapping the
            # colors of a red circle and a blue triangle shows two held-out combinations): draw
            # the twin with the default weights rather than drop it
            truth, _ = contrast_truth(s.truth, twin_rng, world.split)
        imgs.append(pil_to_tensor(render(truth, world.resolution, extra_colors=world.extra_colors)))
        caps.append(make_caption(truth, twin_rng, world.background_phrase_prob))
    x = torch.stack(imgs)
    if aug is not None:
        from unclip.nets.decoder import gaussian_blur

        blur = torch.tensor([rng.random() < aug.blur_prob for _ in range(n)])
        if blur.any():
            sig = torch.tensor([rng.uniform(0.3, 0.8) for _ in range(n)])
            x = torch.where(blur.view(-1, 1, 1, 1), gaussian_blur(x, sig), x)
        noisy = torch.tensor([rng.random() < aug.noise_prob for _ in range(n)], dtype=torch.float32)
        std = torch.tensor([rng.uniform(0, aug.noise_std) for _ in range(n)]) * noisy
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        x = (x + std.view(-1, 1, 1, 1) * torch.randn(x.shape, generator=gen)).clamp(-1, 1)
    return x, caps


def clip_batches(data: ClipDataConfig, seed: int, rank: int, world_size: int, start: int = 0):
    """Batches ``{"image", "caption"}`` of :func:`make_batch` for this rank: rank ``r`` of ``w``
    takes batches ``r, r+w, …``, starting after ``start`` consumed samples; each batch's
    augmentation draws come from its own seed, so a resumed run sees what an uninterrupted one
    would."""
    from unclip.shapes.world import ShapesWorld

    world = ShapesWorld(
        data.resolution,
        seed=data.seed,
        split=data.split,
        two_object_prob=data.two_object_prob,
        extra_colors=data.extra_colors,
    )
    index = start // data.batch_size
    while True:
        number = rank + index * world_size
        rng = random.Random(sample_seed(seed, number))
        images, captions = make_batch(world, number, data.batch_size, data, rng)
        yield {"image": images, "caption": captions}
        index += 1


class ClipTask:
    """The CLIP's training task: the symmetric contrastive loss of a batch of image–caption pairs,
    with the learned temperature kept at most 100 (as in CLIP)."""

    name = "clip"

    def __init__(self, clip: CLIP, device):
        import open_clip

        self.clip, self.device = clip, device
        self.contrastive = open_clip.ClipLoss()

    def loss(self, model, batch: dict, generators) -> torch.Tensor:
        pixels = self.clip.preprocess_tensor(batch["image"]).to(self.device)
        tokens = self.clip.tokenize(batch["caption"], warn=False).to(self.device)
        out = model(pixels, tokens)  # through the (DDP) wrapper: normalised features, exp(scale)
        if isinstance(out, dict):
            out = (out["image_features"], out["text_features"], out["logit_scale"])
        image, text, scale = out[:3]
        return self.contrastive(image.float(), text.float(), scale.float())

    def after_optimizer_step(self, model) -> None:
        with torch.no_grad():
            unwrapped = model.module if hasattr(model, "module") else model
            unwrapped.logit_scale.clamp_(0, math.log(100))


def _canonical(truth: dict, **change) -> str:
    """A full caption of ``truth`` (every attribute named; a pair's objects without size), with
    attributes replaced by ``change`` (an object attribute changes the first object)."""
    from unclip.shapes.captions import canonical_caption

    pair = truth["relation"] is not None
    objs = [{k: o[k] for k in ("shape", "color", "size", "position")} for o in truth["objects"]]
    objs[0].update({k: v for k, v in change.items() if k in objs[0]})
    if pair:
        objs = [{**o, "size": None, "position": None} for o in objs]
    scene = {k: change.get(k, truth[k]) for k in ("background", "relation")}
    return canonical_caption({**scene, "objects": objs})


@torch.no_grad()
def attribute_retrieval(
    clip: CLIP,
    num: int = 300,
    seed: int = 1,
    split: str = "heldout",
    resolution: int | None = None,
) -> dict:
    """Does the CLIP separate every attribute? For each held-out render and attribute, the caption
    naming every attribute correctly must score higher (image–text cosine) than every caption that
    changes only that attribute. Returns ``{attribute: accuracy}`` over ``num`` single-object
    renders (color, shape, size, position, background) and ``num`` two-object renders (relation, and
    the first object's color and shape as ``pair_color``/``pair_shape``); chance is 1/#classes."""
    from unclip.shapes.world import (
        BACKGROUNDS,
        COLORS,
        POSITIONS,
        RELATIONS,
        SHAPES,
        SIZES,
        ShapesWorld,
    )

    res = resolution or clip.image_size
    options = {
        "color": list(COLORS),
        "shape": list(SHAPES),
        "size": list(SIZES),
        "position": list(POSITIONS),
        "background": list(BACKGROUNDS),
        "relation": list(RELATIONS),
    }
    out: dict = {}
    for kind, prob in (("single", 0.0), ("pair", 1.0)):
        world = ShapesWorld(res, seed=seed, split=split, two_object_prob=prob)
        samples = [world[i] for i in range(num)]
        img = clip.encode_image(torch.stack([pil_to_tensor(s.image) for s in samples]))
        attrs = (
            ["color", "shape", "size", "position", "background"]
            if kind == "single"
            else ["relation", "color", "shape", "background"]
        )
        for attr in attrs:
            correct = 0
            for i, s in enumerate(samples):
                truth_val = (
                    s.truth["relation"]
                    if attr == "relation"
                    else s.truth["background"]
                    if attr == "background"
                    else s.truth["objects"][0][attr]
                )
                caps = [_canonical(s.truth, **{attr: v}) for v in options[attr]]
                if kind == "pair" and attr == "color":  # both objects have different colors
                    other = s.truth["objects"][1]["color"]
                    caps = [c for c, v in zip(caps, options[attr]) if v != other]
                    vals = [v for v in options[attr] if v != other]
                else:
                    vals = options[attr]
                txt = clip.encode_text(caps).text_embed
                pick = vals[int((txt @ img[i]).argmax())]
                correct += int(pick == truth_val)
            name = attr if kind == "single" or attr == "relation" else f"pair_{attr}"
            out[name] = correct / num
    return out


@releases_folder
def train_clip(
    cfg: ClipTrainConfig,
    resume: Optional[str] = None,
    max_steps_this_run: Optional[int] = None,
    overwrite: bool = False,
) -> int:
    """Train the CLIP ``cfg`` describes; when ``train.max_steps`` is reached, export
    ``<output_dir>/final/clip`` and write ``<output_dir>/retrieval.json``. ``resume``: ``"latest"``
    or a checkpoint folder; ``max_steps_this_run``: stop (with a checkpoint) after that many steps;
    ``overwrite``: replace an earlier run in ``train.output_dir`` (refused otherwise). Returns 0."""
    t, d = cfg.train, cfg.data
    loop = TrainLoop(cfg, resume=resume, max_steps_this_run=max_steps_this_run, overwrite=overwrite)
    torch.manual_seed(t.seed)
    clip = CLIP.from_config(cfg.clip)
    model = clip.model.train().requires_grad_(True)
    loop.prepare(model, no_weight_decay=lambda name, p: p.ndim < 2 or "embedding" in name)
    task = ClipTask(clip, loop.device)
    batches = clip_batches(d, t.seed, loop.rank, loop.world, start=loop.state.samples)
    t0 = time.perf_counter()
    finished = loop.run(task, batches)
    train_s = time.perf_counter() - t0
    if finished:

        def save(model, folder):
            # fp16 weights halve the file; CLIP.from_pretrained loads them into fp32
            if cfg.output.save_dtype == "float16":
                model.half()
            try:
                clip.save_pretrained(folder)
            finally:
                model.float()

        model.eval()
        folder = loop.export("clip", save)
        if loop.accelerator.is_main_process:
            report = {
                "train_seconds": round(train_s, 1),
                "steps": t.max_steps,
                "batch_size": d.batch_size,
                "retrieval_heldout": attribute_retrieval(
                    CLIP.from_pretrained(folder),  # exactly what was saved
                    num=cfg.output.eval_samples,
                    seed=d.seed + 1,
                    resolution=d.resolution,
                ),
                "mixed_precision": loop.mixed_precision,
            }
            path = Path(t.output_dir) / "retrieval.json"
            with disk_full_is_an_error(path):
                path.write_text(json.dumps(report, indent=2))
            print(json.dumps(report, indent=2))
            print(f"saved CLIP to {folder}")
    loop.finish()
    return 0
