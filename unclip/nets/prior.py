"""The diffusion prior: CLIP text → CLIP image embedding (Ramesh et al. 2022, §2.2).

:class:`UnCLIPPrior` wraps diffusers' ``PriorTransformer`` (a causal transformer over
``[text tokens (L), text_embed, time, x_t, prediction token]``) with the unCLIP glue:

* embedding normalisation: the diffusion runs on ``(image_embed − mean) / std`` with per-dimension
  statistics stored with the weights (``set_embedding_stats``), as in Karlo;
* a projection of the text token states ``[B, L, W]`` to the embedding width ``D`` when ``W != D``;
* optionally the paper's own caption transformer (``text_encoder="transformer"``): the
  transformer's text tokens are then the states of a trainable
  :class:`~unclip.nets.text_encoder.CaptionTransformer` over the caption's token ids
  (``TextEncoding.caption_ids``) instead of the frozen CLIP's token states; the CLIP text
  embedding stays an input (paper §2.2). diffusers' ``UnCLIPPipeline`` cannot hold such a prior;
* ``x_0`` prediction (the transformer predicts the clean normalised embedding);
* optionally DALL-E Mega's transformer recipe (``normformer``, ``ff_activation``): the
  transformer's blocks are then :class:`~unclip.nets.blocks.TransformerBlock` instead of
  diffusers' ``BasicTransformerBlock`` (embeddings, masks and output head stay diffusers'). With
  both options at their defaults the network is diffusers' ``PriorTransformer`` unchanged, so
  existing weights load and export as before; a prior with either option cannot be exported to
  diffusers (:func:`unclip.interop.diffusers.export_problems` says so).

The unconditional input for classifier-free guidance is the CLIP encoding of the empty caption (as
in Karlo and diffusers), so exported weights sample identically elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models import ModelMixin, PriorTransformer
from diffusers.models import attention_processor as attn_procs
from diffusers.models.attention_processor import Attention

from unclip.nets.attention import checkpoint
from unclip.nets.blocks import SelfAttention, TransformerBlock, check_block_options
from unclip.nets.text_encoder import CaptionTransformer, caption_tokenizer
from unclip.nets.text_encoding import TextEncoding, check_prompts
from unclip.utils import offload
from unclip.utils.devices import lengths_may_follow_values
from unclip.utils.precision import KeepFp32Mixin

__all__ = ["UnCLIPPrior", "prior_caption_ids"]


class PriorLoading:
    """Building and loading shared by both priors (diffusion and autoregressive): sized from a
    CLIP, loaded from safetensors only."""

    @classmethod
    def from_clip(cls, clip, **kwargs):
        """A prior sized for ``clip`` (a :class:`~unclip.nets.clip.CLIP`)."""
        return cls(
            embed_dim=clip.embed_dim,
            text_width=clip.text_width,
            context_length=clip.context_length,
            **kwargs,
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader restricted to safetensors weights (pickles can run code: refused)."""
        from unclip.io.weights import safe_model_from_pretrained

        return safe_model_from_pretrained(
            super().from_pretrained, pretrained_model_name_or_path, "prior", **kwargs
        )


# ignore: diffusers types ModelMixin.to through functools.wraps, its class defaults by None
class UnCLIPPrior(PriorLoading, KeepFp32Mixin, ModelMixin, ConfigMixin):  # type: ignore[misc]
    """Prior network. ``forward(x_t [B,D], t [B], text) → x_0 prediction [B,D]`` (normalised
    space). ``normformer`` / ``ff_activation``: see :mod:`unclip.nets.blocks`.
    ``text_encoder``: ``"clip"`` (the CLIP token states of ``text``) or ``"transformer"`` (its own
    caption transformer of ``text_encoder_width/layers/heads`` over ``text_context_length`` ids
    of ``text_tokenizer``, read from ``text.caption_ids``; ``context_length`` is then unused)."""

    # enable_gradient_checkpointing reaches the own caption transformer's blocks only (diffusers'
    # PriorTransformer has no checkpointing); a prior without one refuses it
    _supports_gradient_checkpointing = True
    # the embedding statistics stay float32 in a float16/bfloat16 prior (unclip.utils.precision)
    _keep_in_fp32_modules = ["clip_mean", "clip_std"]  # type: ignore[assignment]  # base: None

    if TYPE_CHECKING:
        # diffusers' FrozenDict of the registered arguments, whose fields it also sets as attributes
        config: Any

    @register_to_config
    def __init__(
        self,
        embed_dim: int = 768,
        text_width: int = 768,
        context_length: int = 77,
        num_layers: int = 24,
        num_attention_heads: int = 32,
        attention_head_dim: int = 64,
        dropout: float = 0.0,
        normformer: bool = False,
        ff_activation: str = "gelu",
        text_encoder: str = "clip",
        text_encoder_width: int = 2048,
        text_encoder_layers: int = 24,
        text_encoder_heads: int = 32,
        text_context_length: int = 256,
        text_tokenizer: str = "open_clip_bpe",
    ):
        super().__init__()
        check_block_options(normformer, ff_activation)
        if text_encoder not in ("clip", "transformer"):
            raise ValueError(
                f"prior text_encoder must be 'clip' or 'transformer', got {text_encoder!r}"
            )
        self.text_transformer: Optional[CaptionTransformer] = None
        if text_encoder == "transformer":
            self.text_transformer = CaptionTransformer.for_tokenizer(
                text_tokenizer,
                text_context_length,
                text_encoder_width,
                text_encoder_layers,
                text_encoder_heads,
            )
            # the caption's positions in the transformer's sequence are its own tokens'
            text_width, context_length = text_encoder_width, text_context_length
        self.transformer = PriorTransformer(
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            num_layers=num_layers,
            embedding_dim=embed_dim,
            num_embeddings=context_length,
            additional_embeddings=4,
            dropout=dropout,
        )
        if normformer or ff_activation != "gelu":
            # diffusers' PriorTransformer runs whatever sits in transformer_blocks as
            # block(hidden_states, attention_mask=[B * heads, S, S] additive mask)
            self.transformer.transformer_blocks = torch.nn.ModuleList(
                TransformerBlock(
                    num_attention_heads * attention_head_dim,
                    num_attention_heads,
                    attention_head_dim,
                    dropout=dropout,
                    normformer=normformer,
                    ff_activation=ff_activation,
                )
                for _ in range(num_layers)
            )
        self.text_token_proj = (
            torch.nn.Linear(text_width, embed_dim)
            if text_width != embed_dim
            else torch.nn.Identity()
        )
        with torch.no_grad():  # identity statistics until set from data
            self.transformer.clip_std.fill_(1.0)

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        """diffusers' checkpointing of the own caption transformer's blocks, recomputed with the
        SDPA kernels their forward ran (the training step on a CPU in bf16 picks the math kernel
        around the loss only: :func:`unclip.nets.attention.checkpoint`)."""
        super().enable_gradient_checkpointing(gradient_checkpointing_func or checkpoint)

    # ------------------------------------------------------------------ statistics
    def set_embedding_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Store the per-dimension mean/std ``[D]`` of the training image embeddings."""
        d = self.config.embed_dim
        if mean.shape[-1] != d or std.shape[-1] != d:
            raise ValueError(
                f"embedding statistics must have {d} dims, got {tuple(mean.shape)} and "
                f"{tuple(std.shape)}"
            )
        if not torch.isfinite(mean).all() or not torch.isfinite(std).all() or (std <= 0).any():
            raise ValueError("embedding statistics must be finite with std > 0")
        with torch.no_grad():
            self.transformer.clip_mean.copy_(mean.reshape(1, d))
            self.transformer.clip_std.copy_(std.reshape(1, d))

    def normalize(self, image_embed: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` CLIP image embeddings → the diffusion's normalised space."""
        tr = self.transformer
        return (image_embed - tr.clip_mean.to(image_embed)) / tr.clip_std.to(image_embed)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`normalize`."""
        tr = self.transformer
        return x * tr.clip_std.to(x) + tr.clip_mean.to(x)

    # ------------------------------------------------------------------ captions
    @property
    def has_text_encoder(self) -> bool:
        """True when the prior encodes captions itself (``text_encoder="transformer"``)."""
        return self.text_transformer is not None

    def tokenize(self, prompts) -> Optional[torch.Tensor]:
        """Captions → the token ids ``[B, text_context_length]`` its caption transformer reads;
        None for a prior that reads CLIP token states (it needs no ids)."""
        if not self.has_text_encoder:
            return None
        return prior_caption_ids(self.config, check_prompts(prompts))

    def check_text(self, text: TextEncoding) -> None:
        """``ValueError`` unless ``text`` carries what this prior reads: ``caption_ids`` for a
        prior with its own caption transformer."""
        if self.has_text_encoder and text.caption_ids is None:
            raise ValueError(
                "this prior encodes captions with its own text transformer (text_encoder: "
                "transformer): pass the prompts as strings, or a TextEncoding with caption_ids "
                "(pipe.encode_text(prompts))"
            )

    def text_inputs(self, text: TextEncoding) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's text tokens ``[B, L, D]`` (projected to the embedding width) and
        their mask ``[B, L]``: the CLIP token states, or the caption transformer's states of
        ``text.caption_ids``."""
        if self.text_transformer is None:
            return self.text_token_proj(text.text_tokens.to(self.dtype)), text.text_mask
        self.check_text(text)
        assert text.caption_ids is not None  # check_text raised otherwise
        ids = text.caption_ids.to(self.device)
        states, mask, _ = self.text_transformer(ids)
        # the caption transformer stops at the batch's longest caption; the prior's positions are
        # laid out for the whole context, so the rest comes back as masked padding
        missing = ids.shape[1] - states.shape[1]
        tokens = F.pad(self.text_token_proj(states.to(self.dtype)), (0, 0, 0, missing))
        return tokens, F.pad(mask, (0, missing), value=False)

    # ------------------------------------------------------------------ network
    def forward(self, x_t: torch.Tensor, t: torch.Tensor, text: TextEncoding) -> torch.Tensor:
        """``x_t [B, D]``, ``t [B]`` or scalar, ``text`` with ``B`` rows → predicted
        ``x_0 [B, D]``."""
        tokens, mask = self.text_inputs(text)
        keep = self._text_positions_kept(tokens, mask)
        if keep is not None:
            return self._forward_trimmed(x_t, t, text.text_embed, tokens, mask, keep)
        out = self.transformer(
            x_t.to(self.dtype),
            timestep=t,
            proj_embedding=text.text_embed.to(self.dtype),
            encoder_hidden_states=tokens,
            attention_mask=mask,
            return_dict=False,
        )[0]
        return out

    #: run the transformer without the text padding every row of a batch has at its end (see
    #: :meth:`_forward_trimmed`); off, every call runs diffusers' forward over all positions
    trim_text_padding: bool = True

    def _text_positions_kept(
        self, tokens: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> Optional[int]:
        """How many leading text positions :meth:`_forward_trimmed` keeps, or None where the
        whole sequence runs through diffusers' forward: nothing to trim, trimming switched off,
        forward or backward hooks or a replaced ``forward`` on the transformer (which the trimmed
        path never calls), a sequence laid out otherwise, or shapes that must not depend on the
        data (a graph being compiled or traced, fake or meta tensors)."""
        tr = self.transformer
        if not self.trim_text_padding or mask is None or tr.prd_embedding is None:
            return None
        n = tokens.shape[1]
        if tr.positional_embedding.shape[1] != n + 4 or n == 0:
            return None
        if not lengths_may_follow_values(mask):
            return None
        # global module hooks (a FLOP counter's, a profiler's) see every module that computes
        # either way; only hooks on the transformer itself would miss its call
        if not _calls_as_defined(tr) or tr._backward_hooks or tr._backward_pre_hooks:
            return None
        positions = torch.arange(1, n + 1, device=mask.device)
        # the last position any row attends to; at least one, so the sequence keeps its layout
        keep = max(1, int(torch.where(mask.bool().any(0), positions, 0).max()))
        return keep if keep < n else None

    def _forward_trimmed(
        self,
        x_t: torch.Tensor,
        t,
        text_embed: torch.Tensor,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        keep: int,
    ) -> torch.Tensor:
        """diffusers' ``PriorTransformer`` forward over ``[the first keep text tokens, text
        embedding, time, x_t, prediction]``, each position with the positional embedding and
        causal mask entries it has in the whole sequence.

        The dropped positions are padding in every row: as keys they are masked with an additive
        ``-10000``, whose softmax weight is exactly zero, and as queries their outputs reach no
        other position, so the prediction and every gradient equal the whole sequence's up to
        float rounding (with dropout, equal in distribution: its masks are drawn for the kept
        positions only), while the blocks' work shrinks with the sequence (captions are mostly
        far shorter than the context). Reading ``keep`` off the mask costs one device sync per
        call."""
        tr = self.transformer
        b, n, dtype = x_t.shape[0], tokens.shape[1], self.dtype
        kept = torch.cat([torch.arange(keep), torch.arange(n, n + 4)]).to(tokens.device)
        tokens, mask = tokens[:, :keep], mask[:, :keep]
        # as diffusers: a Python number is a whole timestep, a tensor keeps its dtype
        t = torch.as_tensor(t, device=x_t.device, dtype=None if torch.is_tensor(t) else torch.long)
        t = (t[None] if t.dim() == 0 else t) * torch.ones(b, dtype=t.dtype, device=x_t.device)
        time = tr.time_embedding(tr.time_proj(t).to(dtype))
        proj = text_embed.to(dtype)
        if tr.embedding_proj_norm is not None:
            proj = tr.embedding_proj_norm(proj)
        if tr.encoder_hidden_states_proj is not None:
            tokens = tr.encoder_hidden_states_proj(tokens)
        x = tr.proj_in(x_t.to(dtype))
        prd = tr.prd_embedding.to(x.dtype).expand(b, -1, -1)
        h = torch.cat([tokens, tr.embedding_proj(proj)[:, None], time[:, None], x[:, None], prd], 1)
        h = h + tr.positional_embedding[:, kept].to(x.dtype)
        bias = F.pad((1 - mask.to(h.dtype)) * -10000.0, (0, 4), value=0.0)
        causal = tr.causal_attention_mask[0][kept][:, kept]
        heads = tr.config.num_attention_heads
        attn_mask = (bias[:, None, :] + causal).to(h.dtype).repeat_interleave(heads, dim=0)
        if tr.norm_in is not None:
            h = tr.norm_in(h)
        for block in tr.transformer_blocks:
            h = block(h, attention_mask=attn_mask)
        return tr.proj_to_clip_embeddings(tr.norm_out(h)[:, -1])

    def conditioned(
        self, text: TextEncoding
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``fn(x_t, t)`` computing ``self(x_t, t, text)`` for one ``text`` over a sampling run.

        The transformer's sequence is ``[text tokens, text embedding, time, x_t, prediction]``
        under a causal mask, so the text's L + 1 positions never see the time or ``x_t``: their
        keys and values are the same at every step. ``fn`` computes them once and runs only the
        last three positions per call (:class:`PrefixCache`), with PyTorch's
        ``scaled_dot_product_attention`` in place of diffusers' plain attention processors
        (``AttnProcessor``, ``AttnProcessor2_0``, ``SlicedAttnProcessor``,
        ``XFormersAttnProcessor``: the sequences are at most L + 4 positions long, so slicing
        would save no memory). Forward hooks on the blocks and the modules inside them run, on the
        inputs the cache gives them: the text positions once, then three positions per step.

        Where the cache would skip or change something, ``fn`` is the plain forward: any module
        of the prior in training mode (dropout); a module compiled in place (``.compile()``);
        forward hooks or a replaced ``forward`` on the prior or its transformer, which the cache
        never calls, or a replaced ``forward`` on an attention module, which it would override
        (the hooks of :meth:`~unclip.pipeline.UnCLIPPipeline.enable_model_cpu_offload` only bring
        the weights in, and keep the cache); global module hooks; blocks or attention of another
        kind, or another attention processor. A ``torch.compile(prior)`` wrapper hands
        ``conditioned`` to the module it wraps; the sampler calls the wrapper itself instead."""
        cache = PrefixCache.build(self, text)
        return PlainForward(self, text) if cache is None else cache


def prior_caption_ids(config, prompts) -> Optional[torch.Tensor]:
    """Token ids ``[B, text_context_length]`` of ``prompts`` for a prior with ``config`` (a
    :class:`~unclip.nets.config.PriorConfig` or a prior's ``config``) that has its own caption
    transformer; None for one that reads CLIP token states."""
    if getattr(config, "text_encoder", "clip") != "transformer":
        return None
    return caption_tokenizer(config.text_tokenizer, config.text_context_length)(prompts)


@dataclasses.dataclass
class PlainForward:
    """``fn(x_t, t)`` calling ``prior`` (or its ``torch.compile`` wrapper) on the whole sequence
    for a fixed ``text``: where :class:`PrefixCache` does not apply."""

    prior: torch.nn.Module
    text: TextEncoding

    def __call__(self, x_t: torch.Tensor, t) -> torch.Tensor:
        return self.prior(x_t, t, self.text)


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a module in it runs compiled: ``.compile()`` in place, or a
    ``torch.compile(...)`` wrapper (an ``OptimizedModule``, only defined once dynamo is loaded)."""
    frames = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(frames, "OptimizedModule", ())
    return any(
        getattr(m, "_compiled_call_impl", None) is not None or isinstance(m, wrapper)
        for m in module.modules()
    )


def _forward_replaced(module: torch.nn.Module) -> bool:
    """Whether ``module`` has an instance ``forward`` other than its own method or the one model
    offload installs (:class:`unclip.utils.offload.ModelOffloader`, whose hook only brings the
    component's weights to the device before any submodule runs)."""
    forward = vars(module).get("forward")
    if forward is None or getattr(forward, "__func__", None) is type(module).forward:
        return False  # none, or the class's own (what Accelerate leaves after removing a hook)
    return not isinstance(getattr(module, "_hf_hook", None), offload.Activate)


def _calls_as_defined(module: torch.nn.Module) -> bool:
    """No forward hooks on ``module`` and no replaced ``forward`` (:func:`_forward_replaced`)."""
    hooks = (module._forward_hooks, module._forward_pre_hooks)
    return not any(hooks) and not _forward_replaced(module)


#: diffusers' processors that compute plain attention (the cache's ``_attend`` computes the same)
_PLAIN_PROCESSORS = tuple(
    getattr(attn_procs, name)
    for name in (
        "AttnProcessor",
        "AttnProcessor2_0",
        "SlicedAttnProcessor",
        "XFormersAttnProcessor",
    )
    if hasattr(attn_procs, name)
)


def _attention_of(block) -> Optional[torch.nn.Module]:
    """The self-attention module a prior block calls, if :class:`PrefixCache` can extend it."""
    attn = getattr(block, "attn1", None) if not isinstance(block, TransformerBlock) else block.attn
    if isinstance(attn, SelfAttention):
        return attn if not _forward_replaced(attn) else None
    if not isinstance(attn, Attention) or attn.is_cross_attention:
        return None
    extras = ("norm_q", "norm_k", "spatial_norm", "group_norm")
    if any(getattr(attn, e, None) is not None for e in extras):
        return None
    if attn.residual_connection or attn.rescale_output_factor != 1.0:
        return None
    if type(attn.processor) not in _PLAIN_PROCESSORS:  # a user's processor must run
        return None
    return attn if not _forward_replaced(attn) else None


class PrefixCache:
    """The prior's forward for a fixed text with the text positions' keys and values computed once
    (see :meth:`UnCLIPPrior.conditioned`). Calling it with ``(x_t [B, D], t)`` gives the same
    prediction as ``prior(x_t, t, text)``: the same layers on the same numbers, only the three
    positions that change are recomputed.

    Each block's attention module is given a forward for the duration of a call (restored after)
    that projects the new positions' queries, keys and values, puts the cached keys and values of
    the row's text in front and attends with the mask diffusers' ``PriorTransformer`` builds
    (text padding and causal, as additive ``-10000``), so the blocks' own norms, feed-forwards and
    residuals run unchanged."""

    def __init__(self, prior: UnCLIPPrior, text: TextEncoding, attns: list):
        self.prior, self.attns, self.text = prior, attns, text
        self.rows = len(text)
        self.keys: Optional[list] = None  # filled by the first call
        self.values: Optional[list] = None

    def _run_text(self) -> None:
        """The blocks over the text positions, recording each attention's keys and values. Run
        on the first call, so that it runs under the sampler's autocast, like every step."""
        prior, text = self.prior, self.text
        tr = prior.transformer
        dtype = prior.dtype
        # the prior's own caption transformer, if it has one, runs here once per sampling run
        tokens, text_mask = prior.text_inputs(text)
        n = tokens.shape[1] + 1  # the text positions: tokens and the text embedding
        pos = tr.positional_embedding
        causal = tr.causal_attention_mask[0].to(dtype)
        self.tail_causal = causal[n : n + 3, n : n + 3]
        # additive key bias of the text positions: padding blocked, the text embedding open
        self.text_bias = F.pad((1 - text_mask.to(dtype)) * -10000.0, (0, 1), value=0.0)
        if tr.encoder_hidden_states_proj is not None:
            tokens = tr.encoder_hidden_states_proj(tokens)
        proj = text.text_embed.to(dtype)
        if tr.embedding_proj_norm is not None:
            proj = tr.embedding_proj_norm(proj)
        h = torch.cat([tokens, tr.embedding_proj(proj)[:, None]], dim=1)
        # positions in the hidden states' dtype (bf16/fp16 under autocast), as diffusers adds them
        h = h + pos[:, :n].to(h.dtype)
        self.tail_pos = pos[:, n : n + 3]
        if tr.norm_in is not None:
            h = tr.norm_in(h)
        mask = (self.text_bias[:, None, :] + causal[:n, :n])[:, None]
        # every row, repeated texts too: a content-independent batch keeps each row's numbers
        # independent of the other rows' texts (as the plain forward's are, to rounding where a
        # caption transformer's length follows the batch's longest caption) and runs on fake
        # tensors; the repeats cost one pass over the text positions per sampling run
        self._recorded: tuple[list, list] = ([None] * len(self.attns), [None] * len(self.attns))
        with self._attending(record=True):
            for block in tr.transformer_blocks:
                h = block(h, attention_mask=mask)
        self.keys, self.values = self._recorded  # only once every block has run

    @classmethod
    def build(cls, prior: UnCLIPPrior, text: TextEncoding) -> Optional[PrefixCache]:
        """The cache, or None where it does not apply (see :meth:`UnCLIPPrior.conditioned`)."""
        tr = prior.transformer
        if any(m.training for m in prior.modules()):  # dropout: the plain forward's draws
            return None
        if is_compiled(prior):  # a compiled network is run as compiled
            return None
        if torch.nn.modules.module._has_any_global_hook():
            return None
        if not (_calls_as_defined(prior) and _calls_as_defined(tr)):
            return None
        if tr.prd_embedding is None or text.text_mask is None:
            return None
        ids = text.caption_ids if prior.has_text_encoder else None
        if prior.has_text_encoder and ids is None:
            return None  # the plain forward names what is missing
        length = (text.text_tokens if ids is None else ids).shape[1]
        # one position each for the text tokens, the text embedding, time, x_t and the prediction
        if tr.positional_embedding.shape[1] != length + 4:
            return None
        attns = [_attention_of(b) for b in tr.transformer_blocks]
        if any(a is None for a in attns):
            return None
        return cls(prior, text, attns)

    @contextlib.contextmanager
    def _attending(self, record: bool):
        saved = [a.__dict__.get("forward") for a in self.attns]
        for i, attn in enumerate(self.attns):

            def forward(hidden_states, *args, attention_mask=None, _i=i, _attn=attn, **kwargs):
                if args:  # TransformerBlock passes the mask by position
                    attention_mask = args[0]
                return self._attend(_i, _attn, hidden_states, attention_mask, record)

            attn.forward = forward
        try:
            yield
        finally:
            for attn, old in zip(self.attns, saved):
                if old is None:
                    del attn.forward
                else:
                    attn.forward = old

    def _attend(self, i, attn, x, mask, record: bool) -> torch.Tensor:
        ours = isinstance(attn, SelfAttention)
        if ours:
            q, k, v = attn.project(x)
        else:  # diffusers' Attention: its projections, heads and scale
            b, s, _ = x.shape

            def split(t):
                return t.view(b, s, attn.heads, -1).transpose(1, 2)

            q, k, v = split(attn.to_q(x)), split(attn.to_k(x)), split(attn.to_v(x))
        if record:
            self._recorded[0][i], self._recorded[1][i] = k, v
        else:  # replaying: _run_text recorded every block's keys and values first
            assert self.keys is not None and self.values is not None
            k = torch.cat([self.keys[i], k], dim=2)
            v = torch.cat([self.values[i], v], dim=2)
        if ours:
            return attn.attend(q, k, v, mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=attn.scale)
        return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2)))

    def __call__(self, x_t: torch.Tensor, t) -> torch.Tensor:
        prior, tr = self.prior, self.prior.transformer
        b = x_t.shape[0]
        if b != self.rows:
            raise ValueError(f"prior: {b} samples for {self.rows} rows of text")
        if self.keys is None:
            self._run_text()
        dtype = prior.dtype
        # as diffusers: a Python number is a whole timestep, a tensor keeps its dtype
        t = torch.as_tensor(t, device=x_t.device, dtype=None if torch.is_tensor(t) else torch.long)
        t = (t[None] if t.dim() == 0 else t) * torch.ones(b, dtype=t.dtype, device=x_t.device)
        time = tr.time_embedding(tr.time_proj(t).to(dtype))
        x = tr.proj_in(x_t.to(dtype))
        prd = tr.prd_embedding.to(x.dtype).expand(b, -1, -1)
        h = torch.cat([time[:, None].to(x.dtype), x[:, None], prd], dim=1)
        h = h + self.tail_pos.to(h.dtype)
        if tr.norm_in is not None:
            h = tr.norm_in(h)
        mask = torch.cat(
            [self.text_bias[:, None, :].expand(b, 3, -1), self.tail_causal.expand(b, 3, 3)], dim=2
        )[:, None]
        with self._attending(record=False):
            for block in tr.transformer_blocks:
                h = block(h, attention_mask=mask)
        return tr.proj_to_clip_embeddings(tr.norm_out(h)[:, -1])
