"""The training section of ``benchmarks/gpu_check.py``: every stage's real training run (fp16 with
the scaler, bf16), killed and resumed; and the specs and run settings the other training sections
(``gpu_check_scale.py``) share.

Every run goes through the training commands' own functions (``train_prior``, ``train_decoder``,
``train_tokenizer``, ``train_token_model``: the loop, Accelerate, AdamW, clipping, EMA, the run
folder, checkpoints, export) on the shapes world the data loader renders; nothing is stubbed. The
GPU sizes are reduced widths of the paper's networks, the ``--cpu`` sizes the tiny test configs.

This module also holds what every section module shares: :data:`NEEDS_CUDA`, :class:`Skipped` and
the bookkeeping of the processes the sections start (the driver ends them when a section stops).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TINY = ROOT / "configs" / "tiny"
MiB = 2**20

#: what the smoke mode records in place of a figure only a GPU can give
NEEDS_CUDA = "skipped: needs CUDA"


class Skipped(Exception):
    """A section that cannot run here raises it; its message is the report's reason."""


# the processes the sections started: (process, whether it outlives the section that started it)
_CHILDREN: list = []


def start_child(ctx, target, args, keep: bool = False):
    """Start ``target(*args)`` in a process of ``ctx`` that :func:`end_children` kills if it is
    still running when its section ends (``keep``: when the run ends)."""
    proc = ctx.Process(target=target, args=args)
    proc.start()
    _CHILDREN.append((proc, keep))
    return proc


def end_children(everything: bool = False) -> None:
    """Kill the section's processes that still run (a section stopped by its time box or by an
    error leaves its runs behind); ``everything``: the kept ones too."""
    for proc, keep in list(_CHILDREN):
        if keep and not everything:
            continue
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)
        _CHILDREN.remove((proc, keep))


# a CLIP of width 256 for the GPU's stages: the frozen encoder every stage conditions on, wide
# enough that its kernels are the tensor-core ones a full-size model gets
GPU_CLIP = (
    "clip.model_cfg={embed_dim: 256, vision_cfg: {image_size: 64, layers: 4, width: 256, "
    "patch_size: 8, head_width: 64}, text_cfg: {context_length: 77, vocab_size: 49408, "
    "width: 256, heads: 4, layers: 4}}"
)
# the decoder's own caption transformer (the paper's decoder has one), at each mode's size
GPU_TEXT_ENCODER = [
    "decoder.text_encoder=transformer",
    "decoder.text_encoder_width=512",
    "decoder.text_encoder_layers=4",
    "decoder.text_encoder_heads=8",
    "decoder.text_context_length=77",
]
CPU_TEXT_ENCODER = [
    "decoder.text_encoder=transformer",
    "decoder.text_encoder_width=32",
    "decoder.text_encoder_layers=2",
    "decoder.text_encoder_heads=2",
    "decoder.text_context_length=16",
]
GPU_DECODER = [
    GPU_CLIP,
    "decoder.sample_size=64",
    "data.resolution=64",
    "decoder.block_out_channels=[128,256,384]",
    "decoder.layers_per_block=2",
    "decoder.down_block_types=[ResnetDownsampleBlock2D,SimpleCrossAttnDownBlock2D,"
    "SimpleCrossAttnDownBlock2D]",
    "decoder.up_block_types=[SimpleCrossAttnUpBlock2D,SimpleCrossAttnUpBlock2D,"
    "ResnetUpsampleBlock2D]",
    "decoder.attention_head_dim=64",
    "decoder.norm_num_groups=32",
    "decoder.dropout=0.1",
    *GPU_TEXT_ENCODER,
    "data.batch_size=8",
]


@dataclass(frozen=True)
class Spec:
    """One network's training run: its kind (which loader and training function), its tiny
    config, the overrides that make the GPU's reduced width and those of the CPU smoke mode, the
    tokenizer run a token model trains over, and the one precision the smoke mode trains it in
    (the GPU trains each in both)."""

    name: str
    kind: str  # prior | decoder (decoder or upsampler) | tokenizer | tokens
    config: str
    gpu: tuple[str, ...]
    cpu: tuple[str, ...] = ()
    tokenizer: Optional[str] = None
    cpu_precision: str = "bf16"


# the order matters: a token model trains over the tokenizer exported by an earlier run. The smoke
# mode trains each network once: in bf16 (a real CPU autocast) where that is cheap, in fp16 (which
# Accelerate runs as fp32 on a CPU, with no scaler) where bf16 CPU kernels take several times as
# long (the 64 px upsampler's convolutions, DALL-E's sequence); a token model in its tokenizer's
# precision
SPECS = [
    Spec(
        "dvae",
        "tokenizer",
        "dvae.yaml",
        (
            "tokenizer.dvae={image_size: 64, num_codes: 1024, n_hid: 64, blocks_per_group: 1, "
            "n_init: 64}",
            "data.resolution=64",
            "data.batch_size=8",
        ),
        cpu_precision="fp16",
    ),
    Spec(
        "vqgan",
        "tokenizer",
        "vqgan.yaml",
        (
            "tokenizer.vqgan={image_size: 64, block_out_channels: [64, 64, 128, 128], "
            "layers_per_block: 1, latent_channels: 64, num_codes: 1024, norm_num_groups: 32}",
            "data.resolution=64",
            "data.batch_size=8",
        ),
    ),
    Spec(
        "prior",
        "prior",
        "prior.yaml",
        (
            GPU_CLIP,
            "prior.num_layers=6",
            "prior.num_attention_heads=8",
            "prior.attention_head_dim=64",
            "data.batch_size=64",
        ),
    ),
    Spec("decoder", "decoder", "decoder.yaml", tuple(GPU_DECODER), tuple(CPU_TEXT_ENCODER)),
    Spec(
        "upsampler_1",
        "decoder",
        "sr32.yaml",
        (
            GPU_CLIP,
            "upsampler.low_res_size=64",
            "upsampler.sample_size=128",
            "upsampler.block_out_channels=[64,128]",
            "upsampler.norm_num_groups=32",
            "data.resolution=128",
            "data.batch_size=8",
        ),
    ),
    Spec(
        "upsampler_2",
        "decoder",
        "sr64.yaml",
        (
            GPU_CLIP,
            "upsampler.low_res_size=128",
            "upsampler.sample_size=256",
            "upsampler.block_out_channels=[32,64]",
            "data.resolution=256",
            "data.batch_size=4",
        ),
        cpu_precision="fp16",
    ),
    Spec(
        "dalle",
        "tokens",
        "dalle.yaml",
        (
            "transformer.dalle={num_layers: 6, width: 512, num_heads: 8, text_len: 64, grid: 8, "
            "text_vocab_size: 49408, image_vocab_size: 1024, sparse_attention: false, "
            "conv_kernel: 3, dropout: 0.1}",
            "data.resolution=64",
            "data.batch_size=8",
        ),
        ("transformer.dalle.dropout=0.1",),
        tokenizer="dvae",
        cpu_precision="fp16",
    ),
    Spec(
        "mega",
        "tokens",
        "mega.yaml",
        (
            "transformer.mega={encoder_layers: 3, decoder_layers: 3, width: 512, num_heads: 8, "
            "glu_width: 1024, text_len: 64, grid: 8, text_vocab_size: 49408, "
            "image_vocab_size: 1024, text_bos_id: 49406, text_pad_id: 0, text_eos_id: 49407, "
            "dropout: 0.1}",
            "data.resolution=64",
            "data.batch_size=8",
        ),
        ("transformer.mega.dropout=0.1",),
        tokenizer="vqgan",
    ),
]
SPEC = {s.name: s for s in SPECS}

#: steps of every run; the checkpoint of KILL_AFTER is on disk when the run is killed in the middle
#: of the next step, and the resumed run repeats the steps after it
STEPS, KILL_AFTER = 4, 2


def run_overrides(cpu: bool, precision: str, out: Path) -> list[str]:
    """What every training run of the check shares: 4 steps of 8 micro-batches (2 on the CPU),
    clipping at 1, EMA, a checkpoint every 2 steps, a loss in metrics.jsonl every step."""
    return [
        "train.progress=false",
        "train.trackers=[]",
        f"train.max_steps={STEPS}",
        f"train.checkpoint_every={KILL_AFTER}",
        "train.log_every=1",
        "train.warmup_steps=1",
        "train.sample_every=0",
        f"train.grad_accum_steps={2 if cpu else 8}",
        "train.max_grad_norm=1.0",
        "train.ema=true",
        f"train.mixed_precision={precision}",
        f"train.output_dir={out}",
        *(["data.batch_size=2"] if cpu else []),
    ]


def load_config(spec: Spec, cpu: bool, precision: str, out: Path, tokenizer: Optional[Path]):
    from unclip.train.config import load_stage_config
    from unclip.train.token_config import (
        load_token_model_train_config,
        load_tokenizer_train_config,
    )

    overrides = [*(spec.cpu if cpu else spec.gpu), *run_overrides(cpu, precision, out)]
    if tokenizer is not None:
        overrides.append(f"tokenizer={tokenizer}")
    path = TINY / spec.config
    if spec.kind == "tokenizer":
        return load_tokenizer_train_config(path, overrides)
    if spec.kind == "tokens":
        return load_token_model_train_config(path, overrides)
    return load_stage_config(path, overrides)


def train_function(kind: str):
    if kind == "prior":
        from unclip.train.prior import train_prior

        return train_prior
    if kind == "decoder":
        from unclip.train.decoder import train_decoder

        return train_decoder
    from unclip.train.tokens import train_token_model, train_tokenizer

    return train_tokenizer if kind == "tokenizer" else train_token_model


# ------------------------------------------------------------------------ a run killed mid-step
def killed_run(spec_name: str, cpu: bool, precision: str, out: str, tokenizer: Optional[str]):
    """In a fresh process (CUDA initialised there for the first time): train until the checkpoint
    of step KILL_AFTER is written, run the first micro-batch of the next step, then SIGKILL this
    process: no ``finally``, no flush, no lock released, as an out-of-memory killer or a
    preempted node leaves a run."""
    import torch

    from unclip.train.loop import TrainLoop
    from unclip.train.task import batch_size_of

    if cpu:
        torch.set_num_threads(1)
    logging.getLogger("unclip").setLevel(logging.WARNING)
    run_step = TrainLoop.run_step

    def run_step_then_die(self, task, micro):
        if self.state.step < KILL_AFTER:
            return run_step(self, task, micro)
        with self.accelerator.accumulate(self.model):
            loss = task.loss(self.model, micro[0], self.generators(batch_size_of(micro[0])))
            self.backward(loss)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        os.kill(os.getpid(), signal.SIGKILL)

    TrainLoop.run_step = run_step_then_die  # this process only: it dies in it
    spec = SPEC[spec_name]
    cfg = load_config(spec, cpu, precision, Path(out), Path(tokenizer) if tokenizer else None)
    train_function(spec.kind)(cfg, overwrite=True)


def forkserver(preload: Optional[list[str]] = None):
    """Processes forked from a server that imported the training code but never touched CUDA:
    each child starts in a fraction of a second and initialises CUDA afresh (a plain fork of this
    process could not, once it has). ``preload``: the modules the server imports before its first
    fork (:func:`preload_for`), set before the server starts."""
    ctx = multiprocessing.get_context("forkserver")
    if preload is not None:
        ctx.set_forkserver_preload(preload)
    return ctx


def preload_for(sections, networks=()) -> list[str]:
    """What the selected sections' children run: the server imports only that, since its imports
    compete with this process's for the CPU."""
    modules = ["torch", "unclip.train.loop", "gpu_check_train"]
    if "train" in sections:
        by_kind = {
            "prior": "unclip.train.prior",
            "decoder": "unclip.train.decoder",
            "tokenizer": "unclip.train.tokens",
            "tokens": "unclip.train.tokens",
        }
        modules += sorted({by_kind[s.kind] for s in selected_specs(networks)})
    if "fsdp" in sections:
        modules += ["unclip.train.decoder", "torch.distributed.fsdp", "gpu_check_scale"]
    if {"memory", "full_decoder"} & set(sections):
        modules += ["unclip.train.plan", "gpu_check_scale"]
    return list(dict.fromkeys(modules))


# ------------------------------------------------------------------ what a run did, and equality
@contextlib.contextmanager
def observed(facts: dict):
    """Record what the loop did on the device while the block runs: the precision Accelerate
    actually computed in, the EMA's and the weights' devices and dtypes, the gradient norms before
    clipping, the loss scale and the skipped steps. The loop's own methods run unchanged; the
    wrappers only read after them."""
    from accelerate import Accelerator

    from unclip.train.loop import TrainLoop

    update_ema, optimize, clip = (
        TrainLoop.update_ema,
        TrainLoop.optimize,
        Accelerator.clip_grad_norm_,
    )

    def update_ema_seen(self):
        update_ema(self)
        if self.ema is not None:
            shadow = self.ema.shadow_params[0]
            facts["ema_on"] = f"{shadow.device.type} {str(shadow.dtype).removeprefix('torch.')}"

    def optimize_seen(self, finite_loss):
        took = optimize(self, finite_loss)
        acc = self.accelerator
        # Accelerate accepts fp16 on a CPU and then computes in fp32 without a scaler: the row
        # says what ran, not what was asked for
        facts["autocast"] = acc.mixed_precision if acc.native_amp else "none (fp32)"
        facts["loss_scale"] = float(acc.scaler.get_scale()) if acc.scaler is not None else None
        facts["skipped_steps"] = self.state.nonfinite
        p = self.trainable[0]
        facts["weights_on"] = f"{p.device.type} {str(p.dtype).removeprefix('torch.')}"
        return took

    def clip_seen(self, parameters, max_norm, *args, **kwargs):
        norm = clip(self, parameters, max_norm, *args, **kwargs)
        if norm is not None:
            facts.setdefault("grad_norms", []).append(float(norm))
        return norm

    TrainLoop.update_ema, TrainLoop.optimize = update_ema_seen, optimize_seen
    Accelerator.clip_grad_norm_ = clip_seen
    try:
        yield facts
    finally:
        TrainLoop.update_ema, TrainLoop.optimize = update_ema, optimize
        Accelerator.clip_grad_norm_ = clip


def step_losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "loss" in entry:
            out[entry["step"]] = entry["loss"]
    return out


def compare_runs(a: Path, b: Path) -> dict:
    """Every tensor of the last checkpoint (weights, EMA, optimizer) and of the export, ``a``
    against ``b``, bit for bit; a tensor only one side has counts as unequal. Raises when ``a``
    has nothing to compare (an empty comparison would read as equal)."""
    import torch
    from safetensors.torch import load_file

    last = f"checkpoints/step_{STEPS:08d}"
    files = sorted(
        str(p.relative_to(a))
        for p in [*(a / last).glob("*.safetensors"), *(a / "final").rglob("*.safetensors")]
    )
    if not any(f.startswith(last) for f in files) or not any(f.startswith("final") for f in files):
        raise RuntimeError(f"{a}: no safetensors in {last} or in final/ to compare")
    tensors, unequal, worst = 0, [], 0.0
    for rel in files:
        x, y = load_file(str(a / rel)), load_file(str(b / rel))
        unequal += [f"{rel}:{k} (only in the second run)" for k in sorted(set(y) - set(x))]
        for k, v in x.items():
            tensors += 1
            if k not in y or not torch.equal(v, y[k]):
                unequal.append(f"{rel}:{k}")
                if k in y and v.is_floating_point() and v.shape == y[k].shape:
                    worst = max(worst, float((v.float() - y[k].float()).abs().max()))
    if tensors == 0:
        raise RuntimeError(f"{a}: its safetensors files hold no tensors")
    return {
        "files": len(files),
        "tensors": tensors,
        "unequal": len(unequal),
        "first_unequal": unequal[0] if unequal else "",
        "max_abs_diff": worst,
    }


def full_run(check, spec: Spec, precision: str) -> tuple[dict, Path, Optional[Path]]:
    """The uninterrupted run of ``spec``; its row so far, its base folder and the tokenizer it
    trained over."""
    row: dict = {}
    tok = None
    if spec.tokenizer:
        tok = check.work / f"train-{spec.tokenizer}-{precision}" / "full" / "final" / "tokenizer"
        if not tok.exists():
            raise RuntimeError(f"no tokenizer: the {spec.tokenizer} run of {precision} failed")
    base = check.work / f"train-{spec.name}-{precision}"
    train = train_function(spec.kind)
    facts: dict = {}
    with observed(facts):
        seconds, _ = check.timed(
            lambda: train(
                load_config(spec, check.cpu, precision, base / "full", tok), overwrite=True
            )
        )
    norms = facts.pop("grad_norms", [])
    losses = step_losses(base / "full")
    row.update(full_run_s=seconds, loss=losses.get(STEPS), grad_norm=norms[-1] if norms else None)
    row.update(facts)
    if row.get("loss_scale") is None:
        row["loss_scale"] = (
            NEEDS_CUDA if precision == "fp16" and check.cpu else f"no scaler ({precision})"
        )
    metrics = [json.loads(x) for x in (base / "full" / "metrics.jsonl").read_text().splitlines()]
    rates = [m["samples_per_s"] for m in metrics if "samples_per_s" in m]
    row["samples_per_s"] = rates[-1] if rates else None
    return row, base, tok


def resumed_run(check, spec: Spec, precision: str, row: dict, base: Path, tok, proc) -> None:
    """After the killed run's process ended: check it died of SIGKILL, resume its folder to the
    end and compare it with the uninterrupted run."""
    proc.join(timeout=max(check.left(), 1))
    if proc.is_alive():
        proc.kill()
        proc.join()
    row["killed_exit"] = proc.exitcode
    if proc.exitcode != -signal.SIGKILL:
        raise RuntimeError(f"the run to be killed ended with exit code {proc.exitcode}")
    split = base / "split"
    train_function(spec.kind)(load_config(spec, check.cpu, precision, split, tok), resume="latest")
    same = compare_runs(base / "full", split)
    losses, resumed = step_losses(base / "full"), step_losses(split)
    later = range(KILL_AFTER + 1, STEPS + 1)
    row["resumed_losses_equal"] = all(
        s in losses and s in resumed and resumed[s] == losses[s] for s in later
    )
    row.update({f"resumed_{k}": v for k, v in same.items()})
    row["bit_identical"] = same["unequal"] == 0 and row["resumed_losses_equal"]


def selected_specs(names) -> list[Spec]:
    """The specs of ``names`` (all when empty) and the tokenizers their token models need, in
    :data:`SPECS`' order."""
    if not names:
        return list(SPECS)
    want = set(names) | {SPEC[n].tokenizer for n in names if SPEC[n].tokenizer}
    return [s for s in SPECS if s.name in want]


def section_train(check, rec: dict) -> None:
    """Every network's training run in each precision (the smoke mode: in its
    ``cpu_precision``), killed and resumed (see module doc). Each killed run goes on in its own
    process beside the next network's uninterrupted run (at most one at a time), so the samples/s
    of a row are with one other run on the device; the resumes follow once every killed run has
    ended."""
    logging.getLogger("unclip").setLevel(logging.WARNING)
    ctx = forkserver()
    rows = rec.setdefault("runs", [])
    pending: list = []  # (spec, precision, row, base, tokenizer, process) awaiting the resume
    specs = selected_specs(check.networks)

    def error(row, e):
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:500])

    for precision in ["fp16", "bf16"]:
        for spec in specs:
            if check.cpu and spec.cpu_precision != precision:
                continue
            row: dict = {"network": spec.name, "precision": precision}
            rows.append(row)
            try:
                result, base, tok = full_run(check, spec, precision)
                row.update(result)
                if pending:  # one killed run at a time beside the parent's
                    pending[-1][-1].join(timeout=max(check.left(), 1))
                proc = start_child(
                    ctx,
                    killed_run,
                    (spec.name, check.cpu, precision, str(base / "split"), tok and str(tok)),
                )
                pending.append((spec, precision, row, base, tok, proc))
            except Exception as e:  # one network's failure is its row, the others go on
                error(row, e)
    for spec, precision, row, base, tok, proc in pending:
        try:
            resumed_run(check, spec, precision, row, base, tok, proc)
        except Exception as e:
            error(row, e)
    same = sum(bool(r.get("bit_identical")) for r in rows)
    rec["bit_identical_after_kill"] = f"{same} of {len(rows)} runs"
    if check.cpu:
        rec["fp16_loss_scaler"] = f"{NEEDS_CUDA} (Accelerate runs fp16 as fp32 on a CPU)"
