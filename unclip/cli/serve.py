"""``unclip serve``: a local web demo of a pipeline (default: the bundled shapes model) on Gradio.

    pip install 'unclip[demo]'
    unclip serve                                   # http://127.0.0.1:7860
    unclip serve --model path/to/pipeline --port 8000 --device cuda

Tabs: Generate, Variations, Interpolate, Edit (inpaint, image to image, text diff), with per-stage
sampling settings and a progress bar; see :mod:`unclip.demo`. A DALL-E or DALL-E Mega pipeline
folder gets the Generate tab with its transformer's settings. The server listens on ``--host``
only (no public share link); Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from unclip.cli.generate import add_autocast_arg

__all__ = ["main", "build_parser", "build_app", "check_host", "start", "MISSING_GRADIO"]

MISSING_GRADIO = "the web demo needs gradio, which is not installed: pip install 'unclip[demo]'"
#: prompts offered under the Generate tab for the bundled shapes model
SHAPES_EXAMPLES = (
    "a small red circle on the left",
    "a blue square above a green triangle",
    "a big yellow triangle in the center",
)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be from 1 to 65535, got {value}")
    return value


def _megabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MB, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--max-upload-mb must be a number > 0, got {text}")
    return value


def check_host(host: str) -> str:
    """``host`` if this machine can listen on it: an IP address or a name it resolves, that is
    one of its own addresses (or 0.0.0.0 / ::). A one-line ``ValueError`` otherwise, before
    anything loads."""
    import ipaddress
    import socket

    hint = "give an address of this machine, e.g. 127.0.0.1, or 0.0.0.0 for every interface"
    if all(c.isdigit() or c == "." for c in host):  # dotted numbers are an IPv4 address or wrong
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"--host {host} is not a valid IP address; {hint}") from None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except OSError:
        raise ValueError(
            f"--host {host} is not an IP address or a name found here; {hint}"
        ) from None
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except OSError as exc:
        raise ValueError(f"--host {host} cannot be listened on ({exc.strerror}); {hint}") from None
    return host


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unclip serve", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=None,
        help="pipeline folder (unCLIP, DALL-E or DALL-E Mega), diffusers/Karlo unCLIP folder, "
        "or 'shapes' (bundled, default)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 serves every network interface (default: %(default)s)",
    )
    p.add_argument("--port", type=_port, default=7860, help="(default: %(default)s)")
    p.add_argument(
        "--max-upload-mb",
        type=_megabytes,
        default=20.0,
        help="largest file a visitor may upload, in MB; larger ones are refused (default: "
        "%(default)s)",
    )
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument(
        "--resolution",
        type=int,
        default=None,
        help="the side of the images a model that draws at any size makes (Kandinsky 2.2; "
        "default: its own, 512); other families draw at their fixed resolution",
    )
    add_autocast_arg(p)
    return p


def build_app(args: argparse.Namespace):
    """Load the pipeline of any family (``--model``) and build its app, a ``gr.Blocks`` not yet
    served."""
    import torch

    from unclip.demo.app import build_demo
    from unclip.pipeline.auto import load_pipeline

    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise ValueError(f"--device {args.device!r}: {exc}") from None
    pipe = load_pipeline(args.model, autocast_dtype=args.autocast).to(device)
    if args.resolution is not None:
        if getattr(pipe, "family", None) != "kandinsky":
            raise ValueError(
                f"--resolution: this {type(pipe).__name__} draws at its fixed resolution "
                f"({pipe.resolution} px); leave --resolution out"
            )
        size = args.resolution
        f2 = pipe.decoder.scale_factor**2
        if size < f2 or size % f2:
            raise ValueError(f"--resolution must be a positive multiple of {f2}, got {size}")
        pipe.resolution = size
    bundled = args.model in (None, "shapes")
    name = "shapes (bundled)" if bundled else str(args.model)
    return build_demo(pipe, name, examples=SHAPES_EXAMPLES if bundled else ())


def start(args: argparse.Namespace, block: bool = True):
    """Load the pipeline, build the app and serve it; with ``block=False`` return the running
    ``gr.Blocks`` (``.close()`` stops it)."""
    from unclip.demo.app import launch

    demo = build_app(args)
    limit = int(args.max_upload_mb * 2**20)
    launch(demo, host=args.host, port=args.port, block=block, max_upload_bytes=limit)
    return demo


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_host(args.host)
    # checked before anything is loaded, so a missing extra costs no model load and is one line
    if importlib.util.find_spec("gradio") is None:
        print(f"unclip serve: error: {MISSING_GRADIO}", file=sys.stderr)
        return 1
    start(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
