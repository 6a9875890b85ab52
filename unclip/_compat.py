"""Old import paths of names that moved when the package was split into sub-packages.

``from unclip.config import SamplingConfig`` and the like keep working: the name is looked up
where it lives now and a ``FutureWarning`` names the new path, once per old path and name. The
table is read by name at run time (:mod:`importlib`), so this module imports nothing of the
package and the layer order in ``tests/test_layers.py`` stays one-way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

#: old module -> {module it lives in now: names}
#: the release that drops the old import paths
REMOVED_IN = "0.3.0"

MOVED: dict[str, dict[str, tuple[str, ...]]] = {
    "unclip.ar_prior": {
        "unclip.nets.ar_prior": (
            "ARBlock",
            "ARTransformer",
            "UnCLIPARPrior",
            "quantile_edges",
        ),
    },
    "unclip.ar_sampling": {
        "unclip.sampling.ar": (
            "filter_logits",
            "sample_ar_prior",
        ),
        "unclip.sampling.settings": ("AR_SAMPLING_FIELDS",),
    },
    "unclip.card": {
        "unclip.io.card": (
            "AUTO_DESCRIPTION",
            "CARD_FIELDS",
            "CARD_FILE",
            "NOT_RECORDED",
            "SECTIONS",
            "TAGS",
            "check_card_fields",
            "read_card_info",
            "render_card",
            "write_card",
        ),
    },
    "unclip.clip": {
        "unclip.nets.clip": (
            "CLIP",
            "CONFIG_NAME",
            "FrozenCLIP",
            "build_open_clip_model",
            "closed_vocabulary_ids",
            "tiny_clip_config",
        ),
        "unclip.nets.clip_features": ("named_submodule",),
        "unclip.nets.clip_tokenizer": ("CompatTokenizer",),
        "unclip.nets.clip_weights": (
            "KEPT_TOKENS_KEY",
            "WEIGHTS_NAME",
            "load_pretrained_weights",
        ),
        "unclip.nets.text_encoding": (
            "TextEncoding",
            "check_prompts",
        ),
    },
    "unclip.config": {
        "unclip.diffusion.config": (
            "DiffusionConfig",
            "SCHEDULERS",
            "TRAINING_ONLY_DIFFUSION",
            "diffusion_to_save",
        ),
        "unclip.nets.clip": ("ClipConfig",),
        "unclip.nets.config": (
            "ARPriorOptions",
            "DecoderConfig",
            "PriorConfig",
            "UpsamplerConfig",
        ),
        "unclip.sampling.settings": (
            "NEWER_SAMPLING",
            "SamplingConfig",
            "sampling_to_save",
        ),
        "unclip.utils.config": (
            "ConfigError",
            "apply_overrides",
            "from_dict",
            "load_config",
            "save_config",
            "to_dict",
            "to_yaml",
        ),
    },
    "unclip.decoder": {
        "unclip.nets.decoder": (
            "Caption",
            "TEXT_ENCODERS",
            "UnCLIPDecoder",
            "UnCLIPUpsampler",
            "check_dropout",
            "coordinate_grid",
            "degrade",
            "drop_captions",
            "encode_captions",
            "gaussian_blur",
            "upsample_low_res",
        ),
    },
    "unclip.demo": {
        "unclip.demo.app": (
            "BEST_OF_STAGES",
            "SamplingForm",
            "build_demo",
            "launch",
        ),
    },
    "unclip.demo_handlers": {
        "unclip.demo.handlers": (
            "MAX_IMAGES",
            "Progress",
            "StepProgress",
            "editor_image_and_mask",
            "generate",
            "img2img",
            "inpaint",
            "interpolate",
            "sampling_plan",
            "text_diff",
            "variations",
            "whole_number",
        ),
    },
    "unclip.diffusion": {
        "unclip.diffusion.config": ("SCHEDULERS",),
        "unclip.diffusion.loop": (
            "Generator",
            "check_sampling_args",
            "denoise_steps",
            "diffusion_loss",
            "guided_output",
            "initial_noise",
            "is_guided",
            "make_scheduler",
            "sample_loop",
            "scheduler_step",
            "shifted_timesteps",
            "training_scheduler",
        ),
    },
    "unclip.editing": {
        "unclip.pipeline.edit_ops": (
            "EditOutput",
            "FIXED_POINT_DAMPING",
            "Inversion",
            "RESAMPLING_SCHEDULERS",
            "at_size",
            "ddim_invert_step",
            "ddim_step",
            "mask_at_size",
            "read_image",
            "read_mask",
        ),
    },
    "unclip.files": {
        "unclip.utils.files": (
            "check_output_folder",
            "replace_folder",
            "write_folder",
        ),
    },
    "unclip.hub": {
        "unclip.io.hub": (
            "ALLOW_PATTERNS",
            "ModelNotFoundError",
            "VARIANTS",
            "is_repo_id",
            "push_folder",
            "resolve_folder",
            "upload_folder_of",
        ),
    },
    "unclip.images": {
        "unclip.utils.images": (
            "IMAGE_EXTENSIONS",
            "as_image_input",
            "image_grid",
            "list_images",
            "pil_to_tensor",
            "resize_crop_box",
            "resize_crop_tensor",
            "to_output",
        ),
    },
    "unclip.interop.diffusers": {
        "unclip.interop.diffusers_import": (
            "DIFFUSERS_SAMPLING",
            "LAYOUTS",
            "decoder_from_diffusers",
            "decoder_to_diffusers",
        ),
    },
    "unclip.io": {
        "unclip.io.safety": (
            "PICKLE_SUFFIXES",
            "pickle_refusal",
            "pickles_in",
        ),
        "unclip.io.weights": (
            "check_safetensors",
            "check_state",
            "load_safetensors",
            "load_weights",
            "read_json",
            "safe_model_from_pretrained",
            "state_mismatch",
            "variant_file",
        ),
        "unclip.pipeline.folders": (
            "BUNDLED",
            "CLIP_STAGES",
            "DEFAULT_MODEL",
            "FOLDER_FORMATS",
            "FOLDER_FORMAT_ENTRY_POINTS",
            "PIPELINE_FILE",
            "PIPELINE_FORMAT_VERSION",
            "STAGE_META_FILE",
            "bundled_model_path",
            "folder_format_reader",
            "load_components",
            "read_pipeline_folder",
            "read_pipeline_index",
            "register_folder_format",
            "resolve_pipeline_folder",
            "stage_meta",
            "write_pipeline_folder",
        ),
        "unclip.pipeline.jobs": ("assemble_pipeline",),
    },
    "unclip.lora": {
        "unclip.nets.lora": (
            "ADAPTER_CONFIG",
            "ADAPTER_WEIGHTS",
            "AdapterFolder",
            "DEFAULT_TARGET_MODULES",
            "HALF_FINGERPRINTS",
            "LORA_FORMAT",
            "LORA_META",
            "adaptable_names",
            "adapter_names",
            "adapter_state_dict",
            "add_adapter",
            "base_fingerprint",
            "check_target_modules",
            "default_target_modules",
            "load_adapter_state",
            "merge_adapters",
            "parse_lora_spec",
            "read_adapter",
            "remove_adapter",
            "require_peft",
            "save_adapter",
            "set_adapter_scale",
        ),
    },
    "unclip.memory": {
        "unclip.pipeline.memory": (
            "MemoryMixin",
            "xformers_available",
        ),
    },
    "unclip.offload": {
        "unclip.utils.offload": (
            "Activate",
            "ENTRY_METHODS",
            "ModelOffloader",
            "releases_gpu",
        ),
    },
    "unclip.output": {
        "unclip.pipeline.jobs": (
            "DEFAULT_BATCH_SIZE",
            "GRID_MAX_IMAGES",
            "generate_to_folder",
        ),
        "unclip.pipeline.output": ("UnCLIPOutput",),
        "unclip.utils.files": ("check_output_folder",),
    },
    "unclip.pipeline": {
        "unclip.pipeline.batching": ("negatives_per_row",),
        "unclip.pipeline.edit_ops": (
            "EditOutput",
            "Inversion",
        ),
        "unclip.pipeline.folders": (
            "PIPELINE_FILE",
            "bundled_model_path",
        ),
        "unclip.pipeline.jobs": ("generate_to_folder",),
        "unclip.sampling.settings": (
            "DEFAULT_SAMPLING",
            "EVERY_UPSAMPLER",
            "SAMPLING_FIELDS",
        ),
        "unclip.sampling.utils": ("slerp",),
    },
    "unclip.pipeline_lora": {
        "unclip.pipeline.lora": (
            "LoadedAdapter",
            "LoraMixin",
        ),
    },
    "unclip.pipeline_utils": {
        "unclip.sampling.utils": (
            "check_components",
            "check_count",
            "check_embeds",
            "check_output_type",
            "expand_generator",
            "rows_of",
            "sample_seed",
            "slerp",
            "stages_until",
        ),
    },
    "unclip.precision": {
        "unclip.utils.precision": (
            "HALF_DTYPES",
            "KeepFp32Mixin",
            "cast_floating",
            "dtype_name",
            "native_cpu_bf16",
            "parse_autocast",
            "parse_dtype",
            "resolve_autocast",
        ),
    },
    "unclip.prior": {
        "unclip.nets.prior": (
            "PlainForward",
            "PrefixCache",
            "PriorLoading",
            "UnCLIPPrior",
            "is_compiled",
        ),
    },
    "unclip.priors": {
        "unclip.nets.priors": (
            "PRIOR_CLASSES",
            "load_prior",
            "prior_type",
        ),
    },
    "unclip.registry": {
        "unclip.utils.registry": ("EntryPointRegistry",),
    },
    "unclip.sampling": {
        "unclip.sampling.candidates": (
            "candidate_counts",
            "check_rerank_at",
            "rerank_candidates",
            "sample_decoder_reranked",
        ),
        "unclip.sampling.scorers": (
            "RERANK_CONTRASTS",
            "RERANK_CONTRAST_ENTRY_POINTS",
            "check_rerank_contrast",
            "image_text_cosines",
            "register_rerank_contrast",
        ),
        "unclip.sampling.settings": (
            "DEFAULT_DIFFUSION",
            "DEFAULT_SAMPLING",
            "EVERY_UPSAMPLER",
            "SAMPLING_FIELDS",
            "resolve_sampling",
            "stage_settings",
        ),
        "unclip.sampling.stages": (
            "Denoiser",
            "LoopCallback",
            "StepCallback",
            "decoder_denoiser",
            "sample_decoder",
            "sample_prior",
            "sample_upsampler",
            "select_scheduler_rows",
            "stage_callback",
            "upsampler_denoiser",
        ),
        "unclip.sampling.utils": (
            "check_finite",
            "stage_kind",
        ),
        "unclip.shapes.regions": (
            "REGION_SPLITS",
            "RegionPart",
            "region_scores",
            "region_views",
        ),
    },
    "unclip.schedulers": {
        "unclip.diffusion.schedulers": (
            "BUILTIN",
            "SCHEDULER_ALIASES",
            "build_scheduler",
            "check_scheduler_spec",
            "is_builtin",
            "scheduler_label",
        ),
    },
    "unclip.shapes.world": {
        "unclip.shapes.captions": (
            "canonical_caption",
            "parse_caption",
        ),
        "unclip.shapes.contrasts": (
            "caption_alternatives",
            "contrast_all",
            "contrast_pairs",
            "contrast_pairs_regions",
            "region_parts",
            "shapes_contrast",
        ),
        "unclip.shapes.export": ("write_shapes",),
    },
    "unclip.text_encoder": {
        "unclip.nets.text_encoder": (
            "CaptionBlock",
            "CaptionTokenizer",
            "CaptionTransformer",
            "TOKENIZERS",
            "caption_tokenizer",
            "check_tokenizer",
        ),
    },
    "unclip.tiny": {
        "unclip.pipeline.tiny": (
            "TINY_TEXT_ENCODER",
            "tiny_decoder_kwargs",
            "tiny_pipeline",
            "tiny_prior_kwargs",
            "tiny_upsampler_kwargs",
        ),
    },
    "unclip.train.data.sources": {
        "unclip.train.data.embeddings": (
            "EmbeddingStream",
            "embedding_shards",
        ),
    },
    "unclip.train.loop": {
        "unclip.pipeline.folders": ("STAGE_META_FILE",),
        "unclip.train.checkpoint": (
            "CheckpointError",
            "DiskFullError",
        ),
        "unclip.train.run_folder": ("RUN_FILES",),
    },
    "unclip.transformer_blocks": {
        "unclip.nets.blocks": (
            "FF_ACTIVATIONS",
            "FeedForward",
            "SelfAttention",
            "TransformerBlock",
            "check_block_options",
            "ff_hidden_width",
        ),
    },
    "unclip.vlb": {
        "unclip.diffusion.vlb": (
            "discretized_gaussian_log_likelihood",
            "learned_range_log_variance",
            "normal_kl",
            "posterior_tables",
            "predicted_x0",
            "vlb_term",
        ),
    },
}

_warned: set[tuple[str, str]] = set()


def moved_attribute(old_module: str, name: str):
    """The object ``name`` that ``old_module`` used to define, with a one-time ``FutureWarning``."""
    for new_module, names in MOVED.get(old_module, {}).items():
        if name in names:
            if (old_module, name) not in _warned:
                _warned.add((old_module, name))
                warnings.warn(
                    f"{old_module}.{name} moved to {new_module}.{name}; import it from there "
                    f"(the old path will be removed in unclip {REMOVED_IN})",
                    FutureWarning,
                    stacklevel=3,
                )
            return getattr(importlib.import_module(new_module), name)
    raise AttributeError(f"module {old_module!r} has no attribute {name!r}")


def package_getattr(package: str):
    """A module ``__getattr__`` for a sub-package that took an old module's name (``unclip.io``,
    ``unclip.sampling``, ...): the names the old module had resolve to their new home."""

    def __getattr__(name: str):
        return moved_attribute(package, name)

    return __getattr__


class _OldModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``unclip.config``, ``unclip.clip``, ... (old modules that are no files any more)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED and not _is_real(fullname):
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = lambda name: moved_attribute(spec.name, name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module):
        pass


def _is_real(fullname: str) -> bool:
    """True for old names that are packages now (their ``__init__`` forwards moved names)."""
    return fullname in REAL_PACKAGES


#: old module names that are still modules or sub-packages now (they forward moved names
#: themselves, through :func:`package_getattr`)
REAL_PACKAGES = frozenset(
    {
        "unclip.io",
        "unclip.diffusion",
        "unclip.sampling",
        "unclip.pipeline",
        "unclip.demo",
        "unclip.shapes.world",
        "unclip.train.loop",
        "unclip.train.data.sources",
        "unclip.interop.diffusers",
    }
)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``unclip/__init__.py`` calls this)."""
    if not any(isinstance(f, _OldModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_OldModuleFinder())
