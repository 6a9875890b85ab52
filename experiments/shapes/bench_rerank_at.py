"""When can the decoder's candidates be chosen? The bundled shapes model's reranking after m steps.

    python experiments/shapes/bench_rerank_at.py         # results/bench_rerank_at.json (50 + 50)
    python experiments/shapes/bench_rerank_at.py --num 100 --candidates 16 --steps 10
    python experiments/shapes/bench_rerank_at.py --num 100 --prompt-seed 2000 \
        --out bench_rerank_at:prompt_seed_2000
    python experiments/shapes/bench_rerank_at.py --quick # 2 + 2 prompts, 4 candidates

Results go to ``experiments/shapes/results/``; ``--out FILE:KEY`` stores a run under ``KEY`` of
``FILE.json`` (the default: key ``default`` of ``bench_rerank_at.json``).

For the held-out prompts (``--num`` single-object and ``--num`` two-object), every prompt gets
``--candidates`` decoder candidates, each from its own prior sample (as the pipeline's ``best_of``
makes them; prior UniPC 10 steps), decoded for ``--steps`` steps (DDIM, or the sampler
``--scheduler`` names; no guidance). After each step ``m`` the reranking CLIP scores every
candidate's predicted final image, which is what the decoder's ``rerank_at = m`` chooses by (``m =
steps``: the prediction at the last step; the row "finished images" is the pipeline's reranking
without ``rerank_at``). The chosen candidate's finished image is then read from this one run of all
candidates: a kept row finishes exactly as in the run of every candidate
(``unclip.sampling.sample_decoder_reranked``; tests/test_schedulers.py checks it), so every ``m``
is measured without decoding again. Each ``m`` is scored at the decoder's resolution (32 px) with
the evaluator, next to the first candidate (no reranking) and the ceiling of any reranker over
these candidates (a prompt counts when any of its candidates is fully right). Network calls per
image: ``candidates × m + steps − m``. With ``--contrast NAME`` (default ``shapes``; ``none`` to
skip) each choice is made a second time by contrastive reranking (the decoder's
``rerank_contrast``: the CLIP's log-probability of the prompt among its alternatives), rows marked
``contrast``.

Pruning (the decoder's ``prune_at`` / ``prune_keep``): ``--prune P:R`` adds a row per
``--choose-at M`` that keeps each prompt's ``R`` best candidates after step ``P`` and chooses one
of them after step ``M`` (``candidates × P + R × (M − P) + steps − M`` calls), read from the same
run.
``--subsets K`` adds rows for the first ``K`` candidates alone, chosen after each ``--choose-at``
step: the same draws a run with ``best_of = K`` makes, so settings of equal cost compare on one
set of candidates.

    python experiments/shapes/bench_rerank_at.py --num 200 --candidates 32 \
        --contrast shapes-pairs --prune 4:8 --prune 3:12 --subsets 16 24 --choose-at 6 \
        --out bench_rerank_at:pruning
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# import benchmarks/common.py (timing, machine description, JSON output) from its folder
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import common  # noqa: E402
import torch  # noqa: E402

from unclip.diffusion.loop import guided_output, scheduler_step, training_scheduler  # noqa: E402
from unclip.diffusion.vlb import predicted_x0  # noqa: E402
from unclip.sampling.candidates import rerank_candidates
from unclip.sampling.scorers import RERANK_CONTRASTS, image_text_cosines
from unclip.sampling.settings import DecoderSampling  # noqa: E402
from unclip.sampling.stages import decoder_denoiser
from unclip.shapes.captions import parse_caption  # noqa: E402
from unclip.shapes.detector import evaluate_images, score  # noqa: E402
from unclip.shapes.evaluate import heldout_samples  # noqa: E402
from unclip.utils.images import to_output  # noqa: E402

common.RESULTS = Path(__file__).resolve().parent / "results"  # experiments/shapes/results/

PRIOR = {"prior": {"scheduler": "unipc", "steps": 10}}
DECODER = {"scheduler": "ddim", "guidance_scale": 1.0}  # the bundled model's decoder guidance
#: samplers decode_all can follow: one network call per step at whole-number training timesteps on
#: unscaled samples, which its predicted images (the training schedule's x_0 formula) assume
SAMPLERS = ("ddim", "ddpm", "dpm++", "unipc", "deis")


@torch.no_grad()
def decode_all(pipe, captions, k, steps, seed, decoder=None):
    """Every candidate's finished image ``[N, k, 3, s, s]`` and its predicted final image after
    each step ``{m: [N, k, 3, s, s]}``. ``decoder``: the decoder's settings (default
    :data:`DECODER`)."""
    n = len(captions)
    gens = [torch.Generator().manual_seed(seed + 1000 * i + j) for i in range(n) for j in range(k)]
    text = pipe.encode_text(captions).repeat_interleave(k)
    embeds = pipe.sample_image_embeds(text, 1, gens, PRIOR, progress=False)
    settings = DecoderSampling(**(decoder or DECODER), steps=steps)
    diffusion = pipe.diffusion["decoder"]
    captions_k = [c for c in captions for _ in range(k)]
    dec_text, null = pipe._decoder_captions(
        captions_k if pipe.decoder.has_text_encoder else text, n * k
    )
    d = decoder_denoiser(pipe.decoder, embeds, dec_text, null, settings, diffusion)
    training = training_scheduler(diffusion)
    x = torch.stack([torch.randn(d.shape[1:], generator=g) for g in gens])
    x = x * d.scheduler.init_noise_sigma
    x0s = {}
    for i, t in enumerate(d.scheduler.timesteps):
        out = guided_output(
            d.fn, x, t, d.scheduler, guidance_scale=1.0, learned_variance=d.learned_variance
        )
        mean = out[:, : x.shape[1]]
        pred = predicted_x0(training, x, t, mean, diffusion.prediction_type).clamp(-1, 1)
        x0s[i + 1] = pred.view(n, k, *x.shape[1:])
        x = scheduler_step(d.scheduler, out, i, x, gens, history=i + 1)
    return x.clamp(-1, 1).view(n, k, *x.shape[1:]), x0s


def right_matrix(finals, captions) -> torch.Tensor:
    """``[n, k]``: candidate j of prompt i (``finals [n, k, 3, s, s]``) fully right at its
    resolution."""
    n, k = finals.shape[:2]
    expected = [parse_caption(c) for c in captions]
    right = torch.zeros(n, k, dtype=torch.bool)
    for j in range(k):
        for i, image in enumerate(to_output(finals[:, j], "uint8")):
            right[i, j] = bool(score(image, expected[i])["all"])
    return right


def by_kind(hit: torch.Tensor) -> dict:
    """The share of prompts with ``hit [n]`` true, single-object prompts (the first half) and
    two-object prompts (the second) apart: ``{"single_all", "pair_all"}``."""
    half = hit.shape[0] // 2
    return {
        "single_all": round(hit[:half].float().mean().item(), 4),
        "pair_all": round(hit[half:].float().mean().item(), 4),
    }


def parse_prune(parser, spec: str, args) -> tuple[int, int]:
    """``--prune P:R`` → ``(P, R)``, checked against the run's steps and candidates."""
    try:
        at, r = (int(v) for v in spec.split(":"))
    except ValueError:
        parser.error(f"--prune takes STEP:KEEP (e.g. 4:8), got {spec!r}")
    if not (1 <= at < args.steps and 1 <= r < args.candidates):
        parser.error(
            f"--prune {spec}: the step must be below --steps ({args.steps}) and the number kept "
            f"below --candidates ({args.candidates})"
        )
    return at, r


def summary(images, captions) -> dict:
    rep = evaluate_images(to_output(images, "uint8"), captions)
    out = {"single_all": rep["single"]["all"], "pair_all": rep["pair"]["all"]}
    out.update({f"pair_{key}": rep["pair"][key] for key in ("colors", "shapes", "relation")})
    return {key: round(v, 4) for key, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline folder (default: the bundled model)")
    p.add_argument("--num", type=int, default=50, help="prompts per kind (single, two-object)")
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--scheduler",
        default=DECODER["scheduler"],
        choices=SAMPLERS,
        help="the decoder's sampler (default: %(default)s)",
    )
    p.add_argument("--chunk", type=int, default=10, help="prompts decoded together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompt-seed",
        type=int,
        default=1000,
        help="seed of the held-out captions (1000: the evaluation's; another gives a second set)",
    )
    p.add_argument(
        "--contrast",
        default="shapes",
        choices=[*RERANK_CONTRASTS, "none"],
        help="also choose by this rerank_contrast (default: %(default)s)",
    )
    p.add_argument(
        "--prune",
        action="append",
        default=[],
        metavar="P:R",
        help="also keep the R best candidates after step P, then choose after each --choose-at",
    )
    p.add_argument(
        "--subsets",
        type=int,
        nargs="*",
        default=[],
        metavar="K",
        help="also choose among the first K candidates alone after each --choose-at step",
    )
    p.add_argument(
        "--choose-at",
        type=int,
        nargs="*",
        default=None,
        metavar="M",
        help="the final choice's steps for --prune and --subsets (default: 6, or --steps if fewer)",
    )
    p.add_argument(
        "--save-candidates",
        metavar="PATH",
        help="also save the finished candidates, their predicted images after steps 3-8 and the "
        "captions to PATH (torch.save; about 1 GB for 400 prompts x 32), which "
        "bench_rerank_rules.py reads",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench_rerank_at:default")
    args = p.parse_args(argv)
    if args.quick:
        args.num, args.candidates, args.steps = 2, 4, 4
        if args.out == "bench_rerank_at:default":
            args.out = "bench_rerank_at_quick"
    if min(args.num, args.candidates, args.steps, args.chunk) < 1:
        p.error("--num, --candidates, --steps and --chunk must be >= 1")
    if args.choose_at is None:
        args.choose_at = [min(6, args.steps)]
    prunes = [parse_prune(p, spec, args) for spec in args.prune]
    if any(not 1 <= m <= args.steps for m in args.choose_at):
        p.error(f"--choose-at: steps from 1 to --steps ({args.steps})")
    if any(not 1 < sub < args.candidates for sub in args.subsets):
        p.error(f"--subsets: counts between 2 and --candidates ({args.candidates}) exclusive")
    started = time.perf_counter()
    pipe = common.fp32_pipeline(args.model)
    captions = [s.caption for s in heldout_samples(args.num, seed=args.prompt_seed)]
    k, steps = args.candidates, args.steps
    decoder = {**DECODER, "scheduler": args.scheduler}
    finals, x0s = [], {m: [] for m in range(1, steps + 1)}
    for start in range(0, len(captions), args.chunk):
        f, x = decode_all(
            pipe, captions[start : start + args.chunk], k, steps, args.seed + start, decoder
        )
        finals.append(f)
        for m in x0s:
            x0s[m].append(x[m])
        common.log(f"decoded {start + len(f)} / {len(captions)} prompts")
    finals = torch.cat(finals)
    if args.save_candidates:
        keep = {m: torch.cat(x0s[m]) for m in range(3, min(8, steps) + 1)}
        torch.save({"finals": finals, "x0s": keep, "captions": captions}, args.save_candidates)
    n = finals.shape[0]
    rows = torch.arange(n)
    text_embed = pipe.rerank_clip.encode_text(captions).text_embed.repeat_interleave(k, 0)
    table = {"first candidate (no reranking)": {**summary(finals[:, 0], captions), "calls": steps}}
    finished = image_text_cosines(pipe.rerank_clip, finals.flatten(0, 1), text_embed).view(n, k)
    table["finished images (rerank_at None)"] = {
        **summary(finals[rows, finished.argmax(1)], captions),
        "calls": k * steps,
    }
    contrast = None if args.contrast == "none" else args.contrast
    captions_k = [c for c in captions for _ in range(k)]

    def contrast_row(images, name, calls):
        keep = rerank_candidates(pipe.rerank_clip, images.flatten(0, 1), captions_k, k, contrast)
        table[f"{name}, contrast {contrast}"] = {
            **summary(finals.flatten(0, 1)[keep], captions),
            "calls": calls,
        }

    if contrast:
        contrast_row(finals, "finished images", k * steps)
    for m, parts in x0s.items():
        pred = torch.cat(parts)
        scores = image_text_cosines(pipe.rerank_clip, pred.flatten(0, 1), text_embed).view(n, k)
        row = summary(finals[rows, scores.argmax(1)], captions)
        table[f"rerank_at {m}"] = {**row, "calls": k * m + steps - m}
        if contrast:
            contrast_row(pred, f"rerank_at {m}", k * m + steps - m)
    flat = finals.flatten(0, 1)
    for m in args.choose_at:
        pred = torch.cat(x0s[m])
        for sub in args.subsets:
            keep = rerank_candidates(
                pipe.rerank_clip, pred[:, :sub].flatten(0, 1), captions, sub, contrast
            )
            table[f"first {sub} candidates, rerank_at {m}"] = {
                **summary(finals[:, :sub].flatten(0, 1)[keep], captions),
                "calls": sub * m + steps - m,
            }
        for at, r in prunes:
            if at >= m:
                continue
            early = torch.cat(x0s[at]).flatten(0, 1)
            kept = rerank_candidates(pipe.rerank_clip, early, captions, k, contrast, keep=r)
            chosen = kept[
                rerank_candidates(pipe.rerank_clip, pred.flatten(0, 1)[kept], captions, r, contrast)
            ]
            table[f"prune_at {at} to {r}, rerank_at {m}"] = {
                **summary(flat[chosen], captions),
                "calls": k * at + r * (m - at) + steps - m,
            }
    right = right_matrix(finals, captions)
    half = args.num
    ceiling = {
        **by_kind(right.any(1)),
        "single_mean_candidate": round(right[:half].float().mean().item(), 4),
        "pair_mean_candidate": round(right[half:].float().mean().item(), 4),
    }
    result = {
        "machine": common.machine(),
        "prompts_per_kind": args.num,
        "prompt_seed": args.prompt_seed,
        "candidates": k,
        "steps": steps,
        "sampling": {**PRIOR, "decoder": {**decoder, "steps": steps, "best_of": k}},
        "contrast": contrast,
        "model": args.model or "bundled:shapes",
        "resolution": int(finals.shape[-1]),
        "by_setting": table,
        "any_candidate_right": ceiling,
    }
    return common.finish(args.out, result, started, report)


def report(result: dict) -> str:
    cols = [("setting", "setting"), ("network calls / image", "calls")]
    cols += [(key, key) for key in next(iter(result["by_setting"].values())) if key != "calls"]
    rows = [{"setting": name, **row} for name, row in result["by_setting"].items()]
    ceiling = result["any_candidate_right"]
    return common.table(rows, cols) + f"\nany candidate right (a reranker's ceiling): {ceiling}"


if __name__ == "__main__":
    raise SystemExit(main())
