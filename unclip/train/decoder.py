"""Train the base decoder or one upsampler (chosen by the config's ``stage``).

    unclip train-decoder configs/tiny/decoder.yaml train.max_steps=200
    unclip train-decoder configs/tiny/sr32.yaml
    accelerate launch train_decoder.py configs/decoder_64.yaml --resume latest

Decoder (paper §2.1): condition on the frozen CLIP's image embedding of the training image (of the
original image with ``data.clip_view: full``, or precomputed) and the caption (CLIP token states, or
the decoder's own text transformer over its tokens); drop the image embedding for
``train.image_embed_drop_prob`` of the samples (learned null embedding) and the caption for
``train.text_drop_prob`` (empty caption), for classifier-free guidance. With
``decoder.learned_variance`` the loss is the hybrid loss (``diffusion.vlb_weight``).

Upsampler: take a random ``upsampler_train.crop_size`` crop (or the whole image), make its low-res
conditioning by downsampling and corrupting it (``blur`` or ``bsr``), add Gaussian noise of a random
level ``≤ upsampler_train.max_noise_level`` (the level is an input of the network), upsample it back
and concatenate.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch
from accelerate.utils import extract_model_from_parallel
from PIL import Image

from unclip.diffusion.loop import diffusion_loss, training_scheduler
from unclip.nets.attention import explicit_attention
from unclip.nets.autoencoder import LatentSpace, autoencoder_config
from unclip.nets.clip import CLIP
from unclip.nets.decoder import (
    Caption,
    UnCLIPDecoder,
    degrade,
    drop_captions,
    encode_captions,
    upsample_low_res,
)
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.sampling.stages import sample_upsampler
from unclip.train.config import StageConfig
from unclip.train.data.loader import make_batches
from unclip.train.loop import TrainLoop, sample_generators
from unclip.train.optimizers import run_mixed_precision
from unclip.train.repa import (
    RepaDecoder,
    alignment_loss,
    block_output_shape,
    check_sizes,
    clip_features,
    exported_model,
)
from unclip.train.run_folder import releases_folder
from unclip.utils.devices import under_fake_tensors
from unclip.utils.images import image_grid

__all__ = [
    "DecoderTask",
    "UpsamplerTask",
    "decoder_loss",
    "decoder_image_embed",
    "decoder_batches",
    "upsampler_inputs",
    "upsampler_loss",
    "train_decoder",
    "build_image_model",
    "clip_device",
    "frozen_latent_space",
]

logger = logging.getLogger("unclip.train")

#: how many training captions/images a sample grid shows
GRID_SIZE = 8


def decoder_loss(
    model,
    batch,
    clip: CLIP,
    null: Caption,
    gens,
    cfg,
    noise_sched,
    device,
    parts=None,
    latent_space: Optional[LatentSpace] = None,
):
    """Denoising loss of the base decoder on one micro-batch, with condition dropout (``null``:
    the empty caption as the decoder takes captions, :func:`~unclip.nets.decoder.encode_captions`);
    with a ``repa:`` section ``model`` is a :class:`~unclip.train.repa.RepaDecoder` and the
    alignment loss is added (and its value appended to ``parts["repa"]`` if ``parts`` is given).
    A latent decoder denoises ``latent_space``'s latents of the batch's images (the autoencoder
    it holds, :func:`frozen_latent_space`)."""
    images = batch["image"].to(device)
    base: Any = _base_decoder(model)
    if getattr(base, "is_latent", False):
        if latent_space is None:
            raise ValueError(
                "decoder_loss: this is a latent decoder; pass latent_space (its autoencoder, "
                "unclip.train.decoder.frozen_latent_space) or it would denoise pixels"
            )
        images = latent_space.encode(images).float()
        if tuple(images.shape[1:]) != tuple(base.sample_shape):
            raise ValueError(
                f"decoder_loss: latent_space gives latents {tuple(images.shape[1:])} but the "
                f"decoder samples {tuple(base.sample_shape)}; pass the decoder's own autoencoder"
            )
    image_embed = decoder_image_embed(batch, clip, device)
    text = encode_captions(cfg.decoder, clip, batch["caption"]).to(device)
    coins = torch.stack([torch.rand(2, generator=g) for g in gens]).to(device)
    drop_image = coins[:, 0] < cfg.train.image_embed_drop_prob
    drop_text = coins[:, 1] < cfg.train.text_drop_prob
    text = drop_captions(text, null, drop_text)
    projected = []

    def predict(x_t, t):
        out = model(x_t, t, image_embed, text, drop_image)
        if (cfg.repa is None) != (not isinstance(out, tuple)):
            raise TypeError(
                "the model and the config disagree about alignment: a RepaDecoder needs a "
                "'repa:' section and a 'repa:' section a RepaDecoder; build the model from the "
                "config with unclip.train.decoder.build_image_model"
            )
        if cfg.repa is None:
            return out
        projected.append(out[1])  # diffusion_loss calls this once per micro-batch
        return out[0]

    loss = diffusion_loss(
        predict,
        images,
        noise_sched,
        prediction_type=cfg.diffusion.prediction_type,
        min_snr_gamma=cfg.diffusion.min_snr_gamma,
        timestep_shift=cfg.diffusion.timestep_shift,
        generators=gens,
        learned_variance=cfg.decoder.learned_variance,
        vlb_weight=cfg.diffusion.vlb_weight,
    )
    if cfg.repa is None:
        return loss
    target = clip_features(clip, batch.get("clip_image", batch["image"]), cfg.repa.clip_layer)
    align = alignment_loss(projected[0], target.to(device)).mean()
    if parts is not None:
        parts.setdefault("repa", []).append(float(align.detach()))
    return loss + cfg.repa.weight * align


def decoder_image_embed(batch: dict, clip: CLIP, device) -> torch.Tensor:
    """The CLIP image embeddings ``[B, D]`` that condition the decoder on ``batch``: its
    precomputed ``image_embed`` (``unclip embed`` of the original images) if present, else CLIP's
    embedding of its ``clip_image`` (the original at CLIP's input size, ``data.clip_view: full``),
    else of the training ``image`` (enlarged to CLIP's input size)."""
    if "image_embed" in batch:
        return batch["image_embed"].to(device)
    return clip.encode_image(batch.get("clip_image", batch["image"]).to(device))


def upsampler_inputs(
    images: torch.Tensor, gens, cfg, noise_sched
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """High-res targets, upsampled corrupted low-res conditioning and noise levels for one
    micro-batch (``cfg.upsampler`` sizes, ``cfg.upsampler_train`` crop and corruption)."""
    up, aug = cfg.upsampler, cfg.upsampler_train
    b, _, h, w = images.shape
    crop = aug.crop_size or up.sample_size
    if h < crop or w < crop:
        raise ValueError(
            f"training images are {h}x{w}px but the upsampler crop is {crop}px; set data.resolution"
        )
    if (h, w) != (crop, crop):
        offs = torch.stack([torch.rand(2, generator=g) for g in gens])
        tops = (offs[:, 0] * (h - crop + 1)).long().clamp(max=h - crop)
        lefts = (offs[:, 1] * (w - crop + 1)).long().clamp(max=w - crop)
        images = torch.stack(
            [images[i, :, tops[i] : tops[i] + crop, lefts[i] : lefts[i] + crop] for i in range(b)]
        )
    low_size = crop * up.low_res_size // up.sample_size
    low = degrade(
        images, low_size, aug.corruption, gens, tuple(aug.blur_sigma), aug.blur_kernel_size
    )
    low_up = upsample_low_res(low, crop)
    levels = torch.stack([torch.randint(0, aug.max_noise_level + 1, (), generator=g) for g in gens])
    noise = torch.stack([torch.randn(low_up.shape[1:], generator=g) for g in gens])
    low_up = noise_sched.add_noise(low_up, noise, levels)
    return images, low_up, levels


def upsampler_loss(model, batch, gens, cfg, noise_sched, device):
    """Denoising loss of an upsampler on one micro-batch (inputs from :func:`upsampler_inputs`)."""
    images, low_up, levels = upsampler_inputs(batch["image"], gens, cfg, noise_sched)
    low_up, levels = low_up.to(device), levels.to(device)
    return diffusion_loss(
        lambda x_t, t: model(x_t, t, low_up, levels),
        images.to(device),
        noise_sched,
        prediction_type=cfg.diffusion.prediction_type,
        min_snr_gamma=cfg.diffusion.min_snr_gamma,
        timestep_shift=cfg.diffusion.timestep_shift,
        generators=gens,
    )


def _grid_generators(cfg: StageConfig, n: int) -> list[torch.Generator]:
    # the same draws at every sample step, apart from the training draws
    return sample_generators(cfg.train.seed + 1, 0, 0, n)


class DecoderTask:
    """The base decoder's training task: :func:`decoder_loss`, and a grid of training images (top
    row) and the decoder's samples from their CLIP image embeddings and captions (bottom row)."""

    name = "decoder"

    def __init__(
        self,
        cfg: StageConfig,
        clip: CLIP,
        device,
        mixed_precision: Optional[str] = None,
        latent_space: Optional[LatentSpace] = None,
    ):
        self.cfg, self.clip, self.device = cfg, clip, device
        self.latent_space = latent_space
        self.null = encode_captions(cfg.decoder, clip, [""])
        self.noise_sched = training_scheduler(cfg.diffusion)
        self.parts: dict[str, list[float]] = {}
        # the precision the run trains in (TrainLoop.mixed_precision): under ``auto`` an
        # ``accelerate launch --mixed_precision bf16`` trains in bf16 whatever the CPU
        mp = mixed_precision or run_mixed_precision(cfg.train.mixed_precision, gpu=False)
        self.explicit_attention = torch.device(device).type == "cpu" and mp == "bf16"

    def loss(self, model, batch: dict, generators) -> torch.Tensor:
        # on a CPU in bf16 the attention as plain matrix products trains faster than PyTorch's
        # fused kernel (unclip.nets.attention); the forward's choice also sets the backward's
        with explicit_attention(model, self.explicit_attention):
            return decoder_loss(
                model,
                batch,
                self.clip,
                self.null,
                generators,
                self.cfg,
                self.noise_sched,
                self.device,
                self.parts,
                self.latent_space,
            )

    def log_metrics(self) -> dict:
        """The mean alignment loss (``repa_loss``, before ``repa.weight``) since the last call."""
        out = {f"{k}_loss": sum(v) / len(v) for k, v in self.parts.items() if v}
        self.parts.clear()
        return out

    #: columns of the sample grid (the first samples of the run's first micro-batch)
    grid_size = GRID_SIZE

    def sample_grid(self, model: UnCLIPDecoder | RepaDecoder, batch: dict) -> Image.Image:
        decoder = exported_model(model)
        n = min(GRID_SIZE, len(batch["caption"]))
        images = batch["image"][:n].to(self.device)
        pipe = UnCLIPPipeline(
            self.clip,
            None,
            decoder,
            diffusion={"decoder": self.cfg.diffusion},
            sampling={"decoder": self.cfg.sampling},
        )
        first = {k: batch[k][:n] for k in ("image", "clip_image", "image_embed") if k in batch}
        out = pipe.decode(
            decoder_image_embed(first, self.clip, self.device),
            batch["caption"][:n],
            _grid_generators(self.cfg, n),
            progress=False,
        )
        return image_grid(torch.cat([images.float().cpu(), out.cpu()]), cols=n)


class UpsamplerTask:
    """An upsampler's training task: :func:`upsampler_loss`, and a grid of corrupted low-res
    training images (top row, enlarged) and the upsampler's samples from them (bottom row)."""

    def __init__(self, cfg: StageConfig, clip: CLIP, device):
        self.cfg, self.clip, self.device = cfg, clip, device
        self.name = f"sr{cfg.upsampler_section.sample_size}"
        self.noise_sched = training_scheduler(cfg.diffusion)

    def loss(self, model, batch: dict, generators) -> torch.Tensor:
        return upsampler_loss(model, batch, generators, self.cfg, self.noise_sched, self.device)

    grid_size = GRID_SIZE

    def sample_grid(self, model, batch: dict) -> Image.Image:
        up, aug = self.cfg.upsampler_section, self.cfg.upsampler_train_section
        n = min(GRID_SIZE, len(batch["caption"]))
        gens = _grid_generators(self.cfg, n)
        low = degrade(
            batch["image"][:n],
            up.low_res_size,
            aug.corruption,
            gens,
            aug.blur_sigma,
            aug.blur_kernel_size,
        )
        out = sample_upsampler(
            model, low, self.cfg.sampling, self.cfg.diffusion, generator=gens, progress=False
        )
        low = torch.nn.functional.interpolate(low.float(), size=out.shape[-2:])
        return image_grid(torch.cat([low.cpu(), out.cpu()]), cols=n)


def _base_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder inside the wrappers a training run puts around it (DDP and torch.compile,
    as Accelerate unwraps them; the alignment head). Anything else callable (a test's stand-in
    for the network) is returned as it is."""
    if not isinstance(model, torch.nn.Module):
        return model
    return exported_model(extract_model_from_parallel(model, keep_torch_compile=False))


def check_latent_space(model: torch.nn.Module, space: Optional[LatentSpace], source) -> None:
    """Refuse a run whose decoder holds another autoencoder than the one its batches are encoded
    with: weights from ``train.init_weights`` or a resumed checkpoint carry the autoencoder they
    were trained over, and ``decoder.autoencoder`` (``source``) must be that one. Sharded weights
    are gathered to compare (every process runs this)."""
    if space is None or under_fake_tensors():
        return
    held: Any = getattr(_base_decoder(model), "latent_space", None)
    theirs = held.state_dict() if held is not None else {}
    for key, mine in space.state_dict().items():
        t = theirs.get(key)
        if t is not None and hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if t is None or not torch.equal(t.detach().cpu(), mine.detach().cpu()):
            raise ValueError(
                f"the decoder's autoencoder (from train.init_weights or the resumed checkpoint) "
                f"differs from decoder.autoencoder={source} at {key}: point decoder.autoencoder "
                "at the autoencoder the decoder was trained over"
            )


def frozen_latent_space(model: torch.nn.Module) -> Optional[LatentSpace]:
    """A copy of a latent decoder's frozen autoencoder for the training task to encode each
    batch with (None for a pixel decoder or an upsampler): the copy stays outside the trained
    module, so a sharded or wrapped decoder never gathers its autoencoder to encode a batch."""
    space = getattr(model, "latent_space", None)
    if space is None:
        return None
    if under_fake_tensors():
        # a dry run's fake tensors do not deep-copy into their own mode: a fresh build has the
        # same shapes, which is all a dry run reads
        with torch.device(next(space.parameters()).device):
            return LatentSpace(autoencoder_config(space.model), space.l2_codes, space.scale)
    return copy.deepcopy(space)


def clip_device(cfg: StageConfig, device) -> torch.device:
    """Where a stage's frozen CLIP lives: on the training device for the decoder (and the
    prior), which encode every batch with it; on the CPU for an upsampler, which never runs it (it
    only travels with the export), so it takes no GPU memory."""
    return torch.device("cpu") if cfg.stage == "upsampler" else torch.device(device)


def build_image_model(cfg: StageConfig, clip: CLIP) -> torch.nn.Module:
    """The network a ``decoder`` or ``upsampler`` stage config trains (with gradient checkpointing
    if ``train.gradient_checkpointing``; inside a :class:`~unclip.train.repa.RepaDecoder` with its
    alignment head if the config has a ``repa:`` section)."""
    model = (
        cfg.decoder_section.build(clip) if cfg.stage == "decoder" else cfg.upsampler_section.build()
    )
    if cfg.train.gradient_checkpointing:
        # the decoder's own: its UNet and, when it has one, its caption transformer
        (model if cfg.stage == "decoder" else model.unet).enable_gradient_checkpointing()
    if cfg.repa is not None and cfg.stage == "decoder" and cfg.decoder_section.autoencoder:
        raise ValueError(
            "repa: representation alignment is implemented for pixel decoders (its feature map "
            "sizes follow the image); drop the 'repa:' section or decoder.autoencoder"
        )
    if cfg.repa is not None:
        # one pass of each at its input size gives the widths the head maps between, and a
        # decoder block too small for the CLIP map is refused here, before training starts
        size = clip.image_size
        target = clip_features(clip, torch.zeros(1, 3, size, size), cfg.repa.clip_layer)
        null = encode_captions(cfg.decoder, clip, [""])
        channels, *hw = block_output_shape(model, cfg.repa.decoder_layer, null)
        check_sizes(tuple(hw), tuple(target.shape[-2:]))
        model = RepaDecoder(
            model, cfg.repa.decoder_layer, channels, target.shape[1], cfg.repa.hidden
        )
    return model


def decoder_batches(
    cfg: StageConfig,
    clip: CLIP,
    *,
    rank: int,
    world_size: int,
    start: int = 0,
    cursors: Optional[dict] = None,
):
    """The training batches of a decoder or upsampler run: images at ``data.resolution`` and, for
    ``data.clip_view: full``, each original image at ``clip``'s input size as ``clip_image``;
    ``start``/``cursors``: the resumed data position (:func:`make_batches`)."""
    return make_batches(
        cfg.data,
        resolution=cfg.data.resolution,
        clip_resolution=clip.image_size if cfg.data.clip_view == "full" else None,
        seed=cfg.train.seed,
        rank=rank,
        world_size=world_size,
        start=start,
        cursors=cursors,
    )


@releases_folder
def train_decoder(
    cfg: StageConfig,
    resume: Optional[str] = None,
    max_steps_this_run: Optional[int] = None,
    overwrite: bool = False,
) -> int:
    """Train the base decoder or the upsampler described by ``cfg`` (stage ``decoder`` or
    ``upsampler``); when ``train.max_steps`` is reached, export ``<output_dir>/final/decoder`` (or
    ``final/sr<size>``) and ``final/clip``. ``resume``: ``"latest"`` or a checkpoint folder;
    ``max_steps_this_run``: stop (with a checkpoint) after that many steps; ``overwrite``: replace
    an earlier run in ``train.output_dir`` (refused otherwise). Returns 0."""
    if cfg.stage not in ("decoder", "upsampler"):
        raise ValueError(
            f"train_decoder needs a stage 'decoder' or 'upsampler' config, got stage {cfg.stage!r}"
        )
    if cfg.stage == "decoder" and cfg.data.resolution != cfg.decoder_section.sample_size:
        raise ValueError(
            f"data.resolution ({cfg.data.resolution}) must equal decoder.sample_size "
            f"({cfg.decoder_section.sample_size})"
        )
    loop = TrainLoop(cfg, resume=resume, max_steps_this_run=max_steps_this_run, overwrite=overwrite)
    torch.manual_seed(cfg.train.seed)
    with torch.device(clip_device(cfg, loop.device)):
        clip = CLIP.from_config(cfg.clip)
    with torch.device(loop.device):  # built where it trains: no CPU copy of a large network
        model = build_image_model(cfg, clip)
    space = frozen_latent_space(model)
    model = loop.prepare(model)
    if cfg.stage == "decoder":
        check_latent_space(loop.unwrapped, space, cfg.decoder_section.autoencoder)
    model.train()
    task: DecoderTask | UpsamplerTask
    if cfg.stage == "decoder":
        task = DecoderTask(cfg, clip, loop.device, loop.mixed_precision, space)
    else:
        task = UpsamplerTask(cfg, clip, loop.device)
    data = decoder_batches(
        cfg,
        clip,
        rank=loop.rank,
        world_size=loop.world,
        start=loop.state.samples,
        cursors=loop.data_cursors,
    )
    if loop.run(task, data):
        loop.export_stage(task.name, clip)
    loop.finish()
    return 0
