"""``autotune discover``: write the cluster file of the machines it runs on (``autotune.discover``)."""

from __future__ import annotations

from pathlib import Path


def run(output: Path, name: str) -> int:
    import yaml
    from rich.console import Console
    from rich.markup import escape

    from autotune import discover, prechecks
    from autotune.loading import load_cluster

    distributed = discover.under_torchrun()
    rank0 = not distributed or __import__("os").environ.get("RANK", "0") == "0"
    if rank0:
        prechecks.writable_file(output, "--output")
    console = Console(stderr=True, highlight=False)
    if rank0:
        console.print("measuring this machine" + (" and its links to the others" if distributed else "") + " ...")
    doc = discover.discover_distributed(name) if distributed else discover.discover_local(name)
    if doc is None:  # not rank 0 of a torchrun job: rank 0 writes
        return 0
    header = "# written by `autotune discover`; measured links, catalog or measured GPUs (docs/formats.md)\n"
    output.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    cluster = load_cluster(output)  # the file loads as written
    for node in cluster.nodes:
        console.print(
            escape(
                f"{node.name}: {node.count} x {node.device.name}, intra-node {node.intra_node.bandwidth_GBps:.2f} GB/s "
                f"{node.intra_node.latency_us:.0f} us"
                + (f", network {node.network.bandwidth_GBps:.2f} GB/s" if len(cluster.nodes) > 1 else "")
            )
        )
    console.print(escape(f"cluster file written to {output} ({cluster.num_devices} devices)"))
    return 0
