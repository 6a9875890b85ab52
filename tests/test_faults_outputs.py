"""The last faults of what commands produce: the sampling plan of a pipeline whose samplers fake
tensors cannot run, a full disk while images are written, an evaluation with nothing to compute,
and the web demo's host and uploads."""

import pytest
import torch

from unclip.cli.errors import run_main


def _one_line(capsys, status, command, *needles):
    err = capsys.readouterr().err
    assert status == 1, err
    assert len(err.splitlines()) == 1 and err.startswith(f"unclip {command}: error: "), err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture(scope="module")
def unipc_dir(tmp_path_factory):
    """A tiny pipeline sampled as the bundled one is: UniPC for the prior (and here for the
    decoder too, choosing among candidates part-way, which cuts rows of the sampler's state)."""
    from unclip.pipeline.pipeline import UnCLIPPipeline
    from unclip.pipeline.tiny import tiny_pipeline

    tiny = tiny_pipeline(seed=0, sizes=(16,))
    sampling = {
        "prior": {"scheduler": "unipc", "steps": 3, "guidance_scale": 2.0, "best_of": 2},
        "decoder": {
            "scheduler": "unipc",
            "steps": 3,
            "guidance_scale": 2.0,
            "best_of": 3,
            "rerank_at": 1,
        },
    }
    pipe = UnCLIPPipeline(tiny.clip, tiny.prior, tiny.decoder, [], sampling=sampling)
    path = tmp_path_factory.mktemp("unipc")
    pipe.save_pretrained(path)
    return path


def test_sampling_plan_runs_a_unipc_prior_and_says_its_steps_ran_on_the_cpu(unipc_dir, capsys):
    from unclip.cli.plan import main as plan_main

    status = run_main("unclip plan", plan_main, ["--sample", str(unipc_dir), "--batch", "2"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "fake-CUDA sampling passed: prior → decoder at float16, 2 image(s)" in out
    assert "steps of UniPCMultistepScheduler ran on real CPU tensors" in out


def test_sampling_plan_of_a_unipc_prior_under_bf16_autocast(unipc_dir):
    from unclip.train.plan_sampling import measure_sampling

    m = measure_sampling([unipc_dir], dtype=torch.float32, autocast_dtype=torch.bfloat16)
    assert m.network_autocast == {"prior": "bfloat16", "decoder": "bfloat16"}
    assert m.cpu_schedulers == ["UniPCMultistepScheduler"]
    assert m.output_shape == [1, 3, 16, 16]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from unclip.pipeline.tiny import tiny_pipeline

    path = tmp_path_factory.mktemp("tiny")
    tiny_pipeline(seed=0, sizes=(16,)).save_pretrained(path)
    return path


def _disk_full_halfway(monkeypatch):
    """PNG files stop halfway with the error a full disk gives (ENOSPC), as on a full disk."""
    import errno
    import io

    from PIL import Image, PngImagePlugin

    real = PngImagePlugin._save

    def save(im, fp, filename, *args, **kwargs):
        buf = io.BytesIO()
        real(im, buf, filename, *args, **kwargs)
        fp.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    Image.init()
    monkeypatch.setitem(Image.SAVE, "PNG", save)


def test_a_full_disk_while_generating_names_the_file_and_leaves_no_partial_one(
    tiny_dir, tmp_path, monkeypatch, capsys
):
    from unclip.cli.generate import main as generate_main

    out = tmp_path / "out"
    few = ["--prior-steps", "1", "--decoder-steps", "1", "--no-progress"]
    args = ["a red circle", "--model", str(tiny_dir), "--out", str(out), *few]
    _disk_full_halfway(monkeypatch)
    status = run_main("unclip generate", generate_main, args)
    _one_line(capsys, status, "generate", str(out / "000_00.png"), "the disk is full")
    assert not out.exists() or list(out.iterdir()) == []  # no truncated PNG, no temporary file


def test_evaluate_samples_with_nothing_to_compute_is_one_line(tmp_path, capsys):
    from PIL import Image

    from unclip.cli.evaluate import main as evaluate_main

    samples = tmp_path / "samples"
    samples.mkdir()
    Image.new("RGB", (32, 32)).save(samples / "a.png")
    (samples / "a.txt").write_text("a red circle")
    args = ["--samples", str(samples), "--out", str(tmp_path / "out"), "--no-progress"]
    status = run_main("unclip evaluate", evaluate_main, args)
    _one_line(capsys, status, "evaluate", "nothing to compute", "--reference", "--clip-model")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "host, needle",
    [("256.1.1.1", "not a valid IP address"), ("192.0.2.1", "cannot be listened on")],
)
def test_serve_checks_its_host_before_loading(tmp_path, capsys, host, needle):
    from unclip.cli.serve import main as serve_main

    args = ["--host", host, "--model", str(tmp_path / "none")]  # never reached
    status = run_main("unclip serve", serve_main, args)
    _one_line(capsys, status, "serve", f"--host {host}", needle, "127.0.0.1")


def test_serve_refuses_an_upload_past_its_limit(tiny_dir):
    pytest.importorskip("gradio")
    import socket
    import urllib.error
    import urllib.request
    import uuid

    from unclip.cli import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--model", str(tiny_dir), "--port", str(port), "--max-upload-mb", "0.01"]
    demo = serve.start(serve.build_parser().parse_args(args), block=False)

    def upload(size: int) -> int:
        boundary = uuid.uuid4().hex
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; '
            'filename="x.png"\r\nContent-Type: image/png\r\n\r\n'
        )
        body = head.encode() + b"\0" * size + f"\r\n--{boundary}--\r\n".encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/gradio_api/upload",
            data=body,
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert upload(4_000) == 200  # under 0.01 MB
        assert upload(40_000) == 413
    finally:
        demo.close()
