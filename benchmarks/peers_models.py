"""The models ``bench_peers.py`` trains one step at a time: each stage built by unclip (its real
``TrainLoop`` and task) and by DALLE2-pytorch (its trainers), at matched parameter counts.

Not part of the library; imported by the benchmark's workers (both virtualenvs: keep its
top-level imports to what the DALLE2-pytorch one has) and by other training benchmarks
(``bench_mixed_precision.py``, ``bench_train_options.py``) that build unclip's side.
"""

from __future__ import annotations

import random
import time

import common
import torch

LIBS = ("unclip", "dalle2")
CAPTION_TOKENS = 12  # DALLE2 is fed token encodings this long (the rest zero = padding, as its
# prior and decoder read it)

# unclip sizes come from benchmarks/models.py; the DALLE2-pytorch networks below were sized to
# the same parameter counts (the script reports both). full = models.py's "mid", quick = "tiny".
SETUPS = {
    "full": {
        "size": "mid",
        "batch": {"prior": 8, "decoder": 2, "upsampler": 2},
        "upsampler_sizes": (64, 128),
        # mid-block attention heads as wide as DALLE2's upsampler's (attn_dim_head=32 below);
        # diffusers' default of 8 computes the same FLOPs several times slower on a CPU
        "unclip_upsampler": {"attention_head_dim": 32},
        "dalle2": {
            "prior": dict(depth=6, dim_head=64, heads=4, ff_mult=3),
            "decoder": dict(
                dim=64,
                dim_mults=(1, 2, 4),
                num_resnet_blocks=(1, 1, 2),
                self_attn=(False, True, True),
                attn_heads=4,
                attn_dim_head=64,
            ),
            "upsampler": dict(
                dim=32,
                dim_mults=(1, 2, 3),
                num_resnet_blocks=(2, 2, 1),
                attn_heads=4,
                attn_dim_head=32,
            ),
        },
    },
    "quick": {
        "size": "tiny",
        "batch": {"prior": 8, "decoder": 4, "upsampler": 4},
        "upsampler_sizes": (16, 32),
        # tiny's upsampler has 47 k parameters, below the smallest DALLE2 Unet (72 k)
        "unclip_upsampler": {"block_out_channels": [16, 32]},
        "dalle2": {
            "prior": dict(depth=2, dim_head=16, heads=2, ff_mult=2.5),
            "decoder": dict(
                dim=8,
                dim_mults=(1, 2),
                num_resnet_blocks=2,
                self_attn=(False, True),
                attn_heads=2,
                attn_dim_head=8,
            ),
            "upsampler": dict(
                dim=8,
                dim_mults=(1, 2),
                num_resnet_blocks=(1, 2),
                resnet_groups=4,
                attn_heads=2,
                attn_dim_head=8,
                cond_dim=4,
            ),
        },
    },
}


def _count(params) -> int:
    return sum(p.numel() for p in params if p.requires_grad)


# ------------------------------------------------------------------------------------------ unclip
def build_unclip(stage: str, spec: dict, workdir: str) -> dict:
    """The stage's model in a real ``TrainLoop`` (optimizer, schedule, EMA) and a step function."""
    import models

    from unclip.train.config import load_stage_config
    from unclip.train.decoder import DecoderTask, UpsamplerTask, build_image_model
    from unclip.train.loop import TrainLoop
    from unclip.train.prior import PriorTask, build_prior_model

    size, b = spec["size"], spec["batch"]
    s = models.SIZES[size]
    torch.manual_seed(0)
    clip = models.clip_model(size)
    data = {
        "stage": stage,
        "clip": {"model_name": f"bench-{size}", "model_cfg": clip.model_cfg},
        "train": {
            # fp32 like DALLE2-pytorch's trainer by default; --mixed-precision auto: the default
            # a user of unclip gets (bf16 on a CPU that runs it natively); bf16: both sides bf16
            "mixed_precision": spec.get("mixed_precision", "no"),
            "max_grad_norm": 1.0,
            "grad_accum_steps": 1,  # one micro-batch per step, as DALLE2's trainer call
            "ema": True,
            "output_dir": workdir,
            "text_drop_prob": 0.1,
            "image_embed_drop_prob": 0.1,
            **({"text_cache_mb": 0} if spec.get("no_text_cache") else {}),
            **spec.get("train", {}),  # other settings (bench_mixed_precision.py: lr, warmup)
        },
    }
    plain = lambda d: {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}  # noqa: E731
    if stage == "prior":
        data["prior"] = dict(s["prior"])
        data["diffusion"] = {"prediction_type": "sample"}
    elif (
        stage == "decoder"
    ):  # learned variance + hybrid loss, as the paper's (and DALLE2's) decoder
        dec = {k: v for k, v in plain(s["decoder"]).items() if k != "cross_attention_dim"}
        data["decoder"] = {**dec, "learned_variance": True}
        if spec.get("decoder_res"):  # the --sweep's resolutions
            data["decoder"]["sample_size"] = spec["decoder_res"]
        data["diffusion"] = {"prediction_type": "epsilon", "vlb_weight": 0.001}
    else:
        lo, hi = spec["upsampler_sizes"]
        up = {**plain(s["upsampler"]), **spec["unclip_upsampler"]}
        data["upsampler"] = {**up, "low_res_size": lo, "sample_size": hi}
        data["upsampler_train"] = {"corruption": "blur", "max_noise_level": 250}
        data["diffusion"] = {"prediction_type": "epsilon"}
    cfg = load_stage_config(data)
    loop = TrainLoop(cfg, overwrite=True)
    model = build_prior_model(cfg, clip) if stage == "prior" else build_image_model(cfg, clip)
    model = loop.prepare(model)
    model.train()
    task = {"prior": PriorTask, "decoder": DecoderTask, "upsampler": UpsamplerTask}[stage](
        cfg, clip, loop.device
    )
    # time the frozen CLIP's caption encoding inside the loss (DALLE2 is given encodings instead)
    clock = {"s": 0.0}
    encode = clip.encode_text

    def timed_encode(*args, **kwargs):
        t0 = time.perf_counter()
        out = encode(*args, **kwargs)
        clock["s"] += time.perf_counter() - t0
        return out

    clip.encode_text = timed_encode
    gen = torch.Generator().manual_seed(1)
    batch = {"caption": common.captions(b)}
    if stage in ("prior", "decoder"):
        batch["image_embed"] = torch.nn.functional.normalize(
            torch.randn(b, clip.embed_dim, generator=gen), dim=-1
        )
    if stage != "prior":
        res = cfg.decoder.sample_size if stage == "decoder" else cfg.upsampler.sample_size
        batch["image"] = torch.rand(b, 3, res, res, generator=gen) * 2 - 1

    def step():
        clock["s"] = 0.0
        return loop.run_step(task, [batch])

    section = {"prior": "prior", "decoder": "decoder", "upsampler": "upsampler"}[stage]
    return {
        "step": step,
        "loop": loop,
        "task": task,
        "clip": clip,
        "text_encode_s": lambda: clock["s"],
        "params": _count(loop.trainable),
        "config": {**data[section], "diffusion": data["diffusion"], "clip": s["clip"]},
        "versions": {"torch": torch.__version__},
        # what the DALLE2 side is built to match
        "shared": {
            "embed_dim": clip.embed_dim,
            "context_length": s["clip"]["context_length"],
            "decoder_size": spec.get("decoder_res") or s["decoder"]["sample_size"],
        },
    }


# ------------------------------------------------------------------------------------------ DALLE2
def build_dalle2(stage: str, spec: dict, workdir: str) -> dict:
    """DALLE2-pytorch's model for the stage in its own trainer, fed precomputed CLIP embeddings."""
    import dalle2_pytorch
    from dalle2_pytorch import (
        Decoder,
        DecoderTrainer,
        DiffusionPrior,
        DiffusionPriorNetwork,
        DiffusionPriorTrainer,
        Unet,
    )

    random.seed(0)  # its low-res blur is drawn from Python's random
    torch.manual_seed(0)
    d, ctx, b = spec["embed_dim"], spec["context_length"], spec["batch"]
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["dalle2"][stage].items()}
    gen = torch.Generator().manual_seed(1)
    image_embed = torch.nn.functional.normalize(torch.randn(b, d, generator=gen), dim=-1)
    text_embed = torch.nn.functional.normalize(torch.randn(b, d, generator=gen), dim=-1)
    text_enc = torch.randn(b, ctx, d, generator=gen)
    text_enc[:, CAPTION_TOKENS:] = 0  # padding
    # its trainers' recipe (AdamW with decay / no-decay groups, LR schedule), clipping at 1.0 as
    # unclip's default, and an EMA update on every step
    trainer_kw = dict(
        max_grad_norm=1.0, ema_beta=0.9999, ema_update_after_step=0, ema_update_every=1
    )
    if spec.get("mixed_precision") == "bf16":
        # its own switch: the Accelerator its trainers are handed runs the forward under bf16
        # autocast (accelerate's prepare + the trainers' accelerator.autocast())
        import accelerate

        trainer_kw["accelerator"] = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    if stage == "prior":
        net = DiffusionPriorNetwork(dim=d, max_text_len=ctx, **kw)
        prior = DiffusionPrior(
            net=net,
            image_embed_dim=d,
            timesteps=1000,
            text_cond_drop_prob=0.1,
            image_cond_drop_prob=0.0,
            condition_on_text_encodings=True,
        )
        trainer = DiffusionPriorTrainer(prior, **trainer_kw)
        params = _count(prior.parameters())
        config = {"DiffusionPriorNetwork": {"dim": d, "max_text_len": ctx, **kw}}

        def step():
            # its forward scales the image embedding in place: a fresh copy every step
            loss = trainer(
                text_embed=text_embed, image_embed=image_embed.clone(), text_encodings=text_enc
            )
            trainer.update()
            return loss

    elif stage == "decoder":
        res = spec["decoder_size"]
        unet = Unet(
            image_embed_dim=d, text_embed_dim=d, cond_on_text_encodings=True, max_text_len=ctx, **kw
        )
        decoder = Decoder(
            unet=unet,
            image_sizes=(res,),
            timesteps=1000,
            image_cond_drop_prob=0.1,
            text_cond_drop_prob=0.1,
            learned_variance=True,
        )
        trainer = DecoderTrainer(decoder, **trainer_kw)
        params = _count(decoder.unets[0].parameters())
        config = {"Unet": {"image_embed_dim": d, "text_embed_dim": d, **kw}, "image_size": res}
        images = torch.rand(b, 3, res, res, generator=gen)  # its decoder takes [0, 1] images

        def step():
            loss = trainer(images, image_embed=image_embed, text_encodings=text_enc, unet_number=1)
            trainer.update(1)
            return loss

    else:
        lo, hi = spec["upsampler_sizes"]
        # a cascade needs its first U-Net; a minimal one, never trained here
        base = Unet(dim=8, dim_mults=(1,), num_resnet_blocks=1, image_embed_dim=d)
        sr = Unet(image_embed_dim=d, **kw)
        decoder = Decoder(
            unet=(base, sr),
            image_sizes=(lo, hi),
            timesteps=1000,
            use_noise_for_lowres_cond=True,  # Imagen-style noise level, like unclip's
            use_blur_for_lowres_cond=True,
            learned_variance=False,
        )
        trainer = DecoderTrainer(decoder, **trainer_kw)
        params = _count(decoder.unets[1].parameters())
        config = {"Unet": kw, "image_sizes": [lo, hi], "lowres": "blur (p=0.5) + noise level"}
        images = torch.rand(b, 3, hi, hi, generator=gen)

        def step():
            loss = trainer(images, image_embed=image_embed, unet_number=2)
            trainer.update(2)
            return loss

    import accelerate
    import ema_pytorch

    return {
        "step": step,
        "text_encode_s": lambda: 0.0,
        "params": params,
        "config": config,
        "shared": {},
        "versions": {
            "dalle2_pytorch": dalle2_pytorch.__version__,
            "ema_pytorch": getattr(ema_pytorch, "__version__", "?"),
            "accelerate": accelerate.__version__,
            "torch": torch.__version__,
        },
    }
