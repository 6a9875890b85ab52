"""Train a small CLIP on the shapes world (contrastive image–caption loss), for the shapes recipe.

    unclip train-clip configs/shapes/clip.yaml --output-dir runs/shapes/clip train.steps=2000

A plain loop: open_clip's model built from the config dict (``clip.model_cfg``), ``open_clip.ClipLoss``,
AdamW with a linear warmup then cosine decay (:func:`unclip.train.loop.warmup_cosine`), optional bf16
autocast on CPU. Images are shapes renders at the CLIP's input size with a mild noise/blur augmentation
(so embeddings of slightly grainy generated samples stay meaningful); captions are the world's own.

Writes ``<output_dir>/clip`` (a :class:`~unclip.clip.FrozenCLIP` folder, loadable with
``FrozenCLIP.from_pretrained`` or as ``clip.pretrained=<output_dir>/clip/model.safetensors``; weights
optionally stored in fp16, upcast to the fp32 model on load) and ``<output_dir>/retrieval.json``
(:func:`attribute_retrieval` on held-out renders).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from unclip.clip import FrozenCLIP
from unclip.config import ClipConfig, load_config, save_config
from unclip.train.loop import auto_mixed_precision, warmup_cosine

__all__ = ["ClipTrainConfig", "attribute_retrieval", "main"]

logger = logging.getLogger("unclip.train")


@dataclass
class ClipDataConfig:
    """Shapes renders for contrastive training (``resolution``: render size; resized to the CLIP input)."""

    resolution: int = 32
    seed: int = 0
    split: Literal["train", "heldout", "all"] = "train"
    two_object_prob: float = 0.3
    noise_prob: float = 0.5
    noise_std: float = 0.08
    blur_prob: float = 0.3
    #: Share of each batch made of hard negatives: scenes that differ from another scene of the batch in
    #: one attribute (mostly shape, and relation for two-object scenes; see
    #: :func:`unclip.shapes.world.contrast_truth`), so the contrastive loss must tell them apart. At most 0.5.
    hard_negatives: float = 0.0
    #: Probability that a (non-hard-negative) sample is replaced by its color-free view: the same scene with
    #: the objects in unnamed colors and a caption without color words (:func:`unclip.shapes.world.color_free_view`),
    #: so shape features cannot lean on color (held-out color–shape pairs; docs/shapes_model.md, lever 10).
    color_free_prob: float = 0.0


@dataclass
class ClipOptimConfig:
    output_dir: str = "runs/shapes-clip"
    seed: int = 0
    steps: int = 2000
    batch_size: int = 256
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_steps: int = 100
    weight_decay: float = 0.1
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    max_grad_norm: float = 1.0
    #: ``auto``: bf16 autocast where the CPU runs bf16 natively, else fp32 (see
    #: :func:`unclip.train.loop.auto_mixed_precision`)
    mixed_precision: Literal["no", "bf16", "auto"] = "no"
    log_every: int = 50
    save_dtype: Literal["float32", "float16"] = "float16"
    eval_samples: int = 300


@dataclass
class ClipTrainConfig:
    """``unclip train-clip`` config: the open_clip architecture, the data and the optimisation."""

    clip: ClipConfig = field(default_factory=ClipConfig)
    data: ClipDataConfig = field(default_factory=ClipDataConfig)
    train: ClipOptimConfig = field(default_factory=ClipOptimConfig)


# --------------------------------------------------------------------------------------------------
def _batch(world, step: int, n: int, aug: ClipDataConfig | None, rng: random.Random):
    """Images ``[n, 3, R, R]`` in [-1, 1] and captions for batch ``step``: ``n - m`` consecutive world
    samples (each replaced by its color-free view with probability ``aug.color_free_prob``), then
    ``m = round(n * aug.hard_negatives)`` one-attribute variants of the first ``m`` of them."""
    from unclip.shapes.world import color_free_view, contrast_truth, make_caption, render
    from unclip.train.data.loader import pil_to_tensor

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
        twin_rng = random.Random(f"contrast:{world.seed}:{world.split}:{i}")
        truth, _ = contrast_truth(s.truth, twin_rng, world.split)
        imgs.append(pil_to_tensor(render(truth, world.resolution)))
        caps.append(make_caption(truth, twin_rng, world.background_phrase_prob))
    x = torch.stack(imgs)
    if aug is not None:
        from unclip.decoder import gaussian_blur

        blur = torch.tensor([rng.random() < aug.blur_prob for _ in range(n)])
        if blur.any():
            sig = torch.tensor([rng.uniform(0.3, 0.8) for _ in range(n)])
            x = torch.where(blur.view(-1, 1, 1, 1), gaussian_blur(x, sig), x)
        noisy = torch.tensor([rng.random() < aug.noise_prob for _ in range(n)], dtype=torch.float32)
        std = torch.tensor([rng.uniform(0, aug.noise_std) for _ in range(n)]) * noisy
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        x = (x + std.view(-1, 1, 1, 1) * torch.randn(x.shape, generator=gen)).clamp(-1, 1)
    return x, caps


def _canonical(truth: dict, **change) -> str:
    """A full caption of ``truth`` (every attribute named), with attributes replaced by ``change``."""
    from unclip.shapes.world import POSITION_PHRASES, article

    bg = change.get("background", truth["background"])
    objs = [dict(o) for o in truth["objects"]]
    for k in ("color", "shape", "size", "position"):
        if k in change:
            objs[0][k] = change[k]
    if truth["relation"] is None:
        o = objs[0]
        words = [o["size"], o["color"], o["shape"]]
        return f"{article(words[0])} {' '.join(words)} {POSITION_PHRASES[o['position']]} on a {bg} background"
    rel = change.get("relation", truth["relation"])
    a, b = (f"{article(o['color'])} {o['color']} {o['shape']}" for o in objs)
    return f"{a} {rel} {b} on a {bg} background"


@torch.no_grad()
def attribute_retrieval(
    clip: FrozenCLIP,
    num: int = 300,
    seed: int = 1,
    split: str = "heldout",
    resolution: int | None = None,
) -> dict:
    """Does the CLIP separate every attribute? For each held-out render and attribute, the caption
    naming every attribute correctly must score higher (image–text cosine) than every caption that
    changes only that attribute. Returns ``{attribute: accuracy}`` over ``num`` single-object renders
    (color, shape, size, position, background) and ``num`` two-object renders (relation, and the
    first object's color and shape as ``pair_color``/``pair_shape``); chance is 1/#classes."""
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
        from unclip.train.data.loader import pil_to_tensor

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


def _cfg_from_args(args) -> ClipTrainConfig:
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"train.output_dir={args.output_dir}")
    return load_config(args.config, overrides, schema=ClipTrainConfig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="unclip train-clip", description=__doc__.splitlines()[0])
    p.add_argument(
        "config", help="YAML with clip:, data:, train: sections (see configs/shapes/clip.yaml)"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=500")
    p.add_argument("--output-dir", default=None, help="overrides train.output_dir")
    p.add_argument("--print-config", action="store_true")
    args = p.parse_intermixed_args(argv)
    cfg = _cfg_from_args(args)
    if args.print_config:
        from unclip.config import to_yaml

        print(to_yaml(cfg))
        return 0
    if cfg.clip.model_cfg is None:
        raise ValueError(
            "train-clip needs clip.model_cfg (an open_clip config dict: embed_dim, vision_cfg, text_cfg)"
        )
    if not 0.0 <= cfg.data.hard_negatives <= 0.5:
        raise ValueError(
            f"data.hard_negatives must be in [0, 0.5] (a share of the batch), got {cfg.data.hard_negatives}"
        )
    if not 0.0 <= cfg.data.color_free_prob <= 1.0:
        raise ValueError(
            f"data.color_free_prob must be a probability in [0, 1], got {cfg.data.color_free_prob}"
        )
    t, d = cfg.train, cfg.data
    out = Path(t.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(t.seed)
    rng = random.Random(t.seed)

    import open_clip

    from unclip.shapes.world import ShapesWorld

    clip = FrozenCLIP.from_config(ClipConfig(cfg.clip.model_name, None, cfg.clip.model_cfg))
    if cfg.clip.pretrained:
        from unclip.clip import _load_pretrained

        _load_pretrained(clip.model, cfg.clip.model_name, cfg.clip.pretrained)
    model = clip.model
    model.train().requires_grad_(True)
    world = ShapesWorld(d.resolution, seed=d.seed, split=d.split, two_object_prob=d.two_object_prob)
    params = [q for q in model.parameters() if q.requires_grad]
    decay = [q for n, q in model.named_parameters() if q.ndim >= 2 and "embedding" not in n]
    ids = {id(q) for q in decay}
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": [q for q in params if id(q) not in ids], "weight_decay": 0.0},
        ],
        lr=t.lr,
        betas=tuple(t.adam_betas),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: warmup_cosine(
            s, warmup=t.warmup_steps, total=t.steps, base_lr=t.lr, min_lr=t.min_lr
        ),
    )
    loss_fn = open_clip.ClipLoss()
    precision = auto_mixed_precision(t.mixed_precision, gpu=False)  # this loop trains on the CPU
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    logger.info("train-clip: mixed precision %s", precision)
    log = open(out / "metrics.jsonl", "a")
    t0 = time.perf_counter()
    for step in range(t.steps):
        images, captions = _batch(world, step, t.batch_size, d, rng)
        pixels = clip.preprocess_tensor(images)
        tokens = clip.tokenize(captions, warn=False)
        with autocast:
            img = F.normalize(model.encode_image(pixels), dim=-1)
            txt = F.normalize(model.encode_text(tokens), dim=-1)
            loss = loss_fn(img.float(), txt.float(), model.logit_scale.exp().float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        opt.step()
        sched.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if (step + 1) % t.log_every == 0 or step + 1 == t.steps:
            with torch.no_grad():
                acc = float(((img @ txt.T).argmax(1) == torch.arange(len(img))).float().mean())
            rec = {
                "step": step + 1,
                "loss": float(loss.detach()),
                "batch_acc": acc,
                "lr": sched.get_last_lr()[0],
                "elapsed_s": round(time.perf_counter() - t0, 1),
            }
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(
                f"step {step + 1} loss {rec['loss']:.4f} batch-acc {acc:.3f} ({rec['elapsed_s']:.0f}s)",
                flush=True,
            )
    log.close()
    model.eval().requires_grad_(False)
    train_s = time.perf_counter() - t0
    # save (optionally as fp16; FrozenCLIP.from_pretrained loads into an fp32 model, i.e. upcasts)
    folder = out / "clip"
    if t.save_dtype == "float16":
        model.half()
        clip.save_pretrained(folder)
        model.float()
    else:
        clip.save_pretrained(folder)
    clip = FrozenCLIP.from_pretrained(folder)  # evaluate exactly what was saved
    retrieval = attribute_retrieval(
        clip, num=t.eval_samples, seed=d.seed + 1, resolution=d.resolution
    )
    report = {
        "train_seconds": round(train_s, 1),
        "steps": t.steps,
        "batch_size": t.batch_size,
        "retrieval_heldout": retrieval,
        "mixed_precision": precision,
    }
    (out / "retrieval.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"saved CLIP to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
