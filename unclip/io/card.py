"""Model cards: the ``README.md`` of a pipeline folder, in the Hugging Face Hub's format (YAML
metadata between ``---`` lines, then Markdown), written by ``UnCLIPPipeline.save_pretrained``.

The card states what the library can read off the pipeline itself (components, parameter counts,
resolutions, noise schedules, sampling defaults, how to load it) and what only its author knows,
given as ``model_card={...}`` (keys in :data:`CARD_FIELDS`); a field nobody gave is written as not
recorded rather than guessed. A pipeline loaded from a folder with a card written by unclip keeps
its fields (``pipe.card_info``), so saving it again (converting, fine-tuning, re-uploading) keeps
them unless overridden::

    pipe.save_pretrained("out", model_card={"license": "mit", "training": "...",
                                            "evaluation": {"FID (COCO 30k)": 12.3}})
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import torch

__all__ = ["CARD_FILE", "CARD_FIELDS", "TAGS", "read_card_info", "render_card", "write_card"]

CARD_FILE = "README.md"
TAGS = ["text-to-image", "unclip", "diffusion"]

#: Markdown sections the author supplies: field → heading
SECTIONS = {
    "training": "Training",
    "evaluation": "Evaluation",
    "intended_use": "Intended use and limitations",
}
#: every ``model_card=`` field: the sections, the title and the text under it (``description``),
#: card metadata (``license``: a Hub license id such as ``mit``; ``base_model``, ``datasets``;
#: ``tags`` added to :data:`TAGS`), ``license_text`` (the License section, e.g. what the license
#: covers), ``repo_id`` (shown in the loading example) and ``example_prompt``
CARD_FIELDS = (
    "title",
    "description",
    *SECTIONS,
    "license",
    "license_text",
    "base_model",
    "datasets",
    "tags",
    "repo_id",
    "example_prompt",
)
NOT_RECORDED = "Not recorded"
# the start of the description written when none is given (it describes the pipeline, so it is
# written again rather than kept when a loaded pipeline is saved)
AUTO_DESCRIPTION = "An unCLIP (DALL-E 2-style) text-to-image pipeline for the unclip"


def check_card_fields(info: Optional[Mapping], what: str = "model_card") -> dict:
    """``info`` as a dict, checked: known fields only (:data:`CARD_FIELDS`), text values (a
    mapping or list for ``training``/``evaluation``/``datasets``/``tags``)."""
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        raise TypeError(f"{what} must be a dict of card fields, got {type(info).__name__}")
    unknown = sorted(set(info) - set(CARD_FIELDS))
    if unknown:
        raise ValueError(
            f"{what}: unknown field(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(CARD_FIELDS)}"
        )
    lists = {"datasets", "tags", "base_model"}
    tables = {"training", "evaluation"}
    for key, value in info.items():
        ok = (
            value is None
            or isinstance(value, str)
            or (key in tables and isinstance(value, Mapping))
            or (key in lists and isinstance(value, (list, tuple)))
        )
        if not ok:
            raise TypeError(f"{what}[{key!r}] must be text, got {type(value).__name__}")
    return {k: v for k, v in info.items() if v is not None}


# ----------------------------------------------------------------------------------------- render
def _count(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n / 1e3:.1f} k"


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _components(pipe) -> list[tuple[str, str, int, str]]:
    """(name, what, parameters, resolution) of every component, in the order they run."""
    rows = []
    modules = pipe.modules()
    order = ["clip", "prior", "decoder", *pipe.upsampler_names, "reranker"]
    for name, m in sorted(modules.items(), key=lambda kv: order.index(kv[0])):
        if name in ("clip", "reranker"):
            what = (
                f"open_clip `{m.model_name}`: embedding {m.embed_dim}, text width "
                f"{m.text_width}, context {m.context_length} tokens"
                + ("" if m.has_vision else "; text tower only")
                + (
                    "; conditions the prior and decoder"
                    if name == "clip"
                    else "; reranks decoder candidates"
                )
            )
            res = f"{m.image_size} px input" if m.has_vision else "-"
        elif name == "prior":
            c = m.config
            what = (
                f"diffusion prior (`PriorTransformer`, {c.num_layers} layers, "
                f"{c.num_attention_heads} heads × {c.attention_head_dim})"
            )
            res = "-"
        elif name == "decoder":
            c = m.config
            what = (
                f"decoder UNet, channels {'/'.join(map(str, c.block_out_channels))}, "
                f"conditioned on the CLIP image embedding"
            )
            res = f"{c.sample_size} px"
        else:
            c = m.config
            what = f"upsampler UNet, channels {'/'.join(map(str, c.block_out_channels))}"
            res = f"{c.low_res_size} → {c.sample_size} px"
        rows.append((name, what, _params(m), res))
    return rows


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _section_text(key: str, value) -> str:
    if isinstance(value, Mapping):
        first = "metric" if key == "evaluation" else "setting"
        return _table([first, "value"], [[k, v] for k, v in value.items()])
    return str(value).strip()


def render_card(pipe, info: Optional[Mapping] = None):
    """The ``huggingface_hub.ModelCard`` of ``pipe`` with the author's fields ``info``."""
    from huggingface_hub import ModelCard, ModelCardData

    info = check_card_fields(info)
    extra_tags = [t for t in info.get("tags", []) if t not in TAGS]
    data = ModelCardData(
        # no license unless the author names one: "unknown" would read as a claim about it
        license=info.get("license"),
        library_name="unclip",
        tags=TAGS + extra_tags,
        pipeline_tag="text-to-image",
        base_model=info.get("base_model"),
        datasets=info.get("datasets"),
    )
    comps = _components(pipe)
    total = sum(c[2] for c in comps)
    stages = " → ".join(pipe.stage_names)
    title = info.get("title", "unCLIP text-to-image pipeline")
    description = info.get(
        "description",
        f"{AUTO_DESCRIPTION} library: a CLIP text encoding goes through {stages}, giving "
        f"{pipe.resolution} px images.",
    )
    sampling = [
        [
            stage,
            getattr(s, "scheduler", "—"),  # the autoregressive prior has no noise schedule
            getattr(s, "steps", "—"),
            s.guidance_scale,
            _best_of(s),
            f"{d.prediction_type}, {d.beta_schedule}, T = {d.num_train_timesteps}",
        ]
        for stage in pipe.stage_names
        for s, d in [(pipe.sampling[stage], pipe.diffusion[stage])]
    ]
    source = info.get("repo_id", "path/to/this/folder")
    prompt = info.get("example_prompt", "a photo of a cat")
    license_id = info.get("license")
    license_text = info.get(
        "license_text",
        f"`{license_id}`" if license_id else f"{NOT_RECORDED}: ask the author before reusing it.",
    )
    unrecorded = f"{NOT_RECORDED} by whoever saved this pipeline."
    parts = [
        f"# {title}",
        description,
        "## Components",
        _table(
            ["component", "what", "parameters", "resolution"],
            [[n, w, _count(p), r] for n, w, p, r in comps],
        ),
        f"{_count(total)} parameters in all, stored as safetensors in one subfolder per "
        "component; `unclip.json` names them and holds the sampling defaults.",
        "## Sampling defaults",
        _table(
            ["stage", "scheduler", "steps", "guidance scale", "best of", "trained noise schedule"],
            sampling,
        ),
        "Every setting can be overridden per call (`sampling={stage: {...}}`) or on the command "
        "line (`--decoder-steps`, ...).",
    ]
    for key, heading in SECTIONS.items():
        parts += [f"## {heading}", _section_text(key, info.get(key, unrecorded))]
    parts += [
        "## License",
        license_text,
        "## How to use",
        "```python\nimport torch\nfrom unclip import UnCLIPPipeline\n\n"
        f'pipe = UnCLIPPipeline.from_pretrained("{source}")\n'
        f'images = pipe("{prompt}", generator=torch.Generator().manual_seed(0)).images\n```',
        f'```\nunclip generate "{prompt}" --model {source} --out samples/\n```',
    ]
    text = "\n\n".join(parts) + "\n"
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}")


def _best_of(s) -> str:
    """The "best of" cell: the number of candidates and how the decoder's are chosen."""
    if not hasattr(s, "rerank_at"):  # a stage without candidate choice settings
        return str(getattr(s, "best_of", 1))
    how = []
    # best_of_contrasted counts only where a contrast says which prompts draw it
    more = s.best_of_contrasted if s.rerank_contrast is not None else None
    most = max(s.best_of, more or 0)
    count = str(s.best_of)
    if more is not None:
        count = f"{s.best_of}, or {s.best_of_contrasted} for a prompt with alternatives"
    if most > 1 and s.rerank_at is not None and s.rerank_at < s.steps:
        if s.prune_at is not None and most > s.prune_keep:
            how.append(f"the best {s.prune_keep} kept after step {s.prune_at}")
        how.append(f"chosen after step {s.rerank_at}")
    if most > 1 and s.rerank_contrast is not None:
        how.append(f"scored against the prompt's `{s.rerank_contrast}` alternatives")
    return f"{count} ({', '.join(how)})" if how else count


def write_card(folder, pipe, info: Optional[Mapping] = None) -> Path:
    """Write ``folder/README.md`` (:func:`render_card`); returns its path."""
    path = Path(folder) / CARD_FILE
    render_card(pipe, info).save(path)
    return path


# ------------------------------------------------------------------------------------------- read
def _sections(text: str) -> dict[str, str]:
    """``## heading`` → its text, and ``#`` (the title line) / ``""`` (text under it)."""
    out: dict[str, str] = {}
    key: Optional[str] = None
    lines: list[str] = []
    for line in text.splitlines():
        m = re.match(r"^(#{1,2}) (.+?)\s*$", line)
        if m and not (key is not None and _in_fence(lines)):
            if key is not None:
                out[key] = "\n".join(lines).strip()
            key, lines = (m.group(2) if m.group(1) == "##" else "#"), []
            if key == "#":
                out["#"] = m.group(2)
                key = ""
            continue
        lines.append(line)
    if key is not None:
        out[key] = "\n".join(lines).strip()
    return out


def _in_fence(lines: list[str]) -> bool:
    return sum(1 for x in lines if x.startswith("```")) % 2 == 1


def read_card_info(folder) -> dict:
    """The author's fields of ``folder/README.md`` (``{}`` without one): the metadata (license,
    base model, datasets, extra tags) of any card, and the title, description and
    :data:`SECTIONS` of a card unclip wrote (``library_name: unclip``) whose text is not the
    not-recorded placeholder."""
    from huggingface_hub import ModelCard

    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return {}
    try:
        card = ModelCard.load(path, ignore_metadata_errors=True)
    except (ValueError, UnicodeDecodeError):
        return {}  # a README that is not a model card carries no fields
    data = card.data.to_dict()
    info = {}
    if data.get("license") and data["license"] != "unknown":
        info["license"] = data["license"]
    for key in ("base_model", "datasets"):
        if data.get(key):
            info[key] = data[key]
    extra = [t for t in data.get("tags") or [] if t not in TAGS]
    if extra:
        info["tags"] = extra
    if data.get("library_name") != "unclip":
        return info
    sections = _sections(card.text)
    if sections.get("#"):
        info["title"] = sections["#"]
    if sections.get("") and not sections[""].startswith(AUTO_DESCRIPTION):
        info["description"] = sections[""]
    for key, heading in SECTIONS.items():
        text = sections.get(heading, "")
        if text and not text.startswith(NOT_RECORDED):
            info[key] = text
    license_text = sections.get("License", "")
    if license_text and not license_text.startswith(NOT_RECORDED):
        if license_text != f"`{data.get('license')}`":  # not the text written by default
            info["license_text"] = license_text
    prompt = re.search(r'^images = pipe\("(.*)", generator', sections.get("How to use", ""), re.M)
    if prompt:
        info["example_prompt"] = prompt.group(1)
    return info
