"""The GPU check's smoke mode (``benchmarks/gpu_check.py --cpu``), so that the script a lent H200
runs cannot rot between loans: its driver, report and sections on the tiny configs.

The subprocess runs the real driver with a subset of its sections (the whole smoke run takes
minutes; docs/gpu_check.md) and two sections of the test's own between them: one that raises
and one that runs past its time box. The train section trains, kills (SIGKILL) and resumes the
tiny prior for real and compares the runs bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

DRIVER = """
import sys, time
sys.path.insert(0, {bench!r})
import gpu_check
from gpu_check import SECTIONS, Section


def section_boom(check, rec):
    rec["measured_before_failing"] = 1.5
    raise RuntimeError("a deliberate failure")


def section_hang(check, rec):
    rec["started"] = True
    while True:
        time.sleep(0.05)


sections = {{
    "env": SECTIONS["env"],
    "boom": Section(None, section_boom, 30, 30),
    "hang": Section(None, section_hang, 1, 1),
    "train": SECTIONS["train"],
    "tokens": SECTIONS["tokens"],
    "cuda_graphs": SECTIONS["cuda_graphs"],
}}
sys.exit(gpu_check.main(sys.argv[1:], sections=sections))
"""


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            DRIVER.format(bench=str(BENCH)),
            "--cpu",
            "--out",
            str(out),
            "--networks",
            "prior",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    report = out / "gpu_check.json"
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(report.read_text()), (out / "gpu_check.md").read_text()


@pytest.mark.slow
def test_every_section_is_reported_in_order_and_a_failure_does_not_stop_the_run(smoke):
    proc, data, md = smoke
    sections = data["sections"]
    assert list(sections) == ["env", "boom", "hang", "train", "tokens", "cuda_graphs"]
    status = {name: s["status"] for name, s in sections.items()}
    assert status == {
        "env": "ok",
        "boom": "error",
        "hang": "timeout",
        "train": "ok",
        "tokens": "ok",
        "cuda_graphs": "skipped",
    }, {name: s.get("error") for name, s in sections.items()}
    # the failing section keeps what it measured before it raised, and says why it failed
    assert sections["boom"]["result"] == {"measured_before_failing": 1.5}
    assert sections["boom"]["error"] == "RuntimeError: a deliberate failure"
    assert "section_boom" in sections["boom"]["traceback"]
    assert sections["hang"]["result"] == {"started": True}
    assert "time box" in sections["hang"]["error"]
    assert sections["cuda_graphs"]["error"].startswith("skipped: needs CUDA")
    # a run with a failed section says so in its exit status
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert data["mode"] == "cpu smoke"
    # the Markdown report is the same run's: its summary row for every section
    for name, s in sections.items():
        assert f"| {name} | {s['status']} |" in md
        assert f"## {name}: {s['status']}" in md


@pytest.mark.slow
def test_the_killed_and_resumed_training_run_is_bit_identical(smoke):
    _, data, md = smoke
    train = data["sections"]["train"]["result"]
    (row,) = train["runs"]  # --networks prior: one run, in the prior's smoke precision (bf16)
    assert (row["network"], row["precision"]) == ("prior", "bf16")
    assert row["killed_exit"] == -9  # it died of SIGKILL in the middle of a step
    assert row["resumed_files"] >= 2 and row["resumed_tensors"] > 0
    assert row["resumed_unequal"] == 0 and row["resumed_max_abs_diff"] == 0.0
    assert row["resumed_losses_equal"] is True
    assert row["bit_identical"] is True
    assert train["bit_identical_after_kill"] == "1 of 1 runs"
    # what ran is recorded, not what was asked for: bf16 autocast, fp32 weights and EMA on the CPU
    assert row["autocast"] == "bf16"
    assert row["weights_on"] == row["ema_on"] == "cpu float32"
    assert row["loss_scale"] == "no scaler (bf16)"
    assert row["skipped_steps"] == 0
    assert 0 < row["grad_norm"] < float("inf")
    # the smoke mode reports no figure a GPU would give
    assert train["fp16_loss_scaler"].startswith("skipped: needs CUDA")
    assert "### runs" in md and "| prior | bf16 |" in md


@pytest.mark.slow
def test_token_sampling_with_and_without_the_cache_gives_the_same_images(smoke):
    _, data, _ = smoke
    rows = data["sections"]["tokens"]["result"]["rows"]
    assert [r["family"] for r in rows] == ["dalle", "mega"]
    for r in rows:
        assert "error" not in r, r
        assert r["image_tokens"] > 0
        assert r["image_max_abs_diff"] == 0.0


def test_a_section_past_the_deadline_is_skipped_and_a_failed_row_fails_its_section(tmp_path):
    saved = list(sys.path)  # the benchmarks' modules (common, models) must not shadow others
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path[:] = saved
    ran = []

    def section(check, rec):
        ran.append(True)
        rec["rows"] = [{"network": "a", "x": 1.0}, {"network": "b", "error": "ValueError: no"}]

    late = gpu_check.Check(cpu=True, out=tmp_path, work=tmp_path, deadline=time.perf_counter())
    report: dict = {"sections": {}}
    gpu_check.run_section(late, report, "late", section, 30)
    assert report["sections"]["late"]["status"] == "skipped" and not ran
    assert report["sections"]["late"]["error"].startswith("global deadline")

    check = gpu_check.Check(
        cpu=True, out=tmp_path, work=tmp_path, deadline=time.perf_counter() + 60
    )
    gpu_check.run_section(check, report, "rows", section, 30)
    entry = report["sections"]["rows"]
    assert ran and entry["status"] == "error"
    assert entry["error"] == "1 rows failed; first: rows[1]: ValueError: no"
    report["_t0"] = time.perf_counter()
    report.update(mode="cpu smoke", deadline_s=60.0, machine={"device": "CPU"})
    gpu_check.write_report(check, report)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| late | skipped |" in md and "| rows | error |" in md
    assert "| b |  | ValueError: no |" in md  # the failed row in its table, empty where unmeasured
    assert json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["rows"] == entry
