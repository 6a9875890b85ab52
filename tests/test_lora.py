"""LoRA (unclip/lora.py, unclip/train/lora.py): training only the adapter, exact resume, small
exports, loading onto a pipeline (scale, merge, unload), errors, ``generate --lora``, and the shapes
world's opt-in extra colors that the benchmark teaches."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS
from safetensors.torch import load_file

from unclip import UnCLIPPipeline
from unclip.cli import generate, train_decoder, train_prior
from unclip.nets.decoder import UnCLIPDecoder
from unclip.nets.lora import parse_lora_spec, read_adapter
from unclip.pipeline.tiny import tiny_pipeline
from unclip.train.loop import sample_generators

pytest.importorskip("peft")

CFG = {"prior": CONFIGS / "tiny" / "prior.yaml", "decoder": CONFIGS / "tiny" / "decoder.yaml"}
COMPONENT_FILE = "diffusion_pytorch_model.safetensors"
DECODER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "conv1", "conv2"]
DECODER_TARGETS += ["conv_in", "conv_out"]


def train(stage, out, *overrides, args=()):
    main = train_prior.main if stage == "prior" else train_decoder.main
    return main(
        [str(CFG[stage]), f"train.output_dir={out}", "train.progress=false", *overrides, *args]
    )


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny pipeline's prior and decoder (seed 0) as component folders, the weights adapted,
    and a folder of 8 shapes images: every step trains on the same batch."""
    root = tmp_path_factory.mktemp("bases")
    pipe = tiny_pipeline(seed=0)
    pipe.prior.save_pretrained(root / "prior")
    pipe.decoder.save_pretrained(root / "decoder")
    from unclip.shapes.export import write_shapes

    write_shapes(root / "batch", 8, resolution=32, progress=False)
    return root


def lora_args(stage, bases, *extra):
    return [
        f"train.init_weights={bases / stage}",
        "train.lora.rank=4",
        "data.source=folder",
        f"data.path={bases / 'batch'}",
        "data.batch_size=8",
        "train.warmup_steps=2",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(bases, tmp_path_factory):
    """A LoRA adapter of each stage trained 30 steps on the fixed batch. The decoder's also adapts
    its convolutions: on a random base its attention alone can lower the loss only a little."""
    root = tmp_path_factory.mktemp("lora_runs")
    extra = {
        "prior": ["train.lr=3e-3"],
        "decoder": [f"train.lora.target_modules=[{','.join(DECODER_TARGETS)}]", "train.lr=1e-2"],
    }
    for stage in CFG:
        common = [
            "train.max_steps=30",
            "train.checkpoint_every=0",
            "train.ema=false",
            *extra[stage],
        ]
        assert train(stage, root / stage, *lora_args(stage, bases, *common)) == 0
    return root


def adapter_dir(trained, stage) -> Path:
    return trained / stage / "final" / f"{stage}_lora"


@pytest.mark.parametrize("stage", list(CFG))
def test_training_changes_only_the_adapter_and_exports_it_small(trained, bases, stage):
    """The base weights in the last checkpoint are the initial ones bit for bit; the adapter's B
    moved off its zero initialisation; the export holds the adapter only and is small."""
    base = load_file(str(bases / stage / COMPONENT_FILE))
    ckpt = sorted((trained / stage / "checkpoints").glob("step_*"))[-1]
    state = load_file(str(ckpt / "model.safetensors"))
    lora_keys = [k for k in state if ".lora_" in k]
    assert lora_keys
    plain = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    assert plain.keys() == base.keys()
    for k in base:
        assert torch.equal(plain[k], base[k]), k
    assert all(state[k].abs().max() > 0 for k in lora_keys if ".lora_B." in k)
    folder = adapter_dir(trained, stage)
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "unclip_lora.json",
    ]
    exported = load_file(str(folder / "adapter_model.safetensors"))
    assert all(".lora_A." in k or ".lora_B." in k for k in exported)
    assert len(exported) == len(lora_keys)
    size = (folder / "adapter_model.safetensors").stat().st_size
    assert size < 0.2 * (bases / stage / COMPONENT_FILE).stat().st_size
    meta = json.loads((folder / "unclip_lora.json").read_text())
    assert meta["stage"] == stage and meta["rank"] == 4 and meta["alpha"] == 4.0
    if stage == "decoder":
        assert meta["target_modules"] == sorted(DECODER_TARGETS)
    assert meta["init_weights"] == str(bases / stage) and meta["steps"] == 30
    assert not (trained / stage / "final" / stage).exists()  # no full component


def fixed_loss(stage, bases, adapter=None) -> float:
    """The stage's training loss on the fixed batch, with fixed noise and timesteps, of the base
    weights (plus ``adapter``)."""
    from unclip.diffusion.loop import training_scheduler
    from unclip.nets.clip import CLIP
    from unclip.nets.lora import add_adapter, load_adapter_state
    from unclip.train.config import load_stage_config
    from unclip.train.data.loader import make_batches

    cfg = load_stage_config(CFG[stage], [f"data.path={bases / 'batch'}", "data.source=folder"])
    torch.manual_seed(cfg.train.seed)
    clip = CLIP.from_config(cfg.clip)
    model = (UnCLIPDecoder if stage == "decoder" else _prior_class()).from_pretrained(bases / stage)
    if adapter is not None:
        saved = read_adapter(adapter)
        add_adapter(model, "a", rank=saved.config.r, config=saved.config)
        load_adapter_state(model, "a", saved.state, str(adapter))
    model.eval()
    size = cfg.data.resolution if stage == "decoder" else clip.image_size
    batch = next(iter(make_batches(cfg.data, resolution=size, seed=0, rank=0, world_size=1)))
    sched = training_scheduler(cfg.diffusion)
    losses = []
    with torch.no_grad():
        for rep in range(4):
            gens = sample_generators(100 + rep, 0, 0, 8)
            if stage == "decoder":
                from unclip.nets.decoder import encode_captions
                from unclip.train.decoder import decoder_loss

                null = encode_captions(cfg.decoder, clip, [""])
                loss = decoder_loss(model, batch, clip, null, gens, cfg, sched, "cpu")
            else:
                from unclip.train.prior import prior_loss

                loss = prior_loss(
                    model, batch, clip, clip.encode_text([""]), gens, cfg, sched, "cpu"
                )
            losses.append(float(loss))
    return sum(losses) / len(losses)


def _prior_class():
    from unclip.nets.prior import UnCLIPPrior

    return UnCLIPPrior


@pytest.mark.parametrize("stage", list(CFG))
def test_adapter_lowers_the_loss_on_the_fixed_batch(trained, bases, stage):
    before = fixed_loss(stage, bases)
    after = fixed_loss(stage, bases, adapter_dir(trained, stage))
    assert after < 0.8 * before, (before, after)


@pytest.mark.parametrize("stage", list(CFG))
def test_lora_resume_is_exact(tmp_path, bases, stage):
    common = lora_args(stage, bases, "train.max_steps=6", "train.checkpoint_every=3")
    assert train(stage, tmp_path / "full", *common) == 0
    assert train(stage, tmp_path / "split", *common, args=["--max-steps-this-run", "3"]) == 0
    assert not (tmp_path / "split" / "final").exists()
    assert train(stage, tmp_path / "split", *common, args=["--resume", "latest"]) == 0
    a, b = (
        load_file(str(tmp_path / run / "final" / f"{stage}_lora" / "adapter_model.safetensors"))
        for run in ("full", "split")
    )
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(a[k].abs().max() > 0 for k in a if ".lora_B." in k)


def images(pipe, seed=0):
    return pipe(
        ["a small red circle on the left", "a blue square above a green triangle"],
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
        progress=False,
        last_stage="decoder",  # the adapted stages
    ).images


def test_load_lora_scale_merge_unload(trained, tmp_path):
    """Scale 0 gives the base pipeline's images bit for bit; a loaded adapter changes them; two
    copies at scale 0.5 add up to one at scale 1; merging gives the adapted images to float rounding
    and plain weights that save and load without peft; unloading gives the base bit for bit."""
    pipe = tiny_pipeline(seed=0)
    base = images(pipe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the adapters were trained on these very weights
        dec = pipe.load_lora(adapter_dir(trained, "decoder"), scale=0.0)
    assert dec == "decoder_lora" and pipe.lora_adapters[dec].stage == "decoder"
    assert torch.equal(images(pipe), base)
    pipe.set_lora_scale(1.0)
    assert pipe.load_lora(adapter_dir(trained, "prior"), stage="prior") == "prior_lora"
    adapted = images(pipe)
    assert (adapted - base).abs().max() > 1e-2
    pipe.set_lora_scale(0.5, name=dec)
    twice = pipe.load_lora(adapter_dir(trained, "decoder"), scale=0.5)
    assert twice == "decoder_lora_2"
    assert torch.allclose(images(pipe), adapted, atol=1e-4)
    pipe.unload_lora(twice)
    pipe.set_lora_scale(1.0, name=dec)
    assert torch.equal(images(pipe), adapted)
    with pytest.raises(ValueError, match="merge_lora"):
        pipe.save_pretrained(tmp_path / "refused")
    from unclip.interop.diffusers_export import export_diffusers

    with pytest.raises(ValueError, match="export_diffusers: LoRA adapters are loaded"):
        export_diffusers(pipe, tmp_path / "refused_diffusers")  # peft's names are not diffusers'
    pipe.unload_lora()
    assert not pipe.lora_adapters
    assert torch.equal(images(pipe), base)
    assert type(pipe.decoder.unet.mid_block.attentions[0].to_q) is torch.nn.Linear

    pipe.load_lora(adapter_dir(trained, "decoder"))
    pipe.load_lora(adapter_dir(trained, "prior"))
    pipe.merge_lora()
    assert not pipe.lora_adapters
    assert torch.allclose(images(pipe), adapted, atol=2e-3)
    pipe.save_pretrained(tmp_path / "merged")
    saved = load_file(str(tmp_path / "merged" / "decoder" / COMPONENT_FILE))
    assert not any("lora" in k or "base_layer" in k for k in saved)
    reloaded = UnCLIPDecoder.from_pretrained(tmp_path / "merged" / "decoder")
    live = pipe.decoder.state_dict()
    assert all(torch.equal(reloaded.state_dict()[k], live[k]) for k in live)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        pipe.unload_lora("decoder_lora")


def test_diffusers_lora_names(trained):
    """diffusers' LoRA methods: load_lora_weights, set_adapters (the others at 0), fuse_lora
    (the adapted images, with the base cost), unfuse_lora (the adapters back apart),
    unload_lora_weights (fused adapters stay in the weights; unfused ones leave)."""
    pipe = tiny_pipeline(seed=0)
    base = images(pipe)
    assert pipe.load_lora_weights(adapter_dir(trained, "decoder"), adapter_name="dec") == "dec"
    pipe.load_lora_weights(adapter_dir(trained, "prior"), adapter_name="pri")
    adapted = images(pipe)
    pipe.set_adapters(["dec"])  # the prior's adapter off
    assert pipe.get_active_adapters() == ["dec"] and pipe.lora_adapters["pri"].scale == 0.0
    only_dec = images(pipe)
    assert not torch.equal(only_dec, adapted) and not torch.equal(only_dec, base)
    pipe.set_adapters(["dec", "pri"], [1.0, 1.0])
    assert torch.equal(images(pipe), adapted)
    pipe.fuse_lora()
    assert torch.allclose(images(pipe), adapted, atol=2e-3)
    with pytest.raises(ValueError, match="unfuse_lora"):
        pipe.set_adapters(["dec"])
    pipe.unfuse_lora()
    assert torch.allclose(images(pipe), adapted, atol=1e-4)
    with pytest.raises(ValueError, match="no adapter is fused"):
        pipe.unfuse_lora()
    pipe.unload_lora_weights()  # nothing fused: the base again (unfused: to float rounding)
    assert not pipe.lora_adapters and torch.allclose(images(pipe), base, atol=1e-4)
    pipe = tiny_pipeline(seed=0)  # never fused: unloading gives the base bit for bit
    pipe.load_lora_weights(adapter_dir(trained, "decoder"), adapter_name="dec")
    pipe.unload_lora_weights()
    assert torch.equal(images(pipe), base)
    pipe.load_lora_weights(adapter_dir(trained, "decoder"), adapter_name="dec")
    pipe.fuse_lora(lora_scale=0.5)
    half = images(pipe)
    pipe.unload_lora_weights()  # fused: kept in the weights, the adapter layers gone
    assert not pipe.lora_adapters
    assert type(pipe.decoder.unet.mid_block.attentions[0].to_q) is torch.nn.Linear
    assert torch.allclose(images(pipe), half, atol=2e-3) and not torch.allclose(half, base)


def test_load_lora_refuses_wrong_stage_shape_or_files(trained, tmp_path):
    dec = adapter_dir(trained, "decoder")
    pipe = tiny_pipeline(seed=0)
    with pytest.raises(ValueError, match="for the 'decoder' stage, not 'prior'"):
        pipe.load_lora(dec, stage="prior")
    no_prior = UnCLIPPipeline(pipe.clip, None, pipe.decoder, pipe.upsamplers)
    with pytest.raises(ValueError, match="'prior' stage, which this pipeline does not have"):
        no_prior.load_lora(adapter_dir(trained, "prior"))
    other = tiny_pipeline(seed=1, decoder_kwargs={"cross_attention_dim": 48})
    before = {k: v.clone() for k, v in other.decoder.state_dict().items()}
    with pytest.raises(ValueError, match="does not fit this UnCLIPDecoder.*another shape"):
        other.load_lora(dec)
    assert not other.lora_adapters and other.decoder.state_dict().keys() == before.keys()
    with pytest.warns(UserWarning) as caught:
        tiny_pipeline(seed=1).load_lora(dec)
    messages = " | ".join(str(w.message) for w in caught)
    assert "trained on other decoder weights" in messages
    assert "trained with another CLIP" in messages
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same base weights in bf16: the adapter records theirs
        tiny_pipeline(seed=0).to(torch.bfloat16).load_lora(dec)
    with pytest.warns(UserWarning, match="trained on other decoder weights"):
        tiny_pipeline(seed=1).to(torch.bfloat16).load_lora(dec)
    with pytest.raises(FileNotFoundError, match="LoRA adapter folder not found"):
        pipe.load_lora(tmp_path / "nowhere")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_model.bin").write_bytes(b"\x80")
    with pytest.raises(ValueError, match="pickle"):
        pipe.load_lora(pickled)
    with pytest.raises(ValueError, match="finite"):
        pipe.set_lora_scale(float("nan"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lora.rank=0", "train.lora.rank must be an integer >= 1"),
        ("train.lora.alpha=-1", "train.lora.alpha must be a positive number"),
        ("train.lora.dropout=1.0", r"train.lora.dropout must be in \[0, 1\)"),
        ("train.lora.target_modules=[]", "train.lora.target_modules must be a non-empty list"),
        ("train.lora.target_modules=[to_q,to_q]", "distinct layer names"),
    ],
)
def test_bad_lora_config_values_are_refused(bases, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        train("decoder", tmp_path / "r", *lora_args("decoder", bases, override))


def test_lora_needs_init_weights_and_existing_targets(bases, tmp_path):
    with pytest.raises(
        ValueError, match="train.lora adapts trained weights: set train.init_weights"
    ):
        train("decoder", tmp_path / "a", "train.lora.rank=4")
    with pytest.raises(ValueError, match="'to_qq' matches no layer.*add_k_proj.*to_out.0"):
        train(
            "decoder",
            tmp_path / "b",
            *lora_args("decoder", bases, "train.lora.target_modules=[to_q,to_qq]"),
        )


def test_generate_cli_loads_adapters(trained, tmp_path):
    out = tmp_path / "gen"
    spec = f"{adapter_dir(trained, 'decoder')}:0.5"
    quick = ["--decoder-steps", "2", "--prior-steps", "2", "--upsampler-steps", "1"]
    argv = ["a red circle", "--tiny", "--lora", spec, "--out", str(out), *quick]
    assert generate.main(argv) == 0
    record = json.loads((out / "generate.json").read_text())
    path = adapter_dir(trained, "decoder")
    assert record["lora"] == [
        {"path": str(path), "scale": 0.5, "name": path.name, "stage": "decoder"}
    ]
    assert record["model"] == "tiny (random, untrained)"  # the adapter does not rename the model
    # a caller's pipeline: its own adapter is recorded, the one loaded for the call is unloaded
    from unclip.pipeline.jobs import generate_to_folder

    pipe = tiny_pipeline(seed=0)
    own = pipe.load_lora(adapter_dir(trained, "prior"), scale=0.25)
    steps = {"prior": {"steps": 2}, "decoder": {"steps": 2}, "upsampler": {"steps": 1}}
    rec = generate_to_folder(
        pipe, ["a red circle"], tmp_path / "mem", sampling=steps, progress=False, lora=[(path, 0.5)]
    )
    assert [(a["name"], a["scale"]) for a in rec["lora"]] == [(own, 0.25), (path.name, 0.5)]
    assert list(pipe.lora_adapters) == [own]
    assert parse_lora_spec("runs/a_lora") == ("runs/a_lora", 1.0)
    assert parse_lora_spec("runs/a_lora:0.25") == ("runs/a_lora", 0.25)
    assert parse_lora_spec("C:/x/a_lora") == ("C:/x/a_lora", 1.0)


def test_shapes_world_extra_colors():
    """An opt-in extra color: drawn, captioned, parsed and detected; the spec's world is unchanged
    without it; names and colors that would clash are refused."""
    from unclip.shapes.captions import parse_caption
    from unclip.shapes.detector import detect, evaluate_images
    from unclip.shapes.world import COLORS, ShapesWorld

    pink = {"pink": (255, 105, 180)}
    plain, same = ShapesWorld(32, seed=5), ShapesWorld(32, seed=5, extra_colors=None)
    assert [plain[i].caption for i in range(20)] == [same[i].caption for i in range(20)]
    world = ShapesWorld(32, seed=5, two_object_prob=0.0, extra_colors=pink)
    sample = next(world[i] for i in range(200) if world[i].truth["objects"][0]["color"] == "pink")
    assert "pink" in sample.caption and "pink" not in COLORS
    assert parse_caption(sample.caption, pink)["objects"][0]["color"] == "pink"
    with pytest.raises(ValueError, match="not a shapes caption"):
        parse_caption(sample.caption)
    assert detect(sample.image, extra_colors=pink)["objects"][0]["color"] == "pink"
    assert evaluate_images([sample.image], [sample.caption], extra_colors=pink)["all"] == 1.0
    with pytest.raises(ValueError, match="already a word"):
        ShapesWorld(extra_colors={"red": (1, 2, 3)})
    with pytest.raises(ValueError, match="at least 90 from every color"):
        ShapesWorld(extra_colors={"crimson": (235, 45, 45)})


def test_lora_adapter_listing_switching_and_file_sources(trained, tmp_path):
    """diffusers' adapter listing and switches: get_list_adapters by stage; disable_lora gives
    the base images bit for bit and enable_lora the adapted ones, a scale set while disabled
    waits for enable_lora; delete_adapters removes by name; load_lora_weights reads the
    adapter's weights file, a folder with weight_name (a renamed copy), and refuses a file with
    weight_name."""
    import shutil

    pipe = tiny_pipeline(seed=0)
    base = images(pipe)
    dec = adapter_dir(trained, "decoder")
    pipe.load_lora_weights(dec / "adapter_model.safetensors", adapter_name="dec")
    pipe.load_lora_weights(adapter_dir(trained, "prior"), adapter_name="pri")
    assert pipe.get_list_adapters() == {"decoder": ["dec"], "prior": ["pri"]}
    adapted = images(pipe)
    assert not torch.equal(adapted, base)
    pipe.disable_lora()
    assert pipe.get_active_adapters() == [] and torch.equal(images(pipe), base)
    pipe.set_lora_scale(1.0, name="dec")  # recorded, applied by enable_lora
    assert torch.equal(images(pipe), base)
    with pytest.raises(ValueError, match="enable_lora"):
        pipe.merge_lora()
    pipe.enable_lora()
    assert torch.equal(images(pipe), adapted)
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        pipe.delete_adapters(["dec", "nope"])
    assert pipe.get_list_adapters() == {"decoder": ["dec"], "prior": ["pri"]}  # none removed
    pipe.delete_adapters("pri")
    assert pipe.get_list_adapters() == {"decoder": ["dec"]}
    pipe.delete_adapters(["dec"])
    assert torch.equal(images(pipe), base)

    renamed = tmp_path / "renamed"
    shutil.copytree(dec, renamed)
    (renamed / "adapter_model.safetensors").rename(renamed / "decoder_style.safetensors")
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors is missing"):
        pipe.load_lora_weights(renamed)
    pipe.load_lora_weights(renamed, weight_name="decoder_style.safetensors", adapter_name="r")
    assert pipe.get_list_adapters() == {"decoder": ["r"]}
    with pytest.raises(ValueError, match="weight_name= and subfolder= go with a folder"):
        pipe.load_lora_weights(dec / "adapter_model.safetensors", weight_name="x.safetensors")
    with pytest.raises(ValueError, match="weight_name must be a .safetensors file name"):
        pipe.load_lora_weights(renamed, weight_name="../x.safetensors")


def test_fused_adapters_refuse_what_would_unfuse_them_wrongly(trained):
    """While adapters are fused, the calls that change their scale or remove them refuse (unfusing
    subtracts the update at the current scale); a bad name in fuse_lora changes nothing; an adapter
    loaded after disabling and unloading every adapter is active; from_pipe refuses shared
    modules that hold adapters."""
    pipe = tiny_pipeline(seed=0)
    pipe.load_lora_weights(adapter_dir(trained, "decoder"), adapter_name="d")
    adapted = images(pipe)
    with pytest.raises(ValueError, match="no LoRA adapter named 'typo'"):
        pipe.fuse_lora(lora_scale=0.5, adapter_names=["d", "typo"])
    assert torch.equal(images(pipe), adapted) and pipe.lora_adapters["d"].scale == 1.0
    with pytest.raises(ValueError, match="unload_lora"):
        UnCLIPPipeline.from_pipe(pipe)
    pipe.fuse_lora()
    for call in (pipe.enable_lora, lambda: pipe.set_lora_scale(0.5), pipe.unload_lora,
                 pipe.merge_lora, lambda: pipe.save_pretrained("never")):  # fmt: skip
        with pytest.raises(ValueError, match="fused; call unfuse_lora"):
            call()
    pipe.unfuse_lora()
    unfused = images(pipe)  # fuse and unfuse round the base weights: the reference from here
    pipe.disable_lora()
    pipe.unload_lora()
    without = images(pipe)
    assert not torch.equal(without, unfused)
    pipe.load_lora_weights(adapter_dir(trained, "decoder"), adapter_name="again")
    assert pipe.get_active_adapters() == ["again"] and torch.equal(images(pipe), unfused)
