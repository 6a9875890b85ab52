"""Training speed against DALLE2-pytorch (``dalle2_pytorch``), the trainer unCLIP is usually trained
with: one training step of each stage, side by side, at matched parameter counts.

    python benchmarks/bench_peers.py --peers-python /path/to/venv-peers/bin/python
    python benchmarks/bench_peers.py --quick ...   # tiny models, 2 rounds: a smoke run (~1 min)
    python benchmarks/bench_peers.py --stages prior decoder --rounds 7 ...

``dalle2_pytorch`` pins ``open-clip-torch<3``, which this library's CLIP (open_clip 3) cannot
share a process with, so it lives in its own virtualenv (``--peers-python``, or
``UNCLIP_PEERS_PYTHON``; default: this interpreter) layered over the main one (same torch build);
see benchmarks/README.md ("Peers") for the commands. Without it the script prints how to create it
and exits 0.

Per stage (diffusion prior; 64 px base decoder; one upsampler, 64 → 128 px by default,
``--upsampler-size 256`` for the paper's 64 → 256, about 4× slower per step) both libraries build a
model of about the same parameter count (both counts are reported), at the same resolution, batch
and precision (fp32; ``--mixed-precision bf16``: both under bf16 autocast, unclip's
``train.mixed_precision`` and DALLE2's trainers handed ``Accelerator(mixed_precision="bf16")``),
and run one step at a time in their own worker process:

* unclip: its real training code, ``unclip.train.loop.TrainLoop.run_step`` with the stage's task
  (``PriorTask`` / ``DecoderTask`` / ``UpsamplerTask``: condition dropout, noising, the frozen CLIP
  encoding the captions inside the loss, blur + noise-level corruption of the upsampler's input) —
  loss, backward, clipping at 1.0, AdamW, LR schedule, EMA update;
* DALLE2-pytorch: ``DiffusionPriorTrainer`` / ``DecoderTrainer`` — ``loss = trainer(...)`` (loss and
  backward) then ``trainer.update()`` (clipping at 1.0, AdamW, LR schedule, EMA update). Its EMA
  (``ema_pytorch``) is told to update every step (its default is every 10th step after step 100) so
  both do the same work per step. It is fed precomputed CLIP text embeddings and token encodings
  (using its CLIP adapters would download pretrained weights); unclip's step encodes its captions
  with its frozen CLIP, so that time is measured (timer around ``clip.encode_text``) and a second
  ratio leaves it out. The benchmark's batches repeat six captions, so with the prior's caption
  cache (``train.text_cache_mb``, on by default) every encoding after the warm-up round comes from
  the cache; ``--no-text-cache`` measures the step of data whose captions never repeat.

One untimed warm-up round, then ``--rounds`` rounds of one step per library, the order alternating
(A B, B A, ...); the only process computing is the one timing its step. Ratios are medians of the
per-round ratios (``common.paired_ratio``). Memory: each worker's ``ru_maxrss`` (peak RSS) and its
increase over the high-water mark after the model, optimizer, EMA and batch were built (tracemalloc
would miss torch's allocations). Then one more step of each under ``torch.utils.flop_counter``
(FLOPs per sample, and per CPU second of the timed steps) and one under ``torch.profiler``: the
operators with the most self CPU time. The ratio is also computed from each step's CPU seconds,
steadier than wall time when other jobs share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import common
import torch

LIBS = ("unclip", "dalle2")
STAGES = ("prior", "decoder", "upsampler")
CAPTION_TOKENS = 12  # DALLE2 is fed token encodings this long (the rest zero = padding, as its
# prior and decoder read it)

# unclip sizes come from benchmarks/models.py; the DALLE2-pytorch networks below were sized to
# the same parameter counts (the script reports both). full = models.py's "mid", quick = "tiny".
SETUPS = {
    "full": {
        "size": "mid",
        "batch": {"prior": 8, "decoder": 2, "upsampler": 2},
        "upsampler_sizes": (64, 128),
        "unclip_upsampler": {},
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


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


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


# ------------------------------------------------------------------------------------------ worker
def worker(lib: str, stage: str, spec: dict) -> int:
    """One library, one stage: build, then answer the parent's commands (one JSON line each)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries' prints go to the log, not into the protocol
    warnings.filterwarnings("ignore")
    torch.set_num_threads(spec["threads"])

    def send(obj):
        proto.write(json.dumps(obj) + "\n")

    rss_start = _maxrss_mb()
    workdir = tempfile.mkdtemp(prefix="bench-peers-")
    try:
        t0 = time.perf_counter()
        built = (build_unclip if lib == "unclip" else build_dalle2)(stage, spec, workdir)
        rss_built = _maxrss_mb()
        send(
            {
                "params": built["params"],
                "config": built["config"],
                "versions": built["versions"],
                "shared": built["shared"],
                "build_s": time.perf_counter() - t0,
                "rss_start_mb": rss_start,
                "rss_built_mb": rss_built,
            }
        )
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "step":
                c0, t0 = time.process_time(), time.perf_counter()
                loss = built["step"]()
                dt = time.perf_counter() - t0
                send(
                    {
                        "s": dt,
                        "cpu_share": (time.process_time() - c0) / dt / spec["threads"],
                        "text_encode_s": built["text_encode_s"](),
                        "loss": float(loss),
                    }
                )
            elif cmd["cmd"] == "memory":
                peak = _maxrss_mb()
                send({"rss_peak_mb": peak, "rss_step_increase_mb": peak - rss_built})
            elif cmd["cmd"] == "profile":
                send(common.profile_top(built["step"], cmd["top"]))
            elif cmd["cmd"] == "flops":  # one more step under the FLOP counter (fwd + bwd)
                with common.flop_counter() as fc:
                    built["step"]()
                ops = fc.get_flop_counts().get("Global", {})
                send({"total": fc.get_total_flops(), "by_op": {str(k): v for k, v in ops.items()}})
            else:
                break
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


class Worker:
    def __init__(self, python: str, lib: str, stage: str, spec: dict, log_dir: Path):
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
        env["MKL_NUM_THREADS"] = str(spec["threads"])
        if lib == "unclip":  # this checkout's unclip, not an installed one
            env["PYTHONPATH"] = os.pathsep.join(
                [str(common.ROOT), *filter(None, [env.get("PYTHONPATH")])]
            )
        self.log = log_dir / f"{stage}-{lib}.log"
        args = [python, __file__, "--worker", lib, stage, json.dumps(spec)]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log.open("w"),
            text=True, env=env, cwd=common.ROOT,
        )  # fmt: skip
        self.name = f"{lib} {stage}"
        self.info = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = "".join(self.log.read_text().splitlines(keepends=True)[-30:])
            raise RuntimeError(f"the {self.name} worker failed:\n{tail}")
        return json.loads(line)

    def ask(self, cmd: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait()


# ------------------------------------------------------------------------------------------ parent
def run_stage(
    stage: str, spec: dict, pythons: dict, rounds: int, top: int, log_dir: Path, profile=True
) -> dict:
    workers = {}
    try:
        for lib in LIBS:  # built one after the other: each build has the CPU to itself
            common.log(f"[peers] {stage}: building {lib}")
            workers[lib] = Worker(pythons[lib], lib, stage, spec, log_dir)
            spec = {**spec, **workers[lib].info["shared"]}  # unclip's sizes, for DALLE2
        for lib in LIBS:  # warm-up round, untimed
            workers[lib].ask("step")
        steps = {lib: [] for lib in LIBS}
        for i in range(rounds):
            for lib in common.rounds_order(list(LIBS), i):
                steps[lib].append(workers[lib].ask("step"))
            common.log(
                f"[peers] {stage} round {i + 1}/{rounds}: "
                + ", ".join(f"{lib} {steps[lib][-1]['s']:.3f} s" for lib in LIBS)
            )
        memory = {lib: workers[lib].ask("memory") for lib in LIBS}
        flops = {lib: workers[lib].ask("flops") if profile else None for lib in LIBS}
        profiles = {lib: workers[lib].ask("profile", top=top) if profile else None for lib in LIBS}
    finally:
        for w in workers.values():
            w.close()
    b = spec["batch"]
    out = {"stage": stage, "batch": b, "rounds": rounds}
    if stage == "decoder":
        out["resolution"] = f"{spec['decoder_size']} px"
    elif stage == "upsampler":
        out["resolution"] = "{} → {} px".format(*spec["upsampler_sizes"])
    else:
        out["resolution"] = "-"
    for lib in LIBS:
        s = [x["s"] for x in steps[lib]]
        out[lib] = {
            **workers[lib].info,
            **memory[lib],
            "step_s": s,
            "text_encode_s": [x["text_encode_s"] for x in steps[lib]],
            "cpu_share": [x["cpu_share"] for x in steps[lib]],
            "loss": [x["loss"] for x in steps[lib]],
            "median_step_s": common.median(s),
            "samples_per_s": b / common.median(s),
            "profile": profiles[lib],
            "flops_per_step": flops[lib],
        }
        if flops[lib] is not None:
            cpu_s = common.median(
                [x * c * spec["threads"] for x, c in zip(s, out[lib]["cpu_share"])]
            )
            out[lib]["gflop_per_sample"] = flops[lib]["total"] / b / 1e9
            out[lib]["gflop_per_cpu_s"] = flops[lib]["total"] / cpu_s / 1e9
    u, d = out["unclip"]["step_s"], out["dalle2"]["step_s"]
    u_net = [x - c for x, c in zip(u, out["unclip"]["text_encode_s"])]
    # speed ratio: > 1 means unclip trains faster (DALLE2 seconds ÷ unclip seconds, per round)
    out["speed_ratio"] = common.paired_ratio(d, u)
    out["speed_ratio_of_medians"] = common.median(d) / common.median(u)
    # the same from each step's CPU seconds: steadier than wall time when other jobs share the
    # cores (a step that is descheduled waits without computing)
    cpu = {lib: [x * c for x, c in zip(out[lib]["step_s"], out[lib]["cpu_share"])] for lib in LIBS}
    out["speed_ratio_cpu_time"] = common.paired_ratio(cpu["dalle2"], cpu["unclip"])
    out["speed_ratio_without_text_encoding"] = common.paired_ratio(d, u_net)
    out["unclip_text_encode_share"] = common.median(
        [c / x for x, c in zip(u, out["unclip"]["text_encode_s"])]
    )
    out["param_difference"] = out["dalle2"]["params"] / out["unclip"]["params"] - 1
    return out


def skip_message(python: str, detail: str) -> str:
    return (
        f"bench_peers: skipped — dalle2_pytorch cannot be imported by {python} ({detail}).\n"
        "Create its environment (it pins open-clip-torch<3, so not in the main one) and pass it:\n"
        "    python -m venv venv-peers\n"
        "    python -c \"import sysconfig; print(sysconfig.get_paths()['purelib'])\" \\\n"
        "        > venv-peers/lib/python3.11/site-packages/_main_env.pth   # reuse torch etc.\n"
        "    venv-peers/bin/pip install dalle2-pytorch\n"
        "    python benchmarks/bench_peers.py --peers-python venv-peers/bin/python [--quick]\n"
        "(see benchmarks/README.md, section Peers)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds (~1 minute)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds (default 5; quick 2)"
    )
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument(
        "--upsampler-size",
        type=int,
        default=None,
        help="the upsampler's output size (default 128 from 64; quick: 32 from 16)",
    )
    parser.add_argument("--top", type=int, default=10, help="profiler rows per library")
    parser.add_argument(
        "--no-text-cache",
        action="store_true",
        help="unclip's prior encodes every caption (train.text_cache_mb=0), as for data whose "
        "captions never repeat",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=("no", "auto", "bf16"),
        default="no",
        help="no: both fp32 (DALLE2-pytorch's default; default); bf16: both under bf16 autocast "
        "(unclip's train.mixed_precision bf16, DALLE2's trainers handed "
        "Accelerator(mixed_precision='bf16'); results in bench_peers_bf16.json); auto: unclip's "
        "default (bf16 autocast on a CPU that runs it natively) against DALLE2's fp32 "
        "(bench_peers_auto.json, bench_peers_sweep_auto.json)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results name, NAME or NAME:KEY (default: by --mixed-precision and --sweep, above)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="samples/s vs batch (prior, decoder) and vs resolution (decoder), 3 rounds per "
        "point, no profiles: bench_peers_sweep.json and .png",
    )
    parser.add_argument(
        "--peers-python",
        default=os.environ.get("UNCLIP_PEERS_PYTHON", sys.executable),
        help="interpreter of the environment with dalle2_pytorch (env UNCLIP_PEERS_PYTHON)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    if rounds < 1:
        parser.error("--rounds must be >= 1")
    probe = subprocess.run(
        [args.peers_python, "-c", "import dalle2_pytorch; print(dalle2_pytorch.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        print(skip_message(args.peers_python, last))
        return 0
    started = time.perf_counter()
    setup = SETUPS["quick" if args.quick else "full"]
    spec = {
        "size": setup["size"],
        "threads": args.threads,
        "upsampler_sizes": [
            setup["upsampler_sizes"][0],
            args.upsampler_size or setup["upsampler_sizes"][1],
        ],
        "unclip_upsampler": setup["unclip_upsampler"],
        "dalle2": setup["dalle2"],
        "no_text_cache": args.no_text_cache,
        "mixed_precision": args.mixed_precision,
    }
    result = {
        "machine": common.machine(),
        "args": vars(args),
        "setup": "quick" if args.quick else "full",
        "rounds": rounds,
        "warmup_rounds": 1,
        "dalle2_pytorch": probe.stdout.strip(),
        "stages": [],
    }
    result["machine"]["threads"] = args.threads
    common.log("machine:", common.machine_line(result["machine"]))
    if args.mixed_precision == "auto":
        from unclip.train.optimizers import auto_mixed_precision

        result["unclip_mixed_precision"] = auto_mixed_precision("auto", gpu=False)
    pythons = {"unclip": sys.executable, "dalle2": args.peers_python}
    if args.sweep:
        return sweep(spec, pythons, args, result, started)
    with tempfile.TemporaryDirectory(prefix="bench-peers-logs-") as logs:
        for stage in args.stages:
            stage_spec = {**spec, "batch": setup["batch"][stage]}
            result["stages"].append(
                run_stage(stage, stage_spec, pythons, rounds, args.top, Path(logs))
            )
    name = "bench_peers" if args.mixed_precision == "no" else f"bench_peers_{args.mixed_precision}"
    return common.finish(args.out or name, result, started, report)


# the --sweep: (stage, batch, decoder resolution or None)
SWEEP = (
    [("prior", b, None) for b in (8, 32, 128)]
    + [("decoder", b, 64) for b in (1, 2, 4, 8)]
    + [("decoder", 2, r) for r in (32, 128)]
)
SWEEP_QUICK = [("prior", b, None) for b in (4, 16)] + [("decoder", 2, r) for r in (16, 32)]


def sweep(spec: dict, pythons: dict, args, result: dict, started: float) -> int:
    """Samples/s of both trainers vs batch and resolution (``--sweep``)."""
    points = SWEEP_QUICK if args.quick else SWEEP
    rounds = args.rounds or (2 if args.quick else 3)
    result["rounds"], result["sweep"] = rounds, []
    with tempfile.TemporaryDirectory(prefix="bench-peers-logs-") as logs:
        for stage, batch, res in points:
            point = {**spec, "batch": batch, "decoder_res": res}
            r = run_stage(stage, point, pythons, rounds, args.top, Path(logs), profile=False)
            result["sweep"].append(
                {
                    "stage": stage,
                    "batch": batch,
                    "resolution": res,
                    "unclip_samples_per_s": r["unclip"]["samples_per_s"],
                    "dalle2_samples_per_s": r["dalle2"]["samples_per_s"],
                    "speed_ratio": r["speed_ratio"],
                    "params": [r["unclip"]["params"], r["dalle2"]["params"]],
                }
            )
    name = "bench_peers_sweep_quick" if args.quick else "bench_peers_sweep"
    if args.mixed_precision != "no":
        name += f"_{args.mixed_precision}"
    result["plot"] = plot_sweep(
        result["sweep"], common.RESULTS / f"{name}.png", precision_label(result)
    )
    return common.finish(args.out or name, result, started, report_sweep)


def precision_label(r: dict) -> str:
    """How each library trained: fp32 both, bf16 both, or unclip's resolved ``auto`` against
    DALLE2's fp32."""
    if r["args"].get("mixed_precision") == "bf16":
        return "both bf16 autocast"
    mp = r.get("unclip_mixed_precision", "no")
    return "both fp32" if mp == "no" else f"unclip {mp} autocast, DALLE2 fp32"


def plot_sweep(rows: list[dict], path: Path, precision: str = "fp32") -> str:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("prior: samples/s vs batch", "batch", lambda r: r["stage"] == "prior"),
        (
            "64 px decoder: samples/s vs batch",
            "batch",
            lambda r: r["stage"] == "decoder" and r["resolution"] == 64,
        ),
        (
            "decoder, batch 2: samples/s vs resolution",
            "resolution",
            lambda r: r["stage"] == "decoder" and r["batch"] == 2,
        ),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (title, x, keep) in zip(axes, panels):
        sel = sorted((r for r in rows if keep(r)), key=lambda r: r[x])
        for lib, label in (("unclip", "unclip"), ("dalle2", "DALLE2-pytorch")):
            ax.plot(
                [r[x] for r in sel], [r[f"{lib}_samples_per_s"] for r in sel], "o-", label=label
            )
        ax.set(title=title, xlabel=x, ylabel="samples/s (1 thread)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(f"training step, {precision}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(common.ROOT))


def report_sweep(r: dict) -> str:
    rows = [{**x, "res": f"{x['resolution']} px" if x["resolution"] else "-"} for x in r["sweep"]]
    cols = [
        ("stage", "stage"),
        ("res", "res"),
        ("batch", "batch"),
        ("unclip samples/s", "unclip_samples_per_s"),
        ("DALLE2 samples/s", "dalle2_samples_per_s"),
        ("unclip ÷ DALLE2 (median of per-round ratios)", "speed_ratio"),
    ]
    title = (
        f"training samples/s vs batch and resolution, {precision_label(r)}, 1 thread, "
        f"{r['rounds']} rounds"
    )
    return (
        f"machine: {common.machine_line(r['machine'])}\n"
        + common.table(rows, cols, title)
        + (f"\nplot: {r['plot']}")
    )


def report(r: dict) -> str:
    out = [
        f"machine: {common.machine_line(r['machine'])}",
        f"dalle2_pytorch {r['dalle2_pytorch']}; {r['setup']} sizes; 1 warm-up round + "
        f"{r['rounds']} timed rounds of one step per library, order alternating",
    ]
    rows = []
    for s in r["stages"]:
        u, d = s["unclip"], s["dalle2"]
        rows.append(
            {
                "stage": s["stage"],
                "res": s["resolution"],
                "batch": s["batch"],
                "params": f"{u['params'] / 1e6:.3g} M / {d['params'] / 1e6:.3g} M "
                f"({s['param_difference']:+.1%})",
                "u_sps": u["samples_per_s"],
                "d_sps": d["samples_per_s"],
                "ratio": s["speed_ratio"],
                "ratio_net": s["speed_ratio_without_text_encoding"],
                "ratio_cpu": s.get("speed_ratio_cpu_time", "-"),
                "gflop": (
                    f"{u['gflop_per_sample']:.3g} / {d['gflop_per_sample']:.3g}"
                    if "gflop_per_sample" in u
                    else "-"
                ),
                "rate": (
                    f"{u['gflop_per_cpu_s']:.0f} / {d['gflop_per_cpu_s']:.0f}"
                    if "gflop_per_cpu_s" in u
                    else "-"
                ),
                "enc": f"{s['unclip_text_encode_share']:.1%}",
                "rss": f"{u['rss_peak_mb']:.0f} / {d['rss_peak_mb']:.0f}",
                "inc": f"{u['rss_step_increase_mb']:.0f} / {d['rss_step_increase_mb']:.0f}",
            }
        )
    cols = [
        ("stage", "stage"),
        ("res", "res"),
        ("batch", "batch"),
        ("params unclip / DALLE2 (diff.)", "params"),
        ("unclip samples/s", "u_sps"),
        ("DALLE2 samples/s", "d_sps"),
        ("**unclip ÷ DALLE2 speed** (median of per-round ratios)", "ratio"),
        ("same, without unclip's CLIP text encoding", "ratio_net"),
        ("same, from CPU seconds", "ratio_cpu"),
        ("GFLOP/sample unclip / DALLE2", "gflop"),
        ("GFLOP per CPU s", "rate"),
        ("CLIP text encoding share of unclip's step", "enc"),
        ("peak RSS MB unclip / DALLE2", "rss"),
        ("RSS increase in steps MB", "inc"),
    ]
    out.append(
        common.table(rows, cols, f"one training step, {precision_label(r)} (> 1: unclip faster)")
    )
    for s in r["stages"]:
        tops = [s[lib]["profile"]["top"] for lib in LIBS]
        prow = []
        for i in range(max(len(t) for t in tops)):
            row = {"rank": i + 1}
            for lib, t in zip(LIBS, tops):
                if i < len(t):
                    row[f"{lib}_op"] = t[i]["op"]
                    row[f"{lib}_ms"] = t[i]["self_cpu_ms"]
                    row[f"{lib}_share"] = f"{t[i]['share']:.1%}"
            prow.append(row)
        pcols = [("#", "rank")]
        for lib, name in zip(LIBS, ("unclip", "DALLE2")):
            pcols += [
                (f"{name} op", f"{lib}_op"),
                ("self ms", f"{lib}_ms"),
                ("share", f"{lib}_share"),
            ]
        totals = ", ".join(
            f"{name} {s[lib]['profile']['self_cpu_ms_total']:.0f} ms"
            for lib, name in zip(LIBS, ("unclip", "DALLE2"))
        )
        title = f"where the time goes: {s['stage']}, one profiled step (self CPU: {totals})"
        out.append(common.table(prow, pcols, title))
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        raise SystemExit(worker(sys.argv[2], sys.argv[3], json.loads(sys.argv[4])))
    raise SystemExit(main())
