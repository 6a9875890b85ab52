"""Train the autoregressive prior (``prior.type: ar``; paper §2.1) through ``unclip train-prior``.

    unclip train-prior configs/tiny/prior_ar.yaml train.max_steps=200

Before the first step the PCA and the bucket edges are fitted on the first
``prior.ar.fit_samples`` training embeddings (the same samples on every process, so every process
fits the same) and stored in the model's buffers; a resumed run (or one started from
``train.init_weights``) keeps those of its checkpoint instead of refitting. Per step: encode the
captions with the frozen CLIP, quantise the image embeddings into codes, compute each pair's
dot-product token, drop the caption for ``train.text_drop_prob`` of the samples (the empty
caption's encoding and the "no caption" dot-product token: the unconditional input of guidance),
and minimise the cross-entropy of every code given the codes before it.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from unclip.nets.clip import CLIP
from unclip.nets.text_encoding import TextEncoding
from unclip.train.config import StageConfig
from unclip.train.data.loader import batches, make_stream
from unclip.train.loop import TrainLoop
from unclip.train.run_folder import releases_folder
from unclip.train.text_cache import TextEncodingCache

__all__ = ["ARPriorTask", "ar_prior_loss", "fit_embeddings", "fit_ar_prior", "train_ar_prior"]

logger = logging.getLogger("unclip.train")


def fit_embeddings(cfg: StageConfig, clip: CLIP, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image_embed [n, D], text_embed [n, D])`` of the first ``n = prior.ar.fit_samples``
    training samples, read as rank 0 of one process reads them (identical on every process)."""
    from unclip.train.prior_batches import embed_batch

    ar = cfg.prior_section.ar
    assert ar is not None  # PriorConfig gives an "ar" prior its options
    n = ar.fit_samples
    stream = make_stream(
        cfg.data, resolution=clip.image_size, seed=cfg.train.seed, rank=0, world_size=1
    )
    images, texts, have = [], [], 0
    with torch.no_grad():
        for batch in batches(stream, min(256, n)):
            image_embed, text = embed_batch(clip, batch, device)
            images.append(image_embed.float().cpu())
            texts.append(text.text_embed.float().cpu())
            have += len(image_embed)
            if have >= n:
                break
    return torch.cat(images)[:n], torch.cat(texts)[:n]


def fit_ar_prior(model, cfg: StageConfig, clip: CLIP, device) -> None:
    """Fit ``model``'s PCA and bucket edges on the training embeddings unless it holds a fit
    already (from a checkpoint or ``train.init_weights``)."""
    if model.is_fitted:
        logger.info("AR prior: keeping the PCA and bucket edges of the loaded weights")
        return
    image_embed, text_embed = fit_embeddings(cfg, clip, device)
    model.fit_quantizer(image_embed, text_embed)
    z = model.project(image_embed.to(model.pca_mean))
    kept = float(z.var(0).sum() / (image_embed - image_embed.mean(0)).var(0).sum())
    logger.info(
        "AR prior: fitted %d principal components (%.1f%% of the variance) on %d embeddings",
        model.pca_dims,
        100 * kept,
        len(image_embed),
    )


def ar_prior_loss(
    model, batch: dict, clip: CLIP | TextEncodingCache, null: TextEncoding, gens, cfg, device
):
    """Cross-entropy of the codes of one micro-batch, with caption dropout."""
    from unclip.train.prior_batches import embed_batch

    prior = model.module if hasattr(model, "module") else model
    image_embed, text = embed_batch(clip, batch, device)
    b = image_embed.shape[0]
    codes = prior.encode(image_embed)
    dot = prior.dot_token(text.text_embed, image_embed)  # the true alignment, before dropout
    drop = torch.stack([torch.rand((), generator=g) for g in gens]) < cfg.train.text_drop_prob
    drop = drop.to(device)
    nb = null.repeat_interleave(b).to(device)
    text = TextEncoding(
        torch.where(drop[:, None], nb.text_embed, text.text_embed),
        torch.where(drop[:, None, None], nb.text_tokens, text.text_tokens),
        torch.where(drop[:, None], nb.text_mask, text.text_mask),
    )
    dot = torch.where(drop, torch.full_like(dot, prior.null_dot), dot)
    logits = model(codes, text, dot)
    return F.cross_entropy(logits.float().flatten(0, 1), codes.flatten())


class ARPriorTask:
    """The AR prior's training task: :func:`ar_prior_loss` on each micro-batch."""

    name = "prior"

    def __init__(self, cfg: StageConfig, clip: CLIP, device):
        self.cfg, self.clip, self.device = cfg, clip, device
        self.null = clip.encode_text([""])
        self.text = TextEncodingCache(clip, cfg.data.batch_size, cfg.train.text_cache_mb)

    def loss(self, model, batch: dict, generators) -> torch.Tensor:
        return ar_prior_loss(model, batch, self.text, self.null, generators, self.cfg, self.device)


@releases_folder
def train_ar_prior(
    cfg: StageConfig,
    resume: Optional[str] = None,
    max_steps_this_run: Optional[int] = None,
    overwrite: bool = False,
) -> int:
    """Train the AR prior described by ``cfg`` (stage ``prior``, ``prior.type: ar``); arguments
    and export as :func:`unclip.train.prior.train_prior`, which calls this for such a config."""
    if cfg.stage != "prior" or cfg.prior_section.type != "ar":
        raise ValueError("train_ar_prior needs a stage 'prior' config with prior.type: ar")
    loop = TrainLoop(cfg, resume=resume, max_steps_this_run=max_steps_this_run, overwrite=overwrite)
    torch.manual_seed(cfg.train.seed)
    with torch.device(loop.device):
        clip = CLIP.from_config(cfg.clip)
        model = cfg.prior_section.build(clip)
    if cfg.train.gradient_checkpointing:
        logger.warning("the AR prior has no gradient checkpointing; ignoring the option")
    model = loop.prepare(model)  # loads a checkpoint's (or init_weights') fit, if any
    fit_ar_prior(loop.unwrapped, cfg, clip, loop.device)
    model.train()
    task = ARPriorTask(cfg, clip, loop.device)
    data = loop.batches(cfg.data, clip.image_size)
    if loop.run(task, data):
        loop.export_stage("prior", clip)
    loop.finish()
    return 0
