"""Train the token families through the loop every stage uses
(:class:`~unclip.train.loop.TrainLoop`: checkpoints, exact resume, EMA, logging, export):

    unclip train-tokenizer configs/tiny/dvae.yaml        # → <output_dir>/final/tokenizer
    unclip train-tokens configs/tiny/dalle.yaml          # → final/transformer, final/pipeline

:class:`TokenizerTask`: the dVAE's negative relaxed ELB (gumbel noise from the micro-batch's first
sample generator, temperature and KL weight from :func:`~unclip.nets.dvae.dvae_schedule` at the
loop's step) or the VQGAN's reconstruction + codebook + commitment (+ perceptual) loss. Every log
step it also reports what the tokenizer does at inference, on the step's last micro-batch: the
round trip's mean squared error (``roundtrip_mse``, images in [-1, 1] → hard tokens → images) and
the share of the codebook its tokens use (``codebook_usage``); for the dVAE also how widely its
posterior spreads (``posterior_perplexity``: ``exp`` of the entropy of the posterior averaged over
the batch's tokens, the number of codes in effective use; ``token_perplexity``: ``exp`` of the
mean per-token entropy, near 1 once each token commits to one code), to see a collapse coming.

:class:`TokenModelTask`: each batch's images are tokenized by the frozen tokenizer and its captions
by the transformer's caption BPE; the loss is the transformer's own (DALL-E: text and image
cross-entropies weighted 1/8 and 7/8; Mega: image cross-entropy), with ``train.text_drop_prob`` of
the captions replaced by the empty caption (drawn from the micro-batch's first sample generator,
so resume is exact).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Optional, Union, cast

import torch

from unclip.nets.dalle_transformer import DalleTransformer
from unclip.nets.dvae import DVAE, dvae_schedule
from unclip.nets.mega_transformer import MegaTransformer
from unclip.nets.token_components import (
    WEIGHTS_FILE,
    load_tokenizer,
    save_component,
    tokenizer_facts,
)
from unclip.train import distributed as dist_utils
from unclip.train.loop import TrainLoop
from unclip.train.run_folder import releases_folder
from unclip.train.token_config import TokenizerTrainConfig, TokenModelTrainConfig

__all__ = [
    "TokenizerTask",
    "posterior_metrics",
    "TokenModelTask",
    "train_tokenizer",
    "train_token_model",
]

logger = logging.getLogger("unclip.train")


class _Averages:
    """Running sums of named scalars between two log steps."""

    def __init__(self):
        self.sums: dict = {}
        self.count = 0

    def add(self, **values) -> None:
        for k, v in values.items():
            v = v.detach() if isinstance(v, torch.Tensor) else v
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        self.count += 1

    def pop(self) -> dict:
        out = {k: v / max(1, self.count) for k, v in self.sums.items()}
        self.sums, self.count = {}, 0
        return out


@torch.no_grad()
def roundtrip_metrics(tokenizer, images: torch.Tensor, num_codes: int) -> dict:
    """``roundtrip_mse`` (images ``[B, 3, H, W]`` in [-1, 1] → hard tokens → images) and
    ``codebook_usage`` (distinct codes among the tokens / ``num_codes``)."""
    was_training = tokenizer.training
    tokenizer.eval()
    try:
        tokens = tokenizer.encode(images)
        # a diverging run's NaN shows in its logged roundtrip_mse rather than stopping it here
        recon = tokenizer.decode(tokens, check=False)
    finally:
        tokenizer.train(was_training)
    return {
        "roundtrip_mse": float(((recon.float() - images.float()) ** 2).mean()),
        "codebook_usage": tokens.unique().numel() / num_codes,
    }


@torch.no_grad()
def posterior_metrics(logits: torch.Tensor) -> dict:
    """``posterior_perplexity`` and ``token_perplexity`` (see the module doc) of the dVAE's code
    logits ``[B, K, h, w]``."""
    log_q = logits.float().log_softmax(1).movedim(1, -1).flatten(0, -2)  # [tokens, K]
    q = log_q.exp()
    mean_q = q.mean(0)
    batch_entropy = -(mean_q * mean_q.clamp_min(1e-30).log()).sum()
    token_entropy = -(q * log_q).sum(1).mean()
    return {
        "posterior_perplexity": float(batch_entropy.exp()),
        "token_perplexity": float(token_entropy.exp()),
    }


class TokenizerTask:
    """The tokenizer's training task (see the module doc)."""

    name = "tokenizer"

    def __init__(self, cfg: TokenizerTrainConfig, loop: TrainLoop):
        self.cfg, self.loop = cfg, loop
        self.kind = cfg.tokenizer.type
        vqgan = cfg.tokenizer.vqgan  # set when type is vqgan (TokenizerConfig checks)
        self.vq_loss = vqgan.build_loss() if self.kind == "vqgan" and vqgan is not None else None
        if self.vq_loss is not None:
            self.vq_loss.to(loop.device)
        self.avg = _Averages()
        self.last_images: Optional[torch.Tensor] = None

    def schedule(self):
        """The dVAE's temperature and KL weight at the loop's current step."""
        return dvae_schedule(
            self.loop.state.step,
            self.cfg.train.max_steps,
            tau_end=self.cfg.tau_end,
            kl_weight_end=self.cfg.kl_weight_end,
            tau_steps=self.cfg.tau_steps,
            kl_steps=self.cfg.kl_steps,
        )

    def loss(self, model, batch: dict, generators) -> torch.Tensor:
        images = batch["image"].to(self.loop.device)
        self.last_images = images
        if self.kind == "dvae":
            s = self.schedule()
            out = model(images, s.temperature, s.kl_weight, generators[0])
            self.avg.add(
                recon=out.recon,
                kl=out.kl,
                temperature=s.temperature,
                kl_weight=s.kl_weight,
            )
            return out.loss
        assert self.vq_loss is not None  # the other kind, vqgan, builds its loss in __init__
        terms = self.vq_loss(model, images)
        self.avg.add(**{k: v for k, v in terms.items() if k not in ("loss", "reconstruction")})
        return terms["loss"]

    def log_metrics(self) -> dict:
        out = self.avg.pop()
        if self.last_images is not None:
            # encode and decode are not the training forward: under FSDP2 their weights are
            # shards until gathered (every process logs, so every process gathers)
            with dist_utils.root_unsharded(self.loop.unwrapped):
                out.update(
                    roundtrip_metrics(
                        self.loop.unwrapped,
                        self.last_images,
                        self.cfg.tokenizer.model.num_codes,
                    )
                )
                if self.kind == "dvae":
                    dvae = cast(DVAE, self.loop.unwrapped)
                    with torch.no_grad():
                        logits = dvae.logits(self.last_images)
                    out.update(posterior_metrics(logits))
        return out


@releases_folder
def train_tokenizer(
    cfg: TokenizerTrainConfig,
    resume: Optional[str] = None,
    max_steps_this_run: Optional[int] = None,
    overwrite: bool = False,
) -> int:
    """Train the tokenizer ``cfg`` describes; at ``train.max_steps`` export
    ``<output_dir>/final/tokenizer`` (EMA weights). Arguments as
    :func:`unclip.train.prior.train_prior`. Returns 0."""
    loop = TrainLoop(cfg, resume=resume, max_steps_this_run=max_steps_this_run, overwrite=overwrite)
    torch.manual_seed(cfg.train.seed)
    with torch.device(loop.device):
        model = cfg.tokenizer.build()
    # a sharded run's export builds a plain copy to hold the gathered weights
    dist_utils.remember_build(model, cfg.tokenizer.build)
    if cfg.train.gradient_checkpointing:
        logger.warning("the tokenizers have no gradient checkpointing; ignoring the option")
    model = loop.prepare(model)
    model.train()
    task = TokenizerTask(cfg, loop)
    data = loop.batches(cfg.data, cfg.data.resolution)
    if loop.run(task, data):
        out = loop.export(
            "tokenizer", lambda m, p: save_component(m, p, "tokenizer", cfg.tokenizer)
        )
        if loop.accelerator.is_main_process:
            print(f"exported tokenizer to {out}")
    loop.finish()
    return 0


class TokenModelTask:
    """The token transformer's training task (see the module doc)."""

    name = "transformer"

    def __init__(self, cfg: TokenModelTrainConfig, tokenizer, loop: TrainLoop):
        self.cfg, self.tokenizer, self.loop = cfg, tokenizer, loop
        self.avg = _Averages()

    def loss(self, model, batch: dict, generators) -> torch.Tensor:
        device = self.loop.device
        with torch.no_grad():
            image_tokens = self.tokenizer.encode(batch["image"].to(device)).flatten(1)
        ids, mask = self.cfg.transformer.caption_ids(batch["caption"])
        # the network this task's train_token_model built and prepared
        net = cast(Union[DalleTransformer, MegaTransformer], self.loop.unwrapped)
        out = net.loss(
            ids.to(device),
            mask.to(device),
            image_tokens,
            cond_drop_prob=self.cfg.train.text_drop_prob,
            generator=generators[0],
            forward=model,
        )
        if isinstance(out, torch.Tensor):
            self.avg.add(image_loss=out.detach())
            return out
        self.avg.add(text_loss=out.text.detach(), image_loss=out.image.detach())
        return out.loss

    def log_metrics(self) -> dict:
        return self.avg.pop()


def tokenizer_fingerprint(cfg: TokenModelTrainConfig) -> str:
    """The SHA-256 of the weights file of ``cfg.tokenizer`` (a folder :func:`load_tokenizer`
    accepted); a ``tokenizer_sha256`` the config gives must be it."""
    h = hashlib.sha256()
    with open(Path(cfg.tokenizer) / WEIGHTS_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    if cfg.tokenizer_sha256 is not None and cfg.tokenizer_sha256 != digest:
        raise ValueError(
            f"tokenizer_sha256={cfg.tokenizer_sha256[:12]}… but the tokenizer {cfg.tokenizer} "
            f"has sha256 {digest[:12]}…: give the tokenizer the config names, or set "
            "tokenizer_sha256=null"
        )
    return digest


def _checkpoint_resumed(cfg: TokenModelTrainConfig, resume: str) -> Optional[Path]:
    """The checkpoint ``--resume`` names: a folder, or for ``latest`` the newest finished one
    (manifest written; the loop also checks its files, and skips a damaged one for an older one
    of the same run)."""
    from unclip.train import checkpoint as ckpt

    if resume != "latest":
        return Path(resume)
    done = [
        p
        for p in ckpt.completed_checkpoints(Path(cfg.train.output_dir) / "checkpoints")
        if (p / ckpt.MANIFEST).is_file()
    ]
    return done[-1] if done else None


def check_resumed_tokenizer(cfg: TokenModelTrainConfig, resume: str) -> None:
    """Refuse a resume over another tokenizer than the checkpoint's run trained over (its codes
    are what the transformer learned to predict): the checkpoint's ``config.yaml`` records the
    tokenizer's fingerprint (``tokenizer_sha256``). Checkpoints written before the fingerprint
    was recorded are not checked."""
    import yaml

    path = _checkpoint_resumed(cfg, resume)
    saved = path / "config.yaml" if path is not None else None
    if saved is None or not saved.is_file():
        return  # nothing to resume, or not a checkpoint: the loop says so
    try:
        recorded = yaml.safe_load(saved.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError):
        return  # a damaged checkpoint: the loop's manifest check names it
    digest = recorded.get("tokenizer_sha256") if isinstance(recorded, dict) else None
    if digest is None or digest == cfg.tokenizer_sha256:
        return
    raise ValueError(
        f"checkpoint {path} was trained over the tokenizer {recorded.get('tokenizer')} (sha256 "
        f"{str(digest)[:12]}…), but tokenizer={cfg.tokenizer} has sha256 "
        f"{str(cfg.tokenizer_sha256)[:12]}…: resume with the tokenizer the run started with, or "
        "start afresh with --overwrite"
    )


@releases_folder
def train_token_model(
    cfg: TokenModelTrainConfig,
    resume: Optional[str] = None,
    max_steps_this_run: Optional[int] = None,
    overwrite: bool = False,
) -> int:
    """Train the token transformer ``cfg`` describes over the frozen tokenizer ``cfg.tokenizer``;
    at ``train.max_steps`` export ``<output_dir>/final/transformer`` (EMA weights) and the whole
    token pipeline as ``<output_dir>/final/pipeline`` (loadable with
    :func:`unclip.pipeline.auto.load_pipeline`). Returns 0."""
    tokenizer, tok_cfg = load_tokenizer(cfg.tokenizer)
    facts, model_cfg = tokenizer_facts(tok_cfg), cfg.transformer.model
    if facts["grid"] != model_cfg.grid or facts["num_codes"] != model_cfg.image_vocab_size:
        raise ValueError(
            f"the tokenizer {cfg.tokenizer} makes {facts['grid']}×{facts['grid']} tokens over "
            f"{facts['num_codes']} codes; set transformer.{cfg.transformer.type}.grid="
            f"{facts['grid']} and image_vocab_size={facts['num_codes']}"
        )
    if facts["image_size"] != cfg.data.resolution:
        raise ValueError(
            f"data.resolution={cfg.data.resolution} but the tokenizer works at "
            f"{facts['image_size']} px; set data.resolution={facts['image_size']}"
        )
    # recorded in the run's config.yaml and every checkpoint's (the caller's cfg is left as is)
    cfg = dataclasses.replace(cfg, tokenizer_sha256=tokenizer_fingerprint(cfg))
    if resume:
        check_resumed_tokenizer(cfg, resume)
    loop = TrainLoop(cfg, resume=resume, max_steps_this_run=max_steps_this_run, overwrite=overwrite)
    torch.manual_seed(cfg.train.seed)
    tokenizer = tokenizer.to(loop.device).requires_grad_(False)
    with torch.device(loop.device):
        net = cfg.transformer.build()
    dist_utils.remember_build(net, cfg.transformer.build)  # as train_tokenizer does
    net.gradient_checkpointing = cfg.train.gradient_checkpointing
    model = loop.prepare(net)
    model.train()
    task = TokenModelTask(cfg, tokenizer, loop)
    data = loop.batches(cfg.data, cfg.data.resolution)
    if loop.run(task, data):
        out = loop.export(
            "transformer", lambda m, p: save_component(m, p, "transformer", cfg.transformer)
        )
        if loop.accelerator.is_main_process:
            from unclip.pipeline.token_pipeline import TokenPipeline

            pipe = TokenPipeline.from_components(
                cfg.tokenizer,
                out,
                sampling=cfg.sampling,
                rerank_clip=cfg.rerank_clip,
                upsamplers=cfg.upsamplers,
            )
            folder = loop.write_folder(out.parent / "pipeline", pipe.save_pretrained)
            print(f"exported the {pipe.family} pipeline to {folder}")
    loop.finish()
    return 0
