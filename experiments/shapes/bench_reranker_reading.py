"""How well the bundled shapes model's CLIPs read clean renders, seen and held-out combinations.

    python experiments/shapes/bench_reranker_reading.py --num 300 --candidates cands.pt \\
        --reranker "extra colours=runs/reranker_extra_colours/final/clip"
    python experiments/shapes/bench_reranker_reading.py --finetune 1000 --candidates cands.pt \\
        --pair-negatives '{"swap": 0.25, "relation": 0.25, "color": 0.25, "shape": 0.25}' \\
        --out bench_reranker_reading:finetune_negatives
    python experiments/shapes/bench_rerank_rules.py cands.pt --counts 24 --upsample-top 6 \\
        --save-upsampled up.pt --out bench_rerank_rules:upsampled
    python experiments/shapes/bench_reranker_reading.py --finetune 600 --resolution 64 \\
        --batch 128 --eval-every 100 --upsampled up.pt --out bench_reranker_reading:finetune_64px

Contrastive reranking (the decoder's ``rerank_contrast``) keeps the candidate whose image makes the
CLIP prefer the prompt most over its one-attribute alternatives
(:func:`unclip.shapes.world.caption_alternatives`). This measures that reading where the answer is
known: ``--num`` clean renders of each split (``train``; ``heldout``, whose objects show
colour-shape combinations the training split never does) with one and with two objects, drawn with
``--seed`` (not the evaluator's prompts, seed 1000), at ``--resolution``. For each CLIP (the
reranker and the conditioning CLIP): the share whose own caption the CLIP ranks first among the
alternatives, and for the misses which attribute the preferred alternative changes (``color``,
``shape``, ``relation``, ``color swap``, ``shape swap``, ``size``, ``position``, ``background``).

With ``--candidates`` (``bench_rerank_at.py --save-candidates``; 32 px) each CLIP also chooses
among ``--count`` saved decoder candidates after step ``--at`` by the shipped contrast, and the
share of two-object prompts whose chosen candidate the evaluator finds fully right is reported;
with ``--upsampled`` (``bench_rerank_rules.py --save-upsampled``; 64 px) it chooses among the best
2, 3, 4 and 6 upsampled candidates on their 64 px images. ``--contrast NAME`` (repeatable) chooses
by those contrasts instead, e.g. ``shapes-pairs-regions``, which also reads each object on its own
side of the image (lever 31). ``--reranker NAME=DIR`` reads another CLIP folder too (e.g. one from
``unclip train-clip``).

``--finetune N`` then trains a copy of the reranker for ``N`` steps on the recipe's reranker batches
(training split, colour-free views, a quarter hard negatives) with the hard-negative kinds of
``--pair-negatives`` / ``--single-negatives`` and ``--colour-free``, at ``--resolution`` (at 64 px a
widened copy: the same weights, the attention pool's one spatial position repeated over the four of
a 64 px input; at 64 px the rerankers are read widened and the conditioning CLIP, which never
reranks, is left out), and reports every ``--eval-every`` steps its
reading of the held-out renders and its choices as above. Nothing here is shipped
(docs/journal/shapes_model.md, lever 30). Results: key ``default`` of
``experiments/shapes/results/bench_reranker_reading.json`` (``--out FILE:KEY`` for another key).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import Counter
from pathlib import Path

# import benchmarks/common.py (timing, machine description, JSON output) from its folder
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_rerank_at import right_matrix  # noqa: E402
from bench_rerank_rules import (  # noqa: E402
    CONTRAST,
    RERANKER_DATA,
    chosen_right,
    contrast_scores,
    reranker_batches,
    train_copy,
)

from unclip.nets.clip import CLIP, build_open_clip_model  # noqa: E402
from unclip.sampling.scorers import RERANK_CONTRASTS  # noqa: E402
from unclip.shapes.captions import parse_caption  # noqa: E402
from unclip.shapes.contrasts import caption_alternatives
from unclip.shapes.world import ShapesWorld
from unclip.utils.images import pil_to_tensor  # noqa: E402

common.RESULTS = Path(__file__).resolve().parent / "results"  # experiments/shapes/results/

KINDS = {"single": 0.0, "pair": 1.0}


def changed(caption: str, alternative: str) -> str:
    """Which attribute ``alternative`` changes in ``caption`` (two objects' colours or shapes
    exchanged: ``color swap`` / ``shape swap``)."""
    a, b = parse_caption(caption), parse_caption(alternative)
    if a["relation"] != b["relation"]:
        return "relation"
    if a.get("background") != b.get("background"):
        return "background"
    objs = list(zip(a["objects"], b["objects"]))
    for key in ("color", "shape", "size", "position"):
        moved = [o.get(key) != q.get(key) for o, q in objs]
        if len(objs) == 2 and all(moved) and objs[0][0][key] == objs[1][1][key]:
            return f"{key} swap"
        if any(moved):
            return key
    raise ValueError(f"{alternative!r} does not differ from {caption!r}")


def renders(split: str, kind: str, num: int, seed: int, resolution: int) -> list:
    world = ShapesWorld(resolution, seed=seed, split=split, two_object_prob=KINDS[kind])
    return [world[i] for i in range(num)]


@torch.no_grad()
def reading(clip, samples) -> dict:
    """The share of ``samples`` whose caption ``clip`` prefers to each of its alternatives, and
    what the preferred alternative changes where it does not."""
    images = torch.stack([pil_to_tensor(s.image) for s in samples])
    img = F.normalize(clip.encode_image(images), dim=-1)
    misses, first = Counter(), 0
    for i, s in enumerate(samples):
        alternatives = caption_alternatives(s.caption)
        txt = F.normalize(clip.encode_text(alternatives).text_embed, dim=-1)
        best = int((img[i] @ txt.T).argmax())
        if best == 0:
            first += 1
        else:
            misses[changed(alternatives[0], alternatives[best])] += 1
    return {"first": round(first / len(samples), 4), "misses": dict(misses.most_common())}


def widened(clip, resolution: int):
    """A copy of ``clip`` that reads ``resolution`` px images: the same weights, the attention
    pool's spatial position embedding repeated over the larger grid."""
    cfg = copy.deepcopy(clip.model_cfg)
    cfg["vision_cfg"]["image_size"] = resolution
    model = build_open_clip_model(cfg)
    state = clip.model.state_dict()
    key = "visual.attnpool.positional_embedding"
    pos = state[key]
    grid = (resolution // 32) ** 2
    if pos.shape[0] != 2:
        raise ValueError(f"widening needs a CLIP with one spatial position, not {pos.shape[0] - 1}")
    state[key] = torch.cat([pos[:1], pos[1:].expand(grid, -1)])
    model.load_state_dict(state)
    out = CLIP(
        model,
        clip.tokenizer,
        clip.model_name,
        cfg,
        normalize_embeds=clip.normalize_embeds,
        tokenizer_cfg=clip.tokenizer_cfg,
    )
    out.kept_token_ids = clip.kept_token_ids
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the bundled model)")
    p.add_argument("--num", type=int, default=300, help="renders per split and kind")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--resolution", type=int, default=32, choices=[32, 64])
    p.add_argument("--finetune", type=int, default=0, metavar="STEPS")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--pair-negatives", type=json.loads, default=RERANKER_DATA["pair_negatives"])
    p.add_argument("--single-negatives", type=json.loads, default=None)
    p.add_argument("--colour-free", type=float, default=RERANKER_DATA["color_free_prob"])
    p.add_argument("--candidates", help="bench_rerank_at.py --save-candidates file (32 px)")
    p.add_argument("--at", type=int, default=6)
    p.add_argument("--count", type=int, default=24)
    p.add_argument("--upsampled", help="bench_rerank_rules.py --save-upsampled file (64 px)")
    p.add_argument(
        "--contrast",
        action="append",
        default=None,
        metavar="NAME",
        help=f"a registered rerank contrast to choose by (default: {CONTRAST})",
    )
    p.add_argument(
        "--reranker",
        action="append",
        default=[],
        metavar="NAME=CLIP",
        help="another CLIP folder to read, named NAME in the report",
    )
    p.add_argument("--out", default="bench_reranker_reading:default")
    args = p.parse_args(argv)
    args.contrast = args.contrast or [CONTRAST]
    unknown = [c for c in args.contrast if c not in RERANK_CONTRASTS]
    if unknown:
        p.error(f"--contrast {unknown}: registered ones are {sorted(RERANK_CONTRASTS)}")
    if args.candidates and args.resolution != 32 or args.upsampled and args.resolution != 64:
        p.error("--candidates are read at --resolution 32, --upsampled at 64")
    started = time.perf_counter()
    pipe = common.fp32_pipeline(args.model)
    sets = {
        f"{split} {kind}": renders(split, kind, args.num, args.seed, args.resolution)
        for split in ("train", "heldout")
        for kind in KINDS
    }
    clips = {"reranker": pipe.rerank_clip, "conditioning CLIP": pipe.clip}
    for named in args.reranker:
        name, sep, path = named.partition("=")
        path = path if sep else name
        clips[name] = CLIP.from_pretrained(path)
    if args.resolution != 32:
        # the question at 64 px is whether a reranker reads upsampled candidates better; the
        # conditioning CLIP only conditions, at 32 px, so it is not widened
        clips = {
            f"{name} widened to {args.resolution} px": widened(clip, args.resolution)
            for name, clip in clips.items()
            if name != "conditioning CLIP"
        }
    choices = choice_sets(args)
    result = {
        "machine": common.machine(),
        "model": args.model or "bundled:shapes",
        "renders": args.num,
        "seed": args.seed,
        "resolution": args.resolution,
        "reading": {
            name: {which: reading(clip, samples) for which, samples in sets.items()}
            for name, clip in clips.items()
        },
        "choosing": {name: choosing(clip, choices, args.contrast) for name, clip in clips.items()},
    }
    if args.finetune:
        result["finetune"] = finetune(pipe, args, sets, choices)
    return common.finish(args.out, result, started, report)


def choice_sets(args) -> dict:
    """``name -> (views [n, k, 3, s, s], right [n, k], captions)``: saved candidates to choose
    among, and which of them the evaluator finds fully right."""
    out = {}
    if args.candidates:
        saved = torch.load(args.candidates, mmap=True)
        views, captions = saved["x0s"][args.at][:, : args.count].float(), saved["captions"]
        right = right_matrix(saved["finals"][:, : args.count], captions)
        out[f"pair all, {args.count} candidates after step {args.at}"] = (views, right, captions)
    if args.upsampled:
        saved = torch.load(args.upsampled)
        views, right, captions = saved["x64"].float(), saved["right"], saved["captions"]
        for k in (2, 3, 4, 6):
            if k <= views.shape[1]:
                name = f"pair all, the best {k} upsampled"
                out[name] = (views[:, :k], right[:, :k], captions)
    return out


def choice_key(name: str, contrast: str) -> str:
    """A choice figure's name: the contrast is named unless it is the ``shapes-pairs`` baseline."""
    return name if contrast == CONTRAST else f"{name}, {contrast}"


def choosing(clip, choices, contrasts=(CONTRAST,)) -> dict:
    """The two-object prompts whose candidate chosen by ``clip`` is right, by each of
    ``contrasts`` (:func:`choice_key`)."""
    figures = {}
    for name, (views, right, captions) in choices.items():
        for contrast in contrasts:
            scores = contrast_scores(clip, views, captions, contrast)
            figures[choice_key(name, contrast)] = chosen_right(right, scores, right.shape[1])[
                "pair_all"
            ]
    return figures


def finetune(pipe, args, sets, choices) -> dict:
    """``--finetune``: train a copy of the reranker and follow its figures."""
    held = {kind: sets[f"heldout {kind}"] for kind in KINDS}

    def evaluate(clip) -> dict:
        figures = {f"held-out {kind} read": reading(clip, s)["first"] for kind, s in held.items()}
        return {**figures, **choosing(clip, choices, args.contrast)}

    batches = reranker_batches(
        args.batch,
        args.seed,
        resolution=args.resolution,
        pair_negatives=args.pair_negatives,
        single_negatives=args.single_negatives,
        color_free_prob=args.colour_free,
    )

    clip = (
        widened(pipe.rerank_clip, args.resolution)
        if args.resolution != 32
        else copy.deepcopy(pipe.rerank_clip)
    )
    history = train_copy(clip, args.finetune, args.lr, batches, evaluate, args.eval_every)
    return {
        "steps": args.finetune,
        "lr": args.lr,
        "batch": args.batch,
        "pair_negatives": args.pair_negatives,
        "single_negatives": args.single_negatives,
        "colour_free": args.colour_free,
        "columns": [
            "step",
            *(f"held-out {kind} read" for kind in held),
            *(choice_key(k, c) for k in choices for c in args.contrast),
        ],
        "by_step": history,
    }


def report(result: dict) -> str:
    rows = [
        {"clip": name, "set": which, "first": r["first"], "misses": r["misses"]}
        for name, by in result["reading"].items()
        for which, r in by.items()
    ]
    text = common.table(
        rows,
        [("CLIP", "clip"), ("renders", "set"), ("caption first", "first"), ("misses", "misses")],
    )
    for name, figures in result["choosing"].items():
        text += f"\n{name} choosing: {figures}" if figures else ""
    if "finetune" in result:
        ft = result["finetune"]
        text += f"\nfine-tuned copy {ft['columns']}:\n" + "\n".join(map(str, ft["by_step"]))
    return text


if __name__ == "__main__":
    raise SystemExit(main())
