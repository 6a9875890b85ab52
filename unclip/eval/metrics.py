"""Evaluation metrics: Fréchet distance, the FID Inception, CLIP score, reference statistics.

Everything here works on images already put through :func:`to_eval_image` (the fixed preprocessing
that decides comparability; see :mod:`unclip.eval.evaluate`): uint8 arrays ``[R, R, 3]``.

* :func:`frechet_distance` — ``||mu1 - mu2||² + Tr(S1 + S2 - 2 (S1 S2)^½)`` in float64 with
  ``scipy.linalg.sqrtm`` (Heusel et al. 2017; the offset for singular products as in pytorch-fid).
* :func:`load_inception` — torchmetrics' ``NoTrainInceptionV3`` (torch-fidelity's
  ``FeatureExtractorInceptionV3``, the TF 2015-12-05 FID Inception) from a LOCAL weights file, with
  TF1-compatible bilinear resizing to 299 px (``antialias=False``), pool3 features ``[N, 2048]``.
  ``"random"`` builds the same architecture randomly initialised: for tests only, never comparable.
* :func:`clip_cosines` / :func:`clip_score_summary` — CLIP score in both conventions.
* :class:`GaussianStats` — streamed mean/covariance; :func:`reference_stats` — the reference set's
  statistics from an image folder (cached) or an ``.npz`` (:func:`save_stats` / :func:`load_stats`:
  ``mu``, ``sigma``, optional ``clip_mu``, ``clip_sigma`` and a ``meta`` JSON recording the
  preprocessing, Inception, CLIP and image listing; a cache is reused only if all of them match).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional, cast

import numpy as np
import scipy.linalg
import torch
import torch.nn.functional as F
from PIL import Image
from tqdm.auto import tqdm

from unclip.utils.images import list_images, resize_crop_box

__all__ = [
    "frechet_distance",
    "GaussianStats",
    "InceptionFeatures",
    "load_inception",
    "INCEPTION_FILE",
    "INCEPTION_URL",
    "INCEPTION_SHA256_PREFIX",
    "MIN_COMPARABLE_SAMPLES",
    "clip_cosines",
    "clip_score_summary",
    "clip_fingerprint",
    "to_eval_image",
    "to_rgb8",
    "UnreadableImage",
    "read_image",
    "save_stats",
    "load_stats",
    "STATS_FORMAT",
    "PREPROCESSING",
    "reference_stats",
    "inception_features",
    "check_reference_count",
]

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_URL = (
    f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{INCEPTION_FILE}"
)
#: how torch.hub checks a download: the SHA-256 of the file begins with the hex digits its name
#: carries (torch-fidelity's and pytorch-fid's Inception files both carry these)
INCEPTION_SHA256_PREFIX = "6726825d"
#: FID of fewer samples is biased upwards (its bias falls like 1/N) and its spread is wide; the
#: published protocol uses tens of thousands of samples, and the features are 2048-d
MIN_COMPARABLE_SAMPLES = 2048
STATS_FORMAT = "unclip-reference-stats"
#: The fixed preprocessing (recorded in every report and stats file; stats are only reused if
#: equal).
PREPROCESSING = {
    "mode": "RGB (PIL convert; alpha dropped)",
    "resize": "shorter side to R, PIL bicubic (antialiased), only if the image is not R x R",
    "crop": "centre R x R",
    "quantize": "uint8 (generated images: round(255 * x))",
    "inception_resize": "R -> 299 TF1-compatible bilinear, no antialias (torch-fidelity)",
}


# ------------------------------------------------------------------------------------------- FID
def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2): ``mu [D]``, ``sigma [D, D]``.

    Float64 throughout. If the matrix square root of ``sigma1 @ sigma2`` is not finite or has a
    significant imaginary part (singular covariances, e.g. fewer samples than dimensions), ``eps``
    is added to both diagonals and it is recomputed; tiny imaginary residues are dropped.
    """
    mu1, mu2 = (
        np.atleast_1d(np.asarray(mu1, np.float64)),
        np.atleast_1d(np.asarray(mu2, np.float64)),
    )
    s1, s2 = (
        np.atleast_2d(np.asarray(sigma1, np.float64)),
        np.atleast_2d(np.asarray(sigma2, np.float64)),
    )
    d = mu1.shape[0]
    if mu1.shape != (d,) or mu2.shape != (d,) or s1.shape != (d, d) or s2.shape != (d, d):
        raise ValueError(
            f"frechet_distance: shapes do not match: mu1 {mu1.shape}, sigma1 {s1.shape}, "
            f"mu2 {mu2.shape}, sigma2 {s2.shape}"
        )
    for name, a in (("mu1", mu1), ("sigma1", s1), ("mu2", mu2), ("sigma2", s2)):
        if not np.isfinite(a).all():
            raise ValueError(f"frechet_distance: {name} contains NaN or inf")

    def sqrtm(a):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return scipy.linalg.sqrtm(a)

    def ok(c):
        return np.isfinite(c).all() and (
            not np.iscomplexobj(c) or np.allclose(np.diagonal(c).imag, 0, atol=1e-3)
        )

    covmean = sqrtm(s1 @ s2)
    if not ok(covmean):
        offset = np.eye(d) * eps
        covmean = sqrtm((s1 + offset) @ (s2 + offset))
        if not ok(covmean):
            raise ValueError(
                "frechet_distance: the matrix square root has a large imaginary component even "
                "with the eps offset; the covariances are degenerate (use more samples)"
            )
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2.0 * np.trace(covmean.real))


class GaussianStats:
    """Streamed mean ``[D]`` and unbiased covariance ``[D, D]`` of feature rows, in float64.

    Sums are taken around the first batch's mean (a shift that avoids cancellation when the mean is
    large relative to the spread).
    """

    def __init__(self):
        self.n, self._shift, self._s1, self._s2 = 0, None, None, None

    def update(self, features) -> None:
        f = np.asarray(
            features.detach().cpu() if isinstance(features, torch.Tensor) else features, np.float64
        )
        if f.ndim != 2:
            raise ValueError(f"features must be [N, D], got {f.shape}")
        if not np.isfinite(f).all():
            raise ValueError("features contain NaN or inf")
        if self._shift is None:
            self._shift = f.mean(0)
            self._s1, self._s2 = np.zeros(f.shape[1]), np.zeros((f.shape[1], f.shape[1]))
        f = f - self._shift
        self.n += f.shape[0]
        self._s1 += f.sum(0)
        self._s2 += f.T @ f

    def mu_sigma(self) -> tuple[np.ndarray, np.ndarray]:
        if self.n < 2:
            raise ValueError(f"need at least 2 images for a covariance, got {self.n}")
        m = self._s1 / self.n
        sigma = (self._s2 - self.n * np.outer(m, m)) / (self.n - 1)
        return self._shift + m, sigma


class InceptionFeatures(torch.nn.Module):
    """FID Inception v3 → features ``[N, feature]`` from uint8 images ``[N, 3, H, W]``.

    Wraps torchmetrics' ``NoTrainInceptionV3`` with ``antialias=False`` (TF1 bilinear resize to 299,
    as the original TF FID code). ``state_dict=None`` leaves it randomly initialised (seeded
    He-normal convolutions, identity batch norms, so features neither vanish nor explode): test use
    only.
    """

    def __init__(self, feature: int = 2048, state_dict: Optional[dict] = None, seed: int = 0):
        super().__init__()
        from torchmetrics.image.fid import NoTrainInceptionV3

        if feature not in (64, 192, 768, 2048):
            raise ValueError(
                f"inception feature must be one of 64, 192, 768, 2048 (FID: 2048), got {feature}"
            )

        class _Net(
            NoTrainInceptionV3
        ):  # torch-fidelity always loads weights in __init__: defer that
            _defer_load = False

            def load_state_dict(self, sd, strict=True, assign=False):
                if type(self)._defer_load:
                    return None
                return super().load_state_dict(sd, strict=strict, assign=assign)

        empty = io.BytesIO()
        torch.save(
            {}, empty
        )  # our own bytes: the (deferred) load in torch-fidelity's __init__ reads this
        empty.seek(0)
        _Net._defer_load = True
        try:
            with torch.device("meta"):  # no default init: every tensor is set below
                net = _Net(
                    name="inception-v3-compat",
                    features_list=[str(feature)],
                    # torch-fidelity passes it to torch.load, which reads a file object too
                    feature_extractor_weights_path=empty,  # type: ignore[arg-type]
                    antialias=False,
                )
        finally:
            _Net._defer_load = False
        if state_dict is None:
            state_dict = _random_inception_state(net, seed)
        try:  # assign: the meta tensors are replaced by these (no copy, no default init)
            net.load_state_dict(state_dict, strict=True, assign=True)
        except RuntimeError as e:
            raise ValueError(
                f"the weights are not the FID Inception v3 ({INCEPTION_FILE}): "
                f"{str(e).splitlines()[0]}"
            ) from None
        self.net = net.eval().requires_grad_(False)
        self.num_features = feature

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(
                f"Inception input must be uint8 [N, 3, H, W], got {images.dtype} "
                f"{tuple(images.shape)}"
            )
        return self.net(images).float()


def _random_inception_state(net: torch.nn.Module, seed: int) -> dict:
    """Seeded He-normal convolutions, identity batch norms, zero classifier (keys of ``net``)."""
    gen, state = torch.Generator().manual_seed(seed), {}
    for name, m in net.named_modules():
        p = f"{name}." if name else ""
        if isinstance(m, torch.nn.Conv2d):
            fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
            state[p + "weight"] = torch.randn(m.weight.shape, generator=gen) * (2.0 / fan_in) ** 0.5
        elif isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            state.update(
                {
                    p + "weight": torch.ones(n),
                    p + "bias": torch.zeros(n),
                    p + "running_mean": torch.zeros(n),
                    p + "running_var": torch.ones(n),
                    p + "num_batches_tracked": torch.tensor(0),
                }
            )
        elif isinstance(m, torch.nn.Linear):
            state.update(
                {p + "weight": torch.zeros(m.weight.shape), p + "bias": torch.zeros(m.bias.shape)}
            )
    return state


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_inception(
    weights: Optional[str] = None, feature: int = 2048
) -> tuple[InceptionFeatures, dict]:
    """FID Inception from a local file (``.pth`` state dict or ``.safetensors``), or ``"random"``
    (tests).

    ``weights=None`` looks for ``INCEPTION_FILE`` in torch hub's checkpoint folder; nothing is ever
    downloaded. Returns the module and its identity ``{"name", "sha256", "feature", "verified",
    "comparable"}``: ``verified`` only for torch-fidelity's file, recognised by its SHA-256 (the
    prefix its name carries, torch.hub's check), ``comparable`` (with published FID) only for that
    file at 2048-d features. Any other weights load from ``.safetensors`` only: a pickle is
    refused unless it is that file, which is then read with ``torch.load(weights_only=True)``.
    """
    if weights == "random":
        banner = "!" * 78
        msg = (
            "--inception random: randomly initialised Inception (TEST ONLY). FID numbers from it "
            "are NOT comparable with any published FID or with runs using the real weights."
        )
        print(f"{banner}\nWARNING: {msg}\n{banner}", file=sys.stderr)
        warnings.warn(msg, stacklevel=2)
        return InceptionFeatures(feature, None), {
            "name": "random-init InceptionV3 (seed 0), TEST ONLY",
            "sha256": None,
            "feature": feature,
            "verified": False,
            "comparable": False,
        }
    hub = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_FILE
    path = Path(weights) if weights else hub
    if path.is_dir():
        path = path / INCEPTION_FILE
    if not path.is_file():
        looked = f"{path}" if weights else f"{hub} (default location; no --inception given)"
        raise FileNotFoundError(
            f"FID Inception weights not found: {looked}. FID needs the TF-compatible FID Inception "
            f"v3 weights file {INCEPTION_FILE} (torch-fidelity's conversion of the 2015-12-05 "
            "TensorFlow Inception used by the original FID code). Nothing is downloaded at run "
            f"time: get it from {INCEPTION_URL} and pass --inception /path/to/{INCEPTION_FILE} "
            f"(or place it at {hub})."
        )
    digest = _sha256(path)
    known = digest.startswith(INCEPTION_SHA256_PREFIX)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        elif known:
            # the known file, and even so only tensors: weights_only refuses any code in a pickle
            state = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise ValueError(
                f"refusing {path}: pickles (.pth, .pt, .bin) are not loaded, except the FID "
                f"Inception file {INCEPTION_FILE} itself (its SHA-256 begins "
                f"{INCEPTION_SHA256_PREFIX}, as its name says; this file's begins {digest[:8]}), "
                "and that one with torch.load(weights_only=True); pass that file from "
                f"{INCEPTION_URL}, or these weights as .safetensors"
            )
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(
            f"cannot read Inception weights {path} as a plain state dict ({e}); provide "
            f"{INCEPTION_FILE} from {INCEPTION_URL} or a .safetensors conversion of it"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"Inception weights {path} are not a state dict")
    # comparable with published FID: the checked file, at the 2048-d features FID is defined on
    verified = known and path.suffix != ".safetensors"
    note = "" if verified else ", unverified weights"
    return InceptionFeatures(feature, state), {
        "name": f"FID InceptionV3 ({path.name}{note})",
        "sha256": digest,
        "feature": feature,
        "verified": verified,
        "comparable": verified and feature == 2048,
    }


# ------------------------------------------------------------------------------------------ CLIP
def clip_cosines(image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
    """Cosine similarity ``[N]`` of row i of ``image_embeds [N, D]`` with row i of
    ``text_embeds [N, D]``."""
    image_embeds, text_embeds = (
        torch.as_tensor(image_embeds).float(),
        torch.as_tensor(text_embeds).float(),
    )
    if image_embeds.ndim != 2 or image_embeds.shape != text_embeds.shape:
        raise ValueError(
            f"clip_cosines: need matching [N, D] embeddings, got {tuple(image_embeds.shape)} "
            f"and {tuple(text_embeds.shape)}"
        )
    return (F.normalize(image_embeds, dim=-1) * F.normalize(text_embeds, dim=-1)).sum(-1)


def clip_score_summary(cosines: torch.Tensor) -> dict:
    """Both conventions over per-pair cosines ``[N]``.

    ``clip_score_100``: mean of ``max(100·cos, 0)`` (torchmetrics' documented CLIPScore; its
    implementation clamps the mean instead, identical whenever no cosine is negative).
    ``clipscore_2.5``: mean of ``2.5·max(cos, 0)`` (CLIP-S of Hessel et al. 2021).
    """
    c = torch.as_tensor(cosines).double()
    if c.ndim != 1 or c.numel() == 0:
        raise ValueError("clip_score_summary: need a non-empty [N] tensor of cosines")
    return {
        "clip_score_100": float((100 * c).clamp(min=0).mean()),
        "clipscore_2.5": float((2.5 * c).clamp(min=0).mean()),
        "cosine_mean": float(c.mean()),
        "cosine_std": float(c.std()) if c.numel() > 1 else 0.0,
        "negative_count": int((c < 0).sum()),
        "count": int(c.numel()),
    }


def clip_fingerprint(clip) -> str:
    """Short sha256 of a CLIP's config and weights (identifies the CLIP behind cached CLIP
    features); see :meth:`unclip.nets.clip.CLIP.fingerprint`."""
    return clip.fingerprint()


# ---------------------------------------------------------------------------------------- images
class UnreadableImage(ValueError):
    """An image whose pixels the evaluation cannot read faithfully: refused, not skipped (a
    silently misread image would be scored)."""


#: PIL's modes of 16-bit grey pixels (a PNG's 16-bit grey; older Pillow reads it as ``I``)
_GREY16 = ("I;16", "I;16L", "I;16B", "I;16N")


def to_rgb8(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB, its pixels read at their own depth: 16-bit grey scaled to 8 bits
    (PIL's ``convert("RGB")`` clips it, so nearly every pixel reads white), an alpha channel
    dropped only when every pixel is opaque. 32-bit integer or float pixels (no fixed range)
    and transparent pixels (whose colour depends on a background) are an
    :class:`UnreadableImage` saying what to save instead. (PIL reads a 16-bit-per-channel RGB
    PNG at 8 bits itself.)"""
    mode = image.mode
    if mode in _GREY16 or (mode == "I" and image.format == "PNG"):
        grey = np.asarray(image, dtype=np.float64) / 257  # 65535 → 255
        return Image.fromarray(np.clip(np.round(grey), 0, 255).astype(np.uint8)).convert("RGB")
    if mode in ("I", "F"):
        depth = "32-bit integer" if mode == "I" else "floating-point"
        raise UnreadableImage(
            f"its {depth} pixels have no fixed range; save it as an 8- or 16-bit PNG"
        )
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        if int(np.asarray(rgba)[..., 3].min()) < 255:
            raise UnreadableImage(
                "it has transparent pixels, whose colour depends on a background; flatten it "
                "onto one (or save it without alpha)"
            )
        return rgba.convert("RGB")
    return image.convert("RGB")


def to_eval_image(image: Image.Image, resolution: int) -> np.ndarray:
    """The fixed evaluation preprocessing (:data:`PREPROCESSING`) → uint8 ``[R, R, 3]``; the
    pixels read by :func:`to_rgb8`."""
    image = to_rgb8(image)
    w, h = image.size
    if (w, h) != (resolution, resolution):
        nh, nw, top, left = resize_crop_box(h, w, resolution)
        image = image.resize(
            (nw, nh), Image.Resampling.BICUBIC
        )  # PIL bicubic: part of the FID protocol
        image = image.crop((left, top, left + resolution, top + resolution))
    return np.asarray(image, dtype=np.uint8)


def read_image(path: Path, resolution: int) -> Optional[np.ndarray]:
    """:func:`to_eval_image` of a file, or None if it cannot be decoded (callers count the skip).
    An image decoded but not readable faithfully (:func:`to_rgb8`) is a ``ValueError`` naming
    the file."""
    try:
        with Image.open(path) as im:
            im.load()
            return to_eval_image(im, resolution)
    except UnreadableImage as exc:
        raise ValueError(f"{path}: {exc}") from None
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        return None


def listing_digest(files: list[Path], root: Path) -> str:
    """Identity of a folder's image set: relative paths, sizes and mtimes."""
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------ stats cache
def save_stats(path, meta: dict, **arrays) -> None:
    """Write ``arrays`` (``mu``, ``sigma``, ``clip_mu``, ``clip_sigma``) + ``meta`` JSON to ``path``
    (.npz)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    saved = {k: np.asarray(v, np.float64) for k, v in arrays.items() if v is not None}
    meta_json = np.array(json.dumps({"format": STATS_FORMAT, **meta}))
    # numpy's stubs type **kwds as if they could be allow_pickle: they are arrays here
    np.savez(tmp, meta=meta_json, **saved)  # type: ignore[arg-type]
    os.replace(tmp, path)


def load_stats(path) -> tuple[dict, dict]:
    """Read an ``.npz`` of reference statistics (no pickles) → ``(meta, arrays)``.

    Files from other tools with only ``mu`` and ``sigma`` load with ``meta = {}``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference statistics file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:
        raise ValueError(f"cannot read reference statistics {path}: {e}") from None
    meta = json.loads(str(arrays.pop("meta"))) if "meta" in arrays else {}
    if "mu" not in arrays or "sigma" not in arrays:
        raise ValueError(
            f"{path} has no 'mu' and 'sigma' arrays (keys: {sorted(arrays)}); it is not a file of "
            f"FID reference statistics"
        )
    return meta, arrays


# -------------------------------------------------------------------------------- reference stats
def _check_meta(meta: dict, key: dict, source) -> None:
    for k in ("resolution", "preprocessing", "inception"):
        if meta.get(k) != key[k]:
            raise ValueError(
                f"reference statistics {source} were computed with {k} = {meta.get(k)!r}, but this "
                f"run uses {key[k]!r}; recompute them from the image folder"
            )


def reference_stats(
    reference,
    cache,
    resolution: int,
    inception,
    inception_id: dict,
    clip=None,
    clip_id: Optional[dict] = None,
    batch_size: int = 32,
    min_count: int = 0,
    progress: bool = True,
) -> tuple[dict, dict]:
    """Reference statistics ``(meta, arrays)`` from an ``.npz`` or an image folder (cached to
    ``cache``).

    ``arrays``: ``mu``, ``sigma`` (Inception) and, if ``clip`` is given, ``clip_mu``,
    ``clip_sigma``. ``min_count``: fewer reference images than this is an error.
    """
    if clip is not None and clip_id is None:
        raise TypeError("reference_stats: pass clip_id with clip (it keys the CLIP statistics)")
    ref = Path(reference)
    inc_key = {k: inception_id[k] for k in ("name", "sha256", "feature")}
    key = {"resolution": resolution, "preprocessing": PREPROCESSING, "inception": inc_key}
    if ref.is_file():
        meta, arrays = load_stats(ref)
        if not meta:
            print(
                f"WARNING: {ref} has no metadata; assuming it was made with the same Inception and "
                f"preprocessing, from enough images (none of this can be checked)",
                file=sys.stderr,
            )
            meta = {"foreign": True}
        else:
            _check_meta(meta, key, ref)
        if clip is not None and (meta.get("clip") != clip_id or "clip_mu" not in arrays):
            clip_name = cast(dict, clip_id)["name"]  # given with clip: checked at the top
            raise ValueError(
                f"{ref} has no CLIP statistics for {clip_name} (it has {meta.get('clip')}); "
                f"pass the reference image folder to compute them"
            )
        if arrays["mu"].shape[0] != inc_key["feature"]:
            raise ValueError(
                f"{ref} holds {arrays['mu'].shape[0]}-d features, this Inception gives "
                f"{inc_key['feature']}-d"
            )
        check_reference_count(meta.get("count"), min_count, ref)
        return meta, arrays
    files = list_images(ref, "reference folder")
    check_reference_count(len(files), min_count, ref)
    key.update(source=str(ref.resolve()), listing=listing_digest(files, ref))
    cache = Path(cache)
    if cache.is_file():
        meta, arrays = load_stats(cache)
        if all(meta.get(k) == v for k, v in key.items()) and (
            clip is None or (meta.get("clip") == clip_id and "clip_mu" in arrays)
        ):
            print(f"reusing reference statistics {cache}", file=sys.stderr)
            check_reference_count(meta.get("count"), min_count, ref)
            return meta, arrays
    inc_stats, clip_stats, skipped = GaussianStats(), GaussianStats(), []
    for start in tqdm(range(0, len(files), batch_size), desc="reference", disable=not progress):
        batch = []
        for p in files[start : start + batch_size]:
            arr = read_image(p, resolution)
            (batch.append(arr) if arr is not None else skipped.append(str(p.relative_to(ref))))
        if batch:
            inc_stats.update(inception_features(inception, batch))
            if clip is not None:
                clip_stats.update(clip.encode_image([Image.fromarray(a) for a in batch]))
    if inc_stats.n == 0:
        raise ValueError(
            f"no readable images in reference folder {ref} ({len(skipped)} unreadable)"
        )
    check_reference_count(inc_stats.n, min_count, ref, f" ({len(skipped)} unreadable skipped)")
    mu, sigma = inc_stats.mu_sigma()
    arrays = {"mu": mu, "sigma": sigma}
    if clip is not None:
        arrays["clip_mu"], arrays["clip_sigma"] = clip_stats.mu_sigma()
    meta = {
        **key,
        "clip": clip_id,
        "count": inc_stats.n,
        "skipped": len(skipped),
        "skipped_files": skipped[:20],
    }
    save_stats(cache, meta, **arrays)
    print(
        f"reference statistics cached to {cache} (pass it as --reference next time)",
        file=sys.stderr,
    )
    return meta, arrays


def check_reference_count(count, min_count: int, source, extra: str = "") -> None:
    if count is not None and count < min_count:
        raise ValueError(
            f"the reference set {source} has {count} images{extra}, fewer than the {min_count} "
            f"samples: FID against a smaller reference is biased; add images or pass "
            f"--allow-small-reference"
        )


def inception_features(inception, arrays: list[np.ndarray]) -> torch.Tensor:
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    device = next(inception.parameters()).device
    return inception(x.to(device)).cpu()
