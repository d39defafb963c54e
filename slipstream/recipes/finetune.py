"""``slipstream finetune``: fine-tune a causal LM on alpaca-format data with DeepSpeed ZeRO.

With no arguments: the project's generated dataset, a tiny Llama-architecture model (random
init), 2 local ranks, ZeRO-2, slipstream on. ``--compare`` runs stock DeepSpeed and
DeepSpeed + slipstream on the same data and seed and prints them side by side.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..cluster import ClusterSpec
from ..cluster.worker import flags, launch_worker
from ..core_comm.config import WIRE_FORMATS

WORKERS = {"deepspeed": "slipstream.recipes._deepspeed_worker", "fsdp": "slipstream.recipes._fsdp_worker"}
# What each stack's ranks import besides their modules' top-level imports (once per node where
# the launcher forks the ranks; about 6 s of CPU a rank on 2 cores)
_PRELOAD = {"deepspeed": ("transformers.models.llama.modeling_llama", "deepspeed"),
            "fsdp": ("transformers.models.llama.modeling_llama", "torch.distributed.fsdp")}
# Options handed to every rank unchanged
_PASSED = ("model", "tokenizer", "data", "samples", "max_length", "steps", "zero", "batch_size", "grad_accum", "lr",
           "seed", "config", "output_dir")


def add_arguments(p) -> None:
    p.add_argument("--model", default="llama-tiny",
                   help="a config name (llama-tiny, llama-20m, llama-60m, llama-125m, ...) or a local Hugging Face "
                        "model directory")
    p.add_argument("--tokenizer", help="local tokenizer path (default: the model directory's own; else one "
                   "built locally, which a model without a tokenizer takes where its vocabulary fits it)")
    p.add_argument("--data", default=None, help="alpaca-format JSON (default: a generated dataset)")
    p.add_argument("--samples", type=int, default=400, help="samples to generate when --data is not given")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--nodes", type=int, default=1, help="emulated nodes (network namespaces; needs root)")
    p.add_argument("--link", default=None, help="rate of each emulated node's link, e.g. 1gbit")
    p.add_argument("--pin-nodes", action="store_true",
                   help="run each emulated node's ranks on their own share of the CPUs (taskset)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stack", choices=tuple(WORKERS), default="deepspeed",
                   help="deepspeed: DeepSpeed ZeRO (default); fsdp: PyTorch FSDP2 (fully_shard per decoder layer)")
    p.add_argument("--hsdp", action="store_true",
                   help="with --stack fsdp: a 2-D mesh, shard inside a node and replicate across nodes "
                        "(with --compare: stock full sharding, stock HSDP and slipstream HSDP)")
    p.add_argument("--no-varlen", action="store_true", help="slipstream's collectives only (no padding removal)")
    p.add_argument("--wire", choices=WIRE_FORMATS, default=None,
                   help="slipstream runs: the cross-node format of gradients and gathered parameters "
                        "(lossy; default: the config's, full precision); --compare then shows the loss drift")
    p.add_argument("--compile", action="store_true", help="slipstream runs: the compile strategy chosen by "
                   "measurement on the first steps (slipstream.compile)")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default=None,
                   help="DeepSpeed JSON (default: the packaged slipstream/configs/zero<N>.json)")
    p.add_argument("--output-dir", default="out/finetune")
    p.add_argument("--no-slipstream", action="store_true", help="stock DeepSpeed only")
    p.add_argument("--compare", action="store_true", help="stock DeepSpeed vs DeepSpeed + slipstream")
    p.add_argument("--plot", default=None, help="PNG of the comparison (default: <output-dir>/compare.png)")
    p.add_argument("--json", default=None, help="write the figures of every run here")
    p.add_argument("--timeout", type=float, default=3600)


def validate(args) -> None:
    """Refuse here, before any rank starts, what the ranks would refuse later: bad settings,
    data and config files, named."""
    from ..config import SlipstreamConfig
    from .alpaca import AlpacaFormatError, load_alpaca
    from .model import context_length
    from .tokenizer import tokenizer_source

    for name in ("steps", "batch_size", "grad_accum", "nproc", "nodes", "max_length", "samples"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        tokenizer_source(args.model, args.tokenizer)  # a model directory without one: the built one, if it fits
    except ValueError as e:
        raise SystemExit(str(e)) from None
    context = context_length(args.model)
    if context is not None and args.max_length > context:
        raise SystemExit(f"--max-length {args.max_length} is above the context of model {args.model!r} ({context})")
    per_step = args.batch_size * args.grad_accum * args.nproc * args.nodes
    records = load_alpaca(args.data) if args.data is not None else range(args.samples)
    if len(records) < per_step:
        where = args.data if args.data is not None else "--samples"
        raise AlpacaFormatError(f"{where}: {len(records)} records, fewer than one step needs ({per_step} = "
                                f"--batch-size x --grad-accum x ranks)")
    if args.stack != "fsdp" and args.hsdp:
        raise SystemExit("--hsdp goes with --stack fsdp")
    if args.hsdp and args.nodes < 2:
        raise SystemExit("--hsdp needs --nodes >= 2 (it replicates across nodes)")
    if args.config is not None and args.stack == "fsdp":
        raise SystemExit("--config is a DeepSpeed JSON: it goes with --stack deepspeed")
    if args.config is not None:
        path = Path(args.config)
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SystemExit(f"--config {path}: not a readable JSON file ({e})") from None
        if not isinstance(config, dict):
            raise SystemExit(f"--config {path}: expected a JSON object, got {type(config).__name__}")
        SlipstreamConfig.from_dict(config.get("slipstream", {}), where=f"{path}: slipstream")
    else:
        SlipstreamConfig.from_dict({})  # the SLIPSTREAM_* environment the ranks will read


def run(args) -> int:
    validate(args)
    spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.nproc, link=args.link, pin_nodes=args.pin_nodes)
    results = {key: _launch(args, impl, spec, hsdp) for key, impl, hsdp in _runs(args)}
    _link_bound(results, spec)
    for r in results.values():
        _print_summary(r)
    if args.compare:
        print(compare_table(results["stock"], results["slipstream"], peer=results.get("stock-hsdp")))
        plot = Path(args.plot or Path(args.output_dir) / "compare.png")
        write_plot(results["stock"], results["slipstream"], plot)
        print(f"plot: {plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(list(results.values()), indent=2) + "\n")
    return 0


def _runs(args) -> list[tuple[str, str, bool]]:
    """(key, impl, hsdp) of each job to launch. HSDP is compared with stock full sharding, the
    layout a stock user has, and with stock HSDP, the peer the same mesh gives without us."""
    hsdp = args.hsdp
    if not args.compare:
        impl = "stock" if args.no_slipstream else "slipstream"
        return [(impl, impl, hsdp)]
    return [("stock", "stock", False)] + [("stock-hsdp", "stock", True)] * hsdp + [("slipstream", "slipstream", hsdp)]


def result_file(output_dir, impl: str, hsdp: bool = False) -> Path:
    """Where the ranks of ``impl`` (on an HSDP mesh or not) write their summary."""
    return Path(output_dir) / f"{impl}{'-hsdp' * hsdp}.json"


def _launch(args, impl: str, spec: ClusterSpec, hsdp: bool = False) -> dict:
    argv = ["--impl", impl]
    if args.stack == "fsdp":
        argv += ["--hsdp"] * hsdp
    argv += flags(args, "compile", "no_varlen", *_PASSED)
    out = result_file(args.output_dir, impl, hsdp)
    out.unlink(missing_ok=True)
    env = {"SLIPSTREAM_WIRE": args.wire} if args.wire and impl == "slipstream" else None
    result = launch_worker(WORKERS[args.stack], argv, spec, env=env, timeout=args.timeout, out=out,
                           preload=_PRELOAD[args.stack])
    result["wire"] = (args.wire or "full") if impl == "slipstream" else "full"
    return result


def _link_bound(results: dict, spec: ClusterSpec) -> None:
    """Each run's cross-node bound per step: the bytes slipstream's run sent out of a node
    (the least that must cross; stock moves the same data) at the link's rate."""
    sent = [r["link_bytes_per_node"] for r in results.values() if r["impl"] != "stock" and r["link_bytes_per_node"]]
    for r in results.values():
        r["link_bound_s"] = sent[0] * 8 / spec.link_bps if sent and spec.nodes > 1 and spec.link else None
        if r["impl"] == "stock" and any(o.get("wire", "full") != "full" for o in results.values()):
            r["link_bound_s"] = None  # stock's bytes are full precision: not the lossy run's


def _print_summary(r: dict) -> None:
    what = r.get("stack", "").upper() if r.get("stack") else f"ZeRO-{r['zero']}"
    print(
        f"\n[{r['impl']}] {what}, {r['steps']} steps: {r['tokens_per_s']:.0f} real tokens/s, "
        f"step {r['step_time_s']:.3f} s (communication {r['comm_time_s']:.3f} s, exposed {r['exposed_comm_s']:.3f} s), "
        f"padding removed {100 * r['padding_removed']:.0f}%, final loss {r['final_loss']:.4f}, "
        f"peak memory {r['peak_mem_mb']:.0f} MiB"
        + (f" (the core's buffers {r['core_buffers_mb']:.0f} MiB)" if r.get("core_buffers_mb") is not None else "")
        + (f"\ncheckpoint: {r['checkpoint']}" if r["checkpoint"] else "")
        + (f"\n{r['overlap']}" if r.get("overlap") else "")
    )


def _stack_name(r: dict) -> str:
    return {"fsdp2": "FSDP2", "fsdp2-hsdp": "HSDP"}.get(r.get("stack"), "DeepSpeed")


def compare_table(stock: dict, ours: dict, peer: dict | None = None) -> str:
    """Stock against slipstream (and a stock peer, e.g. stock HSDP, when given): each row's
    figures and slipstream's ratio to each stock run (> 1 is better)."""
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(stock["losses"], ours["losses"])]
    rows = [
        ("real tokens/s", "tokens_per_s", "{:.0f}"),
        ("step time (s)", "step_time_s", "{:.3f}"),
        ("compute (s)", "compute_s", "{:.3f}"),
        ("  slowest rank", "compute_slowest_s", "{:.3f}"),
        ("  fastest rank", "compute_fastest_s", "{:.3f}"),
        ("in collectives (s)", "comm_time_s", "{:.3f}"),
        ("  least of any rank", "comm_least_s", "{:.3f}"),
        ("exposed comm (s)", "exposed_comm_s", "{:.3f}"),
        ("link bound (s)", "link_bound_s", "{:.3f}"),
        ("peak memory (MiB)", "peak_mem_mb", "{:.0f}"),
        ("  core's buffers", "core_buffers_mb", "{:.0f}"),
        ("final loss", "final_loss", "{:.6f}"),
    ]
    bases = [stock] + ([peer] if peer is not None else [])
    ours_name = "+ slipstream" if peer is None else f"{_stack_name(ours)} + slipstream"
    heads = [f"{_stack_name(b):>12}" for b in bases] + [f"{ours_name:>12}"]
    heads += ["ratio" if len(bases) == 1 else f"vs {_stack_name(b)}" for b in bases]
    lines = [f"| {'':20} | " + " | ".join(f"{h:>9}" for h in heads) + " |", "|" + "---|" * (len(heads) + 1)]
    for label, key, fmt in rows:
        if ours.get(key) is None:
            continue
        cells = ["-" if r.get(key) is None else fmt.format(r[key]) for r in bases + [ours]]
        for b in bases:
            a, o = b.get(key), ours[key]
            ratio = None if a is None else o / a if key == "tokens_per_s" else (a / o if o else float("nan"))
            cells.append("-" if ratio is None else f"{ratio:.2f}x")
        lines.append(f"| {label:20} | " + " | ".join(f"{c:>{max(9, len(h))}}" for c, h in zip(cells, heads)) + " |")
    lines.append(f"\nmax per-step relative loss difference: {max(diffs):.2e} over {len(diffs)} steps")
    if ours.get("overlap"):
        lines.append(f"slipstream's {ours['overlap']}")
    if ours.get("wire", "full") != "full":
        lines.append(f"{ours['wire']} across nodes, loss drift against the lossless stock run, per step: "
                     + " ".join(f"{(b - a) / abs(a):+.1e}" for a, b in zip(stock["losses"], ours["losses"])))
    return "\n".join(lines)


def write_plot(stock: dict, ours: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    base, mine = _stack_name(stock), _stack_name(ours)
    for r, label in ((stock, base), (ours, f"{mine} + slipstream")):
        left.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label, marker="o", markersize=3)
    left.set(xlabel="step", ylabel="loss", title="loss per step")
    left.legend()
    bars = right.bar([base, f"{mine} + slipstream" if mine != base else "+ slipstream"],
                     [stock["tokens_per_s"], ours["tokens_per_s"]], color=["#888888", "#2a7ab9"])
    right.bar_label(bars, fmt="%.0f")
    right.set(ylabel="real tokens / s", title=f"throughput ({ours['tokens_per_s'] / stock['tokens_per_s']:.2f}x)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="slipstream finetune")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
