"""Train the diffusion prior (CLIP text → CLIP image embedding).

    unclip-train-prior configs/tiny/prior.yaml train.max_steps=200
    accelerate launch train_prior.py configs/prior_vit_l14.yaml --resume latest

Per step: encode captions with the frozen CLIP (text_embed, text_tokens, text_mask) and images (or read
precomputed image embeddings), normalise the image embedding with the stored statistics, drop the
caption for ``train.text_drop_prob`` of the samples (replaced by the empty caption's encoding, the
unconditional input of classifier-free guidance), and regress x_0 (paper §2.2).
"""

from __future__ import annotations

import logging
import sys

import torch

from unclip.clip import FrozenCLIP, TextEncoding
from unclip.config import to_dict, to_yaml
from unclip.diffusion import diffusion_loss, training_scheduler
from unclip.prior import UnCLIPPrior
from unclip.train.data.loader import batches, make_batches, make_stream
from unclip.train.loop import TrainingRun, load_stage_config, stage_argparser

logger = logging.getLogger("unclip.train")

STATS_SAMPLES = 256


def _embed_batch(clip: FrozenCLIP, batch: dict, device) -> tuple[torch.Tensor, TextEncoding]:
    text = clip.encode_text(batch["caption"]).to(device)
    if "image_embed" in batch:
        image_embed = torch.nn.functional.normalize(batch["image_embed"].float(), dim=-1).to(device)
    else:
        image_embed = clip.encode_image(batch["image"].to(device))
    return image_embed, text


def embedding_stats(
    cfg, clip: FrozenCLIP, device, n: int = STATS_SAMPLES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean/std of image embeddings over the first ``n`` samples (identical on all ranks)."""
    if cfg.data.source == "embeddings":
        from pathlib import Path

        import numpy as np

        stats = Path(cfg.data.path) / "stats.npz"
        if stats.is_file():
            with np.load(stats) as z:
                return torch.from_numpy(z["image_mean"]).float(), torch.from_numpy(
                    z["image_std"]
                ).float()
    stream = make_stream(
        cfg.data, resolution=clip.image_size, seed=cfg.train.seed, rank=0, world_size=1
    )
    embeds = []
    for batch in batches(stream, min(64, n)):
        embeds.append(_embed_batch(clip, batch, device)[0].cpu())
        if sum(len(e) for e in embeds) >= n:
            break
    x = torch.cat(embeds)[:n]
    return x.mean(0), x.std(0).clamp_min(1e-4)


def prior_loss(
    model, batch: dict, clip: FrozenCLIP, null: TextEncoding, gens, cfg, noise_sched, device
):
    """x_0-prediction loss of one micro-batch with caption dropout."""
    image_embed, text = _embed_batch(clip, batch, device)
    b = image_embed.shape[0]
    drop = torch.stack([torch.rand((), generator=g) for g in gens]) < cfg.train.text_drop_prob
    drop = drop.to(device)
    nb = null.repeat_interleave(b).to(device)
    text = TextEncoding(
        torch.where(drop[:, None], nb.text_embed, text.text_embed),
        torch.where(drop[:, None, None], nb.text_tokens, text.text_tokens),
        torch.where(drop[:, None], nb.text_mask, text.text_mask),
    )
    prior = model.module if hasattr(model, "module") else model
    x_0 = prior.normalize(image_embed)
    return diffusion_loss(
        lambda x_t, t: model(x_t, t, text),
        x_0,
        noise_sched,
        prediction_type=cfg.diffusion.prediction_type,
        min_snr_gamma=cfg.diffusion.min_snr_gamma,
        generators=gens,
    )


def main(argv=None) -> int:
    args = stage_argparser("unclip-train-prior", __doc__.splitlines()[1]).parse_intermixed_args(
        argv
    )
    cfg = load_stage_config(args, ("prior",))
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    if cfg.diffusion.prediction_type != "sample":
        logger.warning(
            "the paper's prior predicts x_0 (diffusion.prediction_type=sample); using %s",
            cfg.diffusion.prediction_type,
        )
    run = TrainingRun(cfg, resume=args.resume, max_steps_this_run=args.max_steps_this_run)
    torch.manual_seed(cfg.train.seed)
    clip = FrozenCLIP.from_config(cfg.clip).to(run.device)
    fields = {k: v for k, v in to_dict(cfg.prior).items()}
    model = UnCLIPPrior.from_clip(clip, **fields)
    model.transformer.clip_mean.requires_grad_(False)
    model.transformer.clip_std.requires_grad_(False)
    mean, std = embedding_stats(cfg, clip, run.device)
    model.set_embedding_stats(mean, std)
    if cfg.train.gradient_checkpointing:
        logger.warning(
            "PriorTransformer has no gradient checkpointing in diffusers; ignoring the option"
        )
    model = run.prepare(model)
    model.train()
    null = clip.encode_text([""])
    noise_sched = training_scheduler(cfg.diffusion)
    data = make_batches(
        cfg.data,
        resolution=clip.image_size,
        seed=cfg.train.seed,
        rank=run.rank,
        world_size=run.world,
        start=run.state.samples,
    )
    for micro in run.steps(data):
        for batch in micro:
            with run.accumulate():
                gens = run.generators(len(batch["caption"]))
                loss = prior_loss(model, batch, clip, null, gens, cfg, noise_sched, run.device)
                run.backward(loss)
    return run.complete("prior", clip)


if __name__ == "__main__":
    sys.exit(main())
