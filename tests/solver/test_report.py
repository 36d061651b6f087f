"""The HTML report: self-contained, with every section, a pipeline timeline that follows its
schedule, and (where Debian's chromium is installed) rendered by a real browser without a console
error and not blank."""
from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib

import pytest

import autopar
from autopar import models
from autopar.solver.report import html_report, timeline
from autopar.record.schedules import schedule_orders


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    model, inputs = models.build("gpt", device="meta", layers=8, width=1024, heads=16, seq=256, vocab=8192, batch=16)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    plan = autopar.plan(model, mesh, inputs, pipeline=autopar.Pipeline(stages=2), memory_budget="800MiB")
    rows = autopar.compare(plan, model, inputs, "dp=4", "tp=2,pp=2,mb=4", memory_budget="800MiB")
    text = html_report(plan, rows)
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(text)
    return text, path


def test_report_is_self_contained_and_has_every_section(report):
    text, _ = report
    for heading in ("Summary", "Memory per device", "Pipeline timeline", "One block's graph", "What-ifs", "Stage 1: per-layer table"):
        assert heading in text
    assert "<script" not in text.lower()
    assert not re.search(r"\b(src|href)\s*=", text)  # nothing fetched
    assert set(re.findall(r"https?://[^'\" ]+", text)) <= {"http://www.w3.org/2000/svg"}  # the SVG namespace only


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero-bubble"])
def test_timeline_follows_the_schedule(schedule):
    """Equal stages of time t: the step is (microbatches + stages - 1) x t under GPipe and 1F1B and
    less under zero bubble; every microbatch's tasks run once per stage, in the stage's order, none
    overlapping; 1F1B holds at most ``stages - s`` microbatches in flight on stage s."""
    stages, micro, t = 4, 6, 3.0
    placed = timeline([t] * stages, micro, schedule)
    end = max(op[3] for ops in placed for op in ops)
    if schedule == "zero-bubble":
        assert micro * t < end < (micro + stages - 1) * t
    else:
        assert end == pytest.approx((micro + stages - 1) * t)
    tasks = ("F", "B", "W") if schedule == "zero-bubble" else ("F", "B")
    for s, ops in enumerate(placed):
        assert [(k, m) for k, m, *_ in ops] == schedule_orders(stages, micro, schedule)[s]
        assert sorted((k, m) for k, m, *_ in ops) == sorted((k, m) for k in tasks for m in range(micro))
        assert all(a[3] <= b[2] + 1e-12 for a, b in zip(ops, ops[1:]))
        if schedule == "1f1b":
            inflight = peak = 0
            for k, *_ in ops:
                inflight += 1 if k == "F" else -1
                peak = max(peak, inflight)
            assert peak <= stages - s


def _png_is_not_blank(path) -> bool:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        if kind == b"IHDR":
            width = struct.unpack(">I", data[pos + 8:pos + 12])[0]
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    raw = zlib.decompress(idat)
    return width > 0 and len(set(raw[: 4 * width * 400])) > 8  # more than a handful of byte values


def test_report_renders_in_a_real_browser(report, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium here: install Debian's `chromium` package (apt-get install chromium) to run this test")
    _, path = report
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1600",
         f"--screenshot={shot}", "--enable-logging=stderr", "--v=0", path.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    console_errors = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console_errors, console_errors
    assert shot.exists() and _png_is_not_blank(shot)
