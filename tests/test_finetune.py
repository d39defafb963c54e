"""The fine-tune recipe end to end (short mode) and its input errors."""

import json

import pytest

pytest.importorskip("deepspeed")

from slipstream.cli import main  # noqa: E402
from slipstream.recipes.alpaca import AlpacaFormatError  # noqa: E402


@pytest.mark.slow
def test_embedded_default_runs_end_to_end_and_matches_stock(tmp_path):
    out = tmp_path / "run"
    figures = tmp_path / "figures.json"
    code = main(["finetune", "--steps", "4", "--samples", "96", "--output-dir", str(out), "--compare",
                 "--json", str(figures), "--timeout", "600"])
    assert code == 0
    stock, ours = json.loads(figures.read_text())
    assert (stock["impl"], ours["impl"]) == ("stock", "slipstream")
    for r in (stock, ours):
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and len(r["losses"]) == 4
        assert 0 <= r["comm_least_s"] <= r["comm_time_s"]  # each step's least over the ranks is at most rank 0's
        assert 0 < r["compute_fastest_s"] <= r["compute_s"] <= r["compute_slowest_s"]  # rank 0 lies within the spread
        (rank0, _), _ = r["compute_exposed_by_rank_s"]  # each rank's medians, rank 0's first
        assert rank0 == r["compute_s"]
        assert (out / f"checkpoint-{r['impl']}").is_dir()
    for a, b in zip(stock["losses"], ours["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a)
    assert ours["padding_removed"] > 0.2 and stock["padding_removed"] == 0
    # the core's buffers are part of slipstream's peak (one node: at least its shared segment)
    assert stock["core_buffers_mb"] is None and 0 < ours["core_buffers_mb"] < ours["peak_mem_mb"]
    # slipstream answers DeepSpeed's collectives without adding any: the same calls per
    # collective as stock, except that ZeRO-2's gradient allreduce (this model's gradients fit
    # DeepSpeed's one bucket: one a step) becomes reduce-scatters to the slices' owners: one a
    # step where it blocks, one or more (the tuner's buckets), issued during backward and waited
    # for at its end, in the steps "overlap": "auto" times overlapped (steps 1 and 3 of 4).
    calls = {r["impl"]: {op: v["calls"] for op, v in r["comm_by_op"].items()} for r in (stock, ours)}
    scattered = calls["slipstream"].pop("reduce_scatter_tensor", 0)
    waited = calls["slipstream"].pop("reduce_scatter_tensor.wait", 0)
    assert scattered >= 4 and waited >= 1 and "reduce_scatter_tensor" not in calls["stock"]
    calls["slipstream"]["all_reduce"] += 4
    assert calls["slipstream"] == calls["stock"] and calls["stock"]["all_reduce"] >= 8
    # which path those calls took: stock DeepSpeed never reaches the core; with slipstream the
    # gradient reduce-scatters run on shared memory (one node)
    assert stock["comm_paths"] == {}
    assert set(ours["comm_paths"]["reduce_scatter"]) <= {"shm", "cma"}, ours["comm_paths"]
    assert (out / "compare.png").stat().st_size > 0


@pytest.mark.slow
def test_fsdp_stack_compare_matches_stock_fsdp2_with_its_collectives_through_the_core(tmp_path, monkeypatch):
    """Ours also compiles (--compile): a run of 2 steps of 2 micro-batches is 4 forward calls,
    whose budget (5% of them) pays for no compile, so none is tried at step 4 (steps 2 and 3
    time eager), and each step is eager's (the budget's own checks: tests/test_compile.py)."""
    monkeypatch.setenv("SLIPSTREAM_COMPILE_DIR", str(tmp_path / "compile-cache"))
    figures = tmp_path / "figures.json"
    assert main(["finetune", "--stack", "fsdp", "--compare", "--compile", "--steps", "2", "--grad-accum", "2",
                 "--samples", "48", "--max-length", "128", "--batch-size", "4", "--output-dir",
                 str(tmp_path / "run"), "--json", str(figures)]) == 0
    stock, ours = json.loads(figures.read_text())
    assert stock["stack"] == ours["stack"] == "fsdp2"
    for a, b in zip(stock["losses"], ours["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)
    assert ours["padding_removed"] > 0.1 and stock["padding_removed"] == 0
    assert stock["comm_paths"] == {}  # plain FSDP2 on gloo never reaches the core
    for op in ("all_gather", "reduce_scatter"):
        assert set(ours["comm_paths"][op]) <= {"shm", "cma"}, ours["comm_paths"]
    calls = {op: (stock["comm_by_op"][op]["calls"], ours["comm_by_op"][op]["calls"]) for op in ("all_gather", "reduce_scatter")}
    assert calls["reduce_scatter"][0] == calls["reduce_scatter"][1], calls
    assert calls["all_gather"][1] == calls["all_gather"][0], calls  # no compile check ran a forward
    assert stock["compile"] is None
    report = ours["compile"]
    statuses = {c["name"]: (c["status"], c["reason"]) for c in report["candidates"]}
    assert "inductor" not in statuses  # FSDP2's hooks: never the whole model
    assert statuses["regions"][0] == "skipped" and "expected compile" in statuses["regions"][1], report
    assert report["expected_steps"] == 4 and report["decided_at_step"] == 4, report
    assert report["chosen"] == "eager" and report["fallback"] is None, report


@pytest.mark.netns
@pytest.mark.slow
def test_hsdp_compare_runs_stock_full_sharding_stock_hsdp_and_ours_on_two_nodes(tmp_path, capsys):
    figures = tmp_path / "figures.json"
    assert main(["finetune", "--stack", "fsdp", "--hsdp", "--compare", "--nodes", "2", "--nproc", "2", "--steps",
                 "2", "--samples", "64", "--max-length", "96", "--batch-size", "2", "--output-dir",
                 str(tmp_path / "run"), "--json", str(figures)]) == 0
    stock, stock_hsdp, ours = json.loads(figures.read_text())
    assert (stock["stack"], stock_hsdp["stack"], ours["stack"]) == ("fsdp2", "fsdp2-hsdp", "fsdp2-hsdp")
    for other in (stock_hsdp, ours):  # the same training in fp32: only the reduction order differs
        for a, b in zip(stock["losses"], other["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(a)
    assert stock["comm_paths"] == stock_hsdp["comm_paths"] == {}
    assert set(ours["comm_paths"]["all_reduce"]) == {"hierarchical"}, ours["comm_paths"]  # the replicate all-reduce
    for op in ("all_gather", "reduce_scatter"):  # inside a node
        assert set(ours["comm_paths"][op]) <= {"shm", "cma"}, ours["comm_paths"]
    table = capsys.readouterr().out
    assert "vs FSDP2" in table and "vs HSDP" in table


@pytest.mark.parametrize("args, message", [
    (["--stack", "fsdp", "--hsdp"], "--hsdp needs --nodes >= 2"),
    (["--hsdp"], "--hsdp goes with --stack fsdp"),
    (["--stack", "fsdp", "--config", "x.json"], "goes with --stack deepspeed"),
])
def test_fsdp_stack_options_are_checked_before_any_rank_starts(tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["finetune", *args, "--output-dir", str(tmp_path)])


@pytest.mark.faults
def test_malformed_data_file_names_the_file_and_the_record(tmp_path):
    bad = tmp_path / "data.json"
    bad.write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}, {"instruction": 3}]))
    with pytest.raises(AlpacaFormatError) as err:
        main(["finetune", "--data", str(bad), "--output-dir", str(tmp_path / "o")])
    assert str(bad) in str(err.value) and "1" in str(err.value)


def _alpaca(path, n):
    path.write_text(json.dumps([{"instruction": f"say {i}", "input": "", "output": "ok"} for i in range(n)]))
    return path


@pytest.mark.faults
@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such file"),
        ("directory", "not a file"),
        ("latin1", "not UTF-8 text"),
        ("empty", "0 records, fewer than one step needs (16"),
        ("one", "1 records, fewer than one step needs"),
    ],
)
def test_bad_data_is_refused_before_any_rank_starts_naming_the_file(tmp_path, case, message):
    path = tmp_path / "data.json"
    if case == "directory":
        path.mkdir()
    elif case == "latin1":
        path.write_bytes('[{"instruction": "caf\xe9", "output": "x"}]'.encode("latin-1"))
    elif case in ("empty", "one"):
        _alpaca(path, 0 if case == "empty" else 1)
    with pytest.raises(AlpacaFormatError) as err:
        main(["finetune", "--data", str(path), "--output-dir", str(tmp_path / "o")])
    assert str(path) in str(err.value) and message in str(err.value)


@pytest.mark.faults
@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-length", "4096"], "--max-length 4096 is above the context of model 'llama-tiny' (1024)"),
        (["--config", "{missing}"], "not a readable JSON file"),
        (["--config", "{bad_key}"], "slipstream: unknown key 'comms'"),
        (["--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_bad_settings_are_refused_before_any_rank_starts(tmp_path, args, message):
    bad_key = tmp_path / "ds.json"
    bad_key.write_text(json.dumps({"slipstream": {"comms": {}}}))
    args = [a.format(missing=tmp_path / "nope.json", bad_key=bad_key) for a in args]
    with pytest.raises((SystemExit, ValueError)) as err:
        main(["finetune", *args, "--output-dir", str(tmp_path / "o")])
    assert message in str(err.value)


@pytest.mark.faults
def test_a_bad_environment_variable_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CHUNK_BYTES", "100")
    with pytest.raises(ValueError, match="SLIPSTREAM_CHUNK_BYTES='100'"):
        main(["finetune", "--output-dir", str(tmp_path / "o")])


@pytest.mark.slow
def test_a_model_directory_without_a_tokenizer_trains_with_the_built_one_where_its_vocabulary_fits(tmp_path):
    """A model saved with ``save_pretrained`` alone: the job takes the tokenizer built locally
    when the model's vocabulary holds its ids (and trains), refuses a smaller one before any
    rank starts naming ``--tokenizer``, and takes the directory's own tokenizer when it has one."""
    from slipstream.recipes.model import build_model
    from slipstream.recipes.tokenizer import BUILT_VOCAB, load_tokenizer, tokenizer_source

    fits, small, own = (tmp_path / name for name in ("fits", "small", "own"))
    build_model("llama-tiny", vocab_size=BUILT_VOCAB + 8).save_pretrained(fits)
    build_model("llama-tiny", vocab_size=512).save_pretrained(small)
    build_model("llama-tiny", vocab_size=BUILT_VOCAB).save_pretrained(own)
    load_tokenizer(None).save_pretrained(own)
    assert tokenizer_source(str(fits), None) is None and tokenizer_source(str(own), None) == str(own)
    assert tokenizer_source(str(small), "tok.json") == "tok.json"
    with pytest.raises(SystemExit, match=r"vocabulary of 512 tokens .* --tokenizer PATH"):
        main(["finetune", "--model", str(small), "--output-dir", str(tmp_path / "o")])
    figures = tmp_path / "figures.json"
    assert main(["finetune", "--model", str(fits), "--steps", "1", "--samples", "8", "--max-length", "64",
                 "--batch-size", "2", "--no-varlen", "--output-dir", str(tmp_path / "run"), "--json",
                 str(figures)]) == 0
    (run,) = json.loads(figures.read_text())
    assert len(run["losses"]) == 1 and run["losses"][0] > 0


def _time_in_a_collective_after_rank_1_sleeps(rank, world):
    import time

    import torch
    import torch.distributed as dist

    from slipstream.cluster.worker import least

    dist.barrier()  # both leave it together
    if rank == 1:
        time.sleep(1.0)  # rank 1's compute runs late: rank 0 waits for it inside the collective
    t0 = time.perf_counter()
    dist.all_reduce(torch.ones(4))
    mine = time.perf_counter() - t0
    return mine, least({"s": [mine, 2.0 * rank]})["s"]


def test_least_of_any_rank_is_the_collective_time_of_the_rank_that_arrived_last():
    from _dist import run_ranks

    (t0, least0), (t1, least1) = run_ranks(_time_in_a_collective_after_rank_1_sleeps, 2)
    assert least0 == least1 == [min(t0, t1), 0.0]  # per step, the least over the ranks
    assert t0 >= 0.9 and least0[0] == t1 < t0 - 0.5  # rank 0 waited; the late rank did not
