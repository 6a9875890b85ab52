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

A folder (``save_pretrained``) is self-describing: ``unclip.json`` with
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
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Self, Union, cast

import torch

from unclip.diffusion.config import diffusion_to_save
from unclip.diffusion.loop import Generator
from unclip.io.weights import read_json
from unclip.nets.clip import CLIP, check_prompts
from unclip.nets.decoder import UnCLIPUpsampler
from unclip.nets.token_components import (
    TokenizerConfig,
    TokenModelConfig,
    load_token_model,
    load_tokenizer,
    save_component,
    tokenizer_facts,
)
from unclip.pipeline.base import BasePipeline, ResolvedSampling
from unclip.pipeline.diffusers_api import check_from_pretrained_options
from unclip.pipeline.folders import (
    PIPELINE_FILE,
    component_folder,
    load_upsampler_folder,
    save_diffusers_component,
)
from unclip.pipeline.memory import MemoryMixin
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
from unclip.sampling.stages import StepCallback
from unclip.sampling.tokens import TokenSampling, sample_image_tokens
from unclip.sampling.utils import check_count, check_output_type, expand_generator, stages_until
from unclip.utils.config import to_dict
from unclip.utils.images import to_output
from unclip.utils.offload import releases_gpu
from unclip.utils.precision import parse_autocast, parse_dtype

if TYPE_CHECKING:
    from unclip.nets.dvae import DVAE
    from unclip.nets.vqgan import VQGAN

__all__ = ["TokenPipeline", "TOKEN_FAMILIES", "FAMILY_OF"]

#: the pipeline family of each transformer type
FAMILY_OF = {"dalle": "dalle", "mega": "dalle_mega"}
TOKEN_FAMILIES = tuple(FAMILY_OF.values())
FORMAT_VERSION = 1


class TokenPipeline(MemoryMixin, BasePipeline):
    """Caption → image tokens → image (see the module doc). It stands on the pipeline base
    (:class:`~unclip.pipeline.base.BasePipeline`: devices, dtype, autocast, offload, the upsampler
    chain, ``components``, ``from_pipe``, ``save_pretrained``), with the attention-memory options
    for its upsamplers; it has no LoRA adapters."""

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
        in ``unclip.json``), each defaulting to the upsampler defaults. The networks are put in
        eval mode without gradients: a token pipeline samples (training builds its own)."""
        self._init_base()
        facts = tokenizer_facts(tokenizer_config)
        model = transformer_config.model
        if facts["grid"] != model.grid or facts["num_codes"] != model.image_vocab_size:
            raise ValueError(
                f"the tokenizer makes {facts['grid']}×{facts['grid']} tokens over "
                f"{facts['num_codes']} codes but the transformer models {model.grid}×{model.grid} "
                f"over {model.image_vocab_size}; pair a transformer with the tokenizer it was "
                "trained on"
            )
        if sampling is not None and not isinstance(sampling, TokenSampling):
            raise TypeError(f"sampling must be a TokenSampling, got {type(sampling).__name__}")
        # a dVAE or a VQGAN (what TokenizerConfig builds): decode is theirs
        self.tokenizer = cast("Union[DVAE, VQGAN]", tokenizer)
        self.tokenizer_config = tokenizer_config
        self.transformer, self.transformer_config = transformer, transformer_config
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
        if clip is not None and not isinstance(clip, CLIP):
            raise TypeError(f"clip must be a CLIP (or None), got {type(clip).__name__}")
        self.clip = clip
        self._freeze()

    @property
    def transformer_sampling(self) -> TokenSampling:
        """The transformer's sampling settings (``sampling["transformer"]``)."""
        s = self.sampling["transformer"]
        assert isinstance(s, TokenSampling), type(s).__name__
        return s

    # ------------------------------------------------------------------ the base's hooks
    @property
    def stage_names(self) -> list[str]:
        return ["transformer", *self.upsampler_names]

    def modules(self) -> dict[str, torch.nn.Module]:
        mods = {"tokenizer": self.tokenizer, "transformer": self.transformer}
        mods.update(zip(self.upsampler_names, self.upsamplers))
        if self.clip is not None:
            mods["clip"] = self.clip
        return mods

    def denoisers(self) -> dict[str, torch.nn.Module]:
        """The networks of every sampling step: the token transformer and the upsampler UNets."""
        nets: dict[str, torch.nn.Module] = {"transformer": self.transformer}
        for name, up in zip(self.upsampler_names, self.upsamplers):
            nets[name] = up.unet
            if up.final_unet is not None:
                nets[f"{name}.final"] = up.final_unet
        return nets

    def _anchor(self) -> torch.nn.Module:
        return self.transformer

    def _init_kwargs(self) -> dict[str, Any]:
        return {
            "tokenizer": self.tokenizer,
            "tokenizer_config": self.tokenizer_config,
            "transformer": self.transformer,
            "transformer_config": self.transformer_config,
            "sampling": self.transformer_sampling,
            "clip": self.clip,
            "upsamplers": list(self.upsamplers),
            "upsampler_diffusion": {n: self.diffusion[n] for n in self.upsampler_names},
            "upsampler_sampling": {n: self.sampling[n] for n in self.upsampler_names},
        }

    # ------------------------------------------------------------------ facts
    @property
    def family(self) -> str:
        return FAMILY_OF[self.transformer_config.type]

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

    # ------------------------------------------------------------------ settings
    def sampling_settings(self, sampling: Optional[Mapping] = None) -> ResolvedSampling:
        """``{"transformer": TokenSampling, <upsampler>: UpsamplerSampling, ...}``: the folder's
        defaults with ``sampling`` overrides (``{"transformer": {setting: value}}`` or a
        :class:`TokenSampling`; ``{"sr64": {...}}`` or ``{"upsampler": {...}}`` for the
        upsamplers, as in ``UnCLIPPipeline``); unknown keys or settings are a ``ValueError``
        naming them. A :class:`~unclip.pipeline.base.ResolvedSampling` is returned as it is."""
        if isinstance(sampling, ResolvedSampling):
            return sampling
        if sampling is not None and not isinstance(sampling, Mapping):
            raise TypeError(
                f"sampling must be a mapping of stage to settings, got {type(sampling).__name__}"
            )
        sampling = dict(sampling or {})
        valid = [*self.stage_names, EVERY_UPSAMPLER]
        for key in sampling:
            if key not in valid:
                raise ValueError(
                    f"sampling override {key!r}: a {self.family} pipeline has the stages "
                    f"{', '.join(valid)} ('transformer' settings: temperature, top_k, top_p, "
                    "guidance_scale, candidates, use_cache)"
                )
        base = self.transformer_sampling
        value = sampling.pop("transformer", None)
        if isinstance(value, TokenSampling):
            base = value
        elif value is not None:
            if not isinstance(value, Mapping):
                raise TypeError(
                    "sampling['transformer'] must be a TokenSampling or a mapping of its "
                    f"settings, got {type(value).__name__}"
                )
            fields = set(to_dict(base))
            unknown = [k for k in value if k not in fields]
            if unknown:
                raise ValueError(
                    f"sampling.transformer has no setting {unknown[0]!r}; it has "
                    f"{', '.join(sorted(fields))}"
                )
            base = replace(base, **value)
        ups = resolve_sampling({n: self.sampling[n] for n in self.upsampler_names}, sampling)
        return ResolvedSampling({"transformer": replace(base), **ups})

    # ------------------------------------------------------------------ sampling
    @releases_gpu
    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, Sequence[str], None] = None,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        sampling: Optional[Mapping] = None,
        output_type: str = "pil",
        return_intermediates: bool = False,
        progress: bool = True,
        callback_on_step_end: Optional[StepCallback] = None,
        image_embeds=None,
        last_stage: Optional[str] = None,
        negative_prompt: Optional[str] = None,
        *,
        return_dict: bool = True,
        prompts: Union[str, Sequence[str], None] = None,
    ) -> Union[UnCLIPOutput, tuple]:
        """Images for ``prompt`` (one caption or a list; ``num_images_per_prompt`` each,
        prompt-major), with :meth:`UnCLIPPipeline.__call__
        <unclip.pipeline.pipeline.UnCLIPPipeline.__call__>`'s signature. ``generator``: one, one
        per prompt, one per image, or None; each image's candidates draw from its generator, so
        an image does not depend on the prompts batched with it. With ``sampling.candidates = k >
        1`` each image is the best of ``k`` by the CLIP's image–caption cosine
        (:func:`~unclip.sampling.candidates.rerank_candidates`). ``output_type`` and
        ``return_dict`` as there; the networks run under :attr:`autocast_dtype` when it is set.

        ``callback_on_step_end(pipe, step, timestep, callback_kwargs)`` runs after each image
        token (``step`` and ``timestep``: the token's raster position, ``callback_kwargs``:
        ``{"stage": "transformer", "tokens": [B, step + 1]}``; a returned value is ignored, the
        tokens drawn stay) and after each upsampler denoising step (as in ``UnCLIPPipeline``:
        ``{"stage": "sr64", "latents": x_t}``, a returned ``latents`` replaces ``x_t``).
        ``prompts=``: the earlier name of ``prompt`` (deprecated)."""
        if prompts is not None:
            if prompt is not None:
                raise TypeError("give prompt (or its deprecated name prompts), not both")
            warnings.warn(
                "TokenPipeline(prompts=...) is deprecated; the argument is called prompt, as in "
                "every pipeline",
                FutureWarning,
                stacklevel=2,
            )
            prompt = prompts
        if prompt is None:
            raise TypeError("TokenPipeline.__call__: give prompt, a caption or a list of them")
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
        check_output_type(output_type)
        prompts_ = check_prompts(prompt)
        n = check_count(num_images_per_prompt)
        progress = self._progress(progress)
        settings = self.sampling_settings(sampling)  # resolved once, read by every stage
        s = settings["transformer"]
        assert isinstance(s, TokenSampling)
        if s.candidates > 1 and self.clip is None:
            raise ValueError(
                "sampling.transformer.candidates > 1 reranks with a CLIP, which this pipeline "
                "lacks; set candidates=1 or build the pipeline with rerank_clip"
            )
        k = s.candidates
        from unclip.pipeline.limits import check_token_batch_fits

        check_token_batch_fits(self, s, len(prompts_) * n)  # all rows at once: memory first
        rows = [p for p in prompts_ for _ in range(n * k)]
        gen = expand_generator(generator, len(prompts_), n * k, "generator", candidates=k)
        if gen is not None and not isinstance(gen, torch.Generator):
            gen = list(gen)
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

        t0 = self._now()
        self._onload("transformer")
        autocast = self.autocast_dtype
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            tokens = sample_image_tokens(
                self.transformer,
                ids.to(device),
                mask.to(device),
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                guidance_scale=s.guidance_scale,
                generator=gen,
                use_cache=s.use_cache,
                on_token=on_token,
            )
        t1 = self._now()
        self._onload("tokenizer")
        images = self.tokenizer.decode(tokens).float()
        t2 = self._now()
        timings = {"transformer": t1 - t0, "tokenizer": t2 - t1}
        if k > 1 and self.clip is not None:  # (candidates > 1 without a CLIP: refused above)
            self._onload("clip")
            best = rerank_candidates(self.clip, images, rows, k)
            images = images[best]
            timings["rerank"] = self._now() - t2
        stage_images = {"tokenizer": images}
        if last_stage in (None, *self.upsampler_names):
            # the generators carry on from the token sampling, one per kept image
            gen = gen[::k] if isinstance(gen, list) else gen
            for name in stages_until(self.upsampler_names, last_stage):
                t0 = self._now()
                images = self.upsample(
                    images,
                    gen,
                    settings,
                    stages=[name],
                    progress=progress,
                    callback_on_step_end=callback_on_step_end,
                )
                timings[name] = self._now() - t0
                stage_images[name] = images
        text_embeds = None
        if self.clip is not None:
            self._onload("clip")
            text_embeds = self.clip.encode_text([p for p in prompts_ for _ in range(n)]).text_embed
        out = to_output(images, output_type)
        if not return_dict:
            return (out,)
        return UnCLIPOutput(
            images=out,
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
    ) -> Self:
        """A pipeline from component folders (``final/tokenizer`` of ``unclip
        train-tokenizer``, ``final/transformer`` of ``unclip train-tokens``) and, optionally, a
        CLIP folder to rerank with and upsampler folders to run after the tokenizer (see
        :meth:`with_upsamplers`)."""
        tok, tok_cfg = load_tokenizer(tokenizer)
        net, net_cfg = load_token_model(transformer)
        clip = CLIP.from_pretrained(rerank_clip).eval() if rerank_clip is not None else None
        return cls(tok, tok_cfg, net, net_cfg, sampling, clip).with_upsamplers(upsamplers)

    def with_upsamplers(self, folders: Sequence[Union[str, os.PathLike]]) -> Self:
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
        pipe = type(self).from_pipe(
            self, upsamplers=ups, upsampler_diffusion=diffusion, upsampler_sampling=sampling
        )
        device = self.device
        for up in ups:
            if up.device != device:  # moving in place warns needlessly otherwise (diffusers)
                up.to(device)
        return pipe

    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, os.PathLike],
        *,
        torch_dtype: Union[torch.dtype, str, None] = None,
        dtype: Union[torch.dtype, str, None] = None,
        autocast_dtype=None,
        memory_format: Optional[torch.memory_format] = None,
        device_map: Union[str, torch.device, None] = None,
        allow_external_components: bool = False,
    ) -> Self:
        """Load a folder written by :meth:`save_pretrained` (its components from inside it, as
        :func:`~unclip.pipeline.folders.component_folder` checks). ``torch_dtype`` (or
        ``dtype``), ``autocast_dtype``, ``memory_format`` (the upsamplers' weights) and
        ``device_map`` (one device) as in :meth:`UnCLIPPipeline.from_pretrained
        <unclip.pipeline.pipeline.UnCLIPPipeline.from_pretrained>`; exact by default."""
        from unclip.pipeline.loading import one_dtype

        _, device = check_from_pretrained_options(None, None, None, device_map)
        weights_dtype = parse_dtype(one_dtype(torch_dtype, dtype))
        autocast = parse_autocast(autocast_dtype)
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
        pipe = cls(
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
        pipe._loaded_defaults(autocast, memory_format, weights_dtype)
        return pipe if device is None else pipe.to(device)

    _reads_variants = False  # the tokenizer and transformer folders hold model.safetensors

    def _write_folder(self, folder: Path, model_card: Mapping) -> None:
        """The folder described in the module doc (``model_card``'s ``license`` and
        ``description``, when given, go into its ``README.md``)."""
        unsupported = sorted(set(model_card) - {"description", "license", "repo_id"})
        if unsupported:
            raise ValueError(
                f"save_pretrained: a token pipeline's README takes description and license only; "
                f"{', '.join(unsupported)} would be dropped (leave them out)"
            )
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
            + "".join(
                f"\n**{key.capitalize()}:** {model_card[key]}\n"
                for key in ("description", "license")
                if model_card.get(key)
            )
        )
