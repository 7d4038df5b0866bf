"""The model the simulator's hand-computed tests share: Korthikanti et al. 2022's setting."""

# GPT-shaped (f = 4h, no GQA, GeLU) so the published formulas apply verbatim; 16-bit, scores stored and
# dropout on, as in Korthikanti et al. 2022
GPT = dict(
    name="gpt",
    num_layers=8,
    hidden_size=256,
    num_heads=8,
    ffn_hidden_size=1024,
    mlp="gelu",
    vocab_size=512,
    seq_len=128,
    global_batch_size=16,
    precision="bf16",
    attention="standard",
    dropout=0.1,
)
FAST = 1e15  # GB/s: a link or memory so fast its time vanishes


def two_nodes(network_GBps: float):  # the error-bar, posterior and chooser tests
    """Two nodes of one A100-80GB each (``a:0``, ``b:0``) joined by ``network_GBps``."""
    from autotune.loading import cluster_from_dict

    node = {"gpu": "A100-80GB", "count": 1, "intra_node": {"bandwidth_GBps": 300, "latency_us": 2}}
    net = {"bandwidth_GBps": network_GBps, "latency_us": 20}
    return cluster_from_dict(
        {
            "name": "two",
            "nodes": [{**node, "name": "a", "network": net}, {**node, "name": "b", "network": net}],
            "network": net,
        },
        "two",
    )
