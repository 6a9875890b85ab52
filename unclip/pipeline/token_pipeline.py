"""The DALL-E and DALL-E Mega generators as one pipeline: caption → token transformer → image
tokens → tokenizer decoder → image, with CLIP reranking of ``candidates`` samples per image.

    pipe = load_pipeline("runs/dalle/final/pipeline")        # unclip.pipeline.auto
    out = pipe(["a red circle"], generator=torch.Generator().manual_seed(0))
    out.images[0].save("circle.png")

It takes the call signature of :class:`~unclip.pipeline.pipeline.UnCLIPPipeline` and returns
:class:`~unclip.pipeline.output.UnCLIPOutput` (``image_embeds`` is None: no CLIP image embedding
is decoded here), so ``unclip generate --model``, ``unclip evaluate`` and ``unclip shapes-eval``
run it unchanged. Sampling settings live under the one stage ``transformer``
(:class:`~unclip.sampling.tokens.TokenSampling`).

A folder (:meth:`TokenPipeline.save_pretrained`) is self-describing: ``unclip.json`` with
``family`` (``dalle`` or ``dalle_mega``, from the transformer's type), the component folders and
the default sampling settings; ``tokenizer/``, ``transformer/`` (``config.json`` +
``model.safetensors`` + ``README.md``) and, when there is one, ``clip/`` (the reranking CLIP, also
the CLIP the evaluators score with); a ``README.md`` card at the root.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union, cast

import torch

from unclip.io.weights import read_json
from unclip.nets.clip import CLIP, check_prompts
from unclip.nets.token_common import parameter_count
from unclip.nets.token_components import (
    TokenizerConfig,
    TokenModelConfig,
    load_token_model,
    load_tokenizer,
    save_component,
    tokenizer_facts,
)
from unclip.pipeline.folders import PIPELINE_FILE, component_folder
from unclip.pipeline.output import UnCLIPOutput
from unclip.sampling.candidates import rerank_candidates
from unclip.sampling.tokens import TokenSampling, sample_image_tokens
from unclip.utils.config import to_dict
from unclip.utils.images import to_output

if TYPE_CHECKING:
    from unclip.nets.dvae import DVAE
    from unclip.nets.vqgan import VQGAN

__all__ = ["TokenPipeline", "TOKEN_FAMILIES", "FAMILY_OF"]

#: the pipeline family of each transformer type
FAMILY_OF = {"dalle": "dalle", "mega": "dalle_mega"}
TOKEN_FAMILIES = tuple(FAMILY_OF.values())
FORMAT_VERSION = 1


class TokenPipeline:
    """Caption → image tokens → image (see the module doc)."""

    stage_names = ("transformer",)
    upsamplers: tuple = ()
    upsampler_names: tuple = ()
    lora_adapters: dict = {}

    def __init__(
        self,
        tokenizer: torch.nn.Module,
        tokenizer_config: TokenizerConfig,
        transformer: torch.nn.Module,
        transformer_config: TokenModelConfig,
        sampling: Optional[TokenSampling] = None,
        clip: Optional[CLIP] = None,
    ):
        facts = tokenizer_facts(tokenizer_config)
        model = transformer_config.model
        if facts["grid"] != model.grid or facts["num_codes"] != model.image_vocab_size:
            raise ValueError(
                f"the tokenizer makes {facts['grid']}×{facts['grid']} tokens over "
                f"{facts['num_codes']} codes but the transformer models {model.grid}×{model.grid} "
                f"over {model.image_vocab_size}; pair a transformer with the tokenizer it was "
                "trained on"
            )
        # a dVAE or a VQGAN (what TokenizerConfig builds): decode is theirs
        self.tokenizer = cast("Union[DVAE, VQGAN]", tokenizer.eval())
        self.tokenizer_config = tokenizer_config
        self.transformer, self.transformer_config = transformer.eval(), transformer_config
        self.sampling = {"transformer": sampling or TokenSampling()}
        self.clip = clip
        self.card_info: dict = {}
        for m in self.modules().values():
            m.requires_grad_(False)

    # ------------------------------------------------------------------ facts
    @property
    def family(self) -> str:
        return FAMILY_OF[self.transformer_config.type]

    @property
    def autocast_dtype(self) -> None:
        """None: the token pipeline samples in full precision (a setting is accepted and has no
        effect, so callers that set it for any pipeline work unchanged)."""
        return None

    @autocast_dtype.setter
    def autocast_dtype(self, value) -> None:
        pass

    autocast_setting = None

    @property
    def reranker(self) -> Optional[CLIP]:
        """The CLIP that reranks candidates (the pipeline's only CLIP)."""
        return self.clip

    @property
    def resolution(self) -> int:
        return tokenizer_facts(self.tokenizer_config)["image_size"]

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def modules(self) -> dict[str, torch.nn.Module]:
        mods = {"tokenizer": self.tokenizer, "transformer": self.transformer}
        if self.clip is not None:
            mods["clip"] = self.clip
        return mods

    def to(self, device=None, dtype=None) -> TokenPipeline:
        for m in self.modules().values():
            m.to(device=device, dtype=dtype)
        return self

    def parameter_counts(self) -> dict[str, int]:
        return {k: parameter_count(m) for k, m in self.modules().items()}

    def load_lora(self, *args, **kwargs):
        raise ValueError(f"LoRA adapters apply to unCLIP pipelines; this is a {self.family} one")

    # ------------------------------------------------------------------ settings
    def sampling_settings(self, sampling: Optional[Mapping] = None) -> dict[str, TokenSampling]:
        """``{"transformer": settings}``: the folder's defaults with ``sampling`` overrides
        (``{"transformer": {setting: value}}``, or a :class:`TokenSampling`); unknown keys or
        settings are a ``ValueError`` naming them."""
        base = self.sampling["transformer"]
        for key, value in (sampling or {}).items():
            if key != "transformer":
                raise ValueError(
                    f"sampling override {key!r}: a {self.family} pipeline has one stage, "
                    "'transformer' (settings: temperature, top_k, top_p, guidance_scale, "
                    "candidates, use_cache)"
                )
            if isinstance(value, TokenSampling):
                base = value
                continue
            fields = set(to_dict(base))
            unknown = [k for k in value if k not in fields]
            if unknown:
                raise ValueError(
                    f"sampling.transformer has no setting {unknown[0]!r}; it has "
                    f"{', '.join(sorted(fields))}"
                )
            base = replace(base, **value)
        return {"transformer": replace(base)}

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def __call__(
        self,
        prompts: Union[str, Sequence[str]],
        num_images_per_prompt: int = 1,
        generator=None,
        *,
        sampling: Optional[Mapping] = None,
        output_type: str = "pil",
        return_intermediates: bool = False,
        progress: bool = False,
        negative_prompt: Optional[str] = None,
        image_embeds=None,
        last_stage: Optional[str] = None,
    ) -> UnCLIPOutput:
        """Images for ``prompts`` (``num_images_per_prompt`` each, prompt-major). ``generator``:
        one, one per prompt, or None; each prompt's rows draw from its own generator, so a
        prompt's images do not depend on the prompts batched with it. With
        ``sampling.candidates = k > 1`` each image is the best of ``k`` by the CLIP's
        image–caption cosine (:func:`~unclip.sampling.candidates.rerank_candidates`)."""
        if negative_prompt is not None:
            raise ValueError(
                f"negative_prompt applies to unCLIP pipelines; a {self.family} pipeline guides "
                "with the empty caption (sampling.transformer.guidance_scale)"
            )
        if image_embeds is not None:
            raise ValueError(f"a {self.family} pipeline decodes no CLIP image embeddings")
        if last_stage not in (None, "transformer", "tokenizer"):
            raise ValueError(f"last_stage: a {self.family} pipeline has no stage {last_stage!r}")
        prompts = check_prompts(prompts)
        s = self.sampling_settings(sampling)["transformer"]
        if s.candidates > 1 and self.clip is None:
            raise ValueError(
                "sampling.transformer.candidates > 1 reranks with a CLIP, which this pipeline "
                "lacks; set candidates=1 or build the pipeline with rerank_clip"
            )
        n, k = int(num_images_per_prompt), s.candidates
        if n < 1:
            raise ValueError(f"num_images_per_prompt must be >= 1, got {n}")
        rows = [p for p in prompts for _ in range(n * k)]
        if isinstance(generator, (list, tuple)):
            if len(generator) != len(prompts):
                raise ValueError(
                    f"{len(generator)} generators for {len(prompts)} prompts; pass one per prompt"
                )
            generator = [g for g in generator for _ in range(n * k)]
        device = self.device
        ids, mask = self.transformer_config.caption_ids(rows)
        t0 = time.perf_counter()
        tokens = sample_image_tokens(
            self.transformer,
            ids.to(device),
            mask.to(device),
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            guidance_scale=s.guidance_scale,
            generator=generator,
            use_cache=s.use_cache,
        )
        t1 = time.perf_counter()
        images = self.tokenizer.decode(tokens).float()
        t2 = time.perf_counter()
        timings = {"transformer": t1 - t0, "tokenizer": t2 - t1}
        if k > 1 and self.clip is not None:  # (candidates > 1 without a CLIP: refused above)
            best = rerank_candidates(self.clip, images, rows, k)
            images = images[best]
            timings["rerank"] = time.perf_counter() - t2
        text_embeds = None
        if self.clip is not None:
            text_embeds = self.clip.encode_text([p for p in prompts for _ in range(n)]).text_embed
        return UnCLIPOutput(
            images=to_output(images, output_type),
            image_embeds=None,
            text_embeds=text_embeds,
            stage_images={"tokenizer": images} if return_intermediates else {},
            timings=timings,
        )

    # ------------------------------------------------------------------ folders
    @classmethod
    def from_components(
        cls,
        tokenizer: Union[str, os.PathLike],
        transformer: Union[str, os.PathLike],
        *,
        sampling: Optional[TokenSampling] = None,
        rerank_clip: Union[str, os.PathLike, None] = None,
    ) -> TokenPipeline:
        """A pipeline from component folders (``final/tokenizer`` of ``unclip
        train-tokenizer``, ``final/transformer`` of ``unclip train-tokens``) and, optionally, a
        CLIP folder to rerank with."""
        tok, tok_cfg = load_tokenizer(tokenizer)
        net, net_cfg = load_token_model(transformer)
        clip = CLIP.from_pretrained(rerank_clip).eval() if rerank_clip is not None else None
        return cls(tok, tok_cfg, net, net_cfg, sampling, clip)

    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, os.PathLike],
        allow_external_components: bool = False,
        **_ignored,
    ) -> TokenPipeline:
        """Load a folder written by :meth:`save_pretrained` (its components from inside it, as
        :func:`~unclip.pipeline.folders.component_folder` checks)."""
        path = Path(path)
        index = read_json(path / PIPELINE_FILE, "pipeline")
        if index.get("family") not in TOKEN_FAMILIES:
            raise ValueError(
                f"{path / PIPELINE_FILE} is not a token pipeline (family "
                f"{index.get('family')!r}); load it with unclip.pipeline.auto.load_pipeline"
            )
        comps = index.get("components", {})

        def sub(name):
            return component_folder(path, name, allow_external_components)

        tok, tok_cfg = load_tokenizer(sub(comps.get("tokenizer", "tokenizer")))
        net, net_cfg = load_token_model(sub(comps.get("transformer", "transformer")))
        clip = None
        if comps.get("clip"):
            clip = CLIP.from_pretrained(sub(comps["clip"])).eval()
        sampling = TokenSampling(**index.get("sampling", {}).get("transformer", {}))
        return cls(tok, tok_cfg, net, net_cfg, sampling, clip)

    def save_pretrained(self, folder: Union[str, os.PathLike]) -> Path:
        """Write the folder described in the module doc."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_component(self.tokenizer, folder / "tokenizer", "tokenizer", self.tokenizer_config)
        save_component(
            self.transformer, folder / "transformer", "transformer", self.transformer_config
        )
        if self.clip is not None:
            self.clip.save_pretrained(folder / "clip")
        index = {
            "family": self.family,
            "format_version": FORMAT_VERSION,
            "components": {
                "tokenizer": "tokenizer",
                "transformer": "transformer",
                "clip": "clip" if self.clip is not None else None,
            },
            "sampling": {"transformer": to_dict(self.sampling["transformer"])},
        }
        (folder / PIPELINE_FILE).write_text(json.dumps(index, indent=2))
        counts = self.parameter_counts()
        rows = "\n".join(f"| {k} | {v:,} |" for k, v in counts.items())
        (folder / "README.md").write_text(
            f"# {self.family} pipeline\n\nCaption → {self.transformer_config.type} transformer → "
            f"{self.tokenizer_config.type} tokens → {self.resolution} px image"
            + (", best of the candidates by the CLIP" if self.clip is not None else "")
            + f".\n\n| component | parameters |\n| --- | --- |\n{rows}\n\n"
            "Load with `unclip.pipeline.auto.load_pipeline(folder)`; sample with "
            "`unclip generate --model FOLDER`.\n"
        )
        return folder
