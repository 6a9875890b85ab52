"""Train the base decoder or one upsampler (chosen by the config's ``stage``).

    unclip-train-decoder configs/tiny/decoder.yaml train.max_steps=200
    unclip-train-decoder configs/tiny/sr32.yaml
    accelerate launch train_decoder.py configs/decoder_64.yaml --resume latest

Decoder (paper §2.1): condition on the frozen CLIP's image embedding of the training image and the
caption's token states; drop the image embedding for ``train.image_embed_drop_prob`` of the samples
(learned null embedding) and the caption for ``train.text_drop_prob`` (empty caption), for
classifier-free guidance.

Upsampler: take a random ``upsampler.train_crop_size`` crop (or the whole image), make its low-res
conditioning by downsampling and corrupting it (``blur`` or ``bsr``), add Gaussian noise of a random level
``≤ max_noise_level`` (the level is an input of the network), upsample it back and concatenate.
"""

from __future__ import annotations

import logging
import sys

import torch
from PIL import Image

from unclip.clip import FrozenCLIP, TextEncoding
from unclip.config import to_dict, to_yaml
from unclip.decoder import UnCLIPDecoder, UnCLIPUpsampler, degrade, upsample_low_res
from unclip.diffusion import diffusion_loss, make_scheduler, sample_loop, training_scheduler
from unclip.train.data.loader import make_batches
from unclip.train.loop import TrainingRun, load_stage_config, sample_generators, stage_argparser

logger = logging.getLogger("unclip.train")


def decoder_loss(
    model, batch, clip: FrozenCLIP, null: TextEncoding, gens, cfg, noise_sched, device
):
    """Denoising loss of the base decoder on one micro-batch, with condition dropout."""
    images = batch["image"].to(device)
    b = images.shape[0]
    image_embed = (
        batch["image_embed"].to(device) if "image_embed" in batch else clip.encode_image(images)
    )
    text = clip.encode_text(batch["caption"]).to(device)
    coins = torch.stack([torch.rand(2, generator=g) for g in gens]).to(device)
    drop_image = coins[:, 0] < cfg.train.image_embed_drop_prob
    drop_text = coins[:, 1] < cfg.train.text_drop_prob
    nb = null.repeat_interleave(b).to(device)
    text = TextEncoding(
        torch.where(drop_text[:, None], nb.text_embed, text.text_embed),
        torch.where(drop_text[:, None, None], nb.text_tokens, text.text_tokens),
        torch.where(drop_text[:, None], nb.text_mask, text.text_mask),
    )
    return diffusion_loss(
        lambda x_t, t: model(x_t, t, image_embed, text, drop_image),
        images,
        noise_sched,
        prediction_type=cfg.diffusion.prediction_type,
        min_snr_gamma=cfg.diffusion.min_snr_gamma,
        generators=gens,
    )


def upsampler_inputs(
    images: torch.Tensor, gens, cfg, noise_sched
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """High-res targets, upsampled corrupted low-res conditioning and noise levels for one micro-batch."""
    up = cfg.upsampler
    b, _, h, w = images.shape
    crop = up.train_crop_size or up.sample_size
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
    low = degrade(images, low_size, up.corruption, gens, tuple(up.blur_sigma))
    low_up = upsample_low_res(low, crop)
    levels = torch.stack([torch.randint(0, up.max_noise_level + 1, (), generator=g) for g in gens])
    noise = torch.stack([torch.randn(low_up.shape[1:], generator=g) for g in gens])
    low_up = noise_sched.add_noise(low_up, noise, levels)
    return images, low_up, levels


def upsampler_loss(model, batch, gens, cfg, noise_sched, device):
    images, low_up, levels = upsampler_inputs(batch["image"], gens, cfg, noise_sched)
    low_up, levels = low_up.to(device), levels.to(device)
    return diffusion_loss(
        lambda x_t, t: model(x_t, t, low_up, levels),
        images.to(device),
        noise_sched,
        prediction_type=cfg.diffusion.prediction_type,
        min_snr_gamma=cfg.diffusion.min_snr_gamma,
        generators=gens,
    )


@torch.no_grad()
def sample_grid(run: TrainingRun, clip: FrozenCLIP, batch: dict, null: TextEncoding) -> Image.Image:
    """Samples from the EMA weights for the captions/images of ``batch`` (at most 8), as one grid image."""
    from unclip.pipeline import UnCLIPPipeline, to_output

    cfg = run.cfg
    model = run.unwrapped
    n = min(8, len(batch["caption"]))
    if run.ema is not None:
        run.ema.store(run.trainable)
        run.ema.copy_to(run.trainable)
    model.eval()
    try:
        gens = sample_generators(cfg.train.seed + 1, 0, 0, n)
        images = batch["image"][:n].to(run.device)
        if cfg.stage == "decoder":
            pipe = UnCLIPPipeline(
                clip,
                None,
                model,
                [],
                diffusion={"decoder": cfg.diffusion},
                sampling={"decoder": cfg.sampling},
            )
            out = pipe.decode(clip.encode_image(images), batch["caption"][:n], gens, progress=False)
        else:
            up = cfg.upsampler
            low = degrade(images.cpu(), up.low_res_size, up.corruption, gens, tuple(up.blur_sigma))
            low_up = upsample_low_res(low, up.sample_size).to(run.device)
            sched = make_scheduler(cfg.sampling.scheduler, cfg.diffusion)
            levels = torch.zeros(n, dtype=torch.long, device=run.device)
            out = sample_loop(
                lambda x, t: model(x, t, low_up, levels),
                (n, 3, up.sample_size, up.sample_size),
                sched,
                num_steps=cfg.sampling.steps,
                guidance_scale=1.0,
                generator=gens,
                device=run.device,
                progress=False,
            ).clamp(-1, 1)
            images = low_up
        row = torch.cat(
            [torch.nn.functional.interpolate(images.float(), size=out.shape[-2:]), out.float()]
        )
    finally:
        model.train()
        if run.ema is not None:
            run.ema.restore(run.trainable)
    tiles = to_output(row, "np")
    h, w = tiles.shape[1:3]
    grid = Image.new("RGB", (w * n, h * 2))
    for i, tile in enumerate(tiles):
        grid.paste(Image.fromarray(tile), ((i % n) * w, (i // n) * h))
    return grid


def main(argv=None) -> int:
    args = stage_argparser("unclip-train-decoder", __doc__.splitlines()[1]).parse_intermixed_args(
        argv
    )
    cfg = load_stage_config(args, ("decoder", "upsampler"))
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    run = TrainingRun(cfg, resume=args.resume, max_steps_this_run=args.max_steps_this_run)
    torch.manual_seed(cfg.train.seed)
    clip = FrozenCLIP.from_config(cfg.clip).to(run.device)
    if cfg.stage == "decoder":
        fields = to_dict(cfg.decoder)
        if fields.get("learned_variance"):
            raise ValueError(
                "training decoders with learned variance is not supported; set decoder.learned_variance=false"
            )
        model = UnCLIPDecoder.from_clip(clip, **fields)
        resolution, name = cfg.decoder.sample_size, "decoder"
        if cfg.data.resolution != resolution:
            raise ValueError(
                f"data.resolution ({cfg.data.resolution}) must equal decoder.sample_size ({resolution})"
            )
    else:
        fields = to_dict(cfg.upsampler)
        model = UnCLIPUpsampler(
            **{
                k: fields[k]
                for k in (
                    "sample_size",
                    "low_res_size",
                    "block_out_channels",
                    "layers_per_block",
                    "down_block_types",
                    "up_block_types",
                    "norm_num_groups",
                    "noise_level",
                )
            }
        )
        resolution, name = cfg.data.resolution, f"sr{cfg.upsampler.sample_size}"
    if cfg.train.gradient_checkpointing:
        model.unet.enable_gradient_checkpointing()
    model = run.prepare(model)
    model.train()
    null = clip.encode_text([""])
    noise_sched = training_scheduler(cfg.diffusion)
    data = make_batches(
        cfg.data,
        resolution=resolution,
        seed=cfg.train.seed,
        rank=run.rank,
        world_size=run.world,
        start=run.state.samples,
    )
    first = None
    for micro in run.steps(data):
        for batch in micro:
            first = first or batch
            with run.accumulate():
                gens = run.generators(len(batch["caption"]))
                if cfg.stage == "decoder":
                    loss = decoder_loss(
                        model, batch, clip, null, gens, cfg, noise_sched, run.device
                    )
                else:
                    loss = upsampler_loss(model, batch, gens, cfg, noise_sched, run.device)
                run.backward(loss)
        every = cfg.train.sample_every
        if every and (run.state.step + 1) % every == 0 and run.accelerator.is_main_process:
            path = run.out / "samples" / f"step_{run.state.step + 1:08d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            sample_grid(run, clip, first, null).save(path)
    return run.complete(name, clip)


if __name__ == "__main__":
    sys.exit(main())
