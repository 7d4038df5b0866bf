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
