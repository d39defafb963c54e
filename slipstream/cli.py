"""The ``slipstream`` command line.

Subcommands live in a table; each names a module, imported only when chosen, that provides
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# words of the subcommand -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("bench", "comm"): ("slipstream.bench.comm", "collectives: slipstream vs the stock backend"),
    ("bench", "varlen"): ("slipstream.bench.varlen", "one training step: padded vs varlen"),
    ("bench", "ddp"): ("slipstream.bench.ddp", "DDP training: slipstream backend vs gloo"),
    ("bench", "transport"): ("slipstream.bench.transport", "inter-node transport: K connections vs 1"),
    ("bench", "megatron"): ("slipstream.bench.megatron", "megatron-core GPT: gloo vs slipstream, padded vs packed"),
    ("bench", "soak"): ("slipstream.bench.soak", "mixed collectives and groups vs gloo, resources watched"),
    ("bench", "loader"): ("slipstream.bench.loader", "collation hidden behind the step by AsyncLoader"),
    ("bench", "compile"): ("slipstream.bench.compile",
                           "slipstream.compile's choice vs eager on ResNet-50, BERT, llama varlen"),
    ("bench", "gpu"): ("slipstream.bench.gpu", "the GPU check: stream races, staged comm, varlen, compile, GPU tests"),
    ("finetune",): ("slipstream.recipes.finetune", "fine-tune a causal LM with DeepSpeed ZeRO or FSDP2 (+ slipstream)"),
    ("tune",): ("slipstream.commands.tune", "measure and cache the best algorithm per size"),
    ("env",): ("slipstream.commands.env", "this machine: topology, fast paths, tuned plan, versions"),
}


def _usage() -> str:
    rows = [f"  slipstream {' '.join(words):<16} {help_}" for words, (_, help_) in COMMANDS.items()]
    return ("usage: slipstream COMMAND [options] | slipstream --version\n\ncommands:\n" + "\n".join(rows)
            + "\n\nIn a job, slipstream.status() says what slipstream does there.\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for words, (module_name, help_) in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(argv[: len(words)]) == words:
            module = importlib.import_module(module_name)
            parser = argparse.ArgumentParser(prog="slipstream " + " ".join(words), description=help_)
            module.add_arguments(parser)
            return int(module.run(parser.parse_args(argv[len(words):])) or 0)
    if argv[:1] in (["--version"], ["-V"]):
        from importlib import metadata

        sys.stdout.write(f"slipstream {metadata.version('slipstream')}\n")
        return 0
    sys.stdout.write(_usage())
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
