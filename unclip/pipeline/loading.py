"""Loading and saving an :class:`~unclip.pipeline.pipeline.UnCLIPPipeline`: pipeline folders,
component folders, the bundled model and the Hub."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Optional, Self, Union

import torch

from unclip.io.card import check_card_fields, read_card_info, write_card
from unclip.io.hub import push_folder
from unclip.nets.clip import CLIP
from unclip.pipeline.base import PipelineBase
from unclip.pipeline.diffusers_api import check_from_pretrained_options
from unclip.pipeline.folders import (
    folder_format_reader,
    load_components,
    read_pipeline_folder,
    resolve_pipeline_folder,
    write_pipeline_folder,
)
from unclip.sampling.settings import (
    DEFAULT_DIFFUSION,
    DEFAULT_SAMPLING,
)
from unclip.utils.precision import parse_autocast, parse_dtype


class LoadingMixin(PipelineBase):
    """Loading and saving a pipeline (pipeline folders, component folders, the bundled model
    and the Hub)."""

    # ------------------------------------------------------------------ persistence
    def save_pretrained(
        self,
        path: Union[str, os.PathLike],
        safe_serialization: bool = True,
        model_card: Optional[Mapping] = None,
    ) -> None:
        """Write the self-describing folder: ``unclip.json`` + one subfolder per component, and
        ``README.md``, a model card in the Hub's format (:mod:`unclip.card`) from the pipeline
        and :attr:`card_info` updated with ``model_card`` (fields in
        :data:`unclip.card.CARD_FIELDS`: license, training, evaluation, ...). Refused while LoRA
        adapters are loaded unmerged (:meth:`merge_lora` them first)."""
        self._refuse_unmerged_lora("save_pretrained")
        info = {**self.card_info, **check_card_fields(model_card)}
        write_pipeline_folder(
            path,
            clip=self.clip,
            prior=self.prior,
            decoder=self.decoder,
            upsamplers=dict(zip(self.upsampler_names, self.upsamplers)),
            reranker=self.reranker,
            diffusion=self.diffusion,
            sampling=self.sampling,
            prior_clip_range=self.prior_clip_range,
        )
        write_card(path, self, info)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: Optional[str] = None,
        private: Optional[bool] = None,
        token: Union[str, bool, None] = None,
        revision: Optional[str] = None,
        create_pr: bool = False,
        model_card: Optional[Mapping] = None,
    ):
        """Upload the folder :meth:`save_pretrained` writes (with its model card, whose loading
        example names ``repo_id``) to the Hub model repo ``repo_id``, created if needed; returns
        ``huggingface_hub``'s ``CommitInfo``. ``token``: default, the one ``hf auth login``
        stored."""
        return push_folder(
            self._push_writer(repo_id, model_card),
            repo_id,
            commit_message=commit_message,
            private=private,
            token=token,
            revision=revision,
            create_pr=create_pr,
        )

    def _push_writer(self, repo_id: str, model_card: Optional[Mapping] = None):
        """What :meth:`push_to_hub` uploads: a function writing :meth:`save_pretrained`'s folder
        with a card whose loading example names ``repo_id`` (see
        :func:`unclip.hub.upload_folder_of`)."""
        card = {"repo_id": repo_id, **check_card_fields(model_card)}
        return lambda folder: self.save_pretrained(folder, model_card=card)

    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, os.PathLike, None] = None,
        *,
        revision: Optional[str] = None,
        cache_dir: Union[str, os.PathLike, None] = None,
        local_files_only: Optional[bool] = None,
        torch_dtype: Union[torch.dtype, str, None] = None,
        variant: Optional[str] = None,
        autocast_dtype=None,
        memory_format: Optional[torch.memory_format] = torch.channels_last,
        token: Union[str, bool, None] = None,
        use_safetensors: Optional[bool] = None,
        low_cpu_mem_usage: Optional[bool] = None,
        device_map: Union[str, torch.device, None] = None,
        allow_external_components: bool = False,
    ) -> Self:
        """Load a folder written by :meth:`save_pretrained`, a diffusers ``UnCLIPPipeline``
        folder, or either from the Hugging Face Hub by repo id (``"org/name"``).

        ``path=None`` or ``"shapes"`` loads the bundled offline shapes model. A repo id is
        fetched once into the Hub cache (``cache_dir``, default ``HF_HUB_CACHE``) at ``revision``
        (branch, tag or commit; default ``main``), safetensors weights only
        (:mod:`unclip.hub`); ``local_files_only=True`` or ``HF_HUB_OFFLINE=1`` use the cache only.
        ``torch_dtype`` (``torch.float16``/``bfloat16``/``float32`` or its name): cast the weights
        as :meth:`to` does. ``variant`` (e.g. ``"fp16"``): read ``*.fp16.safetensors`` weights.

        Exact by default, as diffusers is: the networks compute in the weights' dtype (float32
        unless ``torch_dtype`` says otherwise). Faster arithmetic is asked for:
        ``autocast_dtype="auto"`` runs the denoising networks under float16 autocast on a GPU
        and bfloat16 on a CPU that runs it natively (:attr:`autocast_dtype`; ``"bf16"``,
        ``"fp16"``: that one). The image networks store their weights channels-last
        (``memory_format``; ``None`` keeps the default layout; results equal to float rounding).
        benchmarks/README.md measures what each buys.

        diffusers' keywords: ``token`` (a Hub token), ``use_safetensors`` (only safetensors are
        ever loaded; ``False`` is an error), ``low_cpu_mem_usage`` (accepted: components are
        built and then filled from their files), ``device_map`` (a device the whole pipeline
        moves to, e.g. ``"cuda"``).

        The components are read from inside the folder: a component name in ``unclip.json``
        that leads outside it (``../other/decoder``) is refused unless
        ``allow_external_components=True``.
        """
        hub_token, device = check_from_pretrained_options(
            token, use_safetensors, low_cpu_mem_usage, device_map
        )
        dtype = parse_dtype(torch_dtype)
        autocast = parse_autocast(autocast_dtype)
        hub = {"revision": revision, "cache_dir": cache_dir, "local_files_only": local_files_only}
        hub.update(hub_token)
        path = resolve_pipeline_folder(path, variant=variant, **hub)
        reader = folder_format_reader(path)
        if reader is not None:
            pipe = reader(path, variant=variant) if variant else reader(path)
        else:
            external = {"allow_external_components": allow_external_components}
            pipe = cls._frozen(**read_pipeline_folder(path, variant=variant, **external))
        pipe.card_info = read_card_info(path)
        pipe = pipe._loaded_defaults(autocast, memory_format, dtype)
        return pipe if device is None else pipe.to(device)

    @classmethod
    def from_components(
        cls,
        clip: Union[str, os.PathLike],
        decoder: Union[str, os.PathLike],
        prior: Union[str, os.PathLike, None] = None,
        upsamplers: Sequence[Union[str, os.PathLike]] = (),
        reranker: Union[str, os.PathLike, None] = None,
        *,
        autocast_dtype=None,
        memory_format: Optional[torch.memory_format] = torch.channels_last,
    ) -> Self:
        """Assemble a pipeline from component folders exported by the training commands
        (``<output_dir>/final/<name>``, each with ``config.json``, weights and
        ``unclip_stage.json``); ``reranker``: a CLIP folder (e.g. ``unclip train-clip``'s
        ``<output_dir>/clip``) that scores decoder candidates instead of the conditioning CLIP.
        ``autocast_dtype``, ``memory_format``: as in :meth:`from_pretrained`."""
        autocast = parse_autocast(autocast_dtype)
        parts = load_components(
            clip, decoder, prior, upsamplers, DEFAULT_DIFFUSION, DEFAULT_SAMPLING
        )
        pipe = cls._frozen(
            *parts, reranker=CLIP.from_pretrained(reranker) if reranker is not None else None
        )
        return pipe._loaded_defaults(autocast, memory_format)

    def _loaded_defaults(self, autocast, memory_format, dtype=None) -> Self:
        """The sampling defaults of a pipeline that was loaded (it owns its modules, so changing
        their layout changes nothing outside it): the autocast setting, the image networks'
        memory format, the weights' dtype."""
        self._autocast_dtype = autocast
        if dtype is not None or memory_format is not None:
            self.to(dtype=dtype, memory_format=memory_format)
        return self

    @classmethod
    def _frozen(cls, *args, **kwargs) -> Self:
        pipe = cls(*args, **kwargs)
        for m in pipe.modules().values():
            m.eval().requires_grad_(False)
        return pipe
