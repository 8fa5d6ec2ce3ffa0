"""Model FLOPs utilisation of a training step: the FLOPs its tokens need, counted from the model's config,
over what the device can do. async_grpo.py logs it (perf/mfu, perf/tokens_per_second); bench.py --trainer
prints it.

The count is the usual one (PaLM's appendix B, prime-rl's and TRL's logs): 6 FLOPs a parameter a token
forwarded (2 in the forward, 4 in the backward; 4 in all with LoRA, whose frozen weights get no gradient), and
per layer 12 x heads x head_dim a (query, key) pair that causal attention computes (the two matmuls, 2 FLOPs a
multiply-add, forward and twice backward). The output layer runs on the completions' tokens alone
(token_logprobs). Recomputation (gradient checkpointing, the output layer's chunks) is not counted: it is work
the device does that the model does not need.

The peak: a GPU's dense bf16 peak from its data sheet (PEAKS), else the rate of a large matmul measured
once on the device (bf16 on a GPU, fp32 on the CPU, where the trainer computes in fp32), labelled as
measured."""

import time

import torch

# dense bf16 tensor-core peaks (no sparsity), FLOP/s, by what torch.cuda.get_device_name() contains; the first
# match
PEAKS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200 NVL", 835e12),
    ("H200", 989.4e12),  # SXM
    ("H800", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
]
MEASURED = {}  # device -> (FLOP/s, label): measured once per process


def peak_flops(device):
    """(FLOP/s, label): the device's bf16 peak from PEAKS, or a matmul rate measured once (the label says
    which)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for part, flops in PEAKS:
            if part in name:
                return flops, f"{name}, dense bf16 peak of its data sheet"
    if str(device) not in MEASURED:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        flops = matmul_rate(device, dtype)
        MEASURED[str(device)] = (
            flops,
            f"{device.type}: {str(dtype)[6:]} matmul measured ({torch.get_num_threads()} threads)",
        )
    return MEASURED[str(device)]


def matmul_rate(device, dtype, n=None, reps=5):
    """The best FLOP/s of reps n x n matmuls, after one warm-up (n: 8192 on a GPU, 1024 on the CPU)."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def causal_pairs(start, end, window=None):
    """The (query, key) pairs causal attention computes for queries at positions start..end - 1 (each sees
    itself and what precedes it, at most `window` keys)."""

    def upto(x):  # pairs of queries 0..x - 1
        if window is None or x <= window:
            return x * (x + 1) // 2
        return window * (window + 1) // 2 + (x - window) * window

    return upto(end) - upto(start)


def weights_per_token(config):
    """(multiply-adds a token in the decoder layers' weights, in the output layer's) from a transformers
    text config: q, k, v, o and a gated MLP (gate, up, down) a layer; a mixture of experts counts the
    experts a token goes through."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    experts = getattr(config, "num_experts_per_tok", None)
    ffn = getattr(config, "moe_intermediate_size", None) if experts else None
    mlp = 3 * hidden * (ffn * experts if ffn else config.intermediate_size)
    return (attention + mlp) * config.num_hidden_layers, hidden * config.vocab_size


def attention_pairs(samples, share=True, window=None):
    """(query, key) pairs a layer's causal attention computes over `samples` ({'ids', 'n_prompt'}), at most
    `window` keys a query: where `share`, a prompt once and each completion after it (collate's layouts),
    else each sequence whole. Returns (pairs, tokens forwarded, completion tokens)."""
    prompts = set()
    pairs = 0
    forwarded = 0
    completions = 0
    for s in samples:
        n = s["n_prompt"]
        total = len(s["ids"])
        key = tuple(s["ids"][:n])
        if not share or key not in prompts:
            prompts.add(key)
            pairs += causal_pairs(0, n, window)
            forwarded += n
        pairs += causal_pairs(n, total, window)
        forwarded += total - n
        completions += total - n
    return pairs, forwarded, completions


def step_flops(config, samples, share=True, lora=False, tokens=None):
    """FLOPs of a training step on `samples` (every rank's), counted from the model's `config` (a
    transformers text config) for the layout `share` says (attention_pairs). tokens: the tokens forwarded
    if known (train/tokens: the micro-batches may forward a prompt more than once), else attention_pairs'
    count. Returns (FLOPs, tokens)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None)
    every = "sliding_attention" if window else "full_attention"  # a window without layer types: every layer's
    types = getattr(config, "layer_types", None) or [every] * config.num_hidden_layers
    layers, head = weights_per_token(config)
    per_weight = 4 if lora else 6  # LoRA's frozen weights get no gradient: 2 FLOPs forward, 2 backward
    full, forwarded, completions = attention_pairs(samples, share)
    sliding = attention_pairs(samples, share, window)[0] if window else full
    tokens = forwarded if tokens is None else tokens
    flops = per_weight * (layers * tokens + head * completions)
    flops += sum(12 * heads * head_dim * (sliding if t == "sliding_attention" else full) for t in types)
    return flops, tokens


def step_metrics(config, samples, seconds, device, world_size=1, share=True, lora=False, tokens=None):
    """perf/tokens_per_second (tokens forwarded a second of training, every rank's), perf/mfu (the step's
    FLOPs over `seconds` x world_size x the peak) and perf/peak_flops, for metrics.jsonl."""
    flops, tokens = step_flops(config, samples, share, lora, tokens)
    peak = peak_flops(device)[0]
    return {
        "perf/tokens_per_second": tokens / seconds,
        "perf/mfu": flops / (seconds * world_size * peak),
        "perf/peak_flops": peak,
    }
