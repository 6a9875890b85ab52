"""The autoregressive prior: CLIP text → CLIP image embedding as a sequence of discrete codes
(Ramesh et al. 2022, §2.1, "Autoregressive (AR) prior").

The image embedding ``[D]`` is centred and projected on its first ``P = pca_dims`` principal
components (fitted on training embeddings, ordered by decreasing variance), each component is
quantised into ``K = num_buckets`` buckets, and a causal transformer predicts the ``P`` codes in
that order, one at a time. The sequence it reads is::

    [caption token states (L), text_embed, dot-product token, code_0, …, code_{P-2}]

and the state at the dot-product token predicts ``code_0``, the state at ``code_i`` predicts
``code_{i+1}``. The dot-product token is the bucket of the cosine between the text and image
embeddings (the paper's quantised ``z_i · z_t``): at training the true value, at sampling a chosen
quantile of the training distribution (paper: the top half). Classifier-free guidance drops the
caption: the empty caption's CLIP encoding (as the diffusion prior) with a separate "no caption"
dot-product token, since the alignment with an absent caption means nothing.

Bucket edges are per-component quantiles of the training projections (``k/K`` for ``k = 1…K-1``;
the fitted minimum and maximum close the outer buckets), so every code is equally frequent in the
training data: a uniform grid over ``[min, max]`` would spend most buckets on the sparse tails of
the roughly Gaussian components and leave the dense middle coarse. A code decodes to its bucket's
midpoint. The fit (:meth:`UnCLIPARPrior.fit_quantizer`) is stored in buffers, so it is saved and
loaded with the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models import ModelMixin
from torch import nn

from unclip.nets.blocks import FeedForward, check_block_options
from unclip.nets.prior import PriorLoading
from unclip.nets.text_encoding import TextEncoding

__all__ = ["UnCLIPARPrior", "ARTransformer", "ARBlock", "quantile_edges"]


def quantile_edges(x: torch.Tensor, k: int) -> torch.Tensor:
    """Bucket edges ``[..., k + 1]`` of the values ``x [n, ...]``: the minimum, the ``j/k``
    quantiles (``j = 1…k-1``, linear interpolation) and the maximum."""
    xs = x.sort(dim=0).values
    n = xs.shape[0]
    pos = torch.linspace(0, n - 1, k + 1, dtype=torch.float64)
    lo = pos.floor().long().clamp(max=n - 1)
    hi = (lo + 1).clamp(max=n - 1)
    w = (pos - lo).to(xs.dtype).reshape(-1, *([1] * (xs.ndim - 1)))
    edges = xs[lo] * (1 - w) + xs[hi] * w  # [k + 1, ...]
    return edges.movedim(0, -1)


def _bucketize(values: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Bucket indices in ``[0, K-1]`` of ``values [..., B]`` under ``edges [..., K+1]`` (values
    outside ``[edges[0], edges[-1]]`` fall in the outer buckets)."""
    inner = edges[..., 1:-1].contiguous()
    return torch.searchsorted(inner, values.contiguous(), right=True)


class ARBlock(nn.Module):
    """A pre-LayerNorm transformer block (attention, then a 4× GELU MLP) with an optional key/value
    cache for decoding one position at a time.

    DALL-E Mega's options (as in :mod:`unclip.nets.blocks`, whose feed-forward it reuses):
    ``normformer`` adds a LayerNorm on the attention output, a learned scale per head and a
    LayerNorm over the feed-forward's hidden units; ``ff_activation`` ``geglu``/``swiglu`` makes
    the feed-forward a GLU of the same parameter count. With both off the block and its weight
    names are the plain GELU block's, so priors saved without them load unchanged."""

    def __init__(
        self,
        width: int,
        heads: int,
        dropout: float = 0.0,
        normformer: bool = False,
        ff_activation: str = "gelu",
    ):
        super().__init__()
        check_block_options(normformer, ff_activation)
        self.heads = heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.head_scale = nn.Parameter(torch.ones(heads)) if normformer else None
        self.attn_out_norm = nn.LayerNorm(width) if normformer else None
        self.norm2 = nn.LayerNorm(width)
        if normformer or ff_activation != "gelu":
            self.mlp = nn.Sequential(
                FeedForward(width, ff_activation, 4, dropout=0.0, inner_norm=normformer),
                nn.Dropout(dropout),
            )
        else:
            self.mlp = nn.Sequential(
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
                nn.Dropout(dropout),
            )
        self.drop = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, allowed: torch.Tensor, cache: Optional[dict] = None
    ) -> torch.Tensor:
        """``x [B, T, W]``; ``allowed [B, T, S]`` (boolean: query may attend to key; ``S`` counts
        the cached positions before ``x``); ``cache``: a dict the keys and values of every
        position seen so far are kept in."""
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed[:, None], dropout_p=self.dropout if self.training else 0.0
        )
        if self.head_scale is not None:
            a = a * self.head_scale.to(a.dtype).view(1, -1, 1, 1)
        h = self.proj(a.transpose(1, 2).reshape(b, t, w))
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        x = x + self.drop(h)
        return x + self.mlp(self.norm2(x))


class ARTransformer(nn.Module):
    """The learned part of the AR prior: input embeddings, causal blocks, the code head.

    ``forward`` runs a whole sequence (training: teacher forcing); :meth:`start` and :meth:`step`
    run the prefix and then one code at a time with a key/value cache (sampling)."""

    def __init__(
        self,
        embed_dim: int,
        text_width: int,
        context_length: int,
        pca_dims: int,
        num_buckets: int,
        dot_buckets: int,
        width: int,
        heads: int,
        layers: int,
        dropout: float,
        normformer: bool = False,
        ff_activation: str = "gelu",
    ):
        super().__init__()
        self.prefix_len = context_length + 2
        self.text_token_proj = nn.Linear(text_width, width)
        self.text_embed_proj = nn.Linear(embed_dim, width)
        self.dot_embedding = nn.Embedding(dot_buckets + 1, width)  # + "no caption"
        self.code_embedding = nn.Embedding(num_buckets, width)
        self.positional_embedding = nn.Parameter(torch.empty(self.prefix_len + pca_dims - 1, width))
        self.blocks = nn.ModuleList(
            ARBlock(width, heads, dropout, normformer, ff_activation) for _ in range(layers)
        )
        self.norm_out = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_buckets)
        self.apply(self._init)
        nn.init.normal_(self.positional_embedding, std=0.01)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            bias = getattr(m, "bias", None)  # Embedding has none; Linear may have none
            if isinstance(bias, torch.Tensor):
                nn.init.zeros_(bias)

    def _prefix(self, text: TextEncoding, dot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.head.weight.dtype
        x = torch.cat(
            [
                self.text_token_proj(text.text_tokens.to(dtype)),
                self.text_embed_proj(text.text_embed.to(dtype))[:, None],
                self.dot_embedding(dot)[:, None],
            ],
            dim=1,
        )
        valid = torch.cat([text.text_mask.bool(), text.text_mask.new_ones(len(text), 2).bool()], 1)
        return x, valid

    def _run(self, x, allowed, caches=None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, allowed, None if caches is None else caches[i])
        return self.head(self.norm_out(x))

    @staticmethod
    def _allowed(valid: torch.Tensor, t0: int, t: int) -> torch.Tensor:
        """``[B, t, t0 + t]``: queries ``t0 … t0+t-1`` attend to earlier valid keys and
        themselves (a padded caption position attends to itself, so no row is empty)."""
        q = torch.arange(t0, t0 + t, device=valid.device)[:, None]
        k = torch.arange(t0 + t, device=valid.device)[None]
        return (k <= q)[None] & (valid[:, None, : t0 + t] | (k == q)[None])

    def forward(self, codes: torch.Tensor, text: TextEncoding, dot: torch.Tensor) -> torch.Tensor:
        """``codes [B, P]``, ``text`` with ``B`` rows, dot-product tokens ``dot [B]`` → logits
        ``[B, P, K]``; those at position ``i`` depend on ``codes[:, :i]`` only."""
        x, valid = self._prefix(text, dot)
        x = torch.cat([x, self.code_embedding(codes[:, :-1])], dim=1)
        x = x + self.positional_embedding[: x.shape[1]].to(x.dtype)
        valid = torch.cat([valid, valid.new_ones(codes.shape[0], codes.shape[1] - 1)], 1)
        logits = self._run(x, self._allowed(valid, 0, x.shape[1]))
        return logits[:, self.prefix_len - 1 :]

    def start(self, text: TextEncoding, dot: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Run the prefix: logits ``[B, K]`` of ``code_0`` and the decoding state."""
        x, valid = self._prefix(text, dot)
        x = x + self.positional_embedding[: x.shape[1]].to(x.dtype)
        caches: list[dict] = [{} for _ in self.blocks]
        logits = self._run(x, self._allowed(valid, 0, x.shape[1]), caches)
        return logits[:, -1], {"caches": caches, "valid": valid}

    def step(self, code: torch.Tensor, state: dict) -> torch.Tensor:
        """Feed ``code [B]`` (the last code sampled): logits ``[B, K]`` of the next one."""
        valid = state["valid"]
        pos = valid.shape[1]
        state["valid"] = valid = torch.cat([valid, valid.new_ones(valid.shape[0], 1)], 1)
        x = self.code_embedding(code)[:, None]
        x = x + self.positional_embedding[pos].to(x.dtype)
        return self._run(x, self._allowed(valid, pos, 1), state["caches"])[:, -1]


# ignore: diffusers' ModelMixin and ConfigMixin disagree on the type of config_name
class UnCLIPARPrior(PriorLoading, ModelMixin, ConfigMixin):  # type: ignore[misc]
    """AR prior network (see module doc). ``forward(codes [B,P], text, dot [B]) → logits
    [B, P, K]``; :meth:`encode`/:meth:`decode` map image embeddings ``[B, D]`` to codes and back
    once :meth:`fit_quantizer` has set the PCA and bucket edges."""

    #: buffers a partial ``train.init_weights`` loads all together or not at all (the fit)
    _load_together = (("pca_mean", "pca_components", "bucket_edges", "dot_edges", "fitted"),)

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
        pca_dims: Optional[int] = None,
        num_buckets: int = 1024,
        dot_buckets: int = 32,
        normformer: bool = False,
        ff_activation: str = "gelu",
    ):
        super().__init__()
        check_block_options(normformer, ff_activation)
        p = embed_dim if pca_dims is None else pca_dims
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= embed_dim:
            raise ValueError(
                f"prior.ar.pca_dims must be in [1, {embed_dim}] (the CLIP embedding has "
                f"{embed_dim} dimensions), got {pca_dims!r}"
            )
        if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 2:
            raise ValueError(f"prior.ar.num_buckets must be an integer >= 2, got {num_buckets!r}")
        if isinstance(dot_buckets, bool) or not isinstance(dot_buckets, int) or dot_buckets < 1:
            raise ValueError(f"prior.ar.dot_buckets must be an integer >= 1, got {dot_buckets!r}")
        self.pca_dims = p
        self.transformer = ARTransformer(
            embed_dim,
            text_width,
            context_length,
            p,
            num_buckets,
            dot_buckets,
            width=num_attention_heads * attention_head_dim,
            heads=num_attention_heads,
            layers=num_layers,
            dropout=dropout,
            normformer=normformer,
            ff_activation=ff_activation,
        )
        # the fit, set from training embeddings by fit_quantizer; saved with the weights; a partial
        # train.init_weights loads these buffers together or not at all, so a half-loaded fit is
        # never taken for a fitted one
        self.register_buffer("pca_mean", torch.zeros(embed_dim))
        self.register_buffer("pca_components", torch.eye(embed_dim)[:p].clone())
        self.register_buffer("bucket_edges", torch.zeros(p, num_buckets + 1))
        self.register_buffer("dot_edges", torch.zeros(dot_buckets + 1))
        # a float flag (1 once fitted): buffers of one floating dtype travel everywhere the
        # weights do (DDP buffer broadcasts, dtype casts of the whole model)
        self.register_buffer("fitted", torch.zeros(()))

    # ------------------------------------------------------------------ the code
    @property
    def is_fitted(self) -> bool:
        return bool(self.fitted > 0)

    @property
    def null_dot(self) -> int:
        """The dot-product token of a dropped caption (the unconditional input of guidance)."""
        return self.config.dot_buckets

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise ValueError(
                "this AR prior has no PCA and bucket edges yet: call fit_quantizer(image_embeds, "
                "text_embeds) with training embeddings (training does it before the first step), "
                "or load a trained prior"
            )

    @torch.no_grad()
    def fit_quantizer(self, image_embed: torch.Tensor, text_embed: torch.Tensor) -> None:
        """Fit the PCA, the code bucket edges and the dot-product bucket edges on training
        embeddings ``image_embed [n, D]`` and their captions' ``text_embed [n, D]`` (computed in
        float64; deterministic, so every process of a run fits the same)."""
        d, p = self.config.embed_dim, self.pca_dims
        if (
            image_embed.ndim != 2
            or image_embed.shape[1] != d
            or text_embed.shape != image_embed.shape
        ):
            raise ValueError(
                f"fit_quantizer needs image and text embeddings [n, {d}], got "
                f"{tuple(image_embed.shape)} and {tuple(text_embed.shape)}"
            )
        n = image_embed.shape[0]
        if n <= p:
            raise ValueError(
                f"fitting {p} principal components needs more than {p} embeddings, got {n}; raise "
                "prior.ar.fit_samples or lower prior.ar.pca_dims"
            )
        x = image_embed.detach().to("cpu", torch.float64)
        if not torch.isfinite(x).all() or not torch.isfinite(text_embed).all():
            raise ValueError("fit_quantizer: the embeddings hold NaN or inf")
        mean = x.mean(0)
        _, _, vh = torch.linalg.svd(x - mean, full_matrices=False)
        comps = vh[:p]
        # an SVD's signs are arbitrary: make each component's largest entry positive so the same
        # data always gives the same codes
        sign = comps.gather(1, comps.abs().argmax(1, keepdim=True)).sign()
        comps = comps * torch.where(sign == 0, torch.ones_like(sign), sign)
        z = (x - mean) @ comps.T
        cos = F.cosine_similarity(x, text_embed.detach().to("cpu", torch.float64), dim=-1)
        for name, value in (
            ("pca_mean", mean),
            ("pca_components", comps),
            ("bucket_edges", quantile_edges(z, self.config.num_buckets)),
            ("dot_edges", quantile_edges(cos, self.config.dot_buckets)),
        ):
            buf = getattr(self, name)
            buf.copy_(value.to(buf.dtype))
        self.fitted.fill_(1.0)

    def project(self, image_embed: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` → PCA coordinates ``[B, P]`` (in order of decreasing variance)."""
        x = image_embed.to(self.pca_mean.dtype) - self.pca_mean
        return x @ self.pca_components.T

    def unproject(self, z: torch.Tensor) -> torch.Tensor:
        """PCA coordinates ``[B, P]`` → image embeddings ``[B, D]``."""
        return z.to(self.pca_components.dtype) @ self.pca_components + self.pca_mean

    def bucket_centers(self) -> torch.Tensor:
        """``[P, K]``: the value each code decodes to (its bucket's midpoint)."""
        e = self.bucket_edges
        return (e[:, :-1] + e[:, 1:]) / 2

    def encode(self, image_embed: torch.Tensor) -> torch.Tensor:
        """CLIP image embeddings ``[B, D]`` → codes ``[B, P]`` (long, in ``[0, K)``)."""
        self._check_fitted()
        z = self.project(image_embed.float())
        return _bucketize(z.T, self.bucket_edges.float()).T

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[B, P]`` → CLIP image embeddings ``[B, D]`` at the scale of the training
        embeddings (what the decoder was trained on)."""
        self._check_fitted()
        centers = self.bucket_centers().float()
        z = centers.gather(1, codes.T.to(centers.device)).T
        return self.unproject(z).float()

    def dot_token(self, text_embed: torch.Tensor, image_embed: torch.Tensor) -> torch.Tensor:
        """The dot-product token ``[B]`` of each (caption, image) pair: the bucket of their
        cosine among the training cosines."""
        self._check_fitted()
        cos = F.cosine_similarity(image_embed.float(), text_embed.float().to(image_embed.device))
        return _bucketize(cos, self.dot_edges.float())

    def dot_token_at(self, quantile: torch.Tensor) -> torch.Tensor:
        """The dot-product token ``[B]`` of the ``quantile [B]`` (in [0, 1]) of the training
        cosines: the buckets hold equal shares, so bucket ``floor(q · K_dot)``."""
        k = self.config.dot_buckets
        return (quantile * k).floor().long().clamp(0, k - 1)

    # ------------------------------------------------------------------ network
    def forward(self, codes: torch.Tensor, text: TextEncoding, dot: torch.Tensor) -> torch.Tensor:
        """``codes [B, P]``, ``text`` with ``B`` rows, ``dot [B]`` → logits ``[B, P, K]`` of every
        code given the codes before it (teacher forcing)."""
        return self.transformer(codes.to(self.pca_mean.device), text, dot)
