"""Fine-tune Kandinsky 2.2 (its prior or its latent decoder) with the one training loop.

    unclip train-decoder kandinsky_decoder.yaml       # kandinsky: {stage: decoder, pretrained: ...}
    unclip train-prior kandinsky_prior.yaml           # kandinsky: {stage: prior, pretrained: ...}
    accelerate launch train_decoder.py kandinsky_decoder.yaml --resume latest

A config with a ``kandinsky:`` section (:class:`KandinskyTrainConfig`) names the folder (or Hub id)
to start from instead of describing a network; ``data:`` and ``train:`` are every stage's sections,
so the optimizer, warmup–cosine schedule, gradient accumulation and clipping, EMA, LoRA, exact
resume, PowerSGD and the distributed strategies are the native stages'.

Decoder (``kandinsky.stage: decoder``, a ``KandinskyV22Pipeline`` folder): the UNet trains; the
MoVQ and the prior's image tower stay frozen. Per micro-batch the training images (at
``data.resolution``) are encoded to MoVQ latents (the encoder's output before quantisation, as the
pipelines decode them) and the originals, resized and centre-cropped to the image tower's input,
to CLIP image embeddings; ``train.image_embed_drop_prob`` of them are replaced by the embedding of
an all-zero image, the unconditional input diffusers' sampler guides against. The loss is the
folder scheduler's: its noise schedule and prediction type, on the UNet's first ``C`` output
channels (the variance half of a learned-variance UNet is not trained, as in diffusers' example
script; the folder's ``DDPMScheduler`` samples with a fixed variance). ``kandinsky.latent_cache_mb``
keeps the latents and embeddings of images seen before (a fine-tuning set read for many epochs).

Prior (``kandinsky.stage: prior``, a ``KandinskyV22PriorPipeline`` folder): the
``PriorTransformer`` trains; the text and image towers stay frozen. It is conditioned on the text
tower's projected embedding and final token states under the real tokens' mask (what the sampler
gives it), ``train.text_drop_prob`` of the captions replaced by the empty one's (the guidance's
unconditional input); its target is the image tower's embedding, normalised by the prior's own
``clip_mean``/``clip_std`` (kept frozen), under the cosine schedule of its ``UnCLIPScheduler``.

At ``train.max_steps`` the run writes ``final/decoder`` (or ``final/prior``) in diffusers' layout,
with the folder's other components: diffusers' ``KandinskyV22Pipeline.from_pretrained`` (or
``KandinskyV22PriorPipeline``) and :class:`~unclip.pipeline.kandinsky.KandinskyPipeline` load it as
they load the originals. A LoRA run (``train.lora``) writes that folder with the adapter merged,
and the adapter alone, in peft's files, as ``final/<stage>_lora``.

Not supported yet, each refused when asked for: an inpainting decoder (its random masks), the
``repa`` head, ``train.init_weights`` (``kandinsky.pretrained`` is the start),
``train.resblock_grad_scaling`` (native UNets only); ``train.text_cache_mb`` is not used.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, cast

import torch
from diffusers.models import UNet2DConditionModel
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from PIL import Image
from torch._subclasses.fake_tensor import is_fake

from unclip.diffusion.loop import diffusion_loss
from unclip.nets.clip import CLIP
from unclip.nets.latent_decoder import LatentDecoder
from unclip.train.config import (
    DataConfig,
    TrainConfig,
    check_probability,
    check_range,
    load_config_naming_source,
)
from unclip.train.loop import TrainLoop, sample_generators
from unclip.train.run_folder import releases_folder
from unclip.utils.config import ConfigError, to_dict
from unclip.utils.images import image_grid

__all__ = [
    "KandinskySection",
    "KandinskyTrainConfig",
    "is_kandinsky_config",
    "load_kandinsky_config",
    "training_noise_schedule",
    "LatentCache",
    "KandinskyDecoderTask",
    "KandinskyPriorTask",
    "train_kandinsky",
]

logger = logging.getLogger("unclip.train")

#: columns of the decoder's sample grid
GRID_SIZE = 8


@dataclass
class KandinskySection:
    """What a Kandinsky run starts from. ``stage``: ``decoder`` or ``prior``; ``pretrained``: the
    folder or Hub id of that stage (``kandinsky-community/kandinsky-2-2-decoder`` or
    ``-prior``); ``prior`` (decoder runs): the prior folder whose image tower embeds the training
    images (default: the one the decoder's model card names, as diffusers finds it);
    ``variant``: read ``*.<variant>.safetensors``; ``revision`` / ``local_files_only``: for Hub
    ids. ``latent_cache_mb`` (decoder runs): megabytes of MoVQ latents and image embeddings kept
    for images seen again (0: off)."""

    stage: Literal["decoder", "prior"] = "decoder"
    pretrained: Optional[str] = None
    prior: Optional[str] = None
    variant: Optional[str] = None
    revision: Optional[str] = None
    local_files_only: Optional[bool] = None
    latent_cache_mb: float = 0.0

    def __post_init__(self) -> None:
        if not self.pretrained:
            raise ConfigError(
                "kandinsky.pretrained is required: the folder or Hub id to fine-tune, e.g. "
                "kandinsky-community/kandinsky-2-2-decoder"
            )
        check_range(
            "kandinsky.latent_cache_mb", self.latent_cache_mb, self.latent_cache_mb >= 0, ">= 0"
        )
        if self.stage == "prior" and self.prior is not None:
            raise ConfigError(
                "kandinsky.prior names the image tower of a decoder run; a prior run reads its own "
                "folder's (kandinsky.pretrained): remove kandinsky.prior"
            )
        if self.stage == "prior" and self.latent_cache_mb:
            raise ConfigError("kandinsky.latent_cache_mb applies to decoder runs; remove it")


@dataclass
class KandinskyTrain(TrainConfig):
    """``train:`` of a Kandinsky run: every stage's, the starting weights named by
    ``kandinsky.pretrained`` (so ``train.lora`` needs no ``init_weights``)."""

    weights_named_elsewhere: ClassVar[bool] = True


@dataclass
class SampleGridConfig:
    """The decoder's sample grids (``train.sample_every``): steps and guidance of its sampler."""

    steps: int = 25
    guidance_scale: float = 4.0

    def __post_init__(self) -> None:
        # checked when the config loads: a bad value found at the first grid would end the run
        # before that step's checkpoint
        from unclip.pipeline.kandinsky import KandinskySampling

        try:
            KandinskySampling(self.steps, self.guidance_scale)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"sampling: {exc}") from None


@dataclass
class KandinskyTrainConfig:
    """A Kandinsky 2.2 fine-tuning run: ``kandinsky`` (:class:`KandinskySection`), ``data`` and
    ``train`` (every stage's sections) and ``sampling`` (the decoder's sample grids)."""

    kandinsky: KandinskySection = field(default_factory=KandinskySection)
    data: DataConfig = field(default_factory=DataConfig)
    train: KandinskyTrain = field(default_factory=KandinskyTrain)
    sampling: SampleGridConfig = field(default_factory=SampleGridConfig)

    def __post_init__(self) -> None:
        t = self.train
        for key, value, why in (
            ("train.init_weights", t.init_weights, "kandinsky.pretrained is the start"),
            (
                "train.resblock_grad_scaling",
                t.resblock_grad_scaling,
                "it rescales the residual blocks of unclip's own UNets",
            ),
        ):
            if value:
                raise ConfigError(f"{key} does not apply to a Kandinsky run ({why}); remove it")
        if self.data.source == "embeddings" or self.data.embeddings_path:
            raise ConfigError(
                "a Kandinsky run embeds its training images with the folder's own image tower; "
                "give images (data.source shapes, folder or webdataset) without embeddings_path"
            )
        check_probability("train.text_drop_prob", t.text_drop_prob)
        check_probability("train.image_embed_drop_prob", t.image_embed_drop_prob)

    @property
    def stage(self) -> str:
        return self.kandinsky.stage


def is_kandinsky_config(path) -> bool:
    """Whether the YAML file (or dict) ``path`` holds a ``kandinsky:`` section (a fine-tuning
    run of :mod:`unclip.train.kandinsky` rather than a native stage config)."""
    if isinstance(path, dict):
        return "kandinsky" in path
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return False  # the stage config loader reports what is wrong with the file
    return isinstance(data, dict) and "kandinsky" in data


def load_kandinsky_config(path, overrides=(), stages=("decoder", "prior")) -> KandinskyTrainConfig:
    """A :class:`KandinskyTrainConfig` from a YAML file or dict with dotted ``overrides``;
    ``stages``: the stages the calling command trains."""
    cfg = load_config_naming_source(path, list(overrides), KandinskyTrainConfig)
    if cfg.stage not in stages:
        command = "train-prior" if cfg.stage == "prior" else "train-decoder"
        raise ValueError(
            f"{path}: kandinsky.stage is {cfg.stage!r}; train it with unclip {command}"
        )
    return cfg


def training_noise_schedule(scheduler) -> DDPMScheduler:
    """The forward process a folder's sampling ``scheduler`` was trained with, as a
    ``DDPMScheduler`` (what :func:`~unclip.diffusion.loop.diffusion_loss` noises with): an
    ``UnCLIPScheduler`` (the prior's) is the cosine schedule; any other keeps its own betas. Its
    ``alphas_cumprod`` are checked to be the folder scheduler's."""
    cfg = dict(scheduler.config)
    steps = int(cfg.get("num_train_timesteps", 1000))
    prediction = cfg.get("prediction_type", "epsilon")
    if type(scheduler).__name__ == "UnCLIPScheduler":
        sched = DDPMScheduler(
            num_train_timesteps=steps, beta_schedule="squaredcos_cap_v2", prediction_type=prediction
        )
    else:
        sched = DDPMScheduler(
            num_train_timesteps=steps,
            beta_start=cfg.get("beta_start", 0.0001),
            beta_end=cfg.get("beta_end", 0.02),
            beta_schedule=cfg.get("beta_schedule", "linear"),
            trained_betas=cfg.get("trained_betas"),
            prediction_type=prediction,
        )
    theirs = getattr(scheduler, "alphas_cumprod", None)
    if theirs is not None and is_fake(theirs):
        theirs = None  # a dry run's (unclip plan) tables hold no values; a real run checks them
    if theirs is not None and not torch.allclose(
        sched.alphas_cumprod, theirs.float().cpu(), rtol=1e-5, atol=1e-6
    ):
        raise ValueError(
            f"the folder's {type(scheduler).__name__} has a noise schedule this trainer cannot "
            "reproduce (its alphas_cumprod differ from the DDPM schedule of its config)"
        )
    if prediction not in ("epsilon", "sample", "v_prediction"):
        raise ValueError(f"the folder's scheduler predicts {prediction!r}, which cannot be trained")
    return sched


# --------------------------------------------------------------------------------------------------
# the decoder
# --------------------------------------------------------------------------------------------------
def _image_key(*tensors: torch.Tensor) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class LatentCache:
    """MoVQ latents and CLIP image embeddings of training images, kept by the images' content.

    Exact in the way :class:`~unclip.train.text_cache.TextEncodingCache` is: images it does not
    hold are encoded in batches of one fixed size ``chunk`` (the micro-batch size), padded with
    all-zero images, so a row's numbers do not depend on its neighbours; the first encoding checks
    that premise on the device at hand (the same images in reverse order give the same rows) and
    turns the cache off with a warning where it fails. Least recently used images are dropped
    beyond ``max_mb`` megabytes. ``encode(images, clip_images) -> (latents, embeds)``."""

    def __init__(self, encode_fn, chunk: int, max_mb: float):
        self.encode_fn, self.chunk = encode_fn, chunk
        self.max_bytes = int(max_mb * 2**20)
        self.rows: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.served = 0
        self.encoded = 0
        self.checked = False

    def encode(self, images: torch.Tensor, clip_images: torch.Tensor):
        n = images.shape[0]
        self.served += n
        if self.max_bytes == 0:
            self.encoded += n
            return self.encode_fn(images, clip_images)
        keys = [_image_key(images[i], clip_images[i]) for i in range(n)]
        todo = [i for i, k in enumerate(keys) if k not in self.rows]
        todo = list({keys[i]: i for i in todo}.values())
        for start in range(0, len(todo), self.chunk):
            part = todo[start : start + self.chunk]
            pad = self.chunk - len(part)
            imgs = torch.cat([images[part], images[:1].mul(0).expand(pad, -1, -1, -1)])
            clips = torch.cat([clip_images[part], clip_images[:1].mul(0).expand(pad, -1, -1, -1)])
            latents, embeds = self.encode_fn(imgs, clips)
            self.encoded += len(part)
            if not self.checked:
                self.checked = True
                back_l, back_e = self.encode_fn(imgs.flip(0), clips.flip(0))
                if not (
                    torch.equal(back_l.flip(0), latents) and torch.equal(back_e.flip(0), embeds)
                ):
                    logger.warning(
                        "kandinsky.latent_cache_mb: the encoders' rows depend on their batch "
                        "neighbours on this device; the cache is off (the run stays exact)"
                    )
                    self.max_bytes = 0
                    self.rows.clear()
                    self.encoded += n - len(part)
                    return self.encode_fn(images, clip_images)
            for j, i in enumerate(part):
                row = (latents[j].clone(), embeds[j].clone())
                self.rows[keys[i]] = row
                self.bytes += sum(t.numel() * t.element_size() for t in row)
        out = [self.rows[k] for k in keys]
        for k in keys:
            self.rows.move_to_end(k)
        while self.bytes > self.max_bytes and self.rows:
            _, old = self.rows.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old)
        return torch.stack([r[0] for r in out]), torch.stack([r[1] for r in out])


class KandinskyDecoderTask:
    """The latent decoder's task: the denoising loss over MoVQ latents (see the module doc) and a
    grid of training images (top row) and the UNet's samples from their image embeddings."""

    name = "decoder"
    grid_size = GRID_SIZE

    def __init__(
        self, cfg: KandinskyTrainConfig, movq, clip: CLIP, scheduler, device, mixed_precision="no"
    ):
        self.cfg, self.movq, self.clip, self.scheduler = cfg, movq, clip, scheduler
        self.device = torch.device(device)
        self.frozen = _frozen_precision(self.device, mixed_precision)
        self.noise_sched = training_noise_schedule(scheduler)
        self.channels = int(movq.config["latent_channels"])
        self.zero = _zero_embed(clip)
        self.cache = LatentCache(self._encode, cfg.data.batch_size, cfg.kandinsky.latent_cache_mb)

    @torch.no_grad()
    def _encode(self, images: torch.Tensor, clip_images: torch.Tensor):
        with self.frozen():
            latents = self.movq.encode(images.to(self.device)).latents.float()
            embeds = self.clip.encode_image(clip_images.to(self.device)).float()
        return latents, embeds

    def loss(self, model, batch: dict, generators) -> torch.Tensor:
        latents, embeds = self.cache.encode(batch["image"], batch["clip_image"])
        coins = torch.stack([torch.rand((), generator=g) for g in generators]).to(self.device)
        drop = coins < self.cfg.train.image_embed_drop_prob
        embeds = torch.where(drop[:, None], self.zero.to(embeds), embeds)
        c = self.channels

        def predict(x_t, t):
            out = model(
                sample=x_t,
                timestep=t,
                encoder_hidden_states=None,
                added_cond_kwargs={"image_embeds": embeds.to(x_t.dtype)},
                return_dict=False,
            )[0]
            return out[:, :c]  # a learned-variance UNet's second half is its variance

        return diffusion_loss(
            predict,
            latents,
            self.noise_sched,
            prediction_type=self.noise_sched.config["prediction_type"],
            generators=generators,
        )

    def log_metrics(self) -> dict:
        if self.cache.max_bytes == 0:
            return {}
        return {"latent_cache_hit_rate": 1 - self.cache.encoded / max(self.cache.served, 1)}

    def sample_grid(self, model, batch: dict) -> Image.Image:
        from unclip.pipeline.kandinsky import KandinskyPipeline

        n = min(GRID_SIZE, len(batch["caption"]))
        images = batch["image"][:n].float()
        _, embeds = self._encode(images, batch["clip_image"][:n])
        decoder = LatentDecoder(model, self.movq)
        s = self.cfg.sampling
        pipe = KandinskyPipeline(
            decoder,
            self.scheduler,
            sampling={"decoder": {"steps": s.steps, "guidance_scale": s.guidance_scale}},
        )
        size = images.shape[-1]
        gens = sample_generators(self.cfg.train.seed + 1, 0, 0, n)
        latents = pipe.decode(
            embeds, self.zero.expand(n, -1), size, size, generator=gens, progress=False
        )
        out = decoder.decode(latents).clamp(-1, 1)
        return image_grid(torch.cat([images.cpu(), out.float().cpu()]), cols=n)


def _frozen_precision(device: torch.device, mixed_precision: str):
    """A context for the frozen encoders (MoVQ, the CLIP towers): the run's half precision under
    autocast when it trains in one (Accelerate's autocast wraps the trained model's forward
    only, and these run outside it on every micro-batch), full precision otherwise."""
    import contextlib

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(mixed_precision))
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def _zero_embed(clip: CLIP) -> torch.Tensor:
    from unclip.sampling.kandinsky import zero_image_embed

    return zero_image_embed(clip, 1)


# --------------------------------------------------------------------------------------------------
# the prior
# --------------------------------------------------------------------------------------------------
class KandinskyPriorTask:
    """The prior's task: x_0 regression of the normalised image-tower embedding from the text
    tower's conditioning (see the module doc); logs the cosine between the predicted and the
    true embeddings."""

    name = "prior"

    def __init__(
        self, cfg: KandinskyTrainConfig, clip: CLIP, scheduler, stats, device, mixed_precision="no"
    ):
        from unclip.sampling.kandinsky import prior_text

        self.cfg, self.clip, self.device = cfg, clip, torch.device(device)
        self.frozen = _frozen_precision(self.device, mixed_precision)
        self.noise_sched = training_noise_schedule(scheduler)
        self.prior_text = prior_text
        self.null = prior_text(clip, [""])
        self.mean, self.std = (s.detach().float().to(self.device) for s in stats)
        self.cosines: list[float] = []

    def loss(self, model, batch: dict, generators) -> torch.Tensor:
        with torch.no_grad(), self.frozen():
            text = self.prior_text(self.clip, batch["caption"])
            target = self.clip.encode_image(batch["clip_image"].to(self.device)).float()
        text = text._map(lambda x: x.float() if x.is_floating_point() else x)
        coins = torch.stack([torch.rand((), generator=g) for g in generators]).to(self.device)
        drop = coins < self.cfg.train.text_drop_prob
        null = self.null
        embed = torch.where(drop[:, None], null.text_embed.to(self.device), text.text_embed)
        tokens = torch.where(
            drop[:, None, None], null.text_tokens.to(self.device), text.text_tokens
        )
        mask = torch.where(drop[:, None], null.text_mask.to(self.device), text.text_mask)
        x_0 = (target - self.mean) / self.std
        predicted = []

        def predict(x_t, t):
            out = model(
                x_t,
                timestep=t,
                proj_embedding=embed.to(x_t.dtype),
                encoder_hidden_states=tokens.to(x_t.dtype),
                attention_mask=mask,
            ).predicted_image_embedding
            predicted.append(out)
            return out

        loss = diffusion_loss(
            predict,
            x_0,
            self.noise_sched,
            prediction_type=self.noise_sched.config["prediction_type"],
            generators=generators,
        )
        if self.noise_sched.config["prediction_type"] == "sample":
            with torch.no_grad():
                guess = predicted[0].float() * self.std + self.mean
                cos = torch.nn.functional.cosine_similarity(guess, target, dim=-1)
                self.cosines.append(float(cos.mean()))
        return loss

    def log_metrics(self) -> dict:
        out = {"cosine": sum(self.cosines) / len(self.cosines)} if self.cosines else {}
        self.cosines.clear()
        return out


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------
def _read(source: str, cfg: KandinskyTrainConfig, what: str) -> tuple[dict, Path]:
    from unclip.interop.kandinsky import read_kandinsky_folder
    from unclip.io.hub import resolve_folder

    k = cfg.kandinsky
    folder = resolve_folder(
        source,
        what=what,
        variant=k.variant,
        revision=k.revision,
        local_files_only=k.local_files_only,
    )
    return read_kandinsky_folder(folder, variant=k.variant), folder


def _decoder_prior(cfg: KandinskyTrainConfig, decoder: LatentDecoder, scheduler, card) -> str:
    """What a decoder run refuses in its folder (checked before the prior is read), and the
    prior whose image tower embeds its images (``kandinsky.prior``, else the one the model card
    names, ``card``)."""
    k = cfg.kandinsky
    if decoder.inpaint:
        raise ValueError(
            f"{k.pretrained} is an inpainting decoder (its UNet reads masked images): fine-tuning "
            "one is not supported yet; fine-tune the text-to-image decoder"
        )
    variance = scheduler.config.get("variance_type")
    if variance in ("learned", "learned_range"):
        raise ValueError(
            f"{k.pretrained}: its scheduler samples with the UNet's learned variance "
            f"(variance_type={variance!r}), which this trainer does not train (the loss covers "
            "the first C output channels); fine-tune a folder whose scheduler has a fixed variance"
        )
    prior_source = k.prior or card
    if prior_source is None:
        raise ValueError(
            f"{k.pretrained}: a decoder run embeds its images with the prior's image tower, and "
            "the folder's model card names no prior; set kandinsky.prior to the prior folder"
        )
    return str(prior_source)


def _check_stage(k: KandinskySection, kind: str, what: str = " folder") -> None:
    # ``what``: how the source is named (a dry run may plan a published id, not a folder)
    if kind != k.stage:
        raise ValueError(
            f"kandinsky.pretrained {k.pretrained!r} is a Kandinsky {kind}{what} but "
            f"kandinsky.stage is {k.stage!r}; give the {k.stage} folder or set kandinsky.stage"
        )


def _check_prior(source: str, kind: str, what: str = " folder") -> None:
    if kind != "prior":
        raise ValueError(f"kandinsky.prior {source!r} is not a Kandinsky 2.2 prior{what}")


def _prior_run(k: KandinskySection, prior, clip: CLIP, scheduler) -> dict[str, Any]:
    """A prior run's parts (the trained network under ``model``)."""
    return {
        "model": prior,
        "clip": clip,
        "scheduler": scheduler,
        "stats": (prior.clip_mean.detach().clone(), prior.clip_std.detach().clone()),
        "source": str(k.pretrained),
    }


def _decoder_run(
    cfg: KandinskyTrainConfig, decoder: LatentDecoder, clip: CLIP, scheduler, prior_source: str
) -> dict[str, Any]:
    """A decoder run's parts, once the prior's image tower fits the decoder and the resolution
    the MoVQ's downsampling."""
    from unclip.interop.kandinsky import check_pair

    check_pair(clip, decoder)
    f2 = decoder.scale_factor**2
    if cfg.data.resolution % f2:
        raise ConfigError(
            f"data.resolution={cfg.data.resolution} must be a multiple of {f2} (the MoVQ's "
            f"{decoder.scale_factor}x downsampling, squared, as the pipelines size images)"
        )
    return {
        "model": decoder.unet,
        "movq": decoder.movq,
        "clip": clip,
        "scheduler": scheduler,
        "source": str(cfg.kandinsky.pretrained),
        "prior_source": str(prior_source),
    }


def _load_parts(cfg: KandinskyTrainConfig) -> dict[str, Any]:
    """The folders' components for the run: the trained network under ``model``."""
    k = cfg.kandinsky
    parts, folder = _read(str(k.pretrained), cfg, f"Kandinsky {k.stage}")
    _check_stage(k, parts.pop("kind"))
    if k.stage == "prior":
        return _prior_run(k, parts["prior"], parts["clip"], parts["prior_scheduler"])
    decoder: LatentDecoder = parts["decoder"]
    prior_source = _decoder_prior(cfg, decoder, parts["scheduler"], parts.get("card_prior"))
    prior_parts, _ = _read(str(prior_source), cfg, "Kandinsky prior")
    _check_prior(prior_source, prior_parts.pop("kind"))
    clip = prior_parts["clip"].drop_text_tower()  # a decoder run embeds images only
    return _decoder_run(cfg, decoder, clip, parts["scheduler"], prior_source)


def skeleton_parts(cfg: KandinskyTrainConfig) -> dict[str, Any]:
    """The parts :func:`_load_parts` gives, built from the folders' configs alone with fresh
    weights on the current device (:func:`~unclip.interop.kandinsky_arch.kandinsky_architecture`:
    a local folder's config files, or the published architecture of a Hub id): what ``unclip
    plan`` runs a step of on fake tensors. The same checks as a real run's apply."""
    import diffusers
    from diffusers.models import PriorTransformer, VQModel

    from unclip.interop.clip import clip_from_configs
    from unclip.interop.kandinsky_arch import kandinsky_architecture

    k = cfg.kandinsky
    arch = kandinsky_architecture(str(k.pretrained))
    _check_stage(k, arch["kind"], "")

    def scheduler(config: dict):
        return getattr(diffusers, config["_class_name"]).from_config(config)

    def prior_clip(prior_arch: dict) -> CLIP:
        return clip_from_configs(prior_arch["text_encoder"], prior_arch["image_encoder"])

    if k.stage == "prior":
        prior = PriorTransformer.from_config(arch["prior"])
        return _prior_run(k, prior, prior_clip(arch), scheduler(arch["scheduler"]))
    decoder = LatentDecoder(
        UNet2DConditionModel.from_config(arch["unet"]), VQModel.from_config(arch["movq"])
    )
    sched = scheduler(arch["scheduler"])
    prior_source = _decoder_prior(cfg, decoder, sched, arch.get("prior"))
    prior_arch = kandinsky_architecture(prior_source)
    _check_prior(prior_source, prior_arch["kind"], "")
    clip = prior_clip(prior_arch).drop_text_tower()
    return _decoder_run(cfg, decoder, clip, sched, prior_source)


def _on(module, device):
    # parts built where they run (a dry run's fake GPU, whose tensors .to cannot swap) stay put
    device = torch.device(device)
    if all(p.device == device for p in module.parameters()):
        return module
    return module.to(device)


def kandinsky_task(cfg: KandinskyTrainConfig, parts: dict, device, mixed_precision):
    """The run's trained network (ready for the loop's ``prepare``) and its training task."""
    clip: CLIP = _on(parts["clip"], device).eval()
    model = _trainable(_on(parts["model"], device), cfg)
    task: KandinskyDecoderTask | KandinskyPriorTask
    if cfg.stage == "decoder":
        movq = _on(parts["movq"], device).eval().requires_grad_(False)
        task = KandinskyDecoderTask(cfg, movq, clip, parts["scheduler"], device, mixed_precision)
    else:
        task = KandinskyPriorTask(
            cfg, clip, parts["scheduler"], parts["stats"], device, mixed_precision
        )
    return model, task


def _trainable(model: torch.nn.Module, cfg: KandinskyTrainConfig) -> torch.nn.Module:
    model.requires_grad_(True)
    if cfg.stage == "prior":
        # the normalisation statistics are parameters in diffusers' PriorTransformer, but no
        # forward reads them: they stay as the folder has them (and DDP sees no unused parameter)
        model.clip_mean.requires_grad_(False)
        model.clip_std.requires_grad_(False)
    if cfg.train.gradient_checkpointing:
        if not getattr(model, "_supports_gradient_checkpointing", False):
            raise ConfigError(
                f"train.gradient_checkpointing: diffusers' {type(model).__name__} does not "
                "support it; set it to false"
            )
        model.enable_gradient_checkpointing()  # type: ignore[operator]
    return model.train()


def _write_card(folder: Path, prior_source: str) -> None:
    # where diffusers' AutoPipelineForText2Image (and load_pipeline) look for the decoder's prior
    (folder / "README.md").write_text(
        "---\nprior:\n- "
        + prior_source
        + "\ntags:\n- kandinsky\n- text-to-image\n- unclip\n---\n\n"
        "# Kandinsky 2.2 decoder, fine-tuned with unclip\n\n"
        "Load it with diffusers' `KandinskyV22Pipeline.from_pretrained` or unclip's "
        "`load_pipeline`.\n",
        encoding="utf-8",
    )


def _exporter(cfg: KandinskyTrainConfig, parts: dict):
    """``save_fn(model, folder)`` writing the trained network with its folder's other components
    in diffusers' layout (a LoRA model merged, on a copy)."""
    from unclip.interop.kandinsky import write_kandinsky_folder, write_kandinsky_prior
    from unclip.nets.lora import merge_adapters

    def save(model: torch.nn.Module, folder: Path) -> None:
        if cfg.train.lora is not None:
            model = copy.deepcopy(model)
            merge_adapters(model)
        model = model.eval()
        if cfg.stage == "prior":
            write_kandinsky_prior(folder, model, parts["clip"], parts["scheduler"])
        else:
            unet = cast(UNet2DConditionModel, model)
            write_kandinsky_folder(folder, LatentDecoder(unet, parts["movq"]), parts["scheduler"])
            _write_card(folder, parts["prior_source"])

    return save


def _export(loop: TrainLoop, cfg: KandinskyTrainConfig, parts: dict) -> Path:
    name = cfg.stage
    meta = {
        "family": "kandinsky",
        "stage": name,
        "pretrained": parts["source"],
        "steps": loop.state.step,
    }
    out = loop.export(name, _exporter(cfg, parts), meta)
    if cfg.train.lora is not None:
        from unclip.nets.lora import save_adapter
        from unclip.train.lora import ADAPTER_NAME, adapter_folder_name

        lora_meta = {**meta, "train_lora": to_dict(cfg.train.lora)}
        loop.export(
            adapter_folder_name(name),
            lambda model, folder: save_adapter(model, folder, ADAPTER_NAME, lora_meta),
        )
    if loop.accelerator.is_main_process:
        print(f"exported the fine-tuned Kandinsky {name} to {out} (diffusers' layout)")
    return out


@releases_folder
def train_kandinsky(
    cfg: KandinskyTrainConfig,
    resume: Optional[str] = None,
    max_steps_this_run: Optional[int] = None,
    overwrite: bool = False,
) -> int:
    """Fine-tune the Kandinsky 2.2 stage ``cfg`` names (see the module doc); at
    ``train.max_steps`` export ``final/<stage>`` in diffusers' layout. ``resume``,
    ``max_steps_this_run`` and ``overwrite`` as for every stage. Returns 0."""
    loop = TrainLoop(cfg, resume=resume, max_steps_this_run=max_steps_this_run, overwrite=overwrite)
    torch.manual_seed(cfg.train.seed)
    try:
        parts = _load_parts(cfg)
    except BaseException:
        loop.release_output_dir()
        raise
    model, task = kandinsky_task(cfg, parts, loop.device, loop.mixed_precision)
    model = loop.prepare(model)
    data = loop.batches(cfg.data, cfg.data.resolution, clip_resolution=task.clip.image_size)
    if loop.run(task, data):
        _export(loop, cfg, parts)
    loop.finish()
    return 0
