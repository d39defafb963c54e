"""``slipstream bench gpu``: the dry run gives every stage's rows with real results, and the
harness turns a stage that fails or hangs into a FAILED row while the later stages run."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import pytest

from slipstream.bench.gpu import STAGES, Stage, _report, run_stages
from slipstream.bench.workers.gpu import device_tag
from slipstream.bench.workers.gpu_varlen import parameters
from slipstream.cli import main


@pytest.mark.slow
def test_dry_run_reports_a_real_result_for_every_stage(tmp_path):
    out, records = tmp_path / "gpu.md", tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--dry-run", "--out", str(out), "--json", str(records)]) == 0
    stages = {r["stage"]: r for r in json.loads(records.read_text())}
    assert list(stages) == [s.name for s in STAGES]
    for name, r in stages.items():
        assert r["failure"] is None, f"{name}: {r['failure']}"
        assert r["rows"] and all(row[2] != "FAILED" for row in r["rows"]), f"{name}: {r['rows']}"
    results = {name: [row[2] for row in r["rows"]] for name, r in stages.items()}
    assert results["probe"].count("no race") == 7  # every wrapper checked its values (DeepSpeed's skipped on CPU)
    assert results["comm"].count("no race") == 5  # the staged layout's, then the collectives vs gloo
    assert [r.endswith("x gloo") for r in results["comm"]].count(True) == 3
    assert results["varlen"][0].endswith("(the reference)")  # padded, then HF's flattening and varlen against it
    assert [r.endswith("x padded") for r in results["varlen"]].count(True) == 2
    varlen = stages["varlen"]["data"]  # the count the rows state is the built model's
    assert varlen["parameters"] == varlen["runs"]["sdpa"]["parameters"] == parameters("llama-gqa-tiny")
    assert results["compile"][0].startswith("chose ")
    assert "skipped" in results["pytest"][0] and "failed" not in results["pytest"][0]
    assert "passed" in results["suite"][0] and "failed" not in results["suite"][0]
    report = out.read_text()
    assert report.startswith("# `slipstream bench gpu` on a CPU dry run")
    head = report.index("| stage | case | result | details |")
    assert head < report.index("## Machine and versions") < report.index("## Command")
    for stage in STAGES:
        assert f"| {stage.title} |" in report


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _stand_in(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


_ROW = ("import json, sys; a = sys.argv; "
        "open(a[a.index('--rows') + 1], 'a').write(json.dumps({'case': 'c', 'result': 'fine', 'detail': ''}) + '\\n')")
_OUT = "; open(a[a.index('--out') + 1], 'w').write('{}')"


def test_a_stage_that_hangs_or_raises_is_a_failed_row_and_the_later_stages_run(tmp_path):
    pid_file = tmp_path / "child.pid"
    hang = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w')"
            ".write(str(p.pid)); time.sleep(60)")
    stages = [Stage("hangs", "A hangs", 2, _stand_in(hang)),
              Stage("raises", "B raises", 20, _stand_in(_ROW + "; raise RuntimeError('boom')")),
              Stage("works", "C works", 20, _stand_in(_ROW + _OUT))]
    started = time.monotonic()
    outcomes = run_stages(stages, {}, time_limit=42, workdir=str(tmp_path))
    assert time.monotonic() - started < 20
    hung, raised, worked = outcomes
    assert hung.failure == "timed out after 2 s" and hung.rows == [["A hangs", "-", "FAILED", hung.failure]]
    assert not _running(int(pid_file.read_text())), "the hung stage's child outlived it"
    assert raised.failure.startswith("exit code 1: RuntimeError: boom")
    assert raised.rows == [["B raises", "c", "fine", ""], ["", "-", "FAILED", raised.failure]]  # its rows stand
    assert worked.failure is None and worked.rows == [["C works", "c", "fine", ""]]
    report = _report(outcomes, "slipstream bench gpu", "today", 3.0, 42, dry=True)
    assert "| A hangs | - | FAILED | timed out after 2 s |" in report
    assert "## B raises: exit code 1: RuntimeError: boom" in report and "| C works | c | fine |  |" in report


def test_a_stage_without_time_left_is_not_started(tmp_path):
    stages = [Stage("slow", "A", 2, _stand_in("import time; time.sleep(60)")),
              Stage("next", "B", 0.5, _stand_in(_ROW + _OUT))]
    outcomes = run_stages(stages, {}, time_limit=2.5, workdir=str(tmp_path))
    assert outcomes[1].failure.startswith("not run:") and outcomes[1].rows[-1][2] == "FAILED"


def test_the_gpu_runs_model_has_153m_parameters():
    assert parameters("llama-150m") == 152_980_224  # LlamaForCausalLM's own count of its config (transformers 5.24)


def test_device_tag_is_the_gpu_model_in_lower_case():
    assert device_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert device_tag("NVIDIA A100-SXM4-80GB") == "a100"
    assert device_tag("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert device_tag("NVIDIA H200") == "h200"


@pytest.mark.slow
def test_a_pytest_stage_row_names_each_failed_test_with_its_error(tmp_path):
    """The GPU machine is lent for minutes: a failure's error must be in the report, not only
    the test's name (a run of real pytest on a generated file, serial and under xdist)."""
    from slipstream.bench.workers.gpu import Rows, _pytest

    (tmp_path / "tests").mkdir()
    case_file = tmp_path / "tests" / "test_made.py"
    case_file.write_text("def test_fine():\n    pass\n\n\ndef test_broken():\n"
                         "    raise AttributeError('no attribute _fsdp_param_groups')\n")
    ctx = {"repo": str(tmp_path), "workdir": str(tmp_path)}
    for extra in ([], ["-n", "2"]) if importlib.util.find_spec("xdist") else ([],):
        rows_path = tmp_path / f"rows{len(extra)}.jsonl"
        out = _pytest(ctx, Rows(str(rows_path)), time.monotonic() + 120, "made", [*extra, str(case_file)])
        (row,) = [json.loads(line) for line in rows_path.read_text().splitlines()]
        assert out["returncode"] == 1 and out["failed"] == ["test_made.py::test_broken"], (extra, out)
        assert "1 failed, 1 passed" in row["result"], row
        assert "test_made.py::test_broken: AttributeError: no attribute _fsdp_param_groups" in row["detail"], row


@pytest.mark.slow
def test_a_pytest_stage_past_its_time_still_names_the_errors_so_far(tmp_path):
    """Past the stage's time pytest is interrupted (SIGINT): the error of a test that failed
    before the one it stopped in is in the row, serially (pytest's short summary) and under
    pytest-xdist, which prints no summary when stopped (``bench/pytest_failures.py``'s file)."""
    from slipstream.bench.workers.gpu import Rows, _pytest

    (tmp_path / "tests").mkdir()
    case_file = tmp_path / "tests" / "test_made.py"
    # test_slow is exempt from the per-test timeout (a third of the stage's): the stage's stop must reach it
    case_file.write_text("import time\n\nimport pytest\n\n\ndef test_broken():\n"
                         "    raise AttributeError('no attribute x')\n\n\n"
                         "@pytest.mark.timeout(0)\ndef test_slow():\n    time.sleep(120)\n")
    for extra in ([], ["-n", "2"]) if importlib.util.find_spec("xdist") else ([],):
        rows_path = tmp_path / f"rows{len(extra)}.jsonl"
        started, limit = time.monotonic(), 60 if extra else 25  # xdist's workers take ~15 s to start on 2 cores
        out = _pytest({"repo": str(tmp_path), "workdir": str(tmp_path)}, Rows(str(rows_path)), started + limit,
                      "made", [*extra, str(case_file)])
        assert time.monotonic() - started < limit
        (row,) = [json.loads(line) for line in rows_path.read_text().splitlines()]
        assert out["returncode"] is None and row["result"] == "FAILED", (extra, row)
        assert "stopped in tests/test_made.py::test_slow;" in row["detail"], (extra, row)
        assert "test_made.py::test_broken: AttributeError: no attribute x" in row["detail"], (extra, row)
