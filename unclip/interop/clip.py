"""CLIP helpers for :mod:`unclip.interop.diffusers`: transformers CLIP ↔ open_clip, CLIP tokenizer
files.

* :func:`clip_from_transformers` builds a :class:`~unclip.nets.clip.CLIP` from a diffusers
pipeline's
  ``text_encoder/`` (``CLIPTextModelWithProjection``), ``tokenizer/`` and optional
  ``image_encoder/`` (``CLIPVisionModelWithProjection``). Without an image encoder the vision tower
  is a tiny placeholder and ``has_vision=False``.
* :func:`text_state_to_transformers` / :func:`text_config_to_transformers` go the other way.
* :func:`bpe_vocab` rebuilds the CLIP BPE vocabulary (``vocab.json`` / ``merges.txt`` contents) from
  open_clip's ``bpe_simple_vocab_16e6.txt.gz``; :func:`check_tokenizer` compares a tokenizer folder
  with it.

Weight layout (per transformer layer ``i``; ``T`` = ``text_model.`` or ``vision_model.``)::

    T.encoder.layers.i.self_attn.{q,k,v}_proj  → resblocks.i.attn.in_proj_{weight,bias} (q;k;v)
    T.encoder.layers.i.self_attn.out_proj      → resblocks.i.attn.out_proj
    T.encoder.layers.i.layer_norm{1,2}         → resblocks.i.ln_{1,2}
    T.encoder.layers.i.mlp.fc{1,2}             → resblocks.i.mlp.c_{fc,proj}
    text_projection.weight [D, W]              → text_projection [W, D]
    visual_projection.weight [D, W]            → visual.proj [W, D]
"""

from __future__ import annotations

import functools
import gzip
import math
from pathlib import Path
from typing import Optional

import torch

from unclip.io.weights import check_state, load_weights, read_json
from unclip.nets.clip import CLIP, build_open_clip_model
from unclip.nets.clip_tokenizer import CompatTokenizer

__all__ = [
    "clip_from_transformers",
    "clip_from_configs",
    "text_state_to_transformers",
    "text_config_to_transformers",
    "bpe_vocab",
    "check_tokenizer",
]

TEXT_DEFAULTS = dict(
    vocab_size=49408,
    hidden_size=512,
    intermediate_size=2048,
    projection_dim=512,
    num_hidden_layers=12,
    num_attention_heads=8,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    eos_token_id=49407,
)
VISION_DEFAULTS = dict(
    hidden_size=768,
    intermediate_size=3072,
    projection_dim=512,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_channels=3,
    image_size=224,
    patch_size=32,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)
PLACEHOLDER_VISION = {
    "image_size": 32,
    "layers": 1,
    "width": 32,
    "head_width": 32,
    "patch_size": 16,
}
ACTS = ("quick_gelu", "gelu")
IGNORED_KEYS = ("text_model.embeddings.position_ids", "vision_model.embeddings.position_ids")
PROBES = [
    "a red circle",
    "Hello, World!! (a test) #1 $5.50",
    "café naïve 東京 🐱",
    "don't  stop\tnow",
    "",
    "it’s &amp; Ｆｕｌｌ",
]


# ---------------------------------------------------------------------------------------- tokenizer
@functools.lru_cache(maxsize=1)
def bpe_vocab() -> tuple[dict[str, int], list[str]]:
    """``(vocab, merges)`` of the CLIP BPE in transformers' naming (``<|startoftext|>``,
    ``<|endoftext|>``)."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe

    merges = gzip.open(default_bpe()).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    units = list(bytes_to_unicode().values())
    tokens = units + [u + "</w>" for u in units] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges


def _token_str(value) -> Optional[str]:
    return value.get("content") if isinstance(value, dict) else value


def read_tokenizer(folder: Path) -> tuple[dict, list[str], str, Optional[int]]:
    """``(vocab, merges, pad_token, model_max_length)`` from vocab.json/merges.txt or
    tokenizer.json."""
    comp = "tokenizer"
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        vocab = read_json(folder / "vocab.json", comp)
        lines = (folder / "merges.txt").read_text(encoding="utf-8").split("\n")
        merges = [m for m in lines if m and not m.startswith("#version")]
    elif (folder / "tokenizer.json").is_file():
        model = read_json(folder / "tokenizer.json", comp).get("model", {})
        vocab = model.get("vocab", {})
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    else:
        raise ValueError(f"{comp}: {folder} has neither vocab.json + merges.txt nor tokenizer.json")
    cfg, special = (
        {} if not (folder / name).is_file() else read_json(folder / name, comp)
        for name in ("tokenizer_config.json", "special_tokens_map.json")
    )
    pad = (
        _token_str(cfg.get("pad_token")) or _token_str(special.get("pad_token")) or "<|endoftext|>"
    )
    added = [
        t.get("content")
        for t in cfg.get("added_tokens_decoder", {}).values()
        if isinstance(t, dict)
    ]
    if (folder / "tokenizer.json").is_file():
        added += [
            t.get("content")
            for t in read_json(folder / "tokenizer.json", comp).get("added_tokens", [])
        ]
    # key=str: a malformed token without content (None) is listed too, not a sorting TypeError
    extra = sorted(set(added) - {"<|startoftext|>", "<|endoftext|>", pad}, key=str)
    if extra:
        raise ValueError(
            f"{comp}: added tokens {extra} are not part of the CLIP BPE tokenizer; not supported"
        )
    max_len = cfg.get("model_max_length")
    return (
        vocab,
        merges,
        pad,
        (int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e9 else None),
    )


def check_tokenizer(folder: Path, context_length: int) -> str:
    """Check ``folder`` holds the CLIP BPE tokenizer that open_clip uses; return its pad token.

    The vocabulary and merges must equal open_clip's. When transformers is installed the real
    ``CLIPTokenizer`` is also run on probe strings (punctuation, unicode, padding) and must give the
    same ids and attention masks as :class:`~unclip.nets.clip_tokenizer.CompatTokenizer`.
    """
    vocab, merges, pad, max_len = read_tokenizer(folder)
    ref_vocab, ref_merges = bpe_vocab()
    if vocab != ref_vocab:
        bad = next((k for k in ref_vocab if vocab.get(k) != ref_vocab[k]), None) or next(
            k for k in vocab if k not in ref_vocab
        )
        raise ValueError(
            f"tokenizer: vocabulary differs from the CLIP BPE vocabulary of open_clip (token "
            f"{bad!r}: {vocab.get(bad)} vs {ref_vocab.get(bad)}); only the standard CLIP tokenizer "
            "is supported"
        )
    if merges != ref_merges:
        i = next(
            (i for i, (a, b) in enumerate(zip(merges, ref_merges)) if a != b),
            min(len(merges), len(ref_merges)),
        )
        raise ValueError(
            f"tokenizer: merges.txt differs from open_clip's CLIP BPE merges at merge {i}"
        )
    if max_len is not None and max_len != context_length:
        raise ValueError(
            f"tokenizer: model_max_length {max_len} != text_encoder max_position_embeddings "
            f"{context_length}"
        )
    try:
        ours = CompatTokenizer(context_length, pad)
    except ValueError as exc:
        raise ValueError(f"tokenizer: pad_token {pad!r} is not a CLIP BPE token") from exc
    try:
        from transformers import CLIPTokenizer
    except ImportError:
        return pad
    theirs = CLIPTokenizer.from_pretrained(str(folder))
    for probe in PROBES:
        enc = theirs(
            probe,
            padding="max_length",
            max_length=context_length,
            truncation=True,
            return_tensors="pt",
        )
        ids = ours([probe])
        clip_mask = (
            torch.arange(context_length)[None]
            <= (ids == ours.eot_token_id).int().argmax(1)[:, None]
        )
        if not torch.equal(enc.input_ids, ids) or not torch.equal(
            enc.attention_mask.bool(), clip_mask
        ):
            raise ValueError(
                f"tokenizer: {folder} tokenizes {probe!r} as {enc.input_ids[0].tolist()} but the "
                f"open_clip BPE gives {ids[0].tolist()}; this tokenizer is not supported"
            )
    return pad


# ---------------------------------------------------------------------------------------- weights
# (transformers name, open_clip name, stored transposed) of the weights outside the layers
_TEXT_NAMES = [
    ("text_model.embeddings.token_embedding.weight", "token_embedding.weight", False),
    ("text_model.embeddings.position_embedding.weight", "positional_embedding", False),
    ("text_model.final_layer_norm.weight", "ln_final.weight", False),
    ("text_model.final_layer_norm.bias", "ln_final.bias", False),
    ("text_projection.weight", "text_projection", True),
]
_VISION_NAMES = [
    ("vision_model.embeddings.class_embedding", "visual.class_embedding", False),
    ("vision_model.embeddings.patch_embedding.weight", "visual.conv1.weight", False),
    ("vision_model.embeddings.position_embedding.weight", "visual.positional_embedding", False),
    ("visual_projection.weight", "visual.proj", True),
] + [
    (f"vision_model.{a}.{kind}", f"visual.{b}.{kind}", False)
    for a, b in (("pre_layrnorm", "ln_pre"), ("post_layernorm", "ln_post"))
    for kind in ("weight", "bias")
]
# per-layer parts other than the attention input projection (q, k, v apart vs fused)
_LAYER_PARTS = (
    ("self_attn.out_proj", "attn.out_proj"),
    ("layer_norm1", "ln_1"),
    ("layer_norm2", "ln_2"),
    ("mlp.fc1", "mlp.c_fc"),
    ("mlp.fc2", "mlp.c_proj"),
)


def _map_state(sd: dict, names: list, hf: str, oc: str, layers: int, to_transformers: bool) -> dict:
    """Rename a tower's weights between transformers (``hf`` prefix) and open_clip (``oc``)."""
    out = {}
    for h, o, transposed in names:
        src, dst = (o, h) if to_transformers else (h, o)
        out[dst] = sd[src].t().contiguous() if transposed else sd[src]
    for i in range(layers):
        h, o = f"{hf}.encoder.layers.{i}.", f"{oc}.resblocks.{i}."
        for kind in ("weight", "bias"):
            fused = f"{o}attn.in_proj_{kind}"
            split = [f"{h}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if to_transformers:
                for name, chunk in zip(split, sd[fused].chunk(3)):
                    out[name] = chunk.clone()
            else:
                out[fused] = torch.cat([sd[name] for name in split])
            for a, b in _LAYER_PARTS:
                src, dst = (o + b, h + a) if to_transformers else (h + a, o + b)
                out[f"{dst}.{kind}"] = sd[f"{src}.{kind}"]
    return out


def text_state_from_transformers(sd: dict, layers: int) -> dict:
    """``CLIPTextModelWithProjection`` weights → open_clip text-tower weights (``CLIP`` naming)."""
    return _map_state(sd, _TEXT_NAMES, "text_model", "transformer", layers, False)


def text_state_to_transformers(sd: dict, layers: int) -> dict:
    """open_clip text-tower weights (``CLIP`` naming) → ``CLIPTextModelWithProjection`` weights."""
    return _map_state(sd, _TEXT_NAMES, "text_model", "transformer", layers, True)


def vision_state_from_transformers(sd: dict, layers: int) -> dict:
    """``CLIPVisionModelWithProjection`` weights → open_clip vision-tower weights."""
    return _map_state(sd, _VISION_NAMES, "vision_model", "visual.transformer", layers, False)


def vision_state_to_transformers(sd: dict, layers: int) -> dict:
    """open_clip vision-tower weights → ``CLIPVisionModelWithProjection`` weights."""
    return _map_state(sd, _VISION_NAMES, "vision_model", "visual.transformer", layers, True)


# ---------------------------------------------------------------------------------------- configs
def _sub_config(cfg: dict, key: str, defaults: dict) -> dict:
    if cfg.get("model_type") == "clip" and key in cfg:  # a full CLIPConfig
        cfg = {
            **cfg[key],
            "projection_dim": cfg.get("projection_dim", cfg[key].get("projection_dim")),
        }
    return {**defaults, **{k: v for k, v in cfg.items() if v is not None}}


def _common_checks(component: str, c: dict) -> None:
    if int(c["hidden_size"] * (c["intermediate_size"] / c["hidden_size"])) != int(
        c["intermediate_size"]
    ):
        raise ValueError(
            f"{component}: intermediate_size {c['intermediate_size']} is not expressible as an "
            f"open_clip mlp_ratio of hidden_size {c['hidden_size']}"
        )
    if c["hidden_act"] not in ACTS:
        raise ValueError(
            f"{component}: hidden_act {c['hidden_act']!r} is not supported (use quick_gelu or gelu)"
        )
    if not math.isclose(float(c["layer_norm_eps"]), 1e-5, rel_tol=1e-6):
        raise ValueError(
            f"{component}: layer_norm_eps {c['layer_norm_eps']} is not supported (open_clip uses "
            "1e-5)"
        )
    if c["hidden_size"] % c["num_attention_heads"]:
        raise ValueError(
            f"{component}: hidden_size {c['hidden_size']} is not divisible by num_attention_heads"
        )


def clip_model_cfg(text: dict, vision: Optional[dict]) -> dict:
    """open_clip model config from transformers text (and optional vision) configs (``config.json``
    dicts)."""
    t = _sub_config(text, "text_config", TEXT_DEFAULTS)
    _common_checks("text_encoder", t)
    if t["eos_token_id"] not in (2, t["vocab_size"] - 1):
        raise ValueError(
            f"text_encoder: eos_token_id {t['eos_token_id']} is not supported (CLIP pools at the "
            f"end token, the largest id {t['vocab_size'] - 1})"
        )
    embed_dim = int(t["projection_dim"])
    cfg = {
        "embed_dim": embed_dim,
        "quick_gelu": t["hidden_act"] == "quick_gelu",
        "text_cfg": {
            "context_length": int(t["max_position_embeddings"]),
            "vocab_size": int(t["vocab_size"]),
            "width": int(t["hidden_size"]),
            "heads": int(t["num_attention_heads"]),
            "layers": int(t["num_hidden_layers"]),
            "mlp_ratio": t["intermediate_size"] / t["hidden_size"],
        },
        "vision_cfg": dict(PLACEHOLDER_VISION),
    }
    if vision is not None:
        v = _sub_config(vision, "vision_config", VISION_DEFAULTS)
        _common_checks("image_encoder", v)
        if v["hidden_act"] != t["hidden_act"]:
            raise ValueError(
                f"image_encoder: hidden_act {v['hidden_act']!r} differs from the text encoder's "
                f"{t['hidden_act']!r}; open_clip uses one activation for both towers"
            )
        if int(v["projection_dim"]) != embed_dim:
            raise ValueError(
                f"image_encoder: projection_dim {v['projection_dim']} != text_encoder "
                f"projection_dim {embed_dim}"
            )
        if int(v["num_channels"]) != 3:
            raise ValueError(
                f"image_encoder: num_channels {v['num_channels']} is not supported (RGB only)"
            )
        size, patch = v["image_size"], v["patch_size"]
        cfg["vision_cfg"] = {
            "image_size": size,
            "patch_size": patch,
            "layers": int(v["num_hidden_layers"]),
            "width": int(v["hidden_size"]),
            "head_width": int(v["hidden_size"]) // int(v["num_attention_heads"]),
            "mlp_ratio": v["intermediate_size"] / v["hidden_size"],
        }
    return cfg


def clip_from_transformers(
    root: Path,
    has_image_encoder: bool,
    feature_extractor: Optional[dict] = None,
    variant: Optional[str] = None,
) -> CLIP:
    """A :class:`~unclip.nets.clip.CLIP` from ``root/text_encoder``, ``root/tokenizer`` and
    (optionally) ``root/image_encoder`` (``variant``: their ``*.<variant>.safetensors`` weights)."""
    text_cfg = read_json(root / "text_encoder" / "config.json", "text_encoder")
    vision_cfg = (
        read_json(root / "image_encoder" / "config.json", "image_encoder")
        if has_image_encoder
        else None
    )
    model_cfg = clip_model_cfg(text_cfg, vision_cfg)
    model = build_open_clip_model(model_cfg)
    expected = model.state_dict()
    text_layers = model_cfg["text_cfg"]["layers"]
    parts = [
        ("text_encoder", text_state_to_transformers, text_state_from_transformers, text_layers)
    ]
    if has_image_encoder:
        parts.append(
            (
                "image_encoder",
                vision_state_to_transformers,
                vision_state_from_transformers,
                model_cfg["vision_cfg"]["layers"],
            )
        )
    state = {k: v for k, v in expected.items() if k.startswith("visual.")}
    # transformers' text and vision encoders carry no temperature; OpenAI's CLIPs (Karlo's
    # included) trained theirs to the clamp, 100 (contrastive reranking reads it)
    state["logit_scale"] = torch.tensor(math.log(100.0), dtype=expected["logit_scale"].dtype)
    for comp, to_tf, from_tf, layers in parts:
        got = load_weights(root / comp, comp, variant)
        got = {k: v for k, v in got.items() if k not in IGNORED_KEYS}
        check_state(comp, to_tf(expected, layers), got, root / comp)
        state.update(from_tf(got, layers))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("attn_mask") for k in missing), (missing, unexpected)
    pad = check_tokenizer(root / "tokenizer", model_cfg["text_cfg"]["context_length"])
    if feature_extractor is not None:
        _check_feature_extractor(feature_extractor, model_cfg["vision_cfg"]["image_size"])
    return _transformers_clip(model, model_cfg, pad, has_image_encoder)


def _transformers_clip(model, model_cfg: dict, pad: str, has_vision: bool) -> CLIP:
    return CLIP(
        model,
        CompatTokenizer(model_cfg["text_cfg"]["context_length"], pad),
        "transformers-clip",
        model_cfg,
        None,
        normalize_embeds=False,
        has_vision=has_vision,
        tokenizer_cfg={"pad_token": pad},
    )


def clip_from_configs(text: dict, vision: Optional[dict], pad: str = "<|endoftext|>") -> CLIP:
    """The :class:`~unclip.nets.clip.CLIP` that transformers ``text`` (and ``vision``) configs
    describe, with freshly initialised weights on the current device: what a dry run of a
    training step (``unclip plan``) needs, where only shapes matter."""
    model_cfg = clip_model_cfg(text, vision)
    return _transformers_clip(build_open_clip_model(model_cfg), model_cfg, pad, vision is not None)


def _check_feature_extractor(cfg: dict, image_size: int) -> None:
    import open_clip

    for key, ref in (
        ("image_mean", open_clip.OPENAI_DATASET_MEAN),
        ("image_std", open_clip.OPENAI_DATASET_STD),
    ):
        if key in cfg and any(abs(a - b) > 1e-4 for a, b in zip(cfg[key], ref)):
            raise ValueError(
                f"feature_extractor: {key} {cfg[key]} differs from CLIP's {list(ref)}; not "
                "supported"
            )
    crop = cfg.get("crop_size", image_size)
    crop = crop.get("height", image_size) if isinstance(crop, dict) else crop
    if int(crop) != int(image_size):
        raise ValueError(
            f"feature_extractor: crop_size {crop} != image_encoder image_size {image_size}"
        )


def text_config_to_transformers(clip: CLIP) -> dict:
    """``CLIPTextConfig`` kwargs for the open_clip text tower of ``clip``."""
    tc = clip.model_cfg["text_cfg"]
    width = int(tc.get("width", 512))
    pad = (
        clip.tokenizer_cfg.get("pad_token", "<|endoftext|>")
        if clip.tokenizer_cfg
        else "<|endoftext|>"
    )
    return dict(
        vocab_size=int(tc.get("vocab_size", 49408)),
        hidden_size=width,
        intermediate_size=int(width * float(tc.get("mlp_ratio", 4.0))),
        projection_dim=clip.embed_dim,
        num_hidden_layers=int(tc.get("layers", 12)),
        num_attention_heads=int(tc.get("heads", 8)),
        max_position_embeddings=clip.context_length,
        layer_norm_eps=1e-5,
        hidden_act="quick_gelu" if clip.model_cfg.get("quick_gelu") else "gelu",
        pad_token_id=bpe_vocab()[0][pad],
        bos_token_id=49406,
        eos_token_id=49407,
    )


def text_encoder_to_transformers(clip: CLIP):
    """transformers' ``CLIPTextModelWithProjection`` and ``CLIPTokenizer`` of ``clip``'s text
    tower (the inverse of :func:`clip_from_transformers` for the text side)."""
    try:
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer
    except ImportError as exc:
        raise ImportError(
            "exporting a CLIP to transformers' layout needs transformers: pip install transformers"
        ) from exc
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**text_config_to_transformers(clip)))
    text_state = text_state_to_transformers(
        clip.model.state_dict(), int(clip.model_cfg["text_cfg"].get("layers", 12))
    )
    missing, unexpected = text_encoder.load_state_dict(text_state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("position_ids")]:
        raise AssertionError(f"text encoder export: missing {missing}, unexpected {unexpected}")
    pad = (
        clip.tokenizer.pad_token if isinstance(clip.tokenizer, CompatTokenizer) else "<|endoftext|>"
    )
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges = bpe_vocab()
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab))
        (Path(tmp) / "merges.txt").write_text(
            "#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8"
        )
        tokenizer = CLIPTokenizer.from_pretrained(
            tmp, pad_token=pad, model_max_length=clip.context_length
        )
    return text_encoder.eval(), tokenizer
