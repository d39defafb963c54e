"""``python -m slipstream.cluster``: the measured throughput of a 2-node emulated cluster
(root needed), one line per number of parallel flows: ``--link``, ``--per-connection-rate``."""

from __future__ import annotations

import argparse

from .emulated import ClusterSpec, EmulatedCluster


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m slipstream.cluster")
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--per-connection-rate", default=None)
    parser.add_argument("--mib", type=int, default=32)
    args = parser.parse_args()
    spec = ClusterSpec(nodes=2, link=args.link, per_connection_rate=args.per_connection_rate)
    with EmulatedCluster(spec) as cluster:
        port = spec.capped_ports.start if spec.per_connection_rate else 5201
        for flows in (1, 2, 4):
            bps = cluster.measure_throughput(nbytes=args.mib << 20, flows=flows, port=port)
            print(f"link {spec.link} per-connection {spec.per_connection_rate}: {flows} flow(s) "
                  f"{bps / 1e6:.1f} Mbit/s ({bps / spec.link_bps:.1%} of the link)")


if __name__ == "__main__":
    main()
