"""Quality-against-CPU-time curves for ``bench_peers_quality.py``: EMA weights kept at fractions of
a run, the CPU time at which a curve first reaches a threshold, and the plot.

Not part of the library; imported by the benchmark's workers (both virtualenvs) and its parent.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

# the fractions of a run's steps at which its EMA weights are kept and later scored
MARKS = (1 / 8, 1 / 4, 1 / 2, 1.0)


def parse_marks(spec: str) -> tuple[float, ...]:
    """``"1/64,1/16,0.5,1"`` -> fractions in (0, 1]; the run's last step is always a mark."""
    out = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        num, slash, den = part.partition("/")
        try:
            f = float(num) / float(den if slash else 1)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"--marks: {part!r} is not a fraction such as 1/16 or 0.25") from None
        if not 0 < f <= 1:
            raise ValueError(f"--marks: {part!r} is outside (0, 1]; give fractions of the run")
        out.add(f)
    return tuple(sorted(out | {1.0}))


def mark_steps(steps: int) -> list[int]:
    """The steps at which EMA weights are kept: ``MARKS``, or the fractions the parent passes its
    workers in ``BENCH_MARKS`` (``--marks``)."""
    spec = os.environ.get("BENCH_MARKS")
    fractions = parse_marks(spec) if spec else MARKS
    return sorted({max(1, round(f * steps)) for f in fractions})


class CpuClock:
    """CPU seconds of this process since ``start()``, less the time spent keeping weights (which
    neither trainer needs to train)."""

    def __init__(self):
        self.t0, self.paused = time.process_time(), 0.0

    def start(self) -> None:
        self.t0, self.paused = time.process_time(), 0.0

    def now(self) -> float:
        return time.process_time() - self.t0 - self.paused

    @contextlib.contextmanager
    def pause(self):
        c = time.process_time()
        try:
            yield
        finally:
            self.paused += time.process_time() - c


def dalle2_trainer_settings(recipe: dict, steps: int) -> dict:
    """DALLE2-pytorch trainer keywords for ``recipe`` (the knobs both libraries share) over a run
    of ``steps``: the same for its prior and decoder trainers, EMA updated every step."""
    return dict(
        lr=recipe["lr"],
        wd=recipe["weight_decay"],
        max_grad_norm=recipe["max_grad_norm"],
        warmup_steps=recipe["warmup_steps"],
        cosine_decay_max_steps=steps,
        ema_beta=recipe["ema_decay"],
        ema_update_after_step=0,
        ema_update_every=1,
    )


def epoch_batches(n: int, b: int, generator: torch.Generator):
    """Index batches of ``b`` of ``n`` rows, forever: each epoch a new permutation drawn from
    ``generator``, its last partial batch dropped."""
    while True:
        perm = torch.randperm(n, generator=generator)
        for i in range(0, n - b + 1, b):
            yield perm[i : i + b]


def train_with_marks(step, ema_state, steps: int, marks=(), folder=None, clock=None):
    """A DALLE2-pytorch run: ``steps`` calls of ``step() -> loss``, keeping ``ema_state()`` (its
    EMA weights) at each step in ``marks`` under ``folder``; the CPU time spent keeping them is not
    counted. ``(cpu_seconds, [(step, loss)], [{"step", "cpu_seconds", "path"}])``."""
    clock = clock or CpuClock()
    clock.start()
    curve, kept = [], []
    for i in range(1, steps + 1):
        curve.append((i, float(step())))
        if i in marks:
            cpu = clock.now()
            with clock.pause():
                path = keep(ema_state(), folder, i)
            kept.append({"step": i, "cpu_seconds": cpu, "path": str(path)})
    return clock.now(), curve, kept


def steps_in_budget(cpu_seconds_of, budget: float, calib: int) -> tuple[float, float, int]:
    """``(CPU s per step, fixed CPU s, steps)`` filling ``budget`` CPU seconds, from
    ``cpu_seconds_of(n)``, the CPU seconds of a run of ``n`` steps, at ``calib`` and twice that."""
    cpu = [cpu_seconds_of(n) for n in (calib, 2 * calib)]
    step_s = max(1e-6, (cpu[1] - cpu[0]) / calib)
    fixed = max(0.0, cpu[0] - step_s * calib)
    return step_s, fixed, max(1, int((budget - fixed) / step_s))


def keep(state_dict: dict, folder: Path, step: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:07d}.pt"
    torch.save({k: v.detach().clone() for k, v in state_dict.items()}, path)
    return path


@contextlib.contextmanager
def unclip_marks(steps: list[int], folder: Path, clock: CpuClock, records: list):
    """While active, unclip's training loop keeps its EMA weights (the weights it exports) at each
    of ``steps``, appending ``{"step", "cpu_seconds", "path"}`` to ``records``. The loop has no
    hook for this, so its per-step logging call is wrapped for the run."""
    from unclip.train.loop import TrainLoop

    original = TrainLoop.log_step
    wanted = set(steps)

    def log_step(self, loss, bar, task=None):
        original(self, loss, bar, task)
        if self.state.step in wanted:
            cpu = clock.now()
            with clock.pause(), torch.no_grad(), self.ema_weights():
                path = keep(self.unwrapped.state_dict(), folder, self.state.step)
            records.append({"step": self.state.step, "cpu_seconds": cpu, "path": str(path)})

    TrainLoop.log_step = log_step
    try:
        yield records
    finally:
        TrainLoop.log_step = original


def time_to(curve: list[dict], key: str, threshold: float):
    """CPU seconds at which ``curve`` (marks in step order) first reaches ``threshold``,
    interpolated linearly between the two marks around the crossing; ``(seconds, "interpolated" |
    "at or before the first mark" | "never")``."""
    prev = None
    for point in curve:
        if point[key] >= threshold:
            if prev is None:
                return point["cpu_seconds"], "at or before the first mark"
            f = (threshold - prev[key]) / max(1e-12, point[key] - prev[key])
            t = prev["cpu_seconds"] + f * (point["cpu_seconds"] - prev["cpu_seconds"])
            return t, "interpolated"
        prev = point
    return None, "never"


def threshold_summary(curves: dict, key: str, threshold=None) -> dict:
    """Time to ``threshold`` for each trainer (default: the best value both curves reach) and the
    ratio DALLE2 ÷ unclip (> 1: unclip reaches it sooner)."""
    if threshold is None:
        threshold = min(max(p[key] for p in c) for c in curves.values())
        start = min(c[0][key] for c in curves.values())
        if threshold <= start:  # a curve never rises above where the lower one starts: the lowest
            # score above that start which a curve reaches (the other then never reaches it)
            above = [p[key] for c in curves.values() for p in c if p[key] > start]
            threshold = min(above, default=threshold)
    out = {"threshold": threshold, "key": key}
    for lib, curve in curves.items():
        t, how = time_to(curve, key, threshold)
        out[lib] = {"cpu_minutes": None if t is None else t / 60, "how": how}
        out[lib]["last_mark_cpu_minutes"] = curve[-1]["cpu_seconds"] / 60
    a, b = out["unclip"]["cpu_minutes"], out["dalle2"]["cpu_minutes"]
    out["ratio_dalle2_over_unclip"] = b / a if a and b else None
    if a and b is None:  # DALLE2 never reached it: its whole run bounds its time from below
        out["ratio_dalle2_over_unclip"] = out["dalle2"]["last_mark_cpu_minutes"] / a
        out["ratio_is"] = "a lower bound (DALLE2 never reached the threshold)"
        return out
    if a is None:  # unclip never reached it: no ratio to state
        out["ratio_is"] = "none (unclip never reached the threshold)"
        return out
    # a curve already past the threshold at its first mark gives only an upper bound on its time
    early = {lib for lib in curves if out[lib]["how"] == "at or before the first mark"}
    out["ratio_is"] = (
        "exact (interpolated)"
        if not early
        else "a lower bound"
        if early == {"unclip"}
        else "an upper bound"
        if early == {"dalle2"}
        else "unknown (both at or before their first mark)"
    )
    return out


def plot(result: dict, path: Path) -> str:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (s, key, label)
        for s, key, label in (
            ("prior", "cos_to_true_image_embed", "cos to true image embedding"),
            ("decoder", "single_all", "single-object prompts all right (%)"),
            ("decoder", "single_parts", "single-object parts right, mean (%)"),
        )
        if s in result["stages"]
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, (stage, key, label) in zip(axes[0], panels):
        r = result["stages"][stage]
        scale = 100 if key.startswith("single") else 1
        line = r["time_to_threshold_parts" if key == "single_parts" else "time_to_threshold"]
        for lib, name in (("unclip", "unclip"), ("dalle2", "DALLE2-pytorch")):
            curve = r["trainers"][lib]["curve"]
            ax.plot(
                [p["cpu_seconds"] / 60 for p in curve],
                [scale * p[key] for p in curve],
                "o-",
                label=name,
            )
        ax.axhline(scale * line["threshold"], color="grey", ls=":", lw=1)
        ax.set(title=f"{stage}: quality vs training CPU time", xlabel="CPU minutes", ylabel=label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
