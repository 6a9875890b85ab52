"""The decoder half of ``bench_peers_quality.py``: unclip's shapes decoder and a DALLE2-pytorch
decoder of the same size trained for the same CPU budget, scored at marks of their runs.

Both are 32 px decoders conditioned on the bundled shapes CLIP's image embedding and its caption
token states. unclip: ``configs/shapes/decoder.yaml`` as it is (v-prediction, min-SNR-5 weighting,
its UNet with coordinate channels), trained by ``train_decoder`` from the shapes world it renders
and CLIP-encodes in the step. DALLE2-pytorch: its ``Unet`` shaped like unclip's (32/64/128 channels,
one resnet block per level, self-attention at 16 and 8 px; parameter counts reported) in its
``Decoder`` and ``DecoderTrainer``, with its best options for this task: v-prediction and its P2
loss weighting (γ = 1, what it recommends), the cosine schedule, no learned variance (both sample
with DDIM); it is handed the first ``rows`` scenes of unclip's own training stream, rendered and
CLIP-encoded beforehand, in a fresh order each epoch.

Scoring: ``n`` held-out single-object prompts (``unclip shapes-eval``'s, prompt seed 1000), each
decoded once from the true CLIP image embedding of its rendered scene and its caption, DDIM 25
steps, guidance 2, by both; the shapes detector's "all right" fraction (colour, shape, size,
position and one object) as ``unclip shapes-eval`` reports it, each part's fraction, and the mean
of the five parts (a graded figure while whole images are still rarely right).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

RECIPE = {
    "batch_size": 16,
    "lr": 6e-4,
    "weight_decay": 0.06,
    "warmup_steps": 200,
    "max_grad_norm": 1.0,
    "ema_decay": 0.999,
    "text_drop_prob": 0.2,
    "image_embed_drop_prob": 0.2,
}
# the DALLE2-pytorch Unet of about the parameter count of configs/shapes/decoder.yaml's decoder
DALLE2_UNET = dict(
    dim=32,
    dim_mults=(1, 2, 4),
    num_resnet_blocks=(1, 1, 1),
    self_attn=(False, True, True),
    attn_heads=4,
    attn_dim_head=32,
)
DALLE2_DECODER = dict(
    timesteps=1000, beta_schedule="cosine", predict_v=True, p2_loss_weight_gamma=1.0,
    learned_variance=False,
)  # fmt: skip
SAMPLING = {"steps": 25, "guidance_scale": 2.0}
PROMPT_SEED = 1000  # unclip shapes-eval's default held-out prompts


def _encode_text(clip, captions: list[str]):
    """CLIP text encodings with the token states zeroed beyond the caption (DALLE2 reads zeros as
    padding)."""
    enc = [clip.encode_text(captions[i : i + 256]) for i in range(0, len(captions), 256)]
    return torch.cat([e.text_tokens * e.text_mask[..., None] for e in enc])


def prepare(work: Path, rows: int, n_eval: int) -> dict:
    """DALLE2's training tensors (``rows`` scenes of unclip's decoder stream) and the held-out
    single-object prompts with their true image embeddings, saved for the workers."""
    from bench_ar_prior import stage_config

    from unclip.nets.clip import CLIP
    from unclip.shapes.evaluate import heldout_samples
    from unclip.train.data.loader import make_batches
    from unclip.utils.images import pil_to_tensor

    cfg = stage_config("decoder", work / "unused", ["data.batch_size=256"])
    clip = CLIP.from_config(cfg.clip)
    images, captions = [], []
    for batch in make_batches(
        cfg.data, resolution=cfg.data.resolution, seed=cfg.train.seed, rank=0, world_size=1
    ):
        images.append(batch["image"])
        captions += batch["caption"]
        if len(captions) >= rows:
            break
    images, captions = torch.cat(images)[:rows], captions[:rows]
    unique = sorted(set(captions))
    index = {c: i for i, c in enumerate(unique)}
    samples = heldout_samples(n_eval, PROMPT_SEED, cfg.data.resolution)[:n_eval]  # single only
    held = [s.caption for s in samples]
    with torch.no_grad():
        image_embed = torch.cat(
            [clip.encode_image(images[i : i + 256]) for i in range(0, rows, 256)]
        )
        truth = clip.encode_image(torch.stack([pil_to_tensor(s.image) for s in samples]))
        tokens, eval_tokens = _encode_text(clip, unique), _encode_text(clip, held)
    torch.save(
        {
            # [0, 1] as DALLE2's decoder takes them, stored as bytes
            "images": ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8),
            "image_embed": image_embed.float(),
            "caption_index": torch.tensor([index[c] for c in captions]),
            "text_tokens": tokens,
        },
        work / "dalle2_decoder_data.pt",
    )
    torch.save(
        {"captions": held, "truth": truth.float(), "text_tokens": eval_tokens},
        work / "decoder_eval.pt",
    )
    return summary(work)


def summary(work: Path) -> dict:
    """What the decoder's data was, read back from the tensors :func:`prepare` saved."""
    data = torch.load(work / "dalle2_decoder_data.pt")
    return {
        "rows": len(data["images"]),
        "distinct_captions": len(data["text_tokens"]),
        "eval_prompts": len(torch.load(work / "decoder_eval.pt")["captions"]),
    }


PARTS = ("color", "shape", "size", "position", "objects")


def single_scores(images_uint8, captions) -> dict:
    """The detector's single-object scores: ``single_all`` (every part right, the figure
    ``unclip shapes-eval`` reports), each part's fraction, and their mean ``single_parts`` (a
    graded figure for models not yet getting whole images right)."""
    from unclip.shapes.detector import evaluate_images

    single = evaluate_images(list(images_uint8), captions)["single"]
    parts = {k: single[k] for k in PARTS}
    return {
        "single_all": single["all"],
        "single_parts": sum(parts.values()) / len(parts),
        "single": parts,
    }


def _point(mark: dict, images, captions, seconds: float) -> dict:
    return {
        "step": mark["step"],
        "cpu_seconds": mark["cpu_seconds"],
        **single_scores(images, captions),
        "seconds_per_image": seconds / len(captions),
    }


def rescore(work: Path, lib: str) -> dict:
    """Score again the weights a finished run kept (``decoder_<lib>.json`` in ``work``)."""
    row = json.loads((work / f"decoder_{lib}.json").read_text())
    folder = work / ("unclip_decoder/marks" if lib == "unclip" else "d2_marks")
    marks = [{**m, "path": str(folder / f"step_{m['step']:07d}.pt")} for m in row["curve"]]
    row["curve"] = score_unclip(work, marks) if lib == "unclip" else score_dalle2(work, marks)
    return row


# --------------------------------------------------------------------------------------- unclip
UNCLIP_SAMPLING = {"scheduler": "ddim", "best_of": 1, **SAMPLING}


def score_unclip(work: Path, marks: list[dict]) -> list[dict]:
    import common

    from unclip.nets.decoder import UnCLIPDecoder
    from unclip.pipeline.pipeline import UnCLIPPipeline

    folder = work / "unclip_decoder" / "run" / "final" / "decoder"
    decoder = UnCLIPDecoder.from_pretrained(folder).eval()
    meta = json.loads((folder / "unclip_stage.json").read_text())
    ev = torch.load(work / "decoder_eval.pt")
    clip = common.fp32_pipeline().clip
    curve = []
    for mark in marks:
        decoder.load_state_dict(torch.load(mark["path"]))
        pipe = UnCLIPPipeline(clip, None, decoder, [], diffusion={"decoder": meta["diffusion"]})
        n = len(ev["captions"])
        t0 = time.perf_counter()
        images = []
        for s in range(0, n, 32):
            caps = ev["captions"][s : s + 32]
            res = pipe(
                caps,
                generator=[torch.Generator().manual_seed(s + i) for i in range(len(caps))],
                sampling={"decoder": UNCLIP_SAMPLING},
                output_type="pt",
                progress=False,
                image_embeds=ev["truth"][s : s + 32],
                last_stage="decoder",
            )
            # output_type "pt" is in [0, 1], as DALLE2's samples
            x = (res.images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
            images += [i.numpy() for i in x]
        curve.append(_point(mark, images, ev["captions"], time.perf_counter() - t0))
        common.log(f"unclip decoder at step {mark['step']}: {curve[-1]}")
    return curve


def run_unclip(work: Path, budget: float, calib: int) -> dict:
    from bench_ar_prior import steps_for_budget, train
    from peers_marks import CpuClock, mark_steps, unclip_marks

    from unclip.nets.decoder import UnCLIPDecoder

    overrides = [f"data.batch_size={RECIPE['batch_size']}"] + [
        f"train.{k}={v}" for k, v in RECIPE.items() if k != "batch_size"
    ]
    plan = steps_for_budget("decoder", work / "unclip_decoder", budget, calib, overrides)
    out = work / "unclip_decoder" / "run"
    clock, marks = CpuClock(), []
    with unclip_marks(mark_steps(plan["steps"]), out.parent / "marks", clock, marks):
        clock.start()
        cpu, wall, records = train("decoder", out, [f"train.max_steps={plan['steps']}", *overrides])
    folder = out / "final" / "decoder"
    decoder = UnCLIPDecoder.from_pretrained(folder)
    meta = json.loads((folder / "unclip_stage.json").read_text())
    curve = score_unclip(work, marks)
    return {
        **plan,
        "params": sum(p.numel() for p in decoder.parameters()),
        "train_cpu_seconds": cpu,
        "train_wall_seconds": wall,
        "loss_curve": [(r["step"], r["loss"]) for r in records if "loss" in r][
            :: max(1, len(records) // 200)
        ],
        "curve": curve,
        "sampling": {**UNCLIP_SAMPLING, "diffusion": meta["diffusion"]},
    }


# --------------------------------------------------------------------------------------- DALLE2
def build_dalle2(work: Path, steps: int, data: dict | None = None):
    """DALLE2's decoder and its trainer with a schedule of ``steps``, sized from the data."""
    from dalle2_pytorch import Decoder, DecoderTrainer, Unet
    from peers_marks import dalle2_trainer_settings

    data = data or torch.load(work / "dalle2_decoder_data.pt")
    d = data["image_embed"].shape[1]
    random.seed(0)
    torch.manual_seed(0)
    unet = Unet(
        image_embed_dim=d,
        text_embed_dim=d,
        cond_on_text_encodings=True,
        max_text_len=data["text_tokens"].shape[1],
        **DALLE2_UNET,
    )
    decoder = Decoder(
        unet=unet,
        image_sizes=(data["images"].shape[-1],),
        sample_timesteps=SAMPLING["steps"],
        image_cond_drop_prob=RECIPE["image_embed_drop_prob"],
        text_cond_drop_prob=RECIPE["text_drop_prob"],
        **DALLE2_DECODER,
    )
    trainer = DecoderTrainer(decoder, **dalle2_trainer_settings(RECIPE, steps))
    return decoder, trainer


def run_dalle2(work: Path, budget: float, calib: int) -> dict:
    from peers_marks import epoch_batches, mark_steps, steps_in_budget, train_with_marks

    data = torch.load(work / "dalle2_decoder_data.pt")

    def build(steps: int):
        return build_dalle2(work, steps, data)

    order = torch.Generator().manual_seed(0)

    def train(trainer, steps, marks=(), folder=None):
        indices = epoch_batches(len(data["images"]), RECIPE["batch_size"], order)

        def step():
            idx = next(indices)
            images = data["images"][idx].float() / 255
            tokens = data["text_tokens"][data["caption_index"][idx]]
            loss = trainer(
                images, image_embed=data["image_embed"][idx], text_encodings=tokens, unet_number=1
            )
            trainer.update(1)
            return loss

        ema = trainer.ema_unets[0].ema_model.state_dict
        return train_with_marks(step, ema, steps, marks, folder)

    step_s, fixed, steps = steps_in_budget(
        lambda n: train(build(10 * calib)[1], n)[0], budget, calib
    )
    decoder, trainer = build(steps)
    t0 = time.perf_counter()
    cpu_s, losses, marks = train(trainer, steps, set(mark_steps(steps)), work / "d2_marks")
    wall = time.perf_counter() - t0
    curve = score_dalle2(work, marks, decoder)
    return {
        "cpu_seconds_per_step": step_s,
        "fixed_cpu_seconds": fixed,
        "steps": steps,
        "params": sum(p.numel() for p in decoder.unets[0].parameters()),
        "train_cpu_seconds": cpu_s,
        "train_wall_seconds": wall,
        "loss_curve": losses[:: max(1, len(losses) // 200)],
        "curve": curve,
        "sampling": {"sample_timesteps": SAMPLING["steps"], "cond_scale": 2.0, "ddim_eta": 0.0},
        "options": {**DALLE2_UNET, **DALLE2_DECODER},
    }


def score_dalle2(work: Path, marks: list[dict], decoder=None) -> list[dict]:
    if decoder is None:
        decoder = build_dalle2(work, 1)[0]
    ev = torch.load(work / "decoder_eval.pt")
    unet = decoder.unets[0]
    decoder.eval()
    curve = []
    for mark in marks:
        unet.load_state_dict(torch.load(mark["path"]))
        torch.manual_seed(0)
        t0 = time.perf_counter()
        images = []
        with torch.no_grad():
            for s in range(0, len(ev["captions"]), 32):
                x = decoder.sample(
                    image_embed=ev["truth"][s : s + 32],
                    text_encodings=ev["text_tokens"][s : s + 32],
                    cond_scale=SAMPLING["guidance_scale"],
                )
                x = (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
                images += [i.numpy() for i in x]
        curve.append(_point(mark, images, ev["captions"], time.perf_counter() - t0))
        print(f"dalle2 decoder at step {mark['step']}: {curve[-1]}", flush=True)
    return curve
