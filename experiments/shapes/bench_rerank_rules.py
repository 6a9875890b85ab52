"""Other ways to choose among the bundled shapes model's decoder candidates, on saved candidates.

    python experiments/shapes/bench_rerank_at.py --num 200 --candidates 32 \\
        --contrast shapes-pairs --save-candidates cands.pt --out bench_rerank_at:pruning
    python experiments/shapes/bench_rerank_rules.py cands.pt              # scoring rules only
    python experiments/shapes/bench_rerank_rules.py cands.pt --finetune 300 --degrade 0.5 \\
        --t-steps 5

The candidates (every prompt's finished 32 px images and their predicted images after steps 3-8,
from ``bench_rerank_at.py --save-candidates``) are decoded once; each rule chooses one per prompt
from the first ``K`` of them (what ``best_of = K`` draws) after step ``--at``, and the chosen
candidate's finished image is scored by the evaluator (a prompt counts when every attribute is
right). "The shipped rule" below is the reranking CLIP's score with the whole-image contrast
``shapes-pairs`` (the bundled model's ``rerank_contrast`` of levers 14-30). Rules: that score, the
conditioning CLIP's, their sum (raw and standardised per prompt), the reranker's scores after two
steps summed, and the ``shapes`` contrast for single objects too; the reranker after later steps and
on the finished images; the reranker with ``shapes-pairs-regions`` (each object of a pair also read
on its own side of the image, the other side painted over: lever 31); test-time views summed with
the shipped score (the image mirrored left to right, scored against the prompt with left and right
swapped; the scores of four one-pixel shifts, so the unshifted image counts once among five); a
colour-free contrast for two objects (the prompt without its colors against its shape variants and,
for two shapes, its relation variants, which the reranker learned from its colour-free views) added
with weights ``--colour-free-weights``; and the mirrored candidates as further candidates (each
candidate and its mirror image scored against the prompt; a mirror costs no decoder call).

``--upsample-top N`` then upsamples each prompt's ``N`` best candidates by the shipped rule (sr64
and sr128, DDIM 2 steps each, one generator per 25 prompts) and scores them at 128 px: the shipped
choice, how often any of the first ``n <= N`` is right, and choosing among them by the reranker on
the upsampled images resized back to 32 px (area) or on their finished 32 px images: how often a
right scene is among them (the ceiling of a reranker that reads them after upsampling), and what
the shipped reranker makes of them. ``--save-upsampled FILE`` keeps the 64 px images and which
are right at 128 px for ``bench_reranker_reading.py --upsampled``.

``--finetune N`` then trains a copy of the reranking CLIP for ``N`` steps on the views it ranks:
batches as the recipe's reranker step draws them (training split, relation and colour-swap hard
negatives, colour-free views), a share ``--degrade`` of each batch replaced by the decoder's
predicted clean image of that render noised to the timestep of a DDIM-10 step in ``--t-steps``
(conditioned on the render's CLIP image embedding and its caption), contrastive loss, AdamW with
warm-up and cosine decay, bf16 autocast; the copy is scored on the saved candidates every
``--eval-every`` steps. Nothing here is shipped: it measures whether such a reranker would choose
better (docs/journal/shapes_model.md, lever 28).

Results: key ``default`` of ``experiments/shapes/results/bench_rerank_rules.json`` (``--out
FILE:KEY`` stores a run under another key).
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import time
from pathlib import Path

# import benchmarks/common.py (timing, machine description, JSON output) from its folder
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import common  # noqa: E402
import torch  # noqa: E402
from bench_rerank_at import by_kind, right_matrix  # noqa: E402

from unclip.diffusion.loop import training_scheduler  # noqa: E402
from unclip.diffusion.vlb import predicted_x0  # noqa: E402
from unclip.sampling.settings import DecoderSampling  # noqa: E402
from unclip.sampling.stages import decoder_denoiser  # noqa: E402
from unclip.shapes.captions import canonical_caption, parse_caption
from unclip.shapes.train_clip import ClipDataConfig, ClipTask, make_batch  # noqa: E402
from unclip.shapes.world import RELATIONS, SHAPES, ShapesWorld, article

common.RESULTS = Path(__file__).resolve().parent / "results"  # experiments/shapes/results/

#: the whole-image contrast the rules build on
CONTRAST = "shapes-pairs"
#: the same plus each object of a pair read on its own side of the image (the bundled model's)
REGIONS = "shapes-pairs-regions"
#: the recipe's reranker step (configs/shapes/clip.yaml with its overrides in unclip.shapes.recipe)
RERANKER_DATA = dict(
    resolution=32,
    two_object_prob=0.45,
    hard_negatives=0.25,
    pair_negatives={"swap": 0.5, "relation": 0.5},
    color_free_prob=0.4,
)


def contrast_scores(clip, images, captions, contrast, chunk=20):
    """``[n, k]`` scores of ``images [n, k, 3, s, s]`` for their prompt ``captions [n]``."""
    from unclip.sampling.scorers import as_scorer

    n, k = images.shape[:2]
    out = []
    with torch.no_grad():
        for a in range(0, n, chunk):
            rows = images[a : a + chunk]
            caps = [c for c in captions[a : a + chunk] for _ in range(k)]
            out.append(as_scorer(contrast).score(clip, rows.flatten(0, 1), caps).view(-1, k))
    return torch.cat(out).float().cpu()


def chosen_right(right, scores, k) -> dict:
    return by_kind(right[torch.arange(right.shape[0]), scores[:, :k].argmax(1)])


_MIRROR = {"to the left of": "to the right of", "left": "right"}
_MIRROR.update({v: k for k, v in _MIRROR.items()})


def mirrored_caption(caption: str) -> str:
    """``caption`` for the image mirrored left to right: left and right swapped, in
    :func:`canonical_caption`'s phrasing (which the ``shapes-pairs`` contrast scores two objects in
    anyway; a single object's plain cosine then reads that phrasing rather than the prompt's)."""
    p = parse_caption(caption)
    p["relation"] = _MIRROR.get(p["relation"], p["relation"])
    for obj in p["objects"]:
        obj["position"] = _MIRROR.get(obj.get("position"), obj.get("position"))
    return canonical_caption(p)


def colour_free_contrast(caption: str) -> list[str]:
    """A two-object caption without its colors, then its shape variants and, when the two shapes
    differ, its relation variants (``[]`` for one object: no colour-free score). Two objects of one
    shape have no relation variant: without colors "a circle above a circle" is the same scene as
    "a circle below a circle"."""
    p = parse_caption(caption)
    if p["relation"] is None:
        return []
    (a, b), rel = (o["shape"] for o in p["objects"]), p["relation"]
    relations = [r for r in RELATIONS if r != rel] if a != b else []

    def cap(x, r, y):
        return f"{article(x)} {x} {r} {article(y)} {y}"

    return [
        cap(a, rel, b),
        *(cap(x, rel, b) for x in SHAPES if x != a),
        *(cap(a, rel, y) for y in SHAPES if y != b),
        *(cap(a, r, b) for r in relations),
    ]


def shifted(images, dx: int, dy: int):
    """``images [..., 3, s, s]`` moved by ``(dx, dy)`` pixels, the edges repeated."""
    flat = images.flatten(0, -4)
    s = flat.shape[-1]
    pad = torch.nn.functional.pad(flat, (1, 1, 1, 1), mode="replicate")
    return pad[..., 1 - dy : 1 - dy + s, 1 - dx : 1 - dx + s].reshape(images.shape)


def standardised(s):
    return (s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-6)


class Degrader:
    """The decoder's predicted clean image of renders noised to a DDIM-10 step's timestep."""

    def __init__(self, pipe, t_steps):
        self.pipe, self.t_steps = pipe, t_steps
        self.diffusion = pipe.diffusion["decoder"]
        self.training = training_scheduler(self.diffusion)
        self.settings = DecoderSampling(scheduler="ddim", steps=10, guidance_scale=1.0)

    @torch.no_grad()
    def __call__(self, images, captions, g: torch.Generator):
        pipe, b = self.pipe, images.shape[0]
        text = pipe.encode_text(captions)
        dtext, null = pipe._decoder_captions(captions if pipe.decoder.has_text_encoder else text, b)
        embeds = pipe.clip.encode_image(images)
        d = decoder_denoiser(pipe.decoder, embeds, dtext, null, self.settings, self.diffusion)
        pick = torch.randint(len(self.t_steps), (b,), generator=g)
        t = d.scheduler.timesteps[torch.tensor(self.t_steps)[pick]].long()
        x_t = self.training.add_noise(images, torch.randn(images.shape, generator=g), t)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pipe.decoder(x_t, t, cond=d.cond)
        mean = out.float()[:, : images.shape[1]]
        return predicted_x0(self.training, x_t, t, mean, self.diffusion.prediction_type).clamp(
            -1, 1
        )


def upsampled_top(pipe, finals, scores, captions, args) -> dict:
    """The ``--upsample-top N`` figures for the first ``--fine-tune-count`` candidates (see the
    module doc)."""
    n, top = finals.shape[0], args.upsample_top
    order = scores[:, : finals.shape[1]].argsort(1, descending=True)[:, :top]
    best = finals[torch.arange(n)[:, None], order]
    x64, x128 = [], []
    for a in range(0, n, 25):
        g = torch.Generator().manual_seed(args.seed + a)
        out, inter = pipe.upsample(
            best[a : a + 25].flatten(0, 1), generator=g, return_intermediates=True, progress=False
        )
        x64.append(inter["sr64"].view(-1, top, *inter["sr64"].shape[1:]))
        x128.append(out.view(-1, top, *out.shape[1:]))
        common.log(f"upsampled {min(a + 25, n)} / {n} prompts")
    x64, x128 = torch.cat(x64), torch.cat(x128)
    right = right_matrix(x128, captions)
    if args.save_upsampled:
        # what bench_reranker_reading.py --upsampled reads: the 64 px images, in the shipped
        # reranker's order, and which are right at 128 px
        torch.save(
            {"x64": x64.half(), "right": right, "captions": list(captions)}, args.save_upsampled
        )

    def among(view, first: int) -> dict:
        small = (
            torch.nn.functional.interpolate(
                view.flatten(0, 1).float(), size=finals.shape[-1], mode="area"
            ).view(best.shape)
            if view.shape[-1] != finals.shape[-1]
            else view
        )
        return chosen_right(
            right, contrast_scores(pipe.rerank_clip, small[:, :first], captions, CONTRAST), first
        )

    rows = {"shipped choice (the best at the chosen step)": by_kind(right[:, 0])}
    for first in range(2, top + 1):
        rows[f"any of the best {first} right"] = by_kind(right[:, :first].any(1))
        for name, view in (("64 px", x64), ("128 px", x128), ("finished 32 px", best)):
            rows[f"best {first}, reranked on the {name} images"] = among(view, first)
    return {
        "candidates": int(finals.shape[1]),
        "top": top,
        "resolution": int(x128.shape[-1]),
        "by_rule": rows,
    }


def train_copy(clip, steps: int, lr: float, batches, evaluate, eval_every: int) -> list:
    """Train ``clip`` (a copy: its weights change) for ``steps`` on ``batches(step) -> (images,
    captions)``: the CLIP's contrastive loss, AdamW, 20 warm-up steps then cosine decay, bf16
    autocast, gradients clipped at 1.0; ``evaluate(clip)`` (a dict of figures) before the first step
    and every ``eval_every`` steps. Returns ``[[step, *figures], ...]``."""
    model = clip.model.train().requires_grad_(True)
    task = ClipTask(clip, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def figures():
        model.eval()
        out = list(evaluate(clip).values())
        model.train()
        return out

    history = [[0, *figures()]]
    started = time.perf_counter()
    for step in range(steps):
        images, captions = batches(step)
        warm = min(1.0, (step + 1) / 20)
        for group in opt.param_groups:
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = task.loss(model, {"image": images, "caption": captions}, None)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        task.after_optimizer_step(model)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            history.append([step + 1, *figures()])
            elapsed = time.perf_counter() - started
            figures_now = history[-1][1:]
            common.log(f"step {step + 1}: loss {loss.item():.4f}, {figures_now}, {elapsed:.0f} s")
    model.eval().requires_grad_(False)
    return history


def reranker_batches(batch: int, seed: int, **changes):
    """``step -> (images, captions)``: the recipe's reranker batches (:data:`RERANKER_DATA` with
    ``changes``, e.g. another resolution or other hard-negative kinds) from the training split."""
    data = ClipDataConfig(**{**RERANKER_DATA, **changes}, batch_size=batch, seed=seed)
    world = ShapesWorld(
        data.resolution, seed=seed, split="train", two_object_prob=data.two_object_prob
    )
    return lambda step: make_batch(world, step, batch, data, random.Random(step))


def finetune(pipe, args, evaluate) -> list:
    """Train a copy of the reranking CLIP on partly degraded reranker batches; ``evaluate(clip)``
    every ``--eval-every`` steps. Returns ``[[step, single_all, pair_all], ...]``."""
    clean = reranker_batches(args.batch, args.seed)
    degrade = Degrader(pipe, args.t_steps)

    def batches(step):
        images, captions = clean(step)
        g = torch.Generator().manual_seed(args.seed * 100_003 + step)
        rows = torch.randperm(args.batch, generator=g)[: round(args.degrade * args.batch)]
        images = images.clone()
        images[rows] = degrade(images[rows], [captions[i] for i in rows.tolist()], g)
        return images, captions

    clip = copy.deepcopy(pipe.rerank_clip)
    return train_copy(clip, args.finetune, args.lr, batches, evaluate, args.eval_every)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("candidates", help="a file of bench_rerank_at.py --save-candidates")
    p.add_argument("--model", default=None, help="pipeline folder (default: the bundled model)")
    p.add_argument("--at", type=int, default=6, help="the step the rules choose after")
    p.add_argument("--counts", type=int, nargs="*", default=[16, 24, 32], metavar="K")
    p.add_argument("--finetune", type=int, default=0, metavar="STEPS")
    p.add_argument(
        "--fine-tune-count",
        type=int,
        default=24,
        help="K the fine-tuned CLIP and --upsample-top choose from",
    )
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--degrade", type=float, default=0.5, help="share of each batch degraded")
    p.add_argument("--t-steps", type=int, nargs="+", default=[5], help="DDIM-10 step indices")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--colour-free-weights", type=float, nargs="*", default=[0.25, 1.0, 4.0], metavar="W"
    )
    p.add_argument(
        "--upsample-top",
        type=int,
        default=0,
        metavar="N",
        help="also upsample each prompt's N best candidates and score them at 128 px",
    )
    p.add_argument(
        "--save-upsampled",
        metavar="FILE",
        help="with --upsample-top: save the 64 px images and which are right at 128 px (for "
        "bench_reranker_reading.py --upsampled)",
    )
    p.add_argument("--out", default="bench_rerank_rules:default")
    args = p.parse_args(argv)
    saved = torch.load(args.candidates)
    finals, x0s, captions = saved["finals"], saved["x0s"], saved["captions"]
    k_max = finals.shape[1]
    if args.at not in x0s or args.at - 1 not in x0s:
        p.error(
            f"--at: the file holds the predicted images after steps {sorted(x0s)}; give one "
            "whose previous step is there too"
        )
    counts = [*args.counts, *([args.fine_tune_count] if args.finetune or args.upsample_top else [])]
    if any(not 1 < k <= k_max for k in counts):
        p.error(f"--counts / --fine-tune-count: between 2 and the {k_max} candidates saved")
    if args.upsample_top and not 1 < args.upsample_top <= args.fine_tune_count:
        p.error("--upsample-top: between 2 and --fine-tune-count")
    if args.save_upsampled and not args.upsample_top:
        p.error("--save-upsampled saves what --upsample-top computes: give both")
    if not 0 < args.degrade <= 1 or any(not 0 <= t < 10 for t in args.t_steps):
        p.error("--degrade in (0, 1]; --t-steps among 0-9")
    started = time.perf_counter()
    pipe = common.fp32_pipeline(args.model)
    right = right_matrix(finals, captions)
    at = x0s[args.at]
    rr = contrast_scores(pipe.rerank_clip, at, captions, CONTRAST)
    cc = contrast_scores(pipe.clip, at, captions, CONTRAST)
    before = contrast_scores(pipe.rerank_clip, x0s[args.at - 1], captions, CONTRAST)
    every = contrast_scores(pipe.rerank_clip, at, captions, "shapes")
    regions = contrast_scores(pipe.rerank_clip, at, captions, REGIONS)
    later = {
        m: contrast_scores(pipe.rerank_clip, x0s[m], captions, CONTRAST) for m in x0s if m > args.at
    }
    finished = contrast_scores(pipe.rerank_clip, finals, captions, CONTRAST)
    mirrored = contrast_scores(
        pipe.rerank_clip, at.flip(-1), [mirrored_caption(c) for c in captions], CONTRAST
    )
    shifts = sum(
        contrast_scores(pipe.rerank_clip, shifted(at, dx, dy), captions, CONTRAST)
        for dx, dy in ((1, 0), (-1, 0), (0, 1), (0, -1))
    )
    pairs = torch.tensor([parse_caption(c)["relation"] is not None for c in captions])
    colour_free = contrast_scores(pipe.rerank_clip, at, captions, colour_free_contrast)
    colour_free[~pairs] = 0.0
    right_mirrors = right_matrix(finals.flip(-1), captions)
    mirror_candidates = contrast_scores(pipe.rerank_clip, at.flip(-1), captions, CONTRAST)
    rules = {}
    for k in args.counts:
        both = torch.cat([torch.arange(k), k_max + torch.arange(k)])
        with_mirrors = chosen_right(
            torch.cat([right, right_mirrors], 1)[:, both],
            torch.cat([rr, mirror_candidates], 1)[:, both],
            2 * k,
        )
        rules[f"{k} candidates"] = {
            "reranker": chosen_right(right, rr, k),
            "conditioning CLIP": chosen_right(right, cc, k),
            "sum of both": chosen_right(right, rr + cc, k),
            "sum of both, standardised per prompt": chosen_right(
                right, standardised(rr[:, :k]) + standardised(cc[:, :k]), k
            ),
            f"reranker after steps {args.at - 1} and {args.at} summed": chosen_right(
                right, rr + before, k
            ),
            "reranker, shapes contrast for single objects too": chosen_right(right, every, k),
            "reranker, each object on its side too (shapes-pairs-regions)": chosen_right(
                right, regions, k
            ),
            **{f"reranker after step {m}": chosen_right(right, later[m], k) for m in sorted(later)},
            "reranker on the finished images": chosen_right(right, finished, k),
            "reranker + its score of the mirrored view": chosen_right(right, rr + mirrored, k),
            "reranker + four one-pixel shifts": chosen_right(right, rr + shifts, k),
            **{
                f"reranker + {w} x colour-free contrast": chosen_right(
                    right, rr + w * colour_free, k
                )
                for w in args.colour_free_weights
            },
            "mirrored candidates too (2K images)": with_mirrors,
            "any candidate right": by_kind(right[:, :k].any(1)),
            "any candidate or mirror right": by_kind((right | right_mirrors)[:, :k].any(1)),
        }
    result = {
        "machine": common.machine(),
        "candidates_file_prompts": int(finals.shape[0]),
        "candidates": k_max,
        "contrast": CONTRAST,
        "choose_after_step": args.at,
        "resolution": int(finals.shape[-1]),
        "model": args.model or "bundled:shapes",
        "by_rule": rules,
    }
    if args.upsample_top:
        result["upsampled"] = upsampled_top(
            pipe, finals[:, : args.fine_tune_count], rr, captions, args
        )
    if args.finetune:
        k = args.fine_tune_count

        def evaluate(clip):
            clip.model.eval()
            return chosen_right(right, contrast_scores(clip, at, captions, CONTRAST), k)

        result["finetune"] = {
            "steps": args.finetune,
            "lr": args.lr,
            "degrade": args.degrade,
            "t_steps": args.t_steps,
            "batch": args.batch,
            "seed": args.seed,
            "candidates": k,
            "single_pair_by_step": finetune(pipe, args, evaluate),
        }
    return common.finish(args.out, result, started, report)


def report(result: dict) -> str:
    rows = [
        {"count": count, "rule": rule, **figures}
        for count, by in result["by_rule"].items()
        for rule, figures in by.items()
    ]
    cols = [("candidates", "count"), ("rule", "rule"), ("single all", "single_all")]
    text = common.table(rows, cols + [("pair all", "pair_all")])
    if "upsampled" in result:
        up = result["upsampled"]
        text += (
            f"\n\nthe best {up['top']} of {up['candidates']} upsampled, at {up['resolution']} px:\n"
        )
        rows = [{"rule": rule, **figures} for rule, figures in up["by_rule"].items()]
        text += common.table(
            rows, [("rule", "rule"), ("single all", "single_all"), ("pair all", "pair_all")]
        )
    if "finetune" in result:
        history = result["finetune"]["single_pair_by_step"]
        text += f"\nfine-tuned reranker [step, single, pair]: {history}"
    return text


if __name__ == "__main__":
    raise SystemExit(main())
