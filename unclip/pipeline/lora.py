"""LoRA adapters on a pipeline's stages: ``load_lora``, ``set_lora_scale``, ``merge_lora``,
``unload_lora``, and diffusers' names for them.

:class:`LoraMixin` is a capability on the pipeline base
(:class:`~unclip.pipeline.base.BasePipeline`) that a family takes on by inheriting it, as
diffusers' loader mixins are; the adapter operations
on one stage component and the adapter folders are in :mod:`unclip.nets.lora`.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from unclip.io.hub import resolve_folder
from unclip.nets.lora import (
    AdapterFolder,
    add_adapter,
    base_fingerprint,
    config_targets,
    drop_adapter_layers,
    fuse_adapters,
    load_adapter_state,
    merge_adapters,
    read_adapter,
    remove_adapter,
    set_adapter_scale,
    unfuse_adapters,
)
from unclip.pipeline.base import BasePipeline

__all__ = ["LoraMixin", "LoadedAdapter"]


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"LoRA scale must be a finite number, got {scale!r}")
    return float(scale)


@dataclass
class LoadedAdapter:
    """An adapter loaded onto a pipeline: the stage it adapts, its scale, its folder."""

    stage: str
    scale: float
    path: str


class LoraMixin(BasePipeline):
    """``load_lora``, ``set_lora_scale``, ``merge_lora``, ``unload_lora`` (see the module doc),
    and diffusers' names: ``load_lora_weights``, ``set_adapters``, ``disable_lora``,
    ``enable_lora``, ``delete_adapters``, ``get_list_adapters``, ``get_active_adapters``,
    ``fuse_lora``, ``unfuse_lora``, ``unload_lora_weights``. The adapted stages are the
    components other than the CLIPs."""

    @property
    def lora_adapters(self) -> dict[str, LoadedAdapter]:
        """The adapters loaded and not merged: ``{name: LoadedAdapter(stage, scale, path)}``."""
        return self.__dict__.setdefault("_lora_adapters", {})

    def _adaptable_stages(self) -> dict[str, torch.nn.Module]:
        return {k: m for k, m in self.modules().items() if k not in ("clip", "reranker")}

    def load_lora(
        self,
        path: Union[str, os.PathLike],
        scale: float = 1.0,
        stage: Optional[str] = None,
        name: Optional[str] = None,
        weight_name: Optional[str] = None,
    ) -> str:
        """Load a LoRA adapter folder onto the stage it was trained for and return its name.

        ``stage``: check that the adapter is for this stage (default: the stage its
        ``unclip_lora.json`` names). ``scale`` multiplies its update (0: the base pipeline's images
        exactly). ``name``: default the folder's name (made unique). Several adapters may be loaded,
        on one stage or several; their updates add up. An adapter of another architecture is a
        ``ValueError`` and leaves the pipeline as it was; one trained on other base weights or with
        another CLIP loads with a warning (the results may be off)."""
        self._refuse_fused("load_lora")
        scale = _check_scale(scale)
        adapter = read_adapter(path, weight_name)
        want = adapter.stage
        stages = self._adaptable_stages()
        if stage is not None and stage != want:
            raise ValueError(
                f"{adapter.path} is a LoRA adapter for the {want!r} stage, not {stage!r}"
            )
        if want not in stages:
            raise ValueError(
                f"{adapter.path} adapts the {want!r} stage, which this pipeline does not have "
                f"(stages: {', '.join(stages)})"
            )
        model = stages[want]
        kind = adapter.meta.get("component")
        if kind != type(model).__name__:
            raise ValueError(
                f"{adapter.path} was trained on a {kind}, but this pipeline's {want!r} is a "
                f"{type(model).__name__}"
            )
        name = self._unique_adapter_name(name or adapter.path.name)
        self._offload_all()  # with model offload: inject next to the weights' CPU home
        try:
            add_adapter(model, name, rank=adapter.config.r, config=adapter.config)
            load_adapter_state(model, name, adapter.state, str(adapter.path))
        except Exception:
            remove_adapter(model, name)  # whatever was injected: the pipeline as it was
            raise
        self._warn_if_other_base(adapter, model, want)
        # loaded while LoRA is disabled: off until enable_lora
        set_adapter_scale(model, name, 0.0 if self.__dict__.get("_lora_disabled") else scale)
        self.lora_adapters[name] = LoadedAdapter(want, float(scale), str(adapter.path))
        return name

    def _unique_adapter_name(self, base: str) -> str:
        taken = set(self.lora_adapters)
        name, i = base, 2
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        return name

    def _warn_if_other_base(self, adapter: AdapterFolder, model, stage: str) -> None:
        meta = adapter.meta
        targets = config_targets(adapter.config)
        # a pipeline cast to fp16/bf16 is compared with the fingerprint of the base weights cast
        # the same way (recorded at export), so a correct adapter does not warn
        want = _fingerprint_for(meta, "base_fingerprint", _weights_dtype(model))
        have = base_fingerprint(model, targets)
        if want is not None and want != have:
            warnings.warn(
                f"LoRA adapter {adapter.path} was trained on other {stage} weights (fingerprint "
                f"{want}; this pipeline's: {have}); its effect may not be the one it learned",
                stacklevel=3,
            )
        clip = getattr(self, "clip", None)  # the conditioning CLIP of a family that has one
        if clip is None:
            return
        clip_want = _fingerprint_for(meta, "clip_fingerprint", clip.dtype)
        if clip_want is not None and clip_want != clip.fingerprint():
            warnings.warn(
                f"LoRA adapter {adapter.path} was trained with another CLIP (fingerprint "
                f"{clip_want}; this pipeline's: {clip.fingerprint()})",
                stacklevel=3,
            )

    def _named(self, name: Optional[str]) -> list[str]:
        if name is None:
            return list(self.lora_adapters)
        if name not in self.lora_adapters:
            raise ValueError(
                f"no LoRA adapter named {name!r} is loaded (loaded: "
                f"{', '.join(self.lora_adapters) or 'none'})"
            )
        return [name]

    def set_lora_scale(self, scale: float, name: Optional[str] = None) -> None:
        """Set the scale of adapter ``name`` (default: of every loaded adapter)."""
        self._refuse_fused("set_lora_scale")  # unfuse subtracts the update at the current scale
        scale = _check_scale(scale)
        for n in self._named(name):
            info = self.lora_adapters[n]
            if not self.__dict__.get("_lora_disabled"):  # else enable_lora applies it
                set_adapter_scale(self._adaptable_stages()[info.stage], n, scale)
            info.scale = scale

    def merge_lora(self) -> None:
        """Fold every loaded adapter, at its scale, into its stage's weights. The stages are plain
        modules again: ``save_pretrained`` writes ordinary weights that load without peft. The
        images equal the adapted pipeline's to float rounding. (To get the base back afterwards,
        load the pipeline again.)"""
        if not self.lora_adapters:
            raise ValueError("merge_lora: no LoRA adapter is loaded")
        self._refuse_fused("merge_lora")
        self._refuse_disabled("merge_lora")
        self._offload_all()  # with model offload: change the weights where they live, on the CPU
        for stage in {info.stage for info in self.lora_adapters.values()}:
            merge_adapters(self._adaptable_stages()[stage])
        self.lora_adapters.clear()

    def unload_lora(self, name: Optional[str] = None) -> None:
        """Remove adapter ``name`` (default: every adapter). Without adapters a stage holds its
        original layers again, so the images are the base pipeline's bit for bit."""
        self._refuse_fused("unload_lora")  # unload_lora_weights keeps fused updates
        names = self._named(name)
        self._offload_all()
        for n in names:
            info = self.lora_adapters.pop(n)
            remove_adapter(self._adaptable_stages()[info.stage], n)
        if not self.lora_adapters:
            self.__dict__.pop("_lora_disabled", None)  # a later adapter loads active

    # ------------------------------------------------------------ diffusers' names
    def load_lora_weights(
        self,
        pretrained_model_name_or_path: Union[str, os.PathLike],
        adapter_name: Optional[str] = None,
        *,
        weight_name: Optional[str] = None,
        subfolder: Optional[str] = None,
        revision: Optional[str] = None,
        cache_dir: Union[str, os.PathLike, None] = None,
        local_files_only: Optional[bool] = None,
        token: Union[str, bool, None] = None,
        scale: float = 1.0,
        stage: Optional[str] = None,
    ) -> str:
        """diffusers' name for :meth:`load_lora`: an unclip adapter (``unclip train-decoder ...
        train.lora.rank=8`` exports one) given as its folder, its ``adapter_model.safetensors``
        file, a folder and ``weight_name`` (its weights file's name there), or a Hub repo id
        (``subfolder``, ``revision``, ``cache_dir``, ``local_files_only``, ``token`` as in
        ``from_pretrained``); ``adapter_name`` its name. Returns the name."""
        self._refuse_fused("load_lora_weights")
        source = Path(pretrained_model_name_or_path).expanduser()
        if source.is_file():  # the weights file of an adapter folder
            if weight_name is not None or subfolder is not None:
                raise ValueError(
                    f"load_lora_weights: {source} is a file; weight_name= and subfolder= go with "
                    "a folder or a Hub repo id"
                )
            folder, weight_name = source.parent, source.name
        else:
            folder = resolve_folder(
                pretrained_model_name_or_path,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                subfolder=subfolder,
                what="LoRA adapter",
                token=token,
            )
        return self.load_lora(
            folder, scale=scale, stage=stage, name=adapter_name, weight_name=weight_name
        )

    def set_adapters(
        self,
        adapter_names: Union[str, list[str]],
        adapter_weights: Union[float, list[float], None] = None,
    ) -> None:
        """Use only ``adapter_names``, each at its weight (default 1); the other loaded adapters
        are set to 0 (their update is off, as diffusers' inactive adapters)."""
        self._refuse_fused("set_adapters")
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        if adapter_weights is None:
            weights = [1.0] * len(names)
        elif isinstance(adapter_weights, (int, float)):
            weights = [float(adapter_weights)] * len(names)
        else:
            weights = list(adapter_weights)
        if len(weights) != len(names):
            raise ValueError(f"set_adapters: {len(names)} adapter names but {len(weights)} weights")
        for n in names:
            self._named(n)  # an unknown name is an error naming the loaded ones
        chosen = dict(zip(names, weights))
        for n in list(self.lora_adapters):
            self.set_lora_scale(chosen.get(n, 0.0), n)

    def get_active_adapters(self) -> list[str]:
        """The loaded adapters whose scale is not 0 (and LoRA not disabled)."""
        if self.__dict__.get("_lora_disabled"):
            return []
        return [n for n, info in self.lora_adapters.items() if info.scale != 0]

    def get_list_adapters(self) -> dict[str, list[str]]:
        """``{stage: [adapter names]}`` of the loaded adapters, as diffusers' (keyed by
        component)."""
        out: dict[str, list[str]] = {}
        for n, info in self.lora_adapters.items():
            out.setdefault(info.stage, []).append(n)
        return out

    def disable_lora(self) -> None:
        """Turn every loaded adapter's update off (the base pipeline's images bit for bit) and
        keep the adapters and their scales for :meth:`enable_lora`."""
        self._refuse_fused("disable_lora")
        for n, info in self.lora_adapters.items():
            set_adapter_scale(self._adaptable_stages()[info.stage], n, 0.0)
        self.__dict__["_lora_disabled"] = True

    def enable_lora(self) -> None:
        """Turn the adapters :meth:`disable_lora` turned off back on, each at its scale."""
        self._refuse_fused("enable_lora")
        self.__dict__.pop("_lora_disabled", None)
        for n, info in self.lora_adapters.items():
            set_adapter_scale(self._adaptable_stages()[info.stage], n, info.scale)

    def delete_adapters(self, adapter_names: Union[str, list[str]]) -> None:
        """Remove the named adapters (diffusers' name for :meth:`unload_lora` by name)."""
        self._refuse_fused("delete_adapters")
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        for n in names:
            self._named(n)  # every name checked before any is removed
        for n in names:
            self.unload_lora(n)

    def fuse_lora(self, lora_scale: float = 1.0, adapter_names: Optional[list[str]] = None) -> None:
        """Add the loaded adapters (or ``adapter_names``), each at its scale times ``lora_scale``,
        into the weights; sampling then costs what the base pipeline costs. :meth:`unfuse_lora`
        takes them out again; :meth:`unload_lora_weights` afterwards keeps them in."""
        self._refuse_fused("fuse_lora")
        self._refuse_disabled("fuse_lora")
        names = self._named(None) if adapter_names is None else list(adapter_names)
        if not names:
            raise ValueError("fuse_lora: no LoRA adapter is loaded")
        for n in names:
            self._named(n)  # every name checked before any weight changes
        lora_scale = _check_scale(lora_scale)
        self._offload_all()  # with model offload: change the weights where they live
        for n in names:
            info = self.lora_adapters[self._named(n)[0]]
            set_adapter_scale(self._adaptable_stages()[info.stage], n, info.scale * lora_scale)
        for stage in {self.lora_adapters[n].stage for n in names}:
            mine = [n for n in names if self.lora_adapters[n].stage == stage]
            fuse_adapters(self._adaptable_stages()[stage], mine)
        self.__dict__["_fused_lora"] = list(names)

    def unfuse_lora(self) -> None:
        """Take fused adapters out of the weights again (up to float rounding)."""
        fused = self.__dict__.pop("_fused_lora", None)
        if not fused:
            raise ValueError("unfuse_lora: no adapter is fused (fuse_lora fuses them)")
        self._offload_all()
        for stage in {self.lora_adapters[n].stage for n in fused}:
            unfuse_adapters(self._adaptable_stages()[stage])
        for n in fused:
            info = self.lora_adapters[n]
            set_adapter_scale(self._adaptable_stages()[info.stage], n, info.scale)

    def unload_lora_weights(self) -> None:
        """Remove every adapter; fused ones stay in the weights (as diffusers does), the others'
        updates are gone (the base pipeline's images bit for bit)."""
        fused = self.__dict__.pop("_fused_lora", None)
        if fused:
            self._offload_all()
            for stage in {info.stage for info in self.lora_adapters.values()}:
                drop_adapter_layers(self._adaptable_stages()[stage])
            self.lora_adapters.clear()
            self.__dict__.pop("_lora_disabled", None)
            return
        if self.lora_adapters:
            self.unload_lora()

    def _refuse_fused(self, action: str) -> None:
        if self.__dict__.get("_fused_lora"):
            raise ValueError(f"{action}: adapters are fused; call unfuse_lora() first")

    def _refuse_disabled(self, action: str) -> None:
        if self.__dict__.get("_lora_disabled"):
            raise ValueError(f"{action}: LoRA is disabled; call enable_lora() first")

    def _check_savable(self, action: str) -> None:
        super()._check_savable(action)
        self._refuse_fused(action)
        self._refuse_unmerged_lora(action)

    def _refuse_unmerged_lora(self, action: str) -> None:
        if self.lora_adapters:
            raise ValueError(
                f"{action}: LoRA adapters are loaded ({', '.join(self.lora_adapters)}); "
                "merge_lora() to write them into the weights, or unload_lora() first"
            )


def _weights_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype most of ``model``'s floating parameters have (a few may be kept in float32)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=lambda dtype: counts[dtype]) if counts else torch.float32


def _fingerprint_for(meta: dict, key: str, dtype: torch.dtype) -> Optional[str]:
    """The fingerprint ``meta`` records under ``key`` for weights in ``dtype``: float32's, or the
    per-dtype ones of ``<key>s`` (None when it was not recorded: no check)."""
    if dtype == torch.float32:
        return meta.get(key)
    return (meta.get(key + "s") or {}).get(str(dtype).removeprefix("torch."))
