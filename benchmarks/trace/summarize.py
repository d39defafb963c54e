"""Where a ZeRO-1/2 step's waits fall, from the probe's files (``sitecustomize.py``):
``python benchmarks/trace/summarize.py <folder>``.

Per rank and step (from one backward's start to the next's, the first and last steps left
out): the backward's wall time and the training thread's waits inside it (the first bucket's
wait, within 1 s of the backward's start, apart: the ranks' skew), the waits between the
backward's end and the first parameter all-gather issued (the last buckets, the optimizer),
and the waits from there to the next backward (the next forward waiting for its parameters);
then each column's median, and the bytes and run time of each kind a step.
"""

import glob
import json
import os
import statistics
import sys


def main(folder: str) -> None:
    rows, kinds = [], {}
    for path in sorted(glob.glob(os.path.join(folder, "rank*.jsonl"))):
        rank = os.path.basename(path)[4:].split("-")[0]
        events = [json.loads(line) for line in open(path)]
        backwards = [e for e in events if e["ev"] == "backward"]
        waits = [e for e in events if e["ev"] == "wait" and e["th"] == "MainThread"]
        gathers = [e["t"] for e in events if e["ev"] == "issue" and e["kind"] == "all_gather"]
        for e in events:
            if e["ev"] == "run":
                k = kinds.setdefault(e["kind"], [0, 0, 0.0])
                k[0], k[1], k[2] = k[0] + 1, k[1] + e["n"], k[2] + e["t1"] - e["t0"]

        def waited(lo, hi, cond=lambda e: True):
            return sum(e["t1"] - e["t0"] for e in waits if lo <= e["t0"] < hi and cond(e))

        for i in range(1, len(backwards) - 1):
            b, following = backwards[i], backwards[i + 1]
            issued = min([t for t in gathers if b["t1"] <= t < following["t0"]], default=following["t0"])
            rows.append({"rank": rank, "step": i, "step_s": following["t0"] - b["t0"],
                         "backward_s": b["t1"] - b["t0"], "waits_in_backward_s": waited(b["t0"], b["t1"]),
                         "of_it_first_bucket_s": waited(b["t0"], b["t1"], lambda e: e["t0"] - b["t0"] < 1.0
                                                        and e["t1"] - e["t0"] > 0.3),
                         "backward_end_to_gather_s": issued - b["t1"],
                         "waits_there_s": waited(b["t1"], issued),
                         "forward_waits_for_parameters_s": waited(issued, following["t0"])})
    if not rows:
        raise SystemExit(f"no steps in {folder}: was SS_TRACE_DIR set and the probe on PYTHONPATH?")
    names = list(rows[0])[2:]
    print("| rank | step | " + " | ".join(names) + " |")
    print("|---|---|" + "---:|" * len(names))
    for r in rows:
        print(f"| {r['rank']} | {r['step']} | " + " | ".join(f"{r[n]:.2f}" for n in names) + " |")
    print("| median | | " + " | ".join(f"{statistics.median(r[n] for r in rows):.2f}" for n in names) + " |")
    steps = len({r["step"] for r in rows}) + 2
    ranks = len({r["rank"] for r in rows})
    for kind, (calls, nbytes, seconds) in kinds.items():
        per = ranks * steps
        print(f"{kind}: {calls / per:.1f} calls, {nbytes / per / 1e6:.1f} MB in, {seconds / per:.2f} s run a rank a step")


if __name__ == "__main__":
    main(sys.argv[1])
