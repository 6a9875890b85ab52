"""Console and README tables of ``bench_peers.py`` (one training step per stage, and the
``--sweep`` against batch and resolution) and the sweep's plot.

Not part of the library; imported by the benchmark's parent process only.
"""

from __future__ import annotations

from pathlib import Path

import common
from peers_models import LIBS


def precision_label(r: dict) -> str:
    """How each library trained: fp32 both, bf16 both, or unclip's resolved ``auto`` against
    DALLE2's fp32."""
    if r["args"].get("mixed_precision") == "bf16":
        return "both bf16 autocast"
    mp = r.get("unclip_mixed_precision", "no")
    return "both fp32" if mp == "no" else f"unclip {mp} autocast, DALLE2 fp32"


def plot_sweep(rows: list[dict], path: Path, precision: str = "fp32") -> str:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("prior: samples/s vs batch", "batch", lambda r: r["stage"] == "prior"),
        (
            "64 px decoder: samples/s vs batch",
            "batch",
            lambda r: r["stage"] == "decoder" and r["resolution"] == 64,
        ),
        (
            "decoder, batch 2: samples/s vs resolution",
            "resolution",
            lambda r: r["stage"] == "decoder" and r["batch"] == 2,
        ),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (title, x, keep) in zip(axes, panels):
        sel = sorted((r for r in rows if keep(r)), key=lambda r: r[x])
        if not sel:  # a quick sweep leaves some panels without points: log axes need data
            ax.set(title=f"{title} (no points in this sweep)")
            ax.axis("off")
            continue
        for lib, label in (("unclip", "unclip"), ("dalle2", "DALLE2-pytorch")):
            ax.plot(
                [r[x] for r in sel], [r[f"{lib}_samples_per_s"] for r in sel], "o-", label=label
            )
        ax.set(title=title, xlabel=x, ylabel="samples/s (1 thread)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(f"training step, {precision}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(common.ROOT))


def report_sweep(r: dict) -> str:
    rows = [{**x, "res": f"{x['resolution']} px" if x["resolution"] else "-"} for x in r["sweep"]]
    cols = [
        ("stage", "stage"),
        ("res", "res"),
        ("batch", "batch"),
        ("unclip samples/s", "unclip_samples_per_s"),
        ("DALLE2 samples/s", "dalle2_samples_per_s"),
        ("unclip ÷ DALLE2 (median of per-round ratios)", "speed_ratio"),
    ]
    title = (
        f"training samples/s vs batch and resolution, {precision_label(r)}, 1 thread, "
        f"{r['rounds']} rounds"
    )
    return (
        f"machine: {common.machine_line(r['machine'])}\n"
        + common.table(rows, cols, title)
        + (f"\nplot: {r['plot']}")
    )


def report(r: dict) -> str:
    out = [
        f"machine: {common.machine_line(r['machine'])}",
        f"dalle2_pytorch {r['dalle2_pytorch']}; {r['setup']} sizes; 1 warm-up round + "
        f"{r['rounds']} timed rounds of one step per library, order alternating",
    ]
    rows = []
    for s in r["stages"]:
        u, d = s["unclip"], s["dalle2"]
        rows.append(
            {
                "stage": s["stage"],
                "res": s["resolution"],
                "batch": s["batch"],
                "params": f"{u['params'] / 1e6:.3g} M / {d['params'] / 1e6:.3g} M "
                f"({s['param_difference']:+.1%})",
                "u_sps": u["samples_per_s"],
                "d_sps": d["samples_per_s"],
                "ratio": s["speed_ratio"],
                "ratio_net": s["speed_ratio_without_text_encoding"],
                "ratio_cpu": s.get("speed_ratio_cpu_time", "-"),
                "gflop": (
                    f"{u['gflop_per_sample']:.3g} / {d['gflop_per_sample']:.3g}"
                    if "gflop_per_sample" in u
                    else "-"
                ),
                "rate": (
                    f"{u['gflop_per_cpu_s']:.0f} / {d['gflop_per_cpu_s']:.0f}"
                    if "gflop_per_cpu_s" in u
                    else "-"
                ),
                "enc": f"{s['unclip_text_encode_share']:.1%}",
                "rss": f"{u['rss_peak_mb']:.0f} / {d['rss_peak_mb']:.0f}",
                "inc": f"{u['rss_step_increase_mb']:.0f} / {d['rss_step_increase_mb']:.0f}",
            }
        )
    cols = [
        ("stage", "stage"),
        ("res", "res"),
        ("batch", "batch"),
        ("params unclip / DALLE2 (diff.)", "params"),
        ("unclip samples/s", "u_sps"),
        ("DALLE2 samples/s", "d_sps"),
        ("**unclip ÷ DALLE2 speed** (median of per-round ratios)", "ratio"),
        ("same, without unclip's CLIP text encoding", "ratio_net"),
        ("same, from CPU seconds", "ratio_cpu"),
        ("GFLOP/sample unclip / DALLE2", "gflop"),
        ("GFLOP per CPU s", "rate"),
        ("CLIP text encoding share of unclip's step", "enc"),
        ("peak RSS MB unclip / DALLE2", "rss"),
        ("RSS increase in steps MB", "inc"),
    ]
    out.append(
        common.table(rows, cols, f"one training step, {precision_label(r)} (> 1: unclip faster)")
    )
    for s in r["stages"]:
        tops = [s[lib]["profile"]["top"] for lib in LIBS]
        prow = []
        for i in range(max(len(t) for t in tops)):
            row = {"rank": i + 1}
            for lib, t in zip(LIBS, tops):
                if i < len(t):
                    row[f"{lib}_op"] = t[i]["op"]
                    row[f"{lib}_ms"] = t[i]["self_cpu_ms"]
                    row[f"{lib}_share"] = f"{t[i]['share']:.1%}"
            prow.append(row)
        pcols = [("#", "rank")]
        for lib, name in zip(LIBS, ("unclip", "DALLE2")):
            pcols += [
                (f"{name} op", f"{lib}_op"),
                ("self ms", f"{lib}_ms"),
                ("share", f"{lib}_share"),
            ]
        totals = ", ".join(
            f"{name} {s[lib]['profile']['self_cpu_ms_total']:.0f} ms"
            for lib, name in zip(LIBS, ("unclip", "DALLE2"))
        )
        title = f"where the time goes: {s['stage']}, one profiled step (self CPU: {totals})"
        out.append(common.table(prow, pcols, title))
    return "\n".join(out)
