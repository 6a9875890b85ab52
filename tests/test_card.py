"""Model cards (unclip/card.py): ``save_pretrained`` writes a README.md that ``huggingface_hub``
parses, stating the pipeline's real components and settings, keeping the author's fields across a
load and save; the bundled model ships one with its recorded figures."""

import json
import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from unclip.io.card import render_card
from unclip.pipeline.folders import PIPELINE_FILE, bundled_model_path
from unclip.pipeline.pipeline import UnCLIPPipeline


def section(card: ModelCard, heading: str) -> str:
    match = re.search(rf"^## {heading}\n\n(.*?)(?=^## |\Z)", card.text, re.S | re.M)
    assert match, heading
    return match.group(1).strip()


def params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_saved_card_parses_with_metadata_and_component_sizes(tiny_pipe, tmp_path):
    tiny_pipe.save_pretrained(tmp_path / "p")
    card = ModelCard.load(tmp_path / "p" / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "unclip" and data["pipeline_tag"] == "text-to-image"
    assert data["tags"] == ["text-to-image", "unclip", "diffusion"]
    assert "license" not in data  # nobody said which: no field, not "unknown"
    assert "license:" not in (tmp_path / "p" / "README.md").read_text().split("---")[1]
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in section(card, "Components").splitlines()[2:]
        if line.startswith("| ")
    }
    assert list(rows) == ["clip", "prior", "decoder", "sr32", "sr64"]
    for name, module in tiny_pipe.modules().items():
        n = params(module)
        count = f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n / 1e3:.1f} k"
        assert rows[name][2] == count, name
    assert rows["decoder"][3].startswith("16 px") and rows["sr64"][3].startswith("32 → 64 px")
    sampling = section(card, "Sampling defaults")
    assert "| prior | ddim | 4 | 2.0 | 2 | sample, squaredcos_cap_v2, T = 1000 |" in sampling
    assert section(card, "Training").startswith("Not recorded")
    assert section(card, "Evaluation").startswith("Not recorded")


def test_card_says_how_the_decoder_candidates_are_chosen(tiny_pipe, monkeypatch):
    from dataclasses import replace

    dec = tiny_pipe.sampling["decoder"]
    choosing = replace(dec, best_of=8, rerank_at=3, rerank_contrast="shapes")
    monkeypatch.setitem(tiny_pipe.sampling, "decoder", choosing)
    text = render_card(tiny_pipe).text
    cell = "8 (chosen after step 3, scored against the prompt's `shapes` alternatives)"
    assert f"| decoder | {dec.scheduler} | {dec.steps} | {dec.guidance_scale} | {cell} |" in text
    monkeypatch.setitem(tiny_pipe.sampling, "decoder", replace(choosing, rerank_at=dec.steps))
    assert (
        "| 8 (scored against the prompt's `shapes` alternatives) |" in render_card(tiny_pipe).text
    )
    monkeypatch.setitem(tiny_pipe.sampling, "decoder", replace(choosing, prune_at=2, prune_keep=4))
    cell = "8 (the best 4 kept after step 2, chosen after step 3, scored against the prompt's"
    assert cell in render_card(tiny_pipe).text
    # more candidates for the prompts the contrast has alternatives for; pruning applies to them
    more = replace(choosing, best_of=2, best_of_contrasted=8, prune_at=2, prune_keep=4)
    monkeypatch.setitem(tiny_pipe.sampling, "decoder", more)
    cell = "| 2, or 8 for a prompt with alternatives (the best 4 kept after step 2, chosen after"
    assert cell in render_card(tiny_pipe).text


def test_author_fields_are_written_and_survive_load_and_save(tiny_pipe, tmp_path):
    fields = {
        "license": "apache-2.0",
        "training": "10k steps on my captions",
        "evaluation": {"FID (COCO 30k)": 12.5},
        "intended_use": "research only",
        "datasets": ["me/captions"],
        "example_prompt": "a red circle",
    }
    tiny_pipe.save_pretrained(tmp_path / "a", model_card=fields)
    card = ModelCard.load(tmp_path / "a" / "README.md")
    assert card.data.license == "apache-2.0" and card.data.datasets == ["me/captions"]
    assert section(card, "Training") == "10k steps on my captions"
    assert "| FID (COCO 30k) | 12.5 |" in section(card, "Evaluation")
    assert section(card, "Intended use and limitations") == "research only"
    loaded = UnCLIPPipeline.from_pretrained(tmp_path / "a")
    assert loaded.card_info["training"] == "10k steps on my captions"
    loaded.save_pretrained(tmp_path / "b", model_card={"license": "mit"})
    again = ModelCard.load(tmp_path / "b" / "README.md")
    assert again.data.license == "mit" and again.data.datasets == ["me/captions"]
    assert section(again, "Training") == "10k steps on my captions"
    assert section(again, "Evaluation") == section(card, "Evaluation")
    assert 'pipe("a red circle", generator' in again.text
    with pytest.raises(ValueError, match="unknown field.*'fid'"):
        tiny_pipe.save_pretrained(tmp_path / "c", model_card={"fid": 3})
    with pytest.raises(TypeError, match=r"model_card\['training'\] must be text"):
        tiny_pipe.save_pretrained(tmp_path / "c", model_card={"training": 3})


def test_bundled_model_card_states_the_shipped_model():
    folder = bundled_model_path()
    card = ModelCard.load(folder / "README.md")
    assert card.data.license == "mit" and card.data.library_name == "unclip"
    assert card.data.pipeline_tag == "text-to-image"
    # the recorded held-out figures (docs/shapes_eval.json)
    evaluation = section(card, "Evaluation")
    report = json.loads((Path(__file__).parents[1] / "docs" / "shapes_eval.json").read_text())
    for stage, label in (
        ("decoder", "decoder (32 px)"),
        ("sr64", "sr64 (64 px)"),
        ("sr128", "sr128 (128 px, the output)"),
    ):
        single, pair = (100 * report["stages"][stage][kind]["all"] for kind in ("single", "pair"))
        assert f"| {label} | {single:.1f} % | {pair:.1f} % |" in evaluation, stage
    pair = {k: 100 * v for k, v in report["stages"]["sr128"]["pair"].items() if k != "count"}
    assert (
        f"both colors {pair['colors']:.1f} %, both shapes {pair['shapes']:.1f} %, "
        f"relation {pair['relation']:.1f} %"
    ) in evaluation
    assert f"cosine {report['prior_cosine_with_true_embed']:.4f}" in evaluation
    assert f"{report['clip_score_100']:.2f}" in evaluation
    assert f"{report['clip_fid']:.3f}" in evaluation
    # the report is of the defaults the card states
    assert report["model"] == "bundled:shapes" and not report["sampling_overrides"]
    defaults = json.loads((folder / PIPELINE_FILE).read_text())["sampling"]
    for stage, settings in defaults.items():
        assert {k: report["sampling"][stage][k] for k in settings} == settings, stage
    # the components section is what the library states for the shipped pipeline
    pipe = UnCLIPPipeline.from_pretrained()
    assert pipe.card_info["license"] == "mit"
    rendered = render_card(pipe, {**pipe.card_info, "repo_id": "shapes"})
    assert section(card, "Components") == section(rendered, "Components")
    assert section(card, "Sampling defaults") == section(rendered, "Sampling defaults")
    # the whole card is what the library writes from its fields (docs/shapes_model.md says how
    # to write it again after a change to the card's layout)
    assert rendered.content == card.content
