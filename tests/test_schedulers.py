"""Any diffusers scheduler per stage: by alias, class name or instance, with the stage's training
facts winning and clear refusals (unclip/schedulers.py)."""

import json

import pytest
import torch
from conftest import gens
from diffusers import DDPMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from unclip.cli import main as unclip_main
from unclip.diffusion.config import DiffusionConfig
from unclip.diffusion.loop import make_scheduler
from unclip.pipeline.tiny import tiny_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=0, sizes=(16,))


def decode(pipe, scheduler, steps=4):
    return pipe(
        ["a red circle", "a blue square"],
        generator=gens(1, 2),
        sampling={"prior": {"steps": 3}, "decoder": {"scheduler": scheduler, "steps": steps}},
        output_type="pt",
        progress=False,
    ).images


@pytest.mark.parametrize("name", ["euler", "euler_a", "heun", "unipc", "dpm2", "lms"])
def test_a_diffusers_scheduler_by_alias_samples_the_decoder(pipe, name):
    ddim = decode(pipe, "ddim")
    got = decode(pipe, name)
    assert torch.isfinite(got).all() and got.shape == ddim.shape
    assert not torch.allclose(got, ddim, atol=1e-4)  # the scheduler was actually used
    assert torch.equal(got, decode(pipe, name))  # and is deterministic for fixed generators


def test_a_class_name_and_an_instance_work_and_the_stage_facts_win(pipe):
    by_alias = decode(pipe, "euler")
    by_class = decode(pipe, "EulerDiscreteScheduler")
    torch.testing.assert_close(by_class, by_alias)
    # an instance built for another model: its schedule and prediction type are replaced by the
    # stage's, its own options (Karras sigmas) are kept
    inst = EulerDiscreteScheduler(
        num_train_timesteps=10, prediction_type="v_prediction", use_karras_sigmas=True
    )
    stage = DiffusionConfig(prediction_type="epsilon")
    sched = make_scheduler(inst, stage)
    assert sched.config.num_train_timesteps == 1000
    assert sched.config.prediction_type == "epsilon"
    assert sched.config.beta_schedule == stage.beta_schedule
    assert sched.config.use_karras_sigmas is True
    assert inst.config.num_train_timesteps == 10  # the given instance is not changed
    karras = decode(pipe, inst)
    assert torch.isfinite(karras).all() and not torch.allclose(karras, by_alias, atol=1e-4)


def test_schedulers_that_cannot_serve_a_stage_are_refused_with_the_reason(pipe):
    with pytest.raises(ValueError, match="unknown sampler 'eulr'; did you mean 'euler'"):
        decode(pipe, "eulr")
    with pytest.raises(ValueError, match="takes no prediction_type"):
        decode(pipe, FlowMatchEulerDiscreteScheduler())
    # the tiny prior predicts x_0 ("sample"), which ancestral Euler does not implement
    with pytest.raises(ValueError, match="EulerAncestralDiscreteScheduler cannot serve this stage"):
        pipe("a red circle", sampling={"prior": {"scheduler": "euler_a"}}, progress=False)
    with pytest.raises(ValueError, match="needs a model that outputs its variance"):
        decode(pipe, DDPMScheduler(variance_type="learned_range"))
    with pytest.raises(ValueError, match="a sampler must be a name or a diffusers scheduler"):
        decode(pipe, 3)


def test_generate_records_the_sampler_and_refuses_an_unknown_one(tmp_path, capsys):
    out = tmp_path / "s"
    code = unclip_main(
        ["generate", "a red circle", "--tiny", "--out", str(out), "--no-progress",
         "--decoder-scheduler", "unipc", "--decoder-steps", "3", "--prior-steps", "2"]
    )  # fmt: skip
    assert code == 0
    rec = json.loads((out / "generate.json").read_text())
    assert rec["sampling"]["decoder"]["scheduler"] == "unipc"
    code = unclip_main(
        ["generate", "a red circle", "--tiny", "--out", str(tmp_path / "t"), "--no-progress",
         "--decoder-scheduler", "nope"]
    )  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert "decoder: unknown sampler 'nope'" in err and "\n" not in err


def test_a_pipeline_saved_with_an_alias_loads_it(pipe, tmp_path):
    from unclip.pipeline.pipeline import UnCLIPPipeline

    pipe.sampling["decoder"].scheduler = "heun"
    try:
        pipe.save_pretrained(tmp_path / "p")
    finally:
        pipe.sampling["decoder"].scheduler = "ddim"
    loaded = UnCLIPPipeline.from_pretrained(tmp_path / "p")
    assert loaded.sampling["decoder"].scheduler == "heun"


def test_attention_slicing_changes_memory_layout_not_results(pipe):
    def sliced(p):
        return type(p).__name__.startswith("SlicedAttn")  # with or without added KV

    plain = decode(pipe, "ddim")
    pipe.enable_attention_slicing("max")
    try:
        procs = [m.processor for net in pipe.denoisers().values() for m in net.modules()
                 if hasattr(m, "set_attention_slice") and hasattr(m, "processor")]  # fmt: skip
        assert procs and all(sliced(p) for p in procs)
        torch.testing.assert_close(decode(pipe, "ddim"), plain, rtol=1e-4, atol=1e-5)
    finally:
        pipe.disable_attention_slicing()
    assert not any(
        sliced(m.processor)
        for net in pipe.denoisers().values()
        for m in net.modules()
        if hasattr(m, "processor")
    )
    with pytest.raises(ValueError, match="slice_size must be"):
        pipe.enable_attention_slicing(0)


def test_sliced_upsampler_attention_takes_temb_without_a_warning_per_call():
    """The upsamplers' attention blocks pass ``temb`` (used only by a spatial norm they do not
    have): sliced, they take it without diffusers logging that it is ignored on every call."""
    import logging

    class Records(logging.Handler):  # diffusers' loggers do not propagate to the root logger
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    pipe = tiny_pipeline(seed=0)  # with upsamplers, whose attention blocks pass temb
    low = torch.zeros(1, 3, 16, 16)
    gen = torch.Generator().manual_seed(0)
    plain = pipe.upsample(low, gen, {"upsampler": {"steps": 2}}, progress=False)
    records, library = Records(), logging.getLogger("diffusers")
    pipe.enable_attention_slicing("max")
    library.addHandler(records)
    try:
        gen = torch.Generator().manual_seed(0)
        sliced = pipe.upsample(low, gen, {"upsampler": {"steps": 2}}, progress=False)
    finally:
        library.removeHandler(records)
        pipe.disable_attention_slicing()
    assert not [m for m in records.messages if "not expected" in m], records.messages[:1]
    torch.testing.assert_close(sliced, plain, rtol=1e-4, atol=1e-5)


def test_xformers_is_refused_with_what_to_do_off_cuda(pipe):
    from unclip.pipeline.memory import xformers_available

    msg = "runs on CUDA only" if xformers_available() else "pip install 'unclip\\[xformers\\]'"
    with pytest.raises(ValueError, match=msg):
        pipe.enable_xformers_memory_efficient_attention()


@pytest.mark.parametrize("name", ["ddim", "dpm++", "euler", "heun", "unipc", "lms", "unclip"])
def test_a_sampler_started_mid_schedule_lands_on_x0_for_an_exact_model(name):
    """Image-to-image starts the sampler at a later step: with a model that predicts the true x_0
    every sampler must end on it (a wrong begin index, order or history would not)."""
    from unclip.diffusion.loop import denoise_steps

    sched = make_scheduler(name, DiffusionConfig(prediction_type="sample"), clip_sample_range=None)
    sched.set_timesteps(6)
    start = 3 * getattr(sched, "order", 1)
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(start)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    x_t = sched.add_noise(x0, noise, sched.timesteps[start].reshape(1).repeat(2))
    out = denoise_steps(
        lambda x, t: x0, x_t, sched, guidance_scale=1.0, start=start, progress=False
    )
    # ddim and unclip end at alphas_cumprod[0] < 1 (a little noise is left: ~0.02 here); a wrong
    # start index or multistep history misses by ~0.3
    assert (out - x0).abs().max() < 0.05


def test_learned_variance_samplers_serve_learned_variance_models_only():
    from diffusers import DDPMScheduler

    stage = DiffusionConfig()
    sched = make_scheduler(
        DDPMScheduler(variance_type="learned_range"), stage, learned_variance=True
    )
    assert sched.config.variance_type == "learned_range"
    with pytest.raises(ValueError, match="variance_type='learned' is not supported"):
        make_scheduler(DDPMScheduler(variance_type="learned"), stage, learned_variance=True)


def _candidates(pipe, n=4):
    text = pipe.encode_text(["a red circle", "a blue square", "a green triangle", "a red circle"])
    g = torch.Generator().manual_seed(0)
    embeds = torch.nn.functional.normalize(torch.randn(n, pipe.clip.embed_dim, generator=g), dim=-1)
    return embeds, text


@pytest.mark.parametrize("name", ["ddim", "unipc", "dpm++", "euler_a", "lms", "ddpm"])
def test_reranking_part_way_finishes_the_kept_candidates_exactly(pipe, name):
    """``rerank_at``: after step m the chooser sees every candidate's predicted x_0 and only the
    rows it keeps are denoised on, each finishing as in a run of every candidate (guided, so the
    conditioning's [uncond; cond] rows are cut to them; multistep history and the per-row
    generators of a stochastic sampler follow the kept rows)."""
    from unclip.sampling.candidates import sample_decoder_reranked
    from unclip.sampling.settings import DecoderSampling
    from unclip.sampling.stages import sample_decoder

    embeds, text = _candidates(pipe)
    s = DecoderSampling(scheduler=name, steps=4, guidance_scale=2.0, rerank_at=2)
    args = (pipe.decoder, embeds, text, pipe.null_text, s, pipe.diffusion["decoder"])
    full = sample_decoder(*args, generator=gens(0, 1, 2, 3), progress=False)
    seen = []

    def choose(x0):
        seen.append(x0)
        return [3, 1]

    got, keep = sample_decoder_reranked(*args, choose, generator=gens(0, 1, 2, 3), progress=False)
    assert keep.tolist() == [3, 1] and len(seen) == 1
    assert seen[0].shape == (4, 3, 16, 16) and seen[0].abs().max() <= 1
    torch.testing.assert_close(got, full[[3, 1]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["ddim", "unipc", "ddpm"])
def test_pruning_then_choosing_finishes_the_kept_candidates_exactly(pipe, name):
    """``prune_at`` / ``prune_keep``: after the pruning step the candidates the prune function
    keeps go on (multistep history, per-row generators and guidance's [uncond; cond] rows cut to
    them), the chooser sees only those, and the indices returned are into the candidates given."""
    from unclip.sampling.candidates import sample_decoder_reranked
    from unclip.sampling.settings import DecoderSampling
    from unclip.sampling.stages import sample_decoder

    embeds, text = _candidates(pipe)
    s = DecoderSampling(
        scheduler=name, steps=4, guidance_scale=2.0, best_of=4, rerank_at=3, prune_at=1
    )
    s.prune_keep = 3
    args = (pipe.decoder, embeds, text, pipe.null_text, s, pipe.diffusion["decoder"])
    full = sample_decoder(*args, generator=gens(0, 1, 2, 3), progress=False)
    seen = []

    def prune(x0):
        seen.append(x0)
        return [3, 0, 2]

    def choose(x0):
        seen.append(x0)
        return [2, 0]  # rows of the pruned set: candidates 2 and 3

    got, keep = sample_decoder_reranked(
        *args, choose, generator=gens(0, 1, 2, 3), progress=False, prune=prune
    )
    assert keep.tolist() == [2, 3] and [x.shape[0] for x in seen] == [4, 3]
    torch.testing.assert_close(got, full[[2, 3]], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="give sample_decoder_reranked the prune function"):
        sample_decoder_reranked(*args, choose, progress=False)


@pytest.mark.parametrize("name", ["ddim", "euler", "lms"])
def test_the_chooser_sees_the_samplers_own_x0_estimate(pipe, name):
    """The x_0 the candidates are chosen by is the sampler's own estimate at that step, also for a
    sampler whose samples live in sigma space (Euler, LMS: scaled model input)."""
    from diffusers.utils.torch_utils import randn_tensor

    from unclip.sampling.candidates import sample_decoder_reranked
    from unclip.sampling.settings import DecoderSampling
    from unclip.sampling.stages import decoder_denoiser

    embeds, text = _candidates(pipe)
    s = DecoderSampling(scheduler=name, steps=4, guidance_scale=1.0, rerank_at=2)
    args = (pipe.decoder, embeds, text, pipe.null_text, s, pipe.diffusion["decoder"])
    seen = []
    sample_decoder_reranked(
        *args, lambda x0: seen.append(x0) or [0], generator=gens(0, 1, 2, 3), progress=False
    )
    d = decoder_denoiser(*args)
    x = randn_tensor(d.shape, generator=gens(0, 1, 2, 3)) * d.scheduler.init_noise_sigma
    with torch.no_grad():
        for t in d.scheduler.timesteps[:2]:
            step = d.scheduler.step(d.output(x, t), t, x)
            x = step.prev_sample
    torch.testing.assert_close(seen[0], step.pred_original_sample.clamp(-1, 1), atol=1e-5, rtol=0)


def test_reranking_part_way_refuses_samplers_it_cannot_stop(pipe):
    """Two network calls per step (Heun, DPM2): steps are not the loop's iterations, so
    ``rerank_at`` is refused with what to use instead; so is a step past the end."""
    from unclip.sampling.candidates import sample_decoder_reranked
    from unclip.sampling.settings import DecoderSampling

    embeds, text = _candidates(pipe)
    for name in ("heun", "dpm2"):
        s = DecoderSampling(scheduler=name, steps=4, guidance_scale=1.0, rerank_at=2)
        args = (pipe.decoder, embeds, text, pipe.null_text, s, pipe.diffusion["decoder"])
        with pytest.raises(ValueError, match="one network call per step.*use ddim"):
            sample_decoder_reranked(*args, lambda x0: [0], progress=False)
    s = DecoderSampling(scheduler="ddim", steps=4, guidance_scale=1.0, rerank_at=4)
    args = (pipe.decoder, embeds, text, pipe.null_text, s, pipe.diffusion["decoder"])
    with pytest.raises(ValueError, match="below steps"):
        sample_decoder_reranked(*args, lambda x0: [0], progress=False)
