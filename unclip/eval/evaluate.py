"""``unclip evaluate``: sample a pipeline on a prompt set and score the samples.

Usage::

    unclip evaluate --model PATH (--prompts FILE | --coco-captions JSON | --shapes) --out DIR
                    [--reference DIR|NPZ] [--num-samples N] [--batch-size B] [--seed S]
                    [--inception PATH|random] [--clip-model NAME|DIR --clip-pretrained PATH]
                    [--clip-fid] [--shapes] [--resolution 256] [--sampling JSON|FILE]
                    [--save-samples]
    unclip evaluate --samples DIR ...      # score existing images (DIR/x.png + DIR/x.txt caption)

Writes ``report.json``, ``report.md`` (a markdown table), ``grid.png`` (the first 64 samples) and
``prompts.txt`` (the exact prompts, one per sample) to ``--out``.

Samples
-------
Sample ``i`` uses prompt ``i mod P`` and its own ``torch.Generator`` seeded with
:func:`unclip.sampling.utils.sample_seed` ``(seed, i)``, so a sample does not depend on the batch
size or on the other prompts.

Fixed preprocessing (decides comparability; recorded in every report and stats cache)
-----------------------------------------------------------------------------------
Generated images (uint8 from the pipeline, ``round(255·x)``) and reference images alike: converted
to RGB (alpha dropped); unless already ``R x R``, the shorter side is resized to ``R =
--resolution`` (default 256) with PIL bicubic (antialiased) and the centre ``R x R`` is cropped;
kept as uint8. The Inception then resizes ``R → 299`` with TF1-compatible bilinear interpolation
(torch-fidelity, no antialias), as the original TensorFlow FID code. CLIP sees the same ``R x R``
images through open_clip's own preprocessing. Statistics are only comparable between runs that agree
on all of this, on the Inception weights (sha256 recorded) and on the reference set.

Metrics
-------
* FID: Fréchet distance of Inception pool3 (2048-d) features against ``--reference`` (an image
  folder, whose stats are computed once and cached to ``--reference-cache``, default
  ``OUT/reference_stats.npz``, or a stats ``.npz``). Weights come from ``--inception`` (local file
  ``weights-inception-2015-12-05-6726825d.pth``); ``--inception random`` is for tests only.
* CLIP score: cosine of evaluation-CLIP image and text embeddings, reported as mean
  ``max(100·cos, 0)`` (torchmetrics) and mean ``2.5·max(cos, 0)`` (CLIP-S, Hessel et al. 2021). The
  evaluation CLIP defaults to the pipeline's own (conditioning) CLIP, which flatters the model; pass
  ``--clip-model`` to use another. ``--clip-fid``: Fréchet distance of (unit-norm) CLIP image
  features.
* Shapes faithfulness (``--shapes``): :func:`unclip.shapes.detector.evaluate_images`; without
  ``--prompts``, prompts are drawn from the held-out split with ``--seed``.

Zero-shot MS-COCO (unCLIP / Karlo protocol): ``--coco-captions captions_val2014.json`` samples
``--num-samples`` (default 30000) captions without replacement with ``--seed`` from the annotations
sorted by id; ``--reference`` is the val2014 image folder (every image resized on the shorter side
and centre-cropped to 256 as above), or its cached ``.npz``.

Bad input never yields a silent number: blank prompt lines and unreadable images are skipped and
counted in the report; non-UTF-8 prompt files, empty folders and reference sets smaller than the
sample set (unless ``--allow-small-reference``) are errors.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from unclip.eval import metrics as M
from unclip.sampling.utils import sample_seed
from unclip.utils.images import image_grid, list_images

__all__ = [
    "check_samples_metrics",
    "evaluate",
    "read_prompts",
    "read_coco_captions",
    "shapes_prompts",
    "SampleScorer",
    "report_markdown",
]

GRID_MAX = 64


# ------------------------------------------------------------------------------------------ prompts
def read_prompts(path) -> tuple[list[str], int]:
    """One prompt per line (UTF-8) → ``(prompts, number of blank lines skipped)``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    data = path.read_bytes()
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()  # the final newline ends the last line; it does not start a blank one
    prompts, blank = [], 0
    for lineno, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path}, line {lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                f"{e.start + 1}); save the prompt file as UTF-8"
            ) from None
        line = (line.lstrip("\ufeff") if lineno == 1 else line).strip()
        if line:
            prompts.append(line)
        else:
            blank += 1
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts ({blank} blank lines)")
    return prompts, blank


def read_coco_captions(path, num: int, seed: int) -> list[str]:
    """``num`` captions sampled without replacement (``random.Random(seed)``) from a COCO captions
    JSON."""
    path = Path(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"COCO captions file not found: {path}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a COCO captions JSON file: {e}") from None
    anns = data.get("annotations") if isinstance(data, dict) else None
    if not isinstance(anns, list) or not all(isinstance(a, dict) and "caption" in a for a in anns):
        raise ValueError(
            f"{path} has no 'annotations' list of {{'caption': ...}} entries (expected e.g. "
            f"captions_val2014.json)"
        )
    anns = sorted(anns, key=lambda a: (a.get("id", 0), a.get("image_id", 0), a["caption"]))
    caps = [" ".join(str(a["caption"]).split()) for a in anns]
    caps = [c for c in caps if c]
    if num > len(caps):
        raise ValueError(f"asked for {num} captions but {path} has only {len(caps)}")
    return [caps[i] for i in random.Random(seed).sample(range(len(caps)), num)]


def shapes_prompts(num: int, seed: int) -> list[str]:
    """``num`` captions of the held-out shapes split (a pure function of ``seed``)."""
    from unclip.shapes.world import ShapesWorld

    world = ShapesWorld(resolution=8, seed=seed, split="heldout")
    return [world[i].caption for i in range(num)]


# ------------------------------------------------------------------------------------------ scoring
class SampleScorer:
    """Accumulates everything the metrics need from batches of (uint8 ``[R, R, 3]`` images,
    captions)."""

    def __init__(
        self,
        inception=None,
        clip=None,
        clip_fid: bool = False,
        shapes: bool = False,
        save_dir: Optional[Path] = None,
    ):
        self.inception, self.clip, self.clip_fid, self.shapes = inception, clip, clip_fid, shapes
        self.inc_stats, self.clip_stats = M.GaussianStats(), M.GaussianStats()
        self.cosines: list[torch.Tensor] = []
        self.shape_images: list[np.ndarray] = []
        self.captions: list[str] = []
        self.grid: list[np.ndarray] = []
        self.save_dir = save_dir
        if save_dir is not None:
            save_dir.mkdir(parents=True, exist_ok=True)

    def add(self, images: list[np.ndarray], captions: list[str]) -> None:
        if self.save_dir is not None:
            for i, (a, c) in enumerate(zip(images, captions), len(self.captions)):
                Image.fromarray(a).save(self.save_dir / f"{i:06d}.png")
                (self.save_dir / f"{i:06d}.txt").write_text(c + "\n", encoding="utf-8")
        self.captions += captions
        self.grid += images[: max(0, GRID_MAX - len(self.grid))]
        if self.inception is not None:
            self.inc_stats.update(M.inception_features(self.inception, images))
        if self.clip is not None:
            img = self.clip.encode_image([Image.fromarray(a) for a in images])
            self.cosines.append(M.clip_cosines(img, self.clip.encode_text(captions).text_embed))
            if self.clip_fid:
                self.clip_stats.update(img)
        if self.shapes:
            self.shape_images += images

    def shapes_report(self) -> dict:
        from unclip.shapes.detector import evaluate_images

        return evaluate_images(self.shape_images, self.captions)


def _iter_generated(
    pipe,
    prompts: list[str],
    num: int,
    seed: int,
    batch_size: int,
    resolution: int,
    sampling: Optional[dict],
    progress: bool,
    size: Optional[dict] = None,
):
    bar = tqdm(total=num, desc="sampling", disable=not progress)
    for start in range(0, num, batch_size):
        idx = range(start, min(num, start + batch_size))
        batch = [prompts[i % len(prompts)] for i in idx]
        gens = [torch.Generator(device=pipe.device).manual_seed(sample_seed(seed, i)) for i in idx]
        out = pipe(
            batch,
            num_images_per_prompt=1,
            generator=gens,
            sampling=sampling,
            output_type="pt",
            progress=False,
            **(size or {}),
        )
        x = out.images  # [B, 3, H, W] in [0, 1]
        finite = torch.isfinite(x).flatten(1).all(1)
        if not bool(finite.all()):
            # cast to 8 bits a NaN reads 0: a black image that would be scored as a sample
            i = int(idx[int((~finite).nonzero()[0])])
            raise ValueError(
                f"sample {i} ({prompts[i % len(prompts)]!r}) has NaN/inf pixels: the model is "
                "broken (check its weights) or its sampling settings overflow; nothing was scored"
            )
        # the pipeline's own PIL conversion (round(255 x)), after the check
        arr = (x.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
        yield [M.to_eval_image(Image.fromarray(a), resolution) for a in arr], batch
        bar.update(len(batch))
    bar.close()


def _check_sample_size(pipe, size: int) -> int:
    """``--sample-size``: the side a pipeline that draws at any size (``height``/``width``, as
    Kandinsky's) draws at; a pipeline of fixed resolution is a ``ValueError``."""
    import inspect

    if isinstance(size, bool) or not isinstance(size, int) or size < 16:
        raise ValueError(f"--sample-size must be an integer >= 16, got {size!r}")
    if "height" not in inspect.signature(pipe.__call__).parameters:
        raise ValueError(
            f"--sample-size: this {type(pipe).__name__} draws at its fixed resolution "
            f"({pipe.resolution}px); leave --sample-size out"
        )
    decoder = getattr(pipe, "decoder", None)
    f2 = int(getattr(decoder, "scale_factor", 1)) ** 2
    if size % f2:
        raise ValueError(
            f"--sample-size must be a multiple of {f2} for this model (its autoencoder's "
            f"downsampling, squared), got {size}"
        )
    return size


def _read_caption(path: Path) -> str:
    """A sample's caption file: UTF-8 text, whitespace runs joined; an empty one (the sample
    would be scored against "") or one that is not UTF-8 is a ``ValueError`` naming it."""
    try:
        caption = " ".join(path.read_text(encoding="utf-8").split())
    except UnicodeDecodeError as e:
        raise ValueError(
            f"caption file {path} is not valid UTF-8 (byte {e.object[e.start]:#04x} at offset "
            f"{e.start}); save it as UTF-8"
        ) from None
    if not caption:
        raise ValueError(
            f"caption file {path} is empty: every sample needs the caption it was drawn for"
        )
    return caption


def _iter_folder(
    folder: Path,
    num: Optional[int],
    resolution: int,
    batch_size: int,
    skipped: list,
    progress: bool,
):
    files = list_images(folder, "samples folder")
    missing = [p for p in files if not p.with_suffix(".txt").is_file()]
    if missing:
        raise ValueError(
            f"{len(missing)} samples in {folder} have no caption file, e.g. "
            f"{missing[0].with_suffix('.txt')}"
        )
    files = files[:num] if num else files
    for start in tqdm(range(0, len(files), batch_size), desc="samples", disable=not progress):
        imgs, caps = [], []
        for p in files[start : start + batch_size]:
            arr = M.read_image(p, resolution)
            if arr is None:
                skipped.append(str(p.relative_to(folder)))
                continue
            imgs.append(arr)
            caps.append(_read_caption(p.with_suffix(".txt")))
        if imgs:
            yield imgs, caps


# ------------------------------------------------------------------------------------------- output
def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def report_markdown(r: dict) -> str:
    rows = []
    if "fid" in r:
        f = r["fid"]
        note = (
            ""
            if f["comparable"]
            else " **NOT COMPARABLE (unverified or test Inception, non-standard features, or "
            "fewer than " + str(M.MIN_COMPARABLE_SAMPLES) + " samples)**"
        )
        rows.append(
            (
                "FID",
                f.get("value", f.get("not_computed")),
                f"{f['inception']}, {f['feature']}-d, "
                f"reference {f['reference_count']} images{note}",
            )
        )
    c = r.get("clip_score", {})
    if "clip_score_100" in c:
        rows += [
            ("CLIP score (100·cos)", c["clip_score_100"], c["model"]),
            ("CLIPScore (2.5·cos, Hessel)", c["clipscore_2.5"], c["model"]),
            (
                "CLIP cosine (mean)",
                c["cosine_mean"],
                f"{c['negative_count']} negative of {c['count']}",
            ),
        ]
    elif c:
        rows.append(("CLIP score", c.get("not_computed"), ""))
    if "clip_fid" in r:
        rows.append(("CLIP-FID", r["clip_fid"]["value"], r["clip_fid"]["model"]))
    if "shapes" in r:
        for kind in ("single", "pair"):
            row = r["shapes"][kind]
            for k, v in row.items():
                if k != "count" and not k.endswith("_count"):
                    rows.append((f"shapes {kind}: {k}", v, f"{row[k + '_count']} prompts"))
        rows.append(("shapes: all correct", r["shapes"]["all"], f"{r['shapes']['count']} prompts"))
    for k, v in r["skipped"].items():
        rows.append((f"skipped: {k}", v, ""))
    lines = [
        f"# Evaluation of `{r['model']}`",
        "",
        f"{r['num_samples']} samples at {r['resolution']}px, seed {r['seed']}, prompts: "
        f"{r['prompts']['source']}",
        "",
        "| metric | value | details |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {a} | {_fmt(b)} | {c} |" for a, b, c in rows]
    return "\n".join(lines + [""] + [f"- {w}" for w in r["warnings"]]) + "\n"


# ------------------------------------------------------------------------------------------ the job
def _load_clip(clip_model, clip_pretrained, pipe):
    from unclip.nets.clip import CLIP, ClipConfig

    if clip_model:
        folder = Path(clip_model)
        if folder.is_dir():
            clip = CLIP.from_pretrained(folder)
            return clip, f"{clip.model_name} from {folder}"
        if not clip_pretrained:
            raise ValueError(
                "--clip-model NAME needs --clip-pretrained PATH (a random CLIP scores nothing)"
            )
        clip = CLIP.from_config(ClipConfig(clip_model, pretrained=clip_pretrained))
        return clip, f"{clip_model} ({clip_pretrained})"
    if pipe is not None:
        if pipe.clip is None:  # a token pipeline exported without a reranking CLIP
            raise ValueError("the pipeline has no CLIP to score with; pass --clip-model FOLDER")
        return pipe.clip, f"pipeline's own CLIP ({pipe.clip.model_name}, the conditioning CLIP)"
    return None, None


def check_samples_metrics(samples, reference, clip_model, shapes: bool) -> None:
    """Scoring existing images (``samples``) needs a metric to compute: FID (``reference``), a
    CLIP score (``clip_model``: no pipeline brings its CLIP) or shapes faithfulness (``shapes``).
    A ``ValueError`` saying so otherwise, before any image is read."""
    if samples and not (reference or clip_model or shapes):
        raise ValueError(
            f"--samples {samples}: nothing to compute; pass --reference REF (FID), --clip-model "
            "(CLIP score) or --shapes (shapes faithfulness)"
        )


def evaluate(
    out,
    *,
    model=None,
    revision: Optional[str] = None,
    cache_dir=None,
    samples=None,
    prompts_file=None,
    coco_captions=None,
    shapes: bool = False,
    reference=None,
    reference_cache=None,
    allow_small_reference: bool = False,
    num_samples: Optional[int] = None,
    batch_size: int = 16,
    seed: int = 0,
    inception_weights=None,
    inception_feature: int = 2048,
    clip_model=None,
    clip_pretrained=None,
    clip_fid: bool = False,
    resolution: int = 256,
    sampling: Optional[dict] = None,
    sample_size: Optional[int] = None,
    save_samples: bool = False,
    device="cpu",
    progress: bool = True,
    autocast_dtype="auto",
) -> dict:
    """Sample the pipeline folder or Hub repo id ``model`` (at ``revision``, cached in
    ``cache_dir``; or read the captioned images in ``samples``), score them and write
    ``report.json``, ``report.md``, ``prompts.txt`` and ``grid.png`` to ``out`` (see the module
    doc; each argument is the ``unclip evaluate`` flag of the same name, ``prompts_file`` is
    ``--prompts`` and ``inception_weights`` is ``--inception``). Returns the report."""
    if not (model or samples):
        raise ValueError("pass --model PATH (generate) or --samples DIR (score existing images)")
    check_samples_metrics(samples, reference, clip_model, shapes)
    if resolution < 16:
        raise ValueError(f"--resolution must be >= 16, got {resolution}")
    out = Path(out)
    warn, skipped, report = (
        [],
        {},
        {
            "model": model or samples,
            **({"revision": revision} if revision else {}),
            "seed": seed,
            "resolution": resolution,
            "preprocessing": M.PREPROCESSING,
        },
    )
    prompts, n = None, num_samples
    if model:
        if prompts_file:
            prompts, skipped["blank_prompt_lines"] = read_prompts(prompts_file)
            report["prompts"] = {"source": str(prompts_file), "count": len(prompts)}
        elif coco_captions:
            n = n or 30000
            prompts = read_coco_captions(coco_captions, n, seed)
            report["prompts"] = {"source": f"COCO {coco_captions} (sampled with seed {seed})"}
        elif shapes:
            n = n or 500
            prompts = shapes_prompts(n, seed)
            report["prompts"] = {"source": f"shapes held-out split, seed {seed}"}
        else:
            raise ValueError("pass --prompts FILE, --coco-captions JSON or --shapes")
        n = n or len(prompts)
        if shapes:
            from unclip.shapes.captions import parse_caption

            for i, prompt in enumerate(prompts):
                try:
                    parse_caption(prompt)
                except ValueError as e:
                    raise ValueError(
                        f"--shapes: prompt {i + 1} is not a shapes caption: {e}"
                    ) from None
    elif prompts_file or coco_captions:
        raise ValueError(
            "--samples takes the captions from DIR/*.txt; drop --prompts/--coco-captions"
        )
    elif sample_size is not None:
        raise ValueError("--sample-size sets the size a --model draws at; --samples are drawn")
    else:
        report["prompts"] = {"source": f"captions in {samples}"}
    if n is not None and n < 2 and reference:
        raise ValueError("FID needs at least 2 samples (--num-samples)")
    pipe = None
    if model:
        from unclip.pipeline.auto import load_pipeline
        from unclip.utils.precision import dtype_name

        hub = {"revision": revision, "cache_dir": cache_dir}
        pipe = load_pipeline(model, **hub, autocast_dtype=autocast_dtype)
        pipe.to(device)
        settings = pipe.sampling_settings(sampling)  # a bad override fails before any work
        report["sampling"] = {k: vars(v) for k, v in settings.items()}
        # resolved on the device ("auto" is bfloat16 on some CPUs, float32 on others)
        report["autocast_dtype"] = dtype_name(pipe.autocast_dtype)
        drawn = pipe.resolution
        if sample_size is not None:
            drawn = _check_sample_size(pipe, sample_size)
            report["sample_size"] = sample_size
        if drawn < resolution:
            warn.append(f"samples are {drawn}px, upsampled to {resolution}px for evaluation")
    clip, clip_name = _load_clip(clip_model, clip_pretrained, pipe)
    if clip is not None:
        clip.to(device)
        clip_id = {"name": clip_name, "fingerprint": M.clip_fingerprint(clip)}
    elif clip_fid:
        raise ValueError("--clip-fid needs a CLIP: pass --model or --clip-model")
    if clip_fid and not reference:
        raise ValueError("--clip-fid needs --reference (CLIP features of the reference set)")

    inception = None
    ref_meta: dict = {}  # the reference set's metadata, read with --reference
    if reference:
        inception, inc_id = M.load_inception(inception_weights, inception_feature)
        inception.to(device)
        if not inc_id["comparable"]:
            warn.append(
                f"FID uses {inc_id['name']}, {inc_id['feature']}-d: "
                "NOT comparable with published FID"
            )
        cache = reference_cache or out / "reference_stats.npz"
        min_count = 0 if allow_small_reference else (n or 0)
        ref_meta, ref = M.reference_stats(
            reference,
            cache,
            resolution,
            inception,
            inc_id,
            clip if clip_fid else None,
            clip_id if clip_fid else None,
            batch_size,
            min_count,
            progress,
        )
        skipped["unreadable_reference_images"] = ref_meta.get("skipped", 0)
    scorer = SampleScorer(
        inception, clip, clip_fid, shapes, out / "samples" if save_samples else None
    )
    if pipe is not None:
        assert prompts is not None and n is not None  # set above with the model
        batches = _iter_generated(
            pipe,
            prompts,
            n,
            seed,
            batch_size,
            resolution,
            sampling,
            progress,
            None if sample_size is None else {"height": sample_size, "width": sample_size},
        )
    else:
        bad: list = []
        batches = _iter_folder(Path(samples), n, resolution, batch_size, bad, progress)
    for images, caps in batches:
        scorer.add(images, caps)
    if pipe is None:
        skipped["unreadable_samples"] = len(bad)
        if not scorer.captions:
            raise ValueError(
                f"no readable images in samples folder {samples} ({len(bad)} unreadable)"
            )
        if reference and ref_meta.get("count") is not None and not allow_small_reference:
            M.check_reference_count(ref_meta["count"], len(scorer.captions), reference)
    n = len(scorer.captions)
    report.update(num_samples=n, batch_size=batch_size, skipped=skipped)
    if pipe is not None:
        report["sample_seeds"] = (
            "sample i: torch.Generator seeded with unclip.sampling.utils.sample_seed(seed, i), "
            "prompt i mod P"
        )
    if skipped.get("blank_prompt_lines"):
        warn.append(f"{skipped['blank_prompt_lines']} blank lines in the prompt file were skipped")
    if skipped.get("unreadable_samples") or skipped.get("unreadable_reference_images"):
        warn.append("some images could not be read and were skipped (see 'skipped')")

    if inception is not None:
        mu, sigma = scorer.inc_stats.mu_sigma()
        few = n < M.MIN_COMPARABLE_SAMPLES
        if few:
            warn.append(
                f"FID on {n} samples (fewer than {M.MIN_COMPARABLE_SAMPLES}) is biased upwards and "
                "noisy: NOT comparable with published FID (which uses tens of thousands); compare "
                "it only with runs of the same sample count"
            )
        report["fid"] = {
            "value": M.frechet_distance(mu, sigma, ref["mu"], ref["sigma"]),
            "inception": inc_id["name"],
            "inception_sha256": inc_id["sha256"],
            "feature": inc_id["feature"],
            "inception_verified": inc_id["verified"],
            "comparable": inc_id["comparable"] and not few,
            "few_samples": few,
            "reference": str(reference),
            "reference_count": ref_meta.get("count"),
        }
    else:
        warn.append("FID not computed: no --reference")
    if clip is not None:
        report["clip_score"] = {
            "model": clip_name,
            **M.clip_score_summary(torch.cat(scorer.cosines)),
        }
        if clip_fid:
            mu, sigma = scorer.clip_stats.mu_sigma()
            report["clip_fid"] = {
                "value": M.frechet_distance(mu, sigma, ref["clip_mu"], ref["clip_sigma"]),
                "model": clip_name,
            }
    else:
        report["clip_score"] = {"not_computed": "no CLIP: pass --model or --clip-model"}
    if shapes:
        report["shapes"] = scorer.shapes_report()
        if resolution < 64:
            warn.append(f"shapes detection is only reliable from 64px; evaluated at {resolution}px")
    report["warnings"] = warn

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report_markdown(report), encoding="utf-8")
    (out / "prompts.txt").write_text("\n".join(scorer.captions) + "\n", encoding="utf-8")
    image_grid(scorer.grid, background=0).save(out / "grid.png")
    return report
