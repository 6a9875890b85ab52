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

**Upsamplers.** A token pipeline may carry unCLIP upsamplers (e.g. the bundled shapes model's
``sr64`` and ``sr128``, 32 → 64 → 128 px) that run after the tokenizer decoder, each with the
diffusion and sampling settings it was trained and shipped with; they are saved in the folder as
``sr64/``, ``sr128/`` (listed under ``components.upsamplers``, their settings under ``diffusion``
and ``sampling``, as in an unCLIP folder). Attach them with ``upsamplers:`` in a ``train-tokens``
config, :meth:`TokenPipeline.from_components` or :meth:`TokenPipeline.with_upsamplers`; sample
settings per upsampler as in ``UnCLIPPipeline`` (``sampling={"sr64": {"steps": 2}}`` or
``{"upsampler": ...}`` for all); ``last_stage="tokenizer"`` stops before them.
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

from unclip.diffusion.config import diffusion_to_save
from unclip.io.weights import read_json
from unclip.nets.clip import CLIP, check_prompts
from unclip.nets.decoder import UnCLIPUpsampler
from unclip.nets.token_common import parameter_count
from unclip.nets.token_components import (
    TokenizerConfig,
    TokenModelConfig,
    load_token_model,
    load_tokenizer,
    save_component,
    tokenizer_facts,
)
from unclip.pipeline.folders import (
    PIPELINE_FILE,
    component_folder,
    load_upsampler_folder,
    save_diffusers_component,
)
from unclip.pipeline.output import UnCLIPOutput
from unclip.sampling.candidates import rerank_candidates
from unclip.sampling.settings import (
    DEFAULT_DIFFUSION,
    DEFAULT_SAMPLING,
    EVERY_UPSAMPLER,
    resolve_sampling,
    sampling_to_save,
    stage_settings,
)
from unclip.sampling.stages import StepCallback, sample_upsampler, stage_callback
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

    lora_adapters: dict = {}

    def __init__(
        self,
        tokenizer: torch.nn.Module,
        tokenizer_config: TokenizerConfig,
        transformer: torch.nn.Module,
        transformer_config: TokenModelConfig,
        sampling: Optional[TokenSampling] = None,
        clip: Optional[CLIP] = None,
        upsamplers: Sequence[UnCLIPUpsampler] = (),
        upsampler_diffusion: Optional[Mapping] = None,
        upsampler_sampling: Optional[Mapping] = None,
    ):
        """``upsamplers``: run in turn after the tokenizer decoder, the first reading the
        tokenizer's resolution, each the one before's; ``upsampler_diffusion`` /
        ``upsampler_sampling``: ``{name: settings}`` (``sr64``: a config or its dict, as stored
        in ``unclip.json``), each defaulting to the upsampler defaults."""
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
        self.upsamplers = list(upsamplers)
        size = facts["image_size"]
        for up in self.upsamplers:
            if not isinstance(up, UnCLIPUpsampler):
                raise TypeError(f"upsamplers must be UnCLIPUpsampler, got {type(up).__name__}")
            if up.config.low_res_size != size:
                raise ValueError(
                    f"upsampler sr{up.config.sample_size} reads {up.config.low_res_size} px "
                    f"images but gets {size} px ones; chain upsamplers from the tokenizer's "
                    f"{facts['image_size']} px, each reading the size the one before makes"
                )
            size = up.config.sample_size
        names = self.upsampler_names
        if len(set(names)) != len(names):
            raise ValueError(f"two upsamplers make the same size: {', '.join(names)}")
        self.diffusion, up_sampling = stage_settings(names, upsampler_diffusion, upsampler_sampling)
        self.sampling = {"transformer": sampling or TokenSampling(), **up_sampling}
        self.clip = clip
        self.card_info: dict = {}

    @property
    def transformer_sampling(self) -> TokenSampling:
        """The transformer's sampling settings (``sampling["transformer"]``)."""
        s = self.sampling["transformer"]
        assert isinstance(s, TokenSampling), type(s).__name__
        return s
        for m in self.modules().values():
            m.requires_grad_(False)

    # ------------------------------------------------------------------ facts
    @property
    def upsampler_names(self) -> list[str]:
        return [f"sr{u.config.sample_size}" for u in self.upsamplers]

    @property
    def stage_names(self) -> tuple[str, ...]:
        return ("transformer", *self.upsampler_names)

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
        """The size of the images the pipeline returns (the last upsampler's, if any)."""
        if self.upsamplers:
            return self.upsamplers[-1].config.sample_size
        return tokenizer_facts(self.tokenizer_config)["image_size"]

    @property
    def num_image_tokens(self) -> int:
        """Image tokens sampled per image, one transformer step each (``grid²``)."""
        return self.transformer_config.model.grid**2

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def modules(self) -> dict[str, torch.nn.Module]:
        mods = {"tokenizer": self.tokenizer, "transformer": self.transformer}
        mods.update(zip(self.upsampler_names, self.upsamplers))
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
    def sampling_settings(self, sampling: Optional[Mapping] = None) -> dict:
        """``{"transformer": TokenSampling, <upsampler>: UpsamplerSampling, ...}``: the folder's
        defaults with ``sampling`` overrides (``{"transformer": {setting: value}}`` or a
        :class:`TokenSampling`; ``{"sr64": {...}}`` or ``{"upsampler": {...}}`` for the
        upsamplers, as in ``UnCLIPPipeline``); unknown keys or settings are a ``ValueError``
        naming them."""
        sampling = dict(sampling or {})
        valid = [*self.stage_names, EVERY_UPSAMPLER]
        for key in sampling:
            if key not in valid:
                raise ValueError(
                    f"sampling override {key!r}: a {self.family} pipeline has the stages "
                    f"{', '.join(valid)} ('transformer' settings: temperature, top_k, top_p, "
                    "guidance_scale, candidates, use_cache)"
                )
        base = self.sampling["transformer"]
        value = sampling.pop("transformer", None)
        if isinstance(value, TokenSampling):
            base = value
        elif value is not None:
            fields = set(to_dict(base))
            unknown = [k for k in value if k not in fields]
            if unknown:
                raise ValueError(
                    f"sampling.transformer has no setting {unknown[0]!r}; it has "
                    f"{', '.join(sorted(fields))}"
                )
            base = replace(base, **value)
        ups = resolve_sampling({n: self.sampling[n] for n in self.upsampler_names}, sampling)
        return {"transformer": replace(base), **ups}

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
        callback_on_step_end: Optional[StepCallback] = None,
    ) -> UnCLIPOutput:
        """Images for ``prompts`` (``num_images_per_prompt`` each, prompt-major). ``generator``:
        one, one per prompt, or None; each prompt's rows draw from its own generator, so a
        prompt's images do not depend on the prompts batched with it. With
        ``sampling.candidates = k > 1`` each image is the best of ``k`` by the CLIP's
        image–caption cosine (:func:`~unclip.sampling.candidates.rerank_candidates`).

        ``callback_on_step_end(pipe, step, timestep, callback_kwargs)`` runs after each image
        token (``step`` and ``timestep``: the token's raster position, ``callback_kwargs``:
        ``{"stage": "transformer", "tokens": [B, step + 1]}``; a returned value is ignored, the
        tokens drawn stay) and after each upsampler denoising step (as in ``UnCLIPPipeline``:
        ``{"stage": "sr64", "latents": x_t}``, a returned ``latents`` replaces ``x_t``)."""
        if negative_prompt is not None:
            raise ValueError(
                f"negative_prompt applies to unCLIP pipelines; a {self.family} pipeline guides "
                "with the empty caption (sampling.transformer.guidance_scale)"
            )
        if image_embeds is not None:
            raise ValueError(f"a {self.family} pipeline decodes no CLIP image embeddings")
        if last_stage not in (None, "transformer", "tokenizer", *self.upsampler_names):
            raise ValueError(
                f"last_stage: a {self.family} pipeline has no stage {last_stage!r} (it has "
                f"tokenizer{''.join(', ' + n for n in self.upsampler_names)})"
            )
        prompts = check_prompts(prompts)
        settings = self.sampling_settings(sampling)
        s = settings["transformer"]
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
        on_token = None
        if callback_on_step_end is not None:
            if not callable(callback_on_step_end):
                raise TypeError(
                    "callback_on_step_end must be callable, got "
                    f"{type(callback_on_step_end).__name__}"
                )

            def on_token(i: int, drawn: torch.Tensor) -> None:
                kwargs = {"stage": "transformer", "tokens": drawn}
                callback_on_step_end(self, i, torch.tensor(i), kwargs)

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
            on_token=on_token,
        )
        t1 = time.perf_counter()
        images = self.tokenizer.decode(tokens).float()
        t2 = time.perf_counter()
        timings = {"transformer": t1 - t0, "tokenizer": t2 - t1}
        if k > 1 and self.clip is not None:  # (candidates > 1 without a CLIP: refused above)
            best = rerank_candidates(self.clip, images, rows, k)
            images = images[best]
            timings["rerank"] = time.perf_counter() - t2
        stage_images = {"tokenizer": images}
        if last_stage in (None, *self.upsampler_names):
            # the generators carry on from the token sampling, one per kept image
            gen = generator[::k] if isinstance(generator, list) else generator
            for name, up in zip(self.upsampler_names, self.upsamplers):
                t0 = time.perf_counter()
                images = sample_upsampler(
                    up,
                    images.to(up.device),
                    settings[name],
                    self.diffusion[name],
                    generator=gen,
                    progress=progress,
                    callback=stage_callback(self, name, callback_on_step_end),
                )
                timings[name] = time.perf_counter() - t0
                stage_images[name] = images
                if name == last_stage:
                    break
        text_embeds = None
        if self.clip is not None:
            text_embeds = self.clip.encode_text([p for p in prompts for _ in range(n)]).text_embed
        return UnCLIPOutput(
            images=to_output(images, output_type),
            image_embeds=None,
            text_embeds=text_embeds,
            stage_images=stage_images if return_intermediates else {},
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
        upsamplers: Sequence[Union[str, os.PathLike]] = (),
    ) -> TokenPipeline:
        """A pipeline from component folders (``final/tokenizer`` of ``unclip
        train-tokenizer``, ``final/transformer`` of ``unclip train-tokens``) and, optionally, a
        CLIP folder to rerank with and upsampler folders to run after the tokenizer (see
        :meth:`with_upsamplers`)."""
        tok, tok_cfg = load_tokenizer(tokenizer)
        net, net_cfg = load_token_model(transformer)
        clip = CLIP.from_pretrained(rerank_clip).eval() if rerank_clip is not None else None
        return cls(tok, tok_cfg, net, net_cfg, sampling, clip).with_upsamplers(upsamplers)

    def with_upsamplers(self, folders: Sequence[Union[str, os.PathLike]]) -> TokenPipeline:
        """This pipeline with the upsamplers in ``folders`` (in order; each an upsampler that a
        training run exported, ``<output_dir>/final/sr64``, or one inside an unCLIP pipeline
        folder, e.g. ``unclip/bundled/shapes/sr64``) after the tokenizer decoder in place of
        any it had, each with its stored diffusion and sampling settings. Returns a new
        pipeline sharing this one's networks."""
        if isinstance(folders, (str, os.PathLike)):
            raise TypeError("with_upsamplers takes a list of upsampler folders, not one path")
        ups, diffusion, sampling = [], {}, {}
        for folder in folders:
            up, d, smp = load_upsampler_folder(
                folder, DEFAULT_DIFFUSION, {"upsampler": DEFAULT_SAMPLING["upsampler"]}
            )
            name = f"sr{up.config.sample_size}"
            ups.append(up)
            diffusion[name], sampling[name] = d, smp
        pipe = type(self)(
            self.tokenizer,
            self.tokenizer_config,
            self.transformer,
            self.transformer_config,
            self.transformer_sampling,
            self.clip,
            ups,
            diffusion,
            sampling,
        )
        pipe.card_info = dict(self.card_info)
        device = self.device
        for up in ups:
            if up.device != device:  # moving in place warns needlessly otherwise (diffusers)
                up.to(device)
        return pipe

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
        stored = index.get("sampling", {})
        sampling = TokenSampling(**stored.get("transformer", {}))
        names = comps.get("upsamplers") or []
        if not isinstance(names, list):
            raise ValueError(f"{path / PIPELINE_FILE}: components.upsamplers must be a list")
        ups = [UnCLIPUpsampler.from_pretrained(sub(n)) for n in names]
        return cls(
            tok,
            tok_cfg,
            net,
            net_cfg,
            sampling,
            clip,
            ups,
            index.get("diffusion", {}),
            {k: v for k, v in stored.items() if k != "transformer"},
        )

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
        for name, up in zip(self.upsampler_names, self.upsamplers):
            save_diffusers_component(up, folder / name)
        index = {
            "family": self.family,
            "format_version": FORMAT_VERSION,
            "components": {
                "tokenizer": "tokenizer",
                "transformer": "transformer",
                "clip": "clip" if self.clip is not None else None,
                "upsamplers": self.upsampler_names,
            },
            "diffusion": {n: diffusion_to_save(self.diffusion[n]) for n in self.upsampler_names},
            "sampling": {
                "transformer": to_dict(self.sampling["transformer"]),
                **{n: sampling_to_save(self.sampling[n]) for n in self.upsampler_names},
            },
        }
        (folder / PIPELINE_FILE).write_text(json.dumps(index, indent=2))
        counts = self.parameter_counts()
        rows = "\n".join(f"| {k} | {v:,} |" for k, v in counts.items())
        (folder / "README.md").write_text(
            f"# {self.family} pipeline\n\nCaption → {self.transformer_config.type} transformer → "
            f"{self.tokenizer_config.type} tokens → "
            f"{tokenizer_facts(self.tokenizer_config)['image_size']} px image"
            + "".join(f" → {n}" for n in self.upsampler_names)
            + (", best of the candidates by the CLIP" if self.clip is not None else "")
            + f".\n\n| component | parameters |\n| --- | --- |\n{rows}\n\n"
            "Load with `unclip.pipeline.auto.load_pipeline(folder)`; sample with "
            "`unclip generate --model FOLDER`.\n"
        )
        return folder
