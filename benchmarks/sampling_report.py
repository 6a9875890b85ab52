"""Console and README tables of ``bench_sampling.py``.

Not part of the library; imported by ``bench_sampling.py``.
"""

from __future__ import annotations

import common


def report(r: dict) -> str:
    out = [f"machine: {common.machine_line(r['machine'])}"]
    b = r.get("bundled")
    if b is not None:
        if "skipped" in b:
            out.append(f"\nbundled model: skipped ({b['skipped']})")
        else:
            med, sp = b["seconds_per_image"], b["speedup_vs_fp32"]
            rows = [
                {
                    "variant": k,
                    **{s: f"{med[k][s]:.3g} ({sp[k][s]:.2f}×)" for s in med[k]},
                    "max_diff": b["final_image_max_abs_diff"][k],
                    "mean_diff": b["final_image_mean_abs_diff"][k],
                }
                for k in med
            ]
            cols = [("variant", "variant")] + [
                (f"{s} s/image (speedup)", s) for s in next(iter(med.values()))
            ]
            cols += [("final max abs diff", "max_diff"), ("final mean abs diff", "mean_diff")]
            out.append(
                common.table(
                    rows,
                    cols,
                    f"trained model {b['path']} (stages {', '.join(b['stages'])}, "
                    f"median of {r['args']['repeats']})",
                )
            )
    v = r.get("vs_diffusers")
    if v is not None:
        rows = [
            {
                "stage": s,
                "u": v["seconds_per_image"]["unclip"][s],
                "d": v["seconds_per_image"]["diffusers"][s],
                "ratio": v["ratio_unclip_over_diffusers"][s],
            }
            for s in v["seconds_per_image"]["unclip"]
        ]
        out.append(
            common.table(
                rows,
                [
                    ("stage", "stage"),
                    ("unclip s/image", "u"),
                    ("diffusers s/image", "d"),
                    ("unclip / diffusers (median of per-round ratios)", "ratio"),
                ],
                f"mid model: unclip vs diffusers UnCLIPPipeline (steps {v['steps']}, "
                f"median of {r['args']['repeats']})",
            )
        )
        e = v["equal_outputs"]
        out.append(
            "equal outputs (same seed): " + ", ".join(f"{k} = {val:.3g}" for k, val in e.items())
        )
        bf = v.get("bf16_both")
        if bf is not None:
            sec = v["seconds_per_image"]
            rows = [
                {
                    "stage": s,
                    "u": sec["unclip bf16"][s],
                    "d": sec["diffusers bf16"][s],
                    "ratio": bf["ratio_unclip_over_diffusers"][s],
                    "su": bf["speedup_over_fp32"]["unclip"][s],
                    "sd": bf["speedup_over_fp32"]["diffusers"][s],
                }
                for s in bf["ratio_unclip_over_diffusers"]
            ]
            out.append(
                common.table(
                    rows,
                    [
                        ("stage", "stage"),
                        ("unclip bf16 s/image", "u"),
                        ("diffusers bf16 s/image", "d"),
                        ("unclip / diffusers (median of per-round ratios)", "ratio"),
                        ("unclip bf16 speedup over its fp32", "su"),
                        ("diffusers bf16 speedup over its fp32", "sd"),
                    ],
                    f"mid model: both under bf16 autocast, {bf['memory_format']}",
                )
            )
            out.append(
                "final image differences ([0, 1]): "
                + "; ".join(
                    f"{k}: max {d['max_abs']:.3g}, mean {d['mean_abs']:.3g}"
                    for k, d in bf["final_image_diff"].items()
                )
            )
        f = v["unclip_defaults"]
        rows = [
            {
                "stage": s,
                "u": v["seconds_per_image"]["unclip defaults"][s],
                "d": v["seconds_per_image"]["diffusers"][s],
                "x": f["speedup_over_diffusers"][s],
            }
            for s in f["speedup_over_diffusers"]
        ]
        out.append(
            common.table(
                rows,
                [
                    ("stage", "stage"),
                    ("unclip defaults s/image", "u"),
                    ("diffusers s/image", "d"),
                    ("speedup over diffusers (median of per-round ratios)", "x"),
                ],
                f"mid model: from_pretrained's defaults (autocast {f['autocast_dtype']}, "
                "channels-last) vs diffusers UnCLIPPipeline (fp32)",
            )
        )
    o = r.get("options")
    if o is not None:
        out.append(
            common.table(
                o["rows"],
                [
                    ("stage", "stage"),
                    ("variant", "variant"),
                    ("kind", "kind"),
                    ("s/image", "s_per_image"),
                    ("speedup vs default", "speedup_vs_default"),
                    ("max abs diff", "max_abs_diff"),
                    ("mean abs diff", "mean_abs_diff"),
                ],
                f"speed options on the mid model (steps {o['steps']}, median of {o['repeats']})",
            )
        )
    if o is not None:
        w = o["work_done_once"]
        out.append(
            f"work done once per call: {w['calls_per_pipeline_call']}; network batch sizes per "
            f"step ({w['prompts']} prompt(s)): {w['network_batch_sizes_per_step']}; decoder "
            f"conditioning {w['decoder_condition_s'] * 1e3:.2f} ms = "
            f"{w['condition_over_forward']:.2%} of one guided decoder forward "
            f"({w['decoder_guided_forward_s']:.3f} s)"
        )
        t = o["threads"]
        out.append(
            f"threads: one guided decoder forward {t['decoder_guided_forward_s']}; speedup of "
            f"doubling the threads {t['speedup_of_more_threads']:.2f}"
        )
    e = r.get("bf16_end_to_end")
    if e is not None:
        out.append(
            "bf16 autocast end to end vs fp32: " + ", ".join(f"{k} = {val}" for k, val in e.items())
        )
    return "\n".join(out)
