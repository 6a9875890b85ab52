"""Train the diffusion prior (CLIP text → CLIP image embedding).

    unclip train-prior configs/tiny/prior.yaml train.max_steps=200
    accelerate launch train_prior.py configs/prior_vit_l14.yaml --resume latest

Per step: encode captions with the frozen CLIP (text_embed, text_tokens, text_mask) and images (or
read precomputed image embeddings), normalise the image embedding with the stored statistics, drop
the caption for ``train.text_drop_prob`` of the samples (replaced by the empty caption's encoding,
the unconditional input of classifier-free guidance), and regress x_0 (paper §2.2).

A prior with its own caption transformer (``prior.text_encoder: transformer``) gets the captions'
token ids of its own tokenizer (``TextEncoding.caption_ids``; the empty caption's ids where the
caption is dropped) and the CLIP's pooled text embedding only: the caption cache
(``train.text_cache_mb``) then holds the pooled embeddings alone, not the CLIP's token states.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from unclip.diffusion.loop import diffusion_loss, training_scheduler
from unclip.diffusion.vlb import predicted_x0
from unclip.nets.ar_prior import UnCLIPARPrior
from unclip.nets.clip import CLIP
from unclip.nets.prior import UnCLIPPrior, prior_caption_ids
from unclip.nets.text_encoding import TextEncoding
from unclip.train.config import StageConfig
from unclip.train.data.loader import batches, make_stream
from unclip.train.embed import STATS_FILE, load_stats
from unclip.train.loop import TrainLoop
from unclip.train.optimizers import run_mixed_precision
from unclip.train.prior_batches import embed_batch
from unclip.train.run_folder import releases_folder
from unclip.train.text_cache import TextEncodingCache

__all__ = ["PriorTask", "prior_loss", "embedding_stats", "train_prior", "build_prior_model"]

logger = logging.getLogger("unclip.train")

STATS_SAMPLES = 256


def embedding_stats(
    cfg: StageConfig, clip: CLIP, device, n: int = STATS_SAMPLES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean/std ``[D]`` of the training image embeddings: those ``unclip embed``
    stored beside precomputed embeddings, else estimated over the first ``n`` samples (identical on
    all ranks). With ``prior.embed_scale`` set, the paper's fixed scale instead: mean 0 and std
    ``1 / embed_scale`` in every dimension (no data is read)."""
    scale = getattr(cfg.prior, "embed_scale", None)
    if scale is not None:
        d = clip.embed_dim
        return torch.zeros(d), torch.full((d,), 1.0 / scale)
    path = cfg.data.path  # DataConfig requires it for embeddings
    if cfg.data.source == "embeddings" and path is not None and (Path(path) / STATS_FILE).is_file():
        stats = load_stats(path)
        return (
            torch.from_numpy(stats["image_mean"]).float(),
            torch.from_numpy(stats["image_std"]).float(),
        )
    stream = make_stream(
        cfg.data, resolution=clip.image_size, seed=cfg.train.seed, rank=0, world_size=1
    )
    embeds = []
    for batch in batches(stream, min(64, n)):
        embeds.append(embed_batch(clip, batch, device)[0].cpu())
        if sum(len(e) for e in embeds) >= n:
            break
    x = torch.cat(embeds)[:n]
    return x.mean(0), x.std(0).clamp_min(1e-4)


def prior_loss(
    model,
    batch: dict,
    clip: CLIP | TextEncodingCache,
    null: TextEncoding,
    gens,
    cfg,
    noise_sched,
    device,
    cosines: list | None = None,
):
    """x_0-prediction loss of one micro-batch with caption dropout. ``cosines``: gets the mean
    cosine between the prior's predicted CLIP image embeddings (at the micro-batch's timesteps,
    denormalized) and the true ones, a quality signal the loss alone does not give."""
    image_embed, text = embed_batch(clip, batch, device)
    b = image_embed.shape[0]
    drop = torch.stack([torch.rand((), generator=g) for g in gens]) < cfg.train.text_drop_prob
    drop = drop.to(device)
    nb = null.repeat_interleave(b).to(device)
    prior = model.module if hasattr(model, "module") else model
    text_embed = torch.where(drop[:, None], nb.text_embed, text.text_embed)
    if getattr(prior, "has_text_encoder", False):
        if nb.caption_ids is None:
            raise ValueError(
                "prior_loss: this prior has its own caption transformer; the null encoding needs "
                "the empty caption's caption_ids (null.with_caption_ids(prior.tokenize(['']))"
            )
        ids = prior.tokenize(batch["caption"]).to(device)
        # the prior reads its own caption tokens: the CLIP's token states are not passed on
        text = TextEncoding(
            text_embed,
            text.text_tokens[:, :0],
            text.text_mask[:, :0],
            torch.where(drop[:, None], nb.caption_ids, ids),
        )
    else:
        text = TextEncoding(
            text_embed,
            torch.where(drop[:, None, None], nb.text_tokens, text.text_tokens),
            torch.where(drop[:, None], nb.text_mask, text.text_mask),
        )
    x_0 = prior.normalize(image_embed)

    def denoise(x_t, t):
        out = model(x_t, t, text)
        if cosines is not None:
            with torch.no_grad():
                pred = predicted_x0(noise_sched, x_t, t, out.float(), cfg.diffusion.prediction_type)
                cos = F.cosine_similarity(prior.denormalize(pred.to(out)), image_embed.to(out))
                cosines.append(float(cos.float().mean()))
        return out

    return diffusion_loss(
        denoise,
        x_0,
        noise_sched,
        prediction_type=cfg.diffusion.prediction_type,
        min_snr_gamma=cfg.diffusion.min_snr_gamma,
        timestep_shift=cfg.diffusion.timestep_shift,
        generators=gens,
    )


class PriorTask:
    """The prior's training task: :func:`prior_loss` on each micro-batch."""

    name = "prior"

    def __init__(self, cfg: StageConfig, clip: CLIP, device, mixed_precision: Optional[str] = None):
        self.cfg, self.clip, self.device = cfg, clip, device
        # own caption transformer: its empty caption's ids, and no CLIP token states cached
        own = cfg.prior_section.text_encoder == "transformer"
        self.null = clip.encode_text([""]).with_caption_ids(
            prior_caption_ids(cfg.prior_section, [""])
        )
        self.noise_sched = training_scheduler(cfg.diffusion)
        self.text = TextEncodingCache(
            clip, cfg.data.batch_size, cfg.train.text_cache_mb, tokens=not own
        )
        self.cosines: list[float] = []
        # the precision the run trains in (TrainLoop.mixed_precision): under ``auto`` an
        # ``accelerate launch --mixed_precision bf16`` trains in bf16 whatever the CPU
        mp = mixed_precision or run_mixed_precision(cfg.train.mixed_precision, gpu=False)
        self.plain_attention = torch.device(device).type == "cpu" and mp == "bf16"

    def log_metrics(self) -> dict:
        """``embed_cosine``: the mean cosine between predicted and true image embeddings since
        the last log (the prior's quality besides its loss)."""
        out = {"embed_cosine": sum(self.cosines) / len(self.cosines)} if self.cosines else {}
        self.cosines.clear()
        return out

    def loss(self, model, batch: dict, generators) -> torch.Tensor:
        # on a CPU in bf16, PyTorch's fused attention kernel is slower over the prior's few
        # positions than the plain matmul + softmax path, mostly in its backward
        # (benchmarks/README.md); the kernel chosen here also sets the backward's
        context = (
            sdpa_kernel([SDPBackend.MATH]) if self.plain_attention else contextlib.nullcontext()
        )
        with context:
            return prior_loss(
                model,
                batch,
                self.text,
                self.null,
                generators,
                self.cfg,
                self.noise_sched,
                self.device,
                cosines=self.cosines,
            )


def build_prior_model(cfg: StageConfig, clip: CLIP) -> UnCLIPPrior | UnCLIPARPrior:
    """The prior a ``prior`` stage config trains; the diffusion prior's embedding statistics are
    buffers-like parameters that are set from the data, not trained (the AR prior keeps its fit in
    buffers). ``train.gradient_checkpointing`` checkpoints the blocks of the prior's own caption
    transformer (diffusers' ``PriorTransformer`` has none to checkpoint)."""
    model = cfg.prior_section.build(clip)
    if cfg.prior_section.type == "ar":
        return model
    if cfg.train.gradient_checkpointing and model.has_text_encoder:
        model.enable_gradient_checkpointing()  # the caption transformer's blocks
    model.transformer.clip_mean.requires_grad_(False)
    model.transformer.clip_std.requires_grad_(False)
    return model


@releases_folder
def train_prior(
    cfg: StageConfig,
    resume: Optional[str] = None,
    max_steps_this_run: Optional[int] = None,
    overwrite: bool = False,
) -> int:
    """Train the prior described by ``cfg`` (stage ``prior``; an autoregressive one,
    ``prior.type: ar``, by :func:`unclip.train.ar_prior.train_ar_prior`); when
    ``train.max_steps`` is reached, export ``<output_dir>/final/prior`` and ``final/clip``.
    ``resume``: ``"latest"`` or a checkpoint folder; ``max_steps_this_run``: stop (with a
    checkpoint) after that many steps; ``overwrite``: replace an earlier run in
    ``train.output_dir`` (refused otherwise). Returns 0."""
    if cfg.stage != "prior":
        raise ValueError(f"train_prior needs a stage 'prior' config, got stage {cfg.stage!r}")
    if cfg.prior_section.type == "ar":
        from unclip.train.ar_prior import train_ar_prior

        return train_ar_prior(
            cfg, resume=resume, max_steps_this_run=max_steps_this_run, overwrite=overwrite
        )
    if cfg.diffusion.prediction_type != "sample":
        logger.warning(
            "the paper's prior predicts x_0 (diffusion.prediction_type=sample); using %s",
            cfg.diffusion.prediction_type,
        )
    loop = TrainLoop(cfg, resume=resume, max_steps_this_run=max_steps_this_run, overwrite=overwrite)
    torch.manual_seed(cfg.train.seed)
    with torch.device(loop.device):  # built where it trains: no CPU copy of a large network
        clip = CLIP.from_config(cfg.clip)
        model = build_prior_model(cfg, clip)
    model.set_embedding_stats(*embedding_stats(cfg, clip, loop.device))
    if cfg.train.gradient_checkpointing:
        logger.warning(
            "PriorTransformer has no gradient checkpointing in diffusers; %s",
            "checkpointing the caption transformer only"
            if model.has_text_encoder
            else "ignoring the option",
        )
    loop.prepare(model).train()
    task = PriorTask(cfg, clip, loop.device, loop.mixed_precision)
    data = loop.batches(cfg.data, clip.image_size)
    if loop.run(task, data):
        loop.export_stage("prior", clip)
    loop.finish()
    return 0
