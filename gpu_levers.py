"""The device check of the trainer's levers (issue 60): one call, about 6 minutes on one H100, every result
appended to a JSON file as it comes (a variant that runs out of memory or fails is recorded so, and the next
one runs).

1. Attention kernels at 16k tokens (Qwen3-1.7B's heads): SDPA's cuDNN and flash kernels and torch's varlen
   flash kernel, TFLOP/s forward and backward.
2. The 1.7B step, 4 x (1,024 + 15,360) in rows of their own, as the trainer ran it before issue 60 (the output
   layer in checkpointed chunks of 2^26 logits), then each lever stacked on the last: the fused output layer
   (output_layer.py), then the run's flags, set up by the run's own compute.set_up_compute: each decoder layer
   compiled (--compile), bf16 compute through FSDP2's MixedPrecisionPolicy (--fsdp on one GPU), selective
   activation checkpointing (--activation-checkpointing selective: the matrix products' and attention's
   outputs saved), none. Each line: seconds, MFU, peak memory, loss, and the largest log-prob difference
   from the first variant.
3. A batch of varied lengths (1.7B, G 8, completions of 512 to 15,360 tokens) as rows with the padding at
   position 0 (before issue 60), rows with the positions continued, and packed; then the constants of a cost
   model (seconds a token and a pair of attention) fitted for rows and for packed from the equal and the
   varied batch.

Run:  python gpu_levers.py [--output levers.json]
CPU dry run (tiny shapes, every line):  python gpu_levers.py --tiny
"""

import argparse, contextlib, functools, json, os, subprocess, sys, time

import torch
import torch.distributed as dist

import async_grpo as ag
import bench
import compute
import mfu
import output_layer
import vllm_server

SHAPES = {
    "gpu": dict(
        bench.TRAINER_SHAPES["qwen3-1.7b"], group=4, prompt=1024, new=15360, varied=(512, 15360), attention=16384
    ),
    "tiny": dict(bench.TRAINER_SHAPES["tiny"], head_dim=64, group=4, prompt=48, new=64, varied=(8, 64), attention=256),
}
# the levers, each stacked on those before it
LEVERS = ["as before", "fused output layer", "compiled layers", "bf16 MixedPrecisionPolicy", "selective checkpointing"]
LEVERS += ["no checkpointing"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a dry run of every line on the CPU")
    p.add_argument("--output", default="levers.json", help="the JSON file the results are appended to")
    p.add_argument("--reps", type=int, default=None, help="timed steps a variant (after one warm-up; 2, tiny 1)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES["tiny" if args.tiny or device.type == "cpu" else "gpu"]
    reps = args.reps or (1 if args.tiny else 2)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ag.HERE)
    results = {
        "device": bench.device_name(device),
        "torch": torch.__version__,
        "commit": commit.stdout.strip() or None,
        "peak_flops": mfu.peak_flops(device)[0],
        "shape": shape,
        "lines": [],
    }

    def record(line):
        results["lines"].append(line)
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps(line), flush=True)

    # FSDP2 needs a process group: one rank
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(vllm_server.free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    for kernel in ("cudnn", "flash", "varlen"):
        record(guarded(f"attention {kernel}", attention_rate, kernel, shape, device))
    new = (shape["new"], shape["new"] + 1)
    samples = bench.random_samples(shape["group"], shape["vocab"], shape["prompt"], new)
    first = None
    for i, lever in enumerate(LEVERS):
        line = guarded(lever, lever_step, LEVERS[: i + 1], shape, samples, device, reps, first)
        first = first if first is not None else line.pop("logprobs", None)
        line.pop("logprobs", None)
        record(line)
    varied = bench.random_samples(8, shape["vocab"], shape["prompt"], shape["varied"])
    fits = {}
    for layout in ("rows, padding at position 0", "rows, positions continued", "packed"):
        line = guarded(layout, layout_step, layout, shape, varied, device, reps)
        record(line)
        equal = guarded(f"{layout}, equal lengths", layout_step, layout, shape, samples, device, reps)
        record(equal)
        fits[layout] = fit(line, equal)
    record({"name": "cost model constants", **fits})
    dist.destroy_process_group()


def guarded(name, fn, *args):
    """fn's line, or what stopped it: out of memory (the memory freed) or another error, one line."""
    try:
        return {"name": name, **fn(*args)}
    except torch.OutOfMemoryError:
        return {"name": name, "error": "out of memory"}
    except Exception as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"{name}: {error}", file=sys.stderr, flush=True)
        return {"name": name, "error": error}
    finally:
        # a compiled variant's code and its guards go with it
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def attention_rate(kernel, shape, device):
    """TFLOP/s of causal attention over shape["attention"] tokens, forward and backward (4 and 8 FLOPs a
    pair a head a head dimension, mfu.py's count)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn

    T, heads, kv, d = shape["attention"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, heads, T, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv, T, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv, T, d, device=device, dtype=dtype, requires_grad=True)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)

    def forward():
        if kernel == "varlen":
            flat = [x[0].transpose(0, 1) for x in (q, k, v)]
            return varlen_attn(*flat, cu, cu, T, T, window_size=(-1, 0), enable_gqa=True)
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[kernel]
        # the flash kernel takes no grouped heads: K and V repeated for it, as SDPA would do for the math
        # kernel
        kk, vv = (k, v) if kernel == "cudnn" else (x.repeat_interleave(heads // kv, 1) for x in (k, v))
        attend = torch.nn.functional.scaled_dot_product_attention
        with sdpa_kernel(backend):
            return attend(q, kk, vv, is_causal=True, enable_gqa=True)

    grad = None
    forward_s, backward_s = [], []
    for _ in range(4):  # one warm-up
        t0 = clock(device)
        out = forward()
        t1 = clock(device)
        grad = torch.randn_like(out) if grad is None else grad
        out.backward(grad)
        forward_s.append(t1 - t0)
        backward_s.append(clock(device) - t1)
    flops = mfu.causal_pairs(0, T) * heads * d
    return {
        "tokens": T,
        "forward_tflops": 4 * flops / min(forward_s[1:]) / 1e12,
        "backward_tflops": 8 * flops / min(backward_s[1:]) / 1e12,
    }


def clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def build(shape, device, levers):
    """The model of the shape (random weights, seed 0: every variant the same), set up as a run sets it
    up (compute.set_up_compute) with the flags of the levers: --activation-checkpointing, --compile,
    --fsdp on one GPU (the bf16 MixedPrecisionPolicy)."""
    from transformers import Qwen3ForCausalLM

    config = bench.trainer_config(shape, positions=shape["prompt"] + 2 * shape["new"])
    torch.manual_seed(0)
    with device:
        model = Qwen3ForCausalLM(config)
    checkpointing = "selective" if "selective checkpointing" in levers else "full"
    flags = argparse.Namespace(
        lora_rank=0,
        activation_checkpointing="none" if "no checkpointing" in levers else checkpointing,
        compile="compiled layers" in levers,
        fsdp="bf16 MixedPrecisionPolicy" in levers,
    )
    return compute.set_up_compute(model, flags, device)


def before_output_layer(hidden, head, targets, stop_masked, scale, softcap, chunk, **sampling):
    """The output layer as token_logprobs ran it before issue 60: chunks of 2^26 logits,
    each under torch.utils.checkpoint (its forward, entropy included, again in backward),
    the head's weight cast in each."""
    rows = max(1, 2**26 // head.out_features)

    def part(h, t, s):
        logits = head(h).float() * (1.0 if softcap else scale)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return output_layer.sampler_logprobs(logits, t, stop_masked=s, **sampling)

    parts = zip(hidden.split(rows), targets.split(rows), stop_masked.split(rows))
    if len(hidden) > rows:
        part = functools.partial(torch.utils.checkpoint.checkpoint, part, use_reentrant=False)
    return [torch.cat(x) for x in zip(*[part(*p) for p in parts])]


@contextlib.contextmanager
def patched(levers, positions_at_zero=False):
    """What was before issue 60 and is not in the model: the output layer (unless fused), and collate's
    padding at position 0. The bf16 policy keeps the run's autocast, as a run does (on bf16 weights a
    matrix product casts nothing)."""
    real = (ag.chunked_logprobs, ag.collate)
    if "fused output layer" not in levers:
        ag.chunked_logprobs = before_output_layer
    if positions_at_zero:

        def collate(samples, *a, **kw):
            batch = real[1](samples, *a, **kw)
            if not kw.get("packed") and not kw.get("share", True):
                for r, s in enumerate(samples):
                    batch["position_ids"][r, len(s["ids"]) :] = 0
            return batch

        ag.collate = collate
    try:
        yield
    finally:
        ag.chunked_logprobs, ag.collate = real


def lever_step(levers, shape, samples, device, reps, first):
    model = build(shape, device, levers)
    with patched(levers):
        line = measured(model, samples, ["--no-share-prefix"], reps, packed=False, share=False)
    if first is not None and "logprobs" in line:
        line["largest_logprob_difference"] = (line["logprobs"] - first).abs().max().item()
    return line


def layout_step(layout, shape, samples, device, reps):
    model = build(shape, device, ["fused output layer"])
    packed = layout == "packed"
    if packed:
        ag.segments_refused(model, ag.probe_logprobs)
    flags = [] if packed else ["--no-share-prefix"]
    with patched(["fused output layer"], positions_at_zero="position 0" in layout):
        line = measured(model, samples, flags, reps, packed=packed, share=packed)
    line.pop("logprobs", None)
    # what the cost model counts: tokens forwarded (rows: padding included) and pairs of attention
    if packed:
        line["pairs"] = mfu.attention_pairs(samples, share=True)[0]
    else:
        longest = max(len(s["ids"]) for s in samples)
        line["tokens"] = longest * len(samples)
        line["pairs"] = len(samples) * mfu.causal_pairs(0, longest)
    return line


def measured(model, samples, flags, reps, packed, share):
    """bench.step_cost's line (seconds, peak memory, loss, tokens), MFU, and the log-probs of the
    completions (under the step's autocast) for the difference between variants."""
    config = model.config
    line = bench.step_cost(model, samples, flags, reps, packed=packed)
    flops = mfu.step_flops(config, samples, share=share, tokens=line["tokens"])[0]
    device = next(model.parameters()).device
    line["mfu"] = flops / line["seconds"] / mfu.peak_flops(device)[0]
    logprobs = []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for s in samples:
            batch = ag.collate([s], 0, device, config=config, share=share, packed=packed)
            logprobs.append(ag.token_logprobs(model, batch)[0][0].float())
    line["logprobs"] = torch.cat(logprobs)
    return line


def fit(varied, equal):
    """(seconds a token, seconds a pair) from two lines: t = a tokens + b pairs."""
    if "error" in varied or "error" in equal:
        return None
    matrix = torch.tensor(
        [[varied["tokens"], varied["pairs"]], [equal["tokens"], equal["pairs"]]], dtype=torch.float64
    )
    a, b = torch.linalg.solve(
        matrix, torch.tensor([varied["seconds"], equal["seconds"]], dtype=torch.float64)
    ).tolist()
    return {"seconds_a_token": a, "seconds_a_pair": b}


if __name__ == "__main__":
    sys.exit(main())
