"""``slipstream bench soak``: a short real run checked against gloo, and the verdict's rules."""

from __future__ import annotations

import copy
import json
import random

import pytest

from slipstream.bench.soak import compare, verdict
from slipstream.cli import main


@pytest.mark.slow
def test_short_soak_matches_gloo_and_keeps_resources_flat(tmp_path):
    out = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--layouts", "1x4", "--collectives", "1200", "--groups", "8", "--max-bytes", "256K",
               "--seed", "3", "--json", str(out)])
    reference, record = json.loads(out.read_text())
    assert reference["reference"] and not record["reference"] and reference["failed"] == []
    assert rc == 0 and record["failed"] == [], record["failed"]
    assert record["differ"] == 0 and record["cycles_wrong"] == 0 and record["world_size"] == 4
    kinds = {k for r in record["ranks"] for k in r["by_kind"]}
    assert kinds == {"all_reduce", "reduce_scatter", "all_gather"}
    # every rank took part in calls of every kind, on several groups (the draws are shared)
    assert all(sum(r["by_kind"].values()) > 300 for r in record["ranks"])
    assert [r["by_kind"] for r in record["ranks"]] == [r["by_kind"] for r in reference["ranks"]]


def _raw(moment="end", calls=4, **changed) -> dict:
    snap = {"rss_mib": 300.0, "buffers_mib": 0.0, "fds": 20, "threads": 6, "segments": 2}
    rank = {"rank": 0, "cycles_wrong": 0, "checksums": [11 * i for i in range(calls)],
            "snapshots": {m: dict(snap) for m in ("start", "after_1000", "middle", "end", "after_groups")}}
    rank["snapshots"][moment].update(changed)
    if moment == "end":  # the group cycles start from the end of the calls
        rank["snapshots"]["after_groups"].update(changed)
    return {"ranks": [rank, copy.deepcopy(rank) | {"rank": 1}], "world_size": 2, "collectives": calls,
            "group_cycles": 0, "calls_s": 1.0}


@pytest.mark.parametrize("end, failed", [
    ({}, None),
    ({"rss_mib": 314.0}, None),  # 4.7%: within the bound
    ({"rss_mib": 315.0}, "memory grew 300 -> 315"),
    ({"fds": 21}, "fds 20 -> 21"),
    ({"threads": 7}, "threads 6 -> 7"),
    ({"segments": 3}, "segments 2 -> 3"),
])
def test_the_verdict_fails_growth_from_the_1000th_call_and_any_change_in_resources(end, failed):
    got = verdict(_raw(**end))
    assert (got == []) if failed is None else any(failed in line for line in got), got


def test_the_verdict_judges_the_memory_less_the_soaks_own_buffers():
    """300 -> 314 MiB is 4.7% of the whole, but 7% of the 200 MiB that is not the soak's
    100 MiB of buffers: it fails."""
    raw = _raw(rss_mib=314.0)
    for r in raw["ranks"]:
        for snap in r["snapshots"].values():
            snap["buffers_mib"] = 100.0
    assert any("memory grew 200 -> 214" in line for line in verdict(raw)), verdict(raw)
    assert verdict(_raw(rss_mib=314.0)) == []


def test_the_verdict_fails_descriptors_or_threads_left_by_the_group_cycles():
    assert any("fds 20 -> 25 over the group cycles" in line for line in verdict(_raw("after_groups", fds=25)))
    assert any("threads 6 -> 9 over the group cycles" in line for line in verdict(_raw("after_groups", threads=9)))
    assert verdict(_raw("after_groups", rss_mib=330.0)) == []  # memory is judged over the calls


def test_a_result_differing_from_gloo_is_named_by_its_call_and_rank_and_fails_the_verdict():
    from slipstream.bench.workers.soak import describe, draw, members

    reference, ours = _raw(calls=40), _raw(calls=40)
    ours["ranks"][1]["checksums"][29] += 1
    assert compare(reference, reference, seed=5, max_bytes=1 << 20) == []
    rng = random.Random(5)
    calls = [draw(rng, members(2), 1 << 20) for _ in range(40)]
    (named,) = compare(reference, ours, seed=5, max_bytes=1 << 20)
    assert named == f"call 29: {describe(calls[29])}, ranks [1]"
    assert any("1 results differ from gloo's" in line for line in verdict(ours, [named]))


def test_the_reference_runs_first_on_gloo_alone_and_does_not_decide_the_exit(tmp_path, monkeypatch):
    from slipstream.bench import soak

    argvs, wrong = [], []

    def launch_worker(module, argv, spec, timeout):
        argvs.append(argv)
        if "--reference" in argv:
            return _raw(rss_mib=450.0, calls=1000)  # the reference's memory grows 50%
        raw = _raw(calls=1000)
        for i in wrong:
            raw["ranks"][0]["checksums"][i] = -1
        return raw

    monkeypatch.setattr(soak, "launch_worker", launch_worker)
    out = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--layouts", "1x2", "--collectives", "1000", "--json", str(out)])
    reference, ours = json.loads(out.read_text())
    assert ["--reference" in argv for argv in argvs] == [True, False]
    assert rc == 0 and not ours["reference"] and ours["failed"] == [] and ours["rss_growth"] == [0.0, 0.0]
    assert reference["reference"] and "memory grew 300 -> 450" in reference["failed"][0]
    assert reference["rss_growth"] == [0.5, 0.5] and reference["layout"].startswith("1x2 (reference")
    assert "checksums" not in ours["ranks"][0]  # compared, not kept
    wrong.extend([3, 700])
    assert main(["bench", "soak", "--layouts", "1x2", "--collectives", "1000", "--json", str(out)]) == 1
    ours = json.loads(out.read_text())[1]
    assert ours["differ"] == 2 and [c.split(":")[0] for c in ours["differ_calls"]] == ["call 3", "call 700"]


def test_the_runs_done_are_written_before_the_next_starts(tmp_path, monkeypatch, capsys):
    """A soak stopped in slipstream's job (its timeout, a signal) keeps the reference's run."""
    from slipstream.bench import soak

    out, md = tmp_path / "soak.json", tmp_path / "soak.md"

    def launch_worker(module, argv, spec, timeout):
        if "--reference" not in argv:
            assert [r["layout"] for r in json.loads(out.read_text())] == ["1x2 (reference: gloo alone)"]
            assert "partial: 1 of 2" in md.read_text()
            raise KeyboardInterrupt  # stopped in its second run
        return _raw(calls=1000)

    monkeypatch.setattr(soak, "launch_worker", launch_worker)
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "soak", "--layouts", "1x2", "--collectives", "1000", "--json", str(out),
              "--markdown", str(md)])
    (reference,) = json.loads(out.read_text())
    assert reference["failed"] == [] and reference["reference"] and "| 1x2 (reference" in md.read_text()
    assert "partial" not in capsys.readouterr().out  # the partial report goes to the files only


_HEAP = """
import ctypes, re
from slipstream.bench.workers.soak import trim_malloc, usage
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read())[1]) / 1024
big, keep = [], []
for _ in range(200):  # 1 MiB blocks from the heap, each followed by a small one that stays
    p = libc.malloc(1 << 20)
    ctypes.memset(p, 1, 1 << 20)
    big.append(p)
    keep.append(libc.malloc(64))
for p in big:
    libc.free(p)
freed = rss()
assert trim_malloc()
print(freed, rss(), usage(trim=True)["rss_mib"])
"""


def test_trim_reads_the_memory_the_process_uses_not_what_the_allocator_keeps():
    """``--trim``: 200 MiB freed but kept in glibc's heap (blocks below its mmap threshold, held
    between small live ones) count in the resident memory until the trim returns them."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    env = {"MALLOC_MMAP_THRESHOLD_": str(4 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _HEAP], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    freed, trimmed, read = map(float, out.stdout.split())
    assert freed - trimmed > 150 and read < freed - 150, out.stdout


@pytest.mark.parametrize("env, said", [
    ({}, "C allocator: glibc's defaults"),
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "C allocator settings from the environment: MALLOC_MMAP_THRESHOLD_=131072"),
])
def test_the_report_names_the_allocator_settings_the_ranks_inherit(tmp_path, monkeypatch, capsys, env, said):
    from slipstream.bench import soak

    for k in soak.allocator_env():
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(soak, "launch_worker", lambda module, argv, spec, timeout: _raw(calls=1000))
    assert main(["bench", "soak", "--layouts", "1x2", "--collectives", "1000", "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert said in out and out.startswith("".join(f"{k}={v} " for k, v in env.items()) + "slipstream bench soak")


def test_the_readings_count_the_segments_of_the_jobs_ranks_only():
    """Another slipstream job's segment on the machine is not the soak's (a fault test beside it
    once made a soak fail on 2 segments it never made)."""
    import os

    from slipstream.bench.workers.soak import usage
    from slipstream.core_comm.collectives.segment import SHM_DIR, segment_name

    if not os.path.isdir(SHM_DIR):
        pytest.skip("no /dev/shm")
    mine, other = (os.path.join(SHM_DIR, segment_name(pid)) for pid in (os.getpid(), os.getppid()))
    try:
        for path in (mine, other):
            open(path, "x").close()
        assert usage(pids={os.getpid()})["segments"] == 1
        assert usage(pids={os.getpid(), os.getppid()})["segments"] == 2
        assert usage()["segments"] >= 2  # every one on the machine
    finally:
        for path in (mine, other):
            if os.path.exists(path):
                os.unlink(path)
