"""Weight dtypes (unclip/precision.py): ``torch_dtype=`` at load and ``pipe.to(dtype)`` give
float16/bfloat16 weights with the prior's embedding statistics in float32, log no diffusers
warning, and sample finite images on the CPU."""

import logging

import pytest
import torch

from unclip.nets.prior import UnCLIPPrior
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.pipeline.tiny import tiny_pipeline
from unclip.utils.precision import parse_dtype

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = {"prior": {"steps": 2, "best_of": 1}, "decoder": {"steps": 2}, "upsampler": {"steps": 2}}
KEPT = {"prior.transformer.clip_mean", "prior.transformer.clip_std"}


@pytest.fixture
def diffusers_log():
    """The records diffusers' loggers emit during the test (diffusers does not propagate them to
    the root logger, so caplog would not see them)."""

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    handler, logger = Keep(), logging.getLogger("diffusers")
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)


def floating(pipe) -> dict[str, torch.dtype]:
    """``{component.tensor: dtype}`` of every floating parameter and buffer."""
    out = {}
    for name, module in pipe.modules().items():
        tensors = [*module.named_parameters(), *module.named_buffers()]
        out.update({f"{name}.{k}": t.dtype for k, t in tensors if t.is_floating_point()})
    return out


def assert_half(pipe, dtype):
    dtypes = floating(pipe)
    assert {k for k, d in dtypes.items() if d == torch.float32} == KEPT
    assert {d for k, d in dtypes.items() if k not in KEPT} == {dtype}
    assert pipe.dtype == pipe.prior.dtype == pipe.clip.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_to_half_keeps_the_statistics_float32_and_logs_nothing(dtype, diffusers_log):
    pipe = tiny_pipeline().to(dtype)  # a positional dtype, as diffusers' pipelines take it
    assert_half(pipe, dtype)
    assert diffusers_log == []  # diffusers' ModelMixin.to logs "should be kept in float32: []"
    pipe.prior.to(dtype=dtype)
    pipe.decoder.to("cpu", dtype)
    assert_half(pipe, dtype)
    assert diffusers_log == []
    pipe.to(dtype=torch.float64)  # a wider dtype casts every tensor
    assert set(floating(pipe).values()) == {torch.float64}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_dtype_at_load_samples_finite_images(dtype, tmp_path, diffusers_log):
    ref = tiny_pipeline()
    ref.save_pretrained(tmp_path / "p")
    pipe = UnCLIPPipeline.from_pretrained(tmp_path / "p", torch_dtype=dtype)
    assert_half(pipe, dtype)
    # the statistics are the saved float32 values, not rounded through the half dtype
    stats = pipe.prior.transformer.clip_std
    assert torch.equal(stats, ref.prior.transformer.clip_std)
    out = pipe(
        ["a red circle", "a blue square"],
        generator=torch.Generator().manual_seed(0),
        sampling=FAST,
        output_type="pt",
        progress=False,
    )
    assert out.images.shape == (2, 3, 64, 64) and torch.isfinite(out.images).all()
    assert out.images.std() > 0.05  # not a constant image
    assert diffusers_log == []
    named = UnCLIPPipeline.from_pretrained(tmp_path / "p", torch_dtype=str(dtype).split(".")[1])
    assert_half(named, dtype)


def test_component_loader_keeps_the_same_tensors_float32(tmp_path):
    ref = tiny_pipeline()
    ref.prior.save_pretrained(tmp_path / "prior")
    prior = UnCLIPPrior.from_pretrained(tmp_path / "prior", torch_dtype=torch.bfloat16)
    cast = tiny_pipeline().prior.to(torch.bfloat16)
    loaded = {k: v.dtype for k, v in prior.state_dict().items()}
    assert loaded == {k: v.dtype for k, v in cast.state_dict().items()}
    assert loaded["transformer.clip_mean"] == torch.float32


def test_dtype_arguments_are_checked():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        parse_dtype("float8")
    with pytest.raises(ValueError, match="floating dtype"):
        UnCLIPPipeline.from_pretrained(torch_dtype=torch.int8)
    with pytest.raises(TypeError, match="torch_dtype must be a torch.dtype"):
        UnCLIPPipeline.from_pretrained(torch_dtype=16)
