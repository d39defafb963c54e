"""``slipstream bench compile`` runs end to end on tiny models; no timing is asserted."""

from __future__ import annotations

import json

import pytest


from slipstream.cli import main

_TINY = ["--batch-size", "2", "--steps", "4", "--image-size", "32", "--resnet-width", "8",
         "--bert-size", "tiny", "--seq-len", "16", "--llama-model", "llama-tiny", "--device", "cpu"]


def _run(tmp_path, argv: list[str]) -> tuple[list[dict], str]:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert main(["bench", "compile", *argv, "--json", str(out), "--markdown", str(md)]) == 0
    return json.loads(out.read_text()), md.read_text()


def _check(records: list[dict], table: str, models: list[str]) -> None:
    assert [r["model"] for r in records] == models
    for r in records:
        assert "error" not in r
        rep, s = r["report"], r["summary"]
        assert len(r["eager_s"]) == len(r["tuned_s"]) == len(r["eager_losses"]) == 4  # two whole runs of 4 steps
        assert s["eager_run_s"] == sum(r["eager_s"]) and s["run_ratio"] == s["tuned_run_s"] / s["eager_run_s"]
        for key in ("chosen", "decided_at_step", "search_s", "search_steps", "overhead_s", "graph_breaks",
                    "recompiles", "expected_steps", "budget_s", "break_even_step"):
            assert key in rep
        names = [c["name"] for c in rep["candidates"]]
        assert names[0] == "eager" and len(names) == len(set(names))
        measured = {c["name"] for c in rep["candidates"] if c["status"] in ("measured", "chosen")}
        assert rep["chosen"] in measured
        assert f"| {r['model']} | cpu | {rep['chosen']} ({rep['decided_at_step']}) |" in table
        for name in names:
            assert f"| {r['model']} | cpu | {name} |" in table
    assert "goals (cpu):" in table and "cold compiles" in table


@pytest.mark.slow
def test_bench_compile_reports_every_candidate_of_three_models(tmp_path):
    # a 4-step run pays for no compile: every model's search ends at step 4, on eager, and each step
    # of the compile-on run is eager's, on the same weights: the same losses
    records, table = _run(tmp_path, ["--models", "resnet50,bert,llama", *_TINY])
    _check(records, table, ["resnet50", "bert", "llama"])
    for r in records:
        assert r["report"]["chosen"] == "eager" and r["report"]["expected_steps"] == 4
        assert {c["status"] for c in r["report"]["candidates"][1:]} == {"skipped"}
        assert r["eager_losses"] == r["tuned_losses"]
    assert "torchvision" in records[0]["description"]



def test_a_model_past_its_timeout_is_reported_failed_and_leaves_nothing(tmp_path, monkeypatch):
    """A worker killed at ``--timeout`` goes with the processes it started (as inductor's compile
    workers, here a loop writing into its cache directory): a FAILED row in a report that is still
    written, the bench's temporary directory removed, no writer left behind."""
    import stat
    import sys
    import tempfile
    import time

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    worker = tmp_path / "worker.sh"  # stands in for the Python worker: a child writing, bounded at 10 s
    worker.write_text('#!/bin/sh\n(for i in $(seq 100); do mkdir -p "$TORCHINDUCTOR_CACHE_DIR/$i"; sleep 0.1; done) &\n'
                      "sleep 10\n")
    worker.chmod(worker.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(worker))
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    rc = main(["bench", "compile", "--models", "bert", "--timeout", "1", *_TINY, "--json", str(out),
               "--markdown", str(md)])
    assert rc == 1
    [record] = json.loads(out.read_text())
    assert record["error"].startswith("worker exit killed after 1 s")
    assert "| bert | cpu | FAILED |" in md.read_text()
    time.sleep(0.5)  # a writer still alive would have made its next directory by now
    assert list(scratch.iterdir()) == []
