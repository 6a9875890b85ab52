"""The attention and sampling sections of ``benchmarks/gpu_check.py``: which attention kernel each
network ran and its numerics against fp32; the bundled model's and a Karlo-size random cascade's
sampling, the latter against diffusers' ``UnCLIPPipeline`` on the same weights at equal precision;
DALL-E and Mega sampling with and without the key/value cache; ``pipe.compile()``, and the same
with CUDA graphs."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

import torch
from gpu_check_train import NEEDS_CUDA, SPEC, TINY, Skipped, load_config
from torch.utils._python_dispatch import TorchDispatchMode

PROMPTS = ["a red circle above a blue square", "a small green triangle on the left"]


# ----------------------------------------------------------------------------------- attention
class AttentionOps(TorchDispatchMode):
    """Counts the attention kernels that ran: SDPA's fused back-ends by their operator, xformers'
    by its namespace, and softmaxes (the math path, or an explicit matmul + softmax)."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        kind = None
        if "xformers" in name:
            kind = "xformers"
        elif "_scaled_dot_product_" in name or "_efficient_attention" in name:
            kind = name.split("::")[-1].split(".")[0].removeprefix("_scaled_dot_product_")
        elif "softmax" in name:
            kind = "softmax (math)"
        if kind:
            self.seen[kind] = self.seen.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))


def _networks(check):
    """``name → (module, run)``: each network of the training sections built by the training
    code at the check's size, and a call of its training loss on a fixed batch with fixed noise
    (``run(precision)``; dropout is off: eval mode)."""
    from unclip.nets.clip import CLIP
    from unclip.train.decoder import clip_device
    from unclip.train.loop import sample_generators
    from unclip.train.plan_build import _build, _synthetic_batch

    device = check.device
    out = {}
    for name in ("prior", "decoder", "upsampler_1"):
        spec = SPEC[name]
        cfg = load_config(spec, check.cpu, "no", check.work / f"attn-{name}", None)
        torch.manual_seed(0)
        with torch.device(clip_device(cfg, device)):
            clip = CLIP.from_config(cfg.clip)
        model, _ = _build(cfg, clip, device, "no")
        model.eval()
        batch = _synthetic_batch(cfg, clip, 2)

        def run(precision, model=model, cfg=cfg, clip=clip, batch=batch):
            # the task of the run's precision: it may choose kernels by it (the prior's on CPUs)
            _, task = _build_task(cfg, clip, device, precision)
            return task.loss(model, batch, sample_generators(0, 0, 0, 2))

        out[name] = (model, run)
    for name in ("dalle", "mega"):
        spec = SPEC[name]
        cfg = load_config(spec, check.cpu, "no", check.work / f"attn-{name}", Path("unused"))
        torch.manual_seed(0)
        with torch.device(device):
            net = cfg.transformer.build()
        net.eval()
        model_cfg = cfg.transformer.model
        ids, mask = cfg.transformer.caption_ids(PROMPTS)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, model_cfg.image_vocab_size, (2, model_cfg.grid**2), generator=g)

        def run(precision, net=net, ids=ids, mask=mask, tokens=tokens):
            out = net.loss(
                ids.to(device),
                mask.to(device),
                tokens.to(device),
                generator=torch.Generator().manual_seed(0),
                forward=net,
            )
            return out if isinstance(out, torch.Tensor) else out.loss

        out[name] = (net, run)
    return out


def _build_task(cfg, clip, device, precision):
    from unclip.train.decoder import DecoderTask, UpsamplerTask
    from unclip.train.prior import PriorTask

    if cfg.stage == "prior":
        return None, PriorTask(cfg, clip, device, precision)
    if cfg.stage == "decoder":
        return None, DecoderTask(cfg, clip, device, precision)
    return None, UpsamplerTask(cfg, clip, device)


def _first_output(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first_output(out[0])
    if isinstance(out, dict):
        return _first_output(next(iter(out.values())))
    return _first_output(out.to_tuple() if hasattr(out, "to_tuple") else out.sample)


def _set_xformers(model, on: bool) -> int:
    """xformers' attention on or off in every diffusers attention layer of ``model`` (as the
    pipelines' ``enable_xformers_memory_efficient_attention`` does per denoiser); how many."""
    from diffusers.models.attention_processor import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for attn in layers:
        attn.set_use_memory_efficient_attention_xformers(on)
    return len(layers)


def section_attention(check, rec: dict) -> None:
    """For each network: the fp32 reference (math attention, no TF32), then under fp16 and bf16
    autocast its default kernels (recorded) and each SDPA back-end forced in turn (xformers too
    where installed): the output's largest error relative to the reference's largest value, or
    why the back-end refused."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from unclip.pipeline.memory import xformers_available

    rows = rec.setdefault("rows", [])
    backends = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}
    if not check.cpu:
        backends.update(efficient=SDPBackend.EFFICIENT_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION)
    rec["xformers"] = "installed" if xformers_available() else "not installed"
    if check.cpu:
        rec["efficient_cudnn_xformers"] = NEEDS_CUDA
        rec["fp16"] = "not run in the smoke mode: the CPU's fp16 is bf16's code with another dtype"
    kind = check.device.type
    for name, (model, run) in _networks(check).items():
        outputs: list = []
        hook = model.register_forward_hook(
            lambda m, a, o, outputs=outputs: outputs.append(_first_output(o))
        )
        try:
            tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
            try:
                with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
                    run("no")
            finally:
                torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
            ref = outputs.pop().float()
            scale = float(ref.abs().max()) or 1.0
            precisions = [(torch.float16, "fp16"), (torch.bfloat16, "bf16")]
            # the CPU's fp16 is the same code with another dtype, and the smoke mode's budget
            for dtype, precision in precisions[1:] if check.cpu else precisions:
                variants = {"default": None, **backends}
                if xformers_available() and not check.cpu:
                    variants["xformers"] = "xformers"
                for label, backend in variants.items():
                    row = {"network": name, "precision": precision, "attention": label}
                    ops = AttentionOps()
                    try:
                        if backend == "xformers" and not _set_xformers(model, True):
                            raise ValueError("no diffusers attention layer: xformers not used")
                        ctx = (
                            sdpa_kernel(backend)
                            if isinstance(backend, SDPBackend)
                            else contextlib.nullcontext()
                        )
                        with torch.no_grad(), torch.autocast(kind, dtype=dtype), ctx, ops:
                            run(precision)
                        out = outputs.pop().float()
                        row["rel_max_err"] = float((out - ref).abs().max()) / scale
                        row["kernels"] = ", ".join(f"{k} ×{n}" for k, n in sorted(ops.seen.items()))
                    except Exception as e:  # a back-end that refuses these inputs is a finding
                        outputs.clear()
                        row["refused"] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
                    finally:
                        if backend == "xformers":  # the next precision's default is SDPA's
                            _set_xformers(model, False)
                    rows.append(row)
        finally:
            hook.remove()


# ------------------------------------------------------------------------------------ sampling
def _steps(check) -> dict:
    if check.cpu:
        return {"prior": {"steps": 2}, "decoder": {"steps": 2}, "upsampler": {"steps": 2}}
    return {"prior": {"steps": 25}, "decoder": {"steps": 25}, "upsampler": {"steps": 7}}


def _seconds_per_image(check, call, n: int, repeats: int) -> tuple[float, object]:
    """One untimed call (kernels chosen, caches filled), then the best of ``repeats``; the
    smoke mode's one timed call includes those first-call costs."""
    if check.cpu:
        seconds, out = check.timed(call)
        return seconds / n, out
    out = call()
    best = float("inf")
    for _ in range(repeats):
        seconds, out = check.timed(call)
        best = min(best, seconds)
    return best / n, out


def karlo_networks():
    """A random cascade shaped as Karlo (kakaobrain/karlo-v1-alpha), built on the default device
    (``with torch.device(...)``): ViT-L/14 CLIP, a 20-layer prior of width 2048, the 64 px decoder
    of widths 320…1280 × 3 blocks with learned variance, one 64 → 256 upsampler of the same
    widths; ``(clip, prior, decoder, upsampler)``."""
    from unclip.nets.clip import CLIP, ClipConfig
    from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
    from unclip.nets.prior import UnCLIPPrior

    torch.manual_seed(0)
    clip = CLIP.from_config(ClipConfig("ViT-L-14"))
    prior = UnCLIPPrior.from_clip(
        clip, num_layers=20, num_attention_heads=32, attention_head_dim=64
    )
    down = ("ResnetDownsampleBlock2D",) + ("SimpleCrossAttnDownBlock2D",) * 3
    up_types = ("SimpleCrossAttnUpBlock2D",) * 3 + ("ResnetUpsampleBlock2D",)
    widths = (320, 640, 960, 1280)
    decoder = UnCLIPDecoder.from_clip(
        clip,
        sample_size=64,
        block_out_channels=widths,
        layers_per_block=3,
        down_block_types=down,
        up_block_types=up_types,
        mid_block_type="UNetMidBlock2DSimpleCrossAttn",
        attention_head_dim=64,
        learned_variance=True,
    )
    up = UnCLIPUpsampler(
        low_res_size=64,
        sample_size=256,
        block_out_channels=widths,
        layers_per_block=3,
        down_block_types=("ResnetDownsampleBlock2D",) * 4,
        up_block_types=("ResnetUpsampleBlock2D",) * 4,
        noise_level_conditioning=False,
        add_attention=False,
        clamp_low_res=False,
    )
    return clip, prior, decoder, up


def karlo_pipeline(check):
    """The Karlo-size random cascade (:func:`karlo_networks`) as a pipeline exportable to
    diffusers, with Karlo's samplers; smoke mode: the tiny exportable cascade of
    ``benchmarks/models.py``."""
    from models import stage_models

    from unclip.pipeline.pipeline import UnCLIPPipeline

    if check.cpu:
        clip, prior, decoder, up = stage_models("tiny", exportable=True)
    else:
        with torch.device("cuda"):  # built on the GPU: random init of 3B parameters in seconds
            clip, prior, decoder, up = karlo_networks()
        clip.normalize_embeds = False  # Karlo's raw CLIP embeddings (what diffusers expects)
    sr = f"sr{up.config.sample_size}"
    pipe = UnCLIPPipeline(
        clip,
        prior,
        decoder,
        [up],
        diffusion={
            "prior": {"prediction_type": "sample"},
            "decoder": {"prediction_type": "epsilon"},
            sr: {"prediction_type": "epsilon"},
        },
        sampling={
            "prior": {"scheduler": "unclip", "steps": 25, "guidance_scale": 4.0, "best_of": 1},
            "decoder": {"scheduler": "unclip", "steps": 25, "guidance_scale": 8.0},
            sr: {"scheduler": "unclip", "steps": 7, "guidance_scale": 1.0},
        },
        prior_clip_range=5.0,
    )
    # equal precision with diffusers: the networks compute in the weights' dtype, no autocast
    pipe.autocast_dtype = None
    pipe.set_progress_bar_config(disable=True)
    for m in pipe.modules().values():
        m.eval().requires_grad_(False)
    return pipe


def section_sampling(check, rec: dict) -> None:
    """The bundled model's s/image in fp32 and under fp16/bf16 autocast; a Karlo-size random
    cascade sampled by unclip and by diffusers' ``UnCLIPPipeline`` from the same weights (exported
    with ``export_diffusers``), both with their weights in fp16 and in bf16, same prompts, same
    CPU generator: s/image each and the final images' difference. Smoke mode: the bundled model
    in fp32 only (its bf16 convolutions take a 2-core CPU some 20 s), the tiny exportable cascade
    against diffusers in fp32 (diffusers' bicubic upsampling has no bf16 CPU kernel)."""
    from diffusers import UnCLIPPipeline as DiffusersUnCLIP

    from unclip.interop.diffusers_export import export_diffusers
    from unclip.pipeline.pipeline import UnCLIPPipeline

    n = len(PROMPTS)
    sampling = _steps(check)
    repeats = 1 if check.cpu else 2
    rows = rec.setdefault("bundled", [])
    pipe = UnCLIPPipeline.from_pretrained(autocast_dtype=None).to(check.device)
    pipe.set_progress_bar_config(disable=True)
    precisions = [
        ("fp32", None),
        ("fp16 autocast", torch.float16),
        ("bf16 autocast", torch.bfloat16),
    ]
    if check.cpu:
        skipped = [
            {"precision": "fp16 autocast", "skipped": NEEDS_CUDA},
            {
                "precision": "bf16 autocast",
                "skipped": "skipped in the smoke mode (about 20 s of CPU)",
            },
        ]
        precisions = precisions[:1]
    for label, dtype in precisions:
        row: dict = {"precision": label}
        try:
            pipe.autocast_dtype = dtype

            def call():
                g = torch.Generator().manual_seed(0)
                return pipe(PROMPTS, generator=g, sampling=sampling, output_type="pt").images

            row["s_per_image"], images = _seconds_per_image(check, call, n, repeats)
            row["finite"] = bool(torch.isfinite(images).all())
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    if check.cpu:
        rows += skipped
    rows = rec.setdefault("karlo_vs_diffusers", [])
    t0 = time.perf_counter()
    ours = karlo_pipeline(check)
    rec["karlo_params_B"] = sum(p.numel() for m in ours.modules().values() for p in m.parameters())
    rec["karlo_params_B"] /= 1e9
    with tempfile.TemporaryDirectory(prefix="gpu-check-karlo-", dir=check.work) as tmp:
        if not check.cpu:
            ours.to(dtype=torch.float16)  # half the bytes written and read back
        export_diffusers(ours, Path(tmp) / "diffusers")
        theirs = DiffusersUnCLIP.from_pretrained(str(Path(tmp) / "diffusers"))
    rec["build_and_export_s"] = time.perf_counter() - t0
    theirs.set_progress_bar_config(disable=True)
    steps = {k: v["steps"] for k, v in sampling.items()}
    precisions = [("fp16", torch.float16), ("bf16", torch.bfloat16)]
    if check.cpu:
        skipped = [{"precision": label, "skipped": NEEDS_CUDA} for label, _ in precisions]
        precisions = [("fp32", torch.float32)]
    for label, dtype in precisions:
        row = {"precision": label}
        try:
            ours.to(check.device, dtype)
            theirs.to(check.device, dtype)

            def unclip_call():
                g = torch.Generator().manual_seed(0)
                return ours(PROMPTS, generator=g, sampling=sampling, output_type="pt").images

            def diffusers_call():
                out = theirs(
                    PROMPTS,
                    generator=torch.Generator().manual_seed(0),
                    output_type="np",
                    prior_num_inference_steps=steps["prior"],
                    decoder_num_inference_steps=steps["decoder"],
                    super_res_num_inference_steps=steps["upsampler"],
                )
                return torch.from_numpy(out.images).permute(0, 3, 1, 2).float()

            row["unclip_s_per_image"], a = _seconds_per_image(check, unclip_call, n, repeats)
            row["diffusers_s_per_image"], b = _seconds_per_image(check, diffusers_call, n, repeats)
            row["unclip_over_diffusers_time"] = (
                row["unclip_s_per_image"] / row["diffusers_s_per_image"]
            )
            a = a.float().cpu()
            row["image_max_abs_diff"] = float((a - b).abs().max())
            row["image_mean_abs_diff"] = float((a - b).abs().mean())
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    if check.cpu:
        rows += skipped


def _compile_check(check, rec: dict, pipe, **compile_kwargs) -> None:
    """Eager s/image, then ``pipe.compile(**compile_kwargs)``: the first compiled call's seconds
    (compiling every denoiser) against the eager call, the steady s/image after it, and the
    compiled images' difference from the eager ones."""
    sampling = _steps(check)
    n = len(PROMPTS)

    def call():
        g = torch.Generator().manual_seed(0)
        return pipe(PROMPTS, generator=g, sampling=sampling, output_type="pt").images

    torch._dynamo.reset()  # no earlier section's compiled frames count against this one's
    pipe.set_progress_bar_config(disable=True)
    rec["eager_s_per_image"], eager = _seconds_per_image(check, call, n, 1 if check.cpu else 2)
    pipe.compile(**compile_kwargs)
    rec["first_call_s"], _ = check.timed(call)
    rec["compile_s"] = rec["first_call_s"] - rec["eager_s_per_image"] * n
    rec["compiled_s_per_image"], compiled = _seconds_per_image(check, call, n, 1)
    rec["speedup"] = rec["eager_s_per_image"] / rec["compiled_s_per_image"]
    rec["image_max_abs_diff"] = float((compiled.float() - eager.float()).abs().max())


def _bundled_bf16(check):
    from unclip.pipeline.pipeline import UnCLIPPipeline

    pipe = UnCLIPPipeline.from_pretrained(autocast_dtype=None).to(check.device)
    pipe.autocast_dtype = torch.bfloat16
    return pipe


def section_compile(check, rec: dict) -> None:
    """``pipe.compile()`` (inductor) on the bundled model in bf16 autocast (see
    :func:`_compile_check`). Smoke mode: the tiny random cascade with the ``eager`` dynamo
    back-end (the tracing, not inductor's code generation, which takes a CPU minutes)."""
    from unclip.pipeline.tiny import tiny_pipeline

    if check.cpu:
        rec["backend"] = "eager (dynamo only)"
        _compile_check(check, rec, tiny_pipeline(seed=0), backend="eager")
    else:
        rec["backend"] = "inductor"
        _compile_check(check, rec, _bundled_bf16(check))


def section_cuda_graphs(check, rec: dict) -> None:
    """``pipe.compile(mode="reduce-overhead")`` on the bundled model in bf16 autocast: inductor
    with CUDA graphs, which replay each denoiser's kernels without launching them one by one (see
    :func:`_compile_check`). Needs CUDA: the smoke mode records the section as skipped."""
    if check.cpu:
        raise Skipped(f"{NEEDS_CUDA} (CUDA graphs)")
    rec["backend"] = "inductor, mode reduce-overhead"
    _compile_check(check, rec, _bundled_bf16(check), mode="reduce-overhead")


# -------------------------------------------------------------------------------------- tokens
def token_configs(cpu: bool, family: str):
    """The tokenizer and transformer configs of a DALL-E (over a dVAE) or Mega (over a VQGAN)
    token pipeline: on the GPU 16 × 16 image tokens of 128 px images after 64 caption tokens,
    width 512; the tiny configs in the smoke mode."""
    from unclip.train.token_config import (
        load_token_model_train_config,
        load_tokenizer_train_config,
    )

    tok_yaml, tr_yaml = (
        ("dvae.yaml", "dalle.yaml") if family == "dalle" else ("vqgan.yaml", "mega.yaml")
    )
    if cpu:
        tok_over, tr_over = [], []
    elif family == "dalle":
        tok_over = ["tokenizer.dvae={image_size: 128, num_codes: 1024, n_hid: 32, n_init: 32}"]
        tr_over = [
            "transformer.dalle={num_layers: 8, width: 512, num_heads: 8, text_len: 64, grid: 16, "
            "text_vocab_size: 49408, image_vocab_size: 1024, sparse_attention: false, "
            "conv_kernel: 3}"
        ]
    else:
        tok_over = [
            "tokenizer.vqgan={image_size: 128, block_out_channels: [32, 32, 64, 64], "
            "layers_per_block: 1, latent_channels: 32, num_codes: 1024, norm_num_groups: 16}"
        ]
        tr_over = [
            "transformer.mega={encoder_layers: 4, decoder_layers: 4, width: 512, num_heads: 8, "
            "glu_width: 1024, text_len: 64, grid: 16, text_vocab_size: 49408, "
            "image_vocab_size: 1024, text_bos_id: 49406, text_pad_id: 0, text_eos_id: 49407}"
        ]
    size = [] if cpu else ["data.resolution=128"]
    tok_cfg = load_tokenizer_train_config(TINY / tok_yaml, [*tok_over, *size]).tokenizer
    tr_cfg = load_token_model_train_config(TINY / tr_yaml, [*tr_over, *size]).transformer
    return tok_cfg, tr_cfg


def token_pipeline(check, family: str):
    """A random token pipeline of :func:`token_configs` on the check's device."""
    from unclip.pipeline.token_pipeline import TokenPipeline
    from unclip.sampling.tokens import TokenSampling

    tok_cfg, tr_cfg = token_configs(check.cpu, family)
    torch.manual_seed(0)
    pipe = TokenPipeline(
        tok_cfg.build(), tok_cfg, tr_cfg.build(), tr_cfg, sampling=TokenSampling(guidance_scale=2.0)
    )
    return pipe.to(check.device)


def section_tokens(check, rec: dict) -> None:
    """DALL-E's and Mega's token sampling with the key/value cache and without (the whole prefix
    recomputed for every token), same generator: s/image each, the ratio, and whether the images
    are the same."""
    rows = rec.setdefault("rows", [])
    for family in ("dalle", "mega"):
        row: dict = {"family": family}
        try:
            pipe = token_pipeline(check, family)
            row["image_tokens"] = pipe.num_image_tokens
            images = {}
            for cache in (True, False):

                def call(cache=cache, pipe=pipe):
                    return pipe(
                        PROMPTS,
                        generator=torch.Generator().manual_seed(0),
                        sampling={"transformer": {"use_cache": cache}},
                        output_type="pt",
                    ).images

                key = "cached" if cache else "uncached"
                row[f"{key}_s_per_image"], images[key] = _seconds_per_image(
                    check, call, len(PROMPTS), 1
                )
            row["speedup"] = row["uncached_s_per_image"] / row["cached_s_per_image"]
            row["image_max_abs_diff"] = float(
                (images["cached"].float() - images["uncached"].float()).abs().max()
            )
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
