"""Memory bounds a pipeline checks before it allocates: decoder candidates (measured on a meta
copy of the decoder) and a token pipeline's images × candidates, against the free memory of the
device (:mod:`unclip.utils.limits`). ``unclip generate``, the pipelines' calls and the web demo
refuse what cannot fit with one line naming the setting, the estimate and the limit."""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from functools import partial
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unclip.utils.devices import under_fake_tensors
from unclip.utils.limits import available_memory, check_fits, format_bytes

__all__ = [
    "decoder_bytes_per_candidate",
    "memory_limit",
    "check_candidates_fit",
    "check_token_batch_fits",
]


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors the ops run under it make (each storage counted from the
    op that made it until its last reference goes). Run on the meta device it measures a
    forward's activations without allocating them."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.current = self.peak = 0

    def _free(self, key: int, _ref) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if id(st) not in self.live:
                n = st.nbytes()
                self.live[id(st)] = (weakref.ref(st, partial(self._free, id(st))), n)
                self.current += n
                self.peak = max(self.peak, self.current)
        return out


#: measured bytes per decoder candidate, by (decoder config, guided)
_CANDIDATE_BYTES: dict[tuple[str, bool], int] = {}


def decoder_bytes_per_candidate(decoder, guided: bool) -> int:
    """Bytes one more decoder candidate adds to a denoising step, at the least: the UNet
    forward's peak activations (two rows when guided: the conditioned and the unconditioned one)
    measured on a meta copy of the decoder (nothing allocated) with its image tokens as the
    only context (the caption's tokens would add attention the meta device computes in full
    where PyTorch's fused kernels do not), plus the sample, the next sample and the network's
    outputs (four float32 images). Counting only the images, as an earlier estimate did, missed
    the activations: some 40 times more at the tiny decoder's 16 px."""
    config = dict(decoder.config)
    key = (json.dumps(config, sort_keys=True, default=str), guided)
    if key not in _CANDIDATE_BYTES:
        with torch.device("meta"):
            meta = type(decoder).from_config(config)
        n = config["num_image_tokens"]
        width, caption_len = meta.image_to_tokens.out_features // n, 0
        # the UNet's own grid and channels: a latent decoder's are its latents'
        size, channels = meta.unet.config.sample_size, meta.unet.config.in_channels
        levels = len(config["block_out_channels"])
        if n in {(size >> i) ** 2 for i in range(levels)}:
            # diffusers pads the context's mask for the added self-attention keys only when the
            # context and the grid differ in length; one caption token keeps them apart
            caption_len = 1
        rows = 2 if guided else 1
        peaks = []
        for b in (rows, 2 * rows):  # the slope: what one more candidate adds
            meter = _LiveBytes()
            with meter, torch.no_grad():
                meta.unet(
                    torch.zeros(b, channels, size, size, device="meta"),
                    torch.zeros(b, dtype=torch.long, device="meta"),
                    encoder_hidden_states=torch.zeros(b, n + caption_len, width, device="meta"),
                    class_labels=torch.zeros(b, meta.image_to_time.out_features, device="meta"),
                    encoder_attention_mask=torch.ones(
                        b, n + caption_len, dtype=torch.bool, device="meta"
                    ),
                    return_dict=False,
                )
            peaks.append(meter.peak)
        # a latent decoder also holds each candidate's decoded image when it is scored
        pixels = config["sample_size"]
        samples = 4 * meta.sample_shape[0] * size * size * 4
        decoded = 3 * pixels * pixels * 4 if meta.is_latent else 0
        _CANDIDATE_BYTES[key] = max(0, peaks[1] - peaks[0]) + samples + decoded
    return _CANDIDATE_BYTES[key]


def memory_limit(device) -> tuple[Optional[int], str]:
    """The bytes a pipeline on ``device`` can still allocate and what they are: a CUDA device's
    free memory, else this machine's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"the free memory of {device}"
    return available_memory(), "this machine's available memory"


def _half(pipe) -> bool:
    return getattr(pipe, "autocast_dtype", None) in (torch.float16, torch.bfloat16)


def check_candidates_fit(pipe, settings: Mapping, rows: int, cli: bool = True) -> None:
    """Refuse decoder candidate counts whose denoising steps alone exceed the memory there is:
    every candidate of the ``rows`` images of one call is denoised at once
    (:func:`decoder_bytes_per_candidate` each; half of it under a 16-bit autocast). ``cli``:
    name the setting as ``unclip generate``'s option, else as the call's ``sampling`` entry."""
    if under_fake_tensors():
        return  # a dry run on fake CUDA (unclip plan) measures the memory itself
    decoder = settings.get("decoder")
    net = getattr(pipe, "decoder", None)
    if decoder is None or net is None or getattr(net, "config", None) is None:
        return
    if not hasattr(decoder, "best_of"):
        return
    counts = [getattr(decoder, name, None) or 0 for name in ("best_of", "best_of_contrasted")]
    if max(counts) <= 1:
        return  # one candidate per image: the plain batch, which --batch-size bounds
    from unclip.diffusion.loop import is_guided

    each = decoder_bytes_per_candidate(net, is_guided(decoder.guidance_scale))
    if _half(pipe):
        each //= 2
    limit, limit_name = memory_limit(pipe.device)
    size = net.config.sample_size
    for name, count in zip(("best_of", "best_of_contrasted"), counts):
        flag = f"--decoder-{name.replace('_', '-')}" if cli else f"sampling['decoder']['{name}']"
        what = (
            f"{format_bytes(each)} per {size}px candidate: the decoder's activations measured "
            f"on its config, {rows} image(s) at a time"
        )
        check_fits(flag, count, rows * each, what, limit, limit_name)


def check_token_batch_fits(pipe, settings, images: int) -> None:
    """Refuse, before anything is allocated, a token pipeline call whose ``images`` (prompts ×
    ``num_images_per_prompt``) × ``settings.candidates`` rows exceed the memory there is. Each
    row holds at the least the transformer's key/value cache (every layer's keys and values for
    the whole sequence; twice under super-conditioning), the logits of a step and the tokenizer
    decoder's first and last activations at full resolution; all rows are sampled at once."""
    from unclip.diffusion.loop import is_guided

    if under_fake_tensors():
        return  # a dry run on fake CUDA measures the memory itself
    model = pipe.transformer_config.model
    tok = pipe.tokenizer_config
    act = 2 if _half(pipe) else 4
    if pipe.transformer_config.type == "dalle":
        cache = model.num_layers * 2 * (model.text_len + 1 + model.image_len) * model.width
    else:  # mega: the decoder's self-attention cache and the encoder's keys and values
        cache = model.decoder_layers * 2 * (model.image_len + model.text_len) * model.width
    scale = settings.guidance_scale
    guided = scale is not None and is_guided(scale)
    top = tok.model.n_hid if tok.type == "dvae" else tok.model.block_out_channels[0]
    size = tok.model.image_size
    each = (
        cache * act * (2 if guided else 1)
        + model.image_vocab_size * 4 * (3 if guided else 1)
        + 2 * top * size * size * 4
    )
    k = settings.candidates
    limit, limit_name = memory_limit(pipe.device)
    what = (
        f"{format_bytes(each)} per candidate: the transformer's key/value cache and the "
        f"tokenizer decoder at {size}px; every candidate of every image is sampled at once"
    )
    setting = f"{images} image(s) (prompts × num_images_per_prompt) × sampling.candidates"
    check_fits(setting, k, images * each, what, limit, limit_name)
