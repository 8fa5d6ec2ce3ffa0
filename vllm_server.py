"""The vLLM servers a run starts (async_grpo.py, start_generation): each a `vllm serve` process in a
process group of its own, on its share of the device plan's GPUs or on the CPU, with this file's
WeightSyncExtension as its workers' extension (the weight sync's receiving end); waited for until
healthy, watched (server_failure, watch_servers) and stopped with every process it started
(stop_vllm): none outlives a run, a test or Ctrl-C. Servers of --vllm-url are checked to be such
servers (served_config). The sync group (sync_group) where the trainer and every worker meet. And on
the CPU, the cores the trainer takes beside its server (cpu_threads, share_idle_core)."""

import contextlib, ctypes, functools, http.client as http_client, json, math, os, re, shlex
import shutil, signal, socket, subprocess, sys, tempfile, time, urllib.error, urllib.parse, urllib.request
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
# the name the servers started here serve the weights under, whatever the checkpoint
SERVED_MODEL = "policy"
# --lora-sync adapter: the name the adapter is loaded under
# (/v1/load_lora_adapter), which requests then name
SERVED_ADAPTER = "policy-adapter"
# where a server started here writes the adapter it serves (receive_adapter): an
# environment variable of its workers
ADAPTER_DIR = "ASYNC_GRPO_ADAPTER_DIR"
# the ranks vLLM takes for --max-lora-rank (vllm/config/lora.py, MaxLoRARanks)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Measured: the default run's "vLLM is up after N s" from a fresh clone and an empty home directory,
# its server eager (issue 63): 65, 67 and 74 s on 2 cores that other jobs' light work shared (a load
# of 2-4); compiled, as before, 133 s there, half of it "Warming up model for the compilation", and
# 406 s under a load of 27-44 (issue 54)
CPU_START_SECONDS = 70


def vllm_flag(args, *names):
    """The value that --vllm-args gives one of these vLLM flags ('' for a bare one), or None."""
    # "--flag value" and "--flag=value" alike: each flag, then its value
    words = [w for word in shlex.split(args.vllm_args) for w in word.split("=", 1)] + [""]
    for i, word in enumerate(words[:-1]):
        if word.replace("_", "-") in names:
            return words[i + 1]
    return None


# --- The device plan: which GPUs the trainer ranks and each server use, and the sync's backend -------


def plan_devices(args, cuda_count, local_ranks, fail, heads=None):
    """Where everything runs, decided before anything loads: the trainer ranks on
    cuda:0..local_ranks-1 or the CPU, each server started here on its share of --vllm-gpus
    or the CPU, and the sync backend: NCCL between devices, else gloo (which takes CUDA
    tensors: NCCL refuses two ranks on one device). By default a server per GPU
    (README.md, "On GPUs": why). heads: the model's (attention heads, KV heads), read
    where None. fail(message) for a bad plan."""
    url = args.vllm_url
    # the devices the trainer ranks leave free
    free = [str(d) for d in range(local_ranks, cuda_count)]
    gpus = server_gpus(args, free)
    n = args.vllm_servers or max(1, len(gpus))
    # no device free: one server shares trainer rank 0's GPU
    shared = bool(cuda_count and not url and not gpus)
    refusals = plan_refusals(args, cuda_count, local_ranks, gpus, n, shared)
    for failed, message in refusals:
        if failed:
            fail(message)
    # tensor parallel: each server on several GPUs
    if len(gpus) // n > 1:
        refuse_tensor_parallel(args, len(gpus), n, heads, fail)
    return {
        "trainer": "cuda" if cuda_count else "cpu",
        "sync_backend": "nccl" if cuda_count and not shared else "gloo",
        # as devices
        "servers": [] if url else server_devices(gpus, n, shared, cuda_count),
        # why 0.3: README.md, "On GPUs"
        "gpu_memory": args.vllm_gpu_memory or (0.3 if shared else None),
        # the server on trainer rank 0's GPU: the trainer is held to what it leaves (memory_share)
        "shared": shared,
        "cpu_server": not cuda_count and all_local(url),
    }  # tuned in start_vllm


def server_gpus(args, free):
    """The GPUs of the servers started here (as CUDA indices): --vllm-gpus, else as many of the free
    ones as --vllm-servers divides evenly; none for --vllm-url."""
    if args.vllm_gpus:
        return args.vllm_gpus.split(",")
    if args.vllm_url:
        return []
    servers = max(1, args.vllm_servers)
    return free[: len(free) // servers * servers]


def plan_refusals(args, cuda_count, local_ranks, gpus, n, shared):
    """(refused, why) for each way the plan can be wrong: plan_devices fails on
    the first refused."""
    free = [str(d) for d in range(local_ranks, cuda_count)]
    if free:
        instead = f"pass --vllm-gpus among {','.join(free)}"
    else:
        instead = "launch fewer ranks (torchrun --nproc-per-node)"
    ours = all(g.isdigit() and local_ranks <= int(g) < cuda_count for g in gpus)
    distinct = len(set(gpus)) == len(gpus)
    memory = args.vllm_gpu_memory
    return [
        (
            args.vllm_url and args.vllm_gpus,
            "--vllm-gpus places servers started here, and --vllm-url starts none: drop one",
        ),
        (
            len(gpus) % n,
            f"--vllm-servers {n} must divide the --vllm-gpus {args.vllm_gpus} evenly",
        ),
        (
            cuda_count and local_ranks > cuda_count,
            f"{local_ranks} trainer ranks on this node, {cuda_count} CUDA devices: "
            f"launch torchrun with --nproc-per-node {cuda_count} or fewer",
        ),
        (
            not ours or not distinct,
            f"--vllm-gpus {args.vllm_gpus}: not distinct CUDA devices of the {cuda_count} here "
            f"that the {local_ranks} trainer ranks leave free (NCCL refuses two ranks on one device): "
            f"{instead}, or leave --vllm-gpus out where none is free, "
            "to share trainer rank 0's GPU with one server",
        ),
        (
            shared and n > 1,
            f"--vllm-servers {n}: no device is free beside the trainer ranks, and trainer rank 0's GPU "
            f"holds one server: pass --vllm-servers 1, or {instead}",
        ),
        (
            memory is not None and not (0 < memory < 1 and (gpus or shared)),
            "--vllm-gpu-memory is a share in (0, 1) of the memory of servers started here on GPUs",
        ),
    ]


def refuse_tensor_parallel(args, gpus, n, heads, fail):
    """fail() unless n servers on `gpus` GPUs split the model's heads (read from --model where
    `heads` is None) as vLLM requires of tensor parallel."""
    # tensor parallel: each server's GPUs
    tp = gpus // n
    try:
        heads, kv_heads = heads or attention_heads(args.model)
    except Exception as e:
        error = str(e)[:200]
        fail(f"--model {args.model}: cannot read its config, which --vllm-servers {n} needs ({error})")

    if not heads_split(tp, heads, kv_heads):
        fail(
            f"--vllm-servers {n}: tensor parallel {tp} does not split the model's {heads} attention heads "
            f"and {kv_heads} KV heads (vLLM refuses it): pass --vllm-servers {gpus}, a server per GPU, "
            "or a count whose share does"
        )


def heads_split(tp, heads, kv_heads):
    """Whether tensor parallel `tp` splits a model's heads as vLLM does: the attention heads over
    the GPUs, and the KV heads or copies of each (layers/linear.py)."""
    if heads % tp:
        return False
    if kv_heads >= tp:
        return kv_heads % tp == 0
    return tp % kv_heads == 0


def server_devices(gpus, n, shared, cuda_count):
    """Each of the n servers' devices as CUDA_VISIBLE_DEVICES names them (a comma-separated string):
    its share of `gpus`, or trainer rank 0's GPU where `shared`, or none (the CPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(cuda_count)))
    physical = visible.split(",")
    if gpus:
        shares = [gpus[i * len(gpus) // n : (i + 1) * len(gpus) // n] for i in range(n)]
    else:
        shares = [["0"] * shared] * n
    return [",".join(physical[int(g)] for g in share) for share in shares]


def all_local(url):
    """Whether every server of --vllm-url (none: the ones started here) is on this machine."""
    urls = (url or "http://127.0.0.1").split(",")
    return all(urllib.parse.urlparse(u).hostname in ("127.0.0.1", "localhost") for u in urls)


def attention_heads(model):
    """(attention heads, KV heads) of --model from its config alone (a local folder's, a GGUF
    file's, the hub's); the built-in model's are tiny_model.py's."""
    from transformers import AutoConfig

    if model is None:
        return 4, 2
    gguf = {"gguf_file": Path(model).name} if model.endswith(".gguf") else {}
    source = Path(model).parent if gguf else model
    config = AutoConfig.from_pretrained(source, **gguf).get_text_config()
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def memory_share(args, total, params, trained, largest=0):
    """The share of one GPU (`total` bytes) that the trainer may take beside a server: what the
    server's share (its weights, 2 bytes a parameter, in half; its KV cache) and a margin leave (the
    worker's two buckets in flight, CUDA contexts and a reloaded layer: 1 GiB). A model that does
    not fit is refused here, with trainer_bytes' parts."""
    server = args.plan["gpu_memory"]
    share = 1 - server - (2 * args.sync_bucket_bytes + 2**30) / total
    parts = trainer_bytes(args, params, trained, largest)
    needed = sum(parts.values())
    if needed > share * total or 4 * params > server * total:
        held = ", ".join(f"{what} {n / 2**30:.1f} GiB" for what, n in parts.items() if n)
        model = f"{params / 1e9:.2f}B parameters, {trained / 1e9:.2f}B of them trained"
        weights = 2 * params / 2**30
        raise SystemExit(
            f"one GPU of {total / 2**30:.0f} GiB cannot hold both: "
            f"the trainer needs {needed / 2**30:.1f} GiB before activations ({held}; {model}) "
            f"and gets {share * total / 2**30:.1f} GiB; "
            f"vLLM's share (--vllm-gpu-memory {server}) is {server * total / 2**30:.1f} GiB, "
            f"at least twice its {weights:.1f} GiB of weights (the rest: its KV cache). "
            "Train a LoRA adapter (--lora-rank 16), a smaller model, "
            "or give vLLM a GPU of its own (--vllm-gpus)"
        )
    return share


def trainer_bytes(args, params, trained, largest=0):
    """What a training step on CUDA holds besides activations, in bytes, by part: the fp32
    weights (4 a parameter; a LoRA run's frozen base in bf16, 2: compute.set_up_compute);
    gradients and AdamW's moments (12 a trained one; fused AdamW makes no temporaries,
    foreach's would be 4 more); the --beta reference (4); without activation checkpointing
    the bf16 copy of every fp32 weight that autocast makes and autograd keeps for the
    backward (2; with it, a layer's at a time); under --fsdp (bf16 policy on one GPU)
    instead the root's gathered bf16 embeddings and head (2 x 2 x `largest`; a layer's at a
    time); and in flight the largest weight's bf16 copy and gradient and its fp32 gradient
    before it is added (8 bytes x `largest`, the output layer's parameters)."""
    kept = 2 * params * (args.activation_checkpointing == "none" and not args.lora_rank)
    return {
        "weights": (2 if args.lora_rank else 4) * params,
        "gradients and AdamW's moments": 12 * trained,
        "reference": 4 * params * bool(args.beta),
        "bf16 copies": 4 * largest if args.fsdp else kept,
        "largest weight's": 8 * largest,
    }


# --- Starting and stopping servers -----------------------------------------------------------------


def free_port():
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def start_vllm(args, model_path, out_dir):
    """Start the `vllm serve` processes of the device plan (args.plan) with WeightSyncExtension as
    their workers', each on its share of --vllm-gpus or on the CPU, and wait until all are healthy.
    Returns the processes (.url, .log_path)."""
    config = checkpoint_config(model_path)
    context = args.max_model_len or getattr(config and config.get_text_config(), "max_position_embeddings", 0)
    why = family_refused(config, args, context)
    if why:
        raise SystemExit(f"--model {model_path}: {why}")
    procs = []
    t0 = time.monotonic()
    try:
        for i in range(len(args.plan["servers"])):
            proc = launch_server(args, model_path, out_dir, i)
            procs.append(proc)
            command = shlex.join(proc.args)
            print(f"starting vLLM (pid {proc.pid}, log {proc.log_path}): {command}", flush=True)
        if args.plan["cpu_server"]:
            print(
                f"a CPU server takes a while to start (the built-in model's: ~{CPU_START_SECONDS} s "
                "on 2 cores from an empty home directory, minutes on busy ones); progress every 10 s",
                flush=True,
            )
        wait_healthy(procs, args.vllm_startup_timeout, t0)
        return procs
    # Ctrl-C included: the caller never got the handles, so stop them here
    except BaseException:
        for proc in procs:
            stop_vllm(proc)
        raise


def launch_server(args, model_path, out_dir, i):
    """Start server i of the device plan, its output appended to its log in out_dir. Returns its
    process (.url, .log_path, .log_start)."""
    plan = args.plan
    share = plan["servers"][i]
    # of each server's log and adapter folder
    suffix = "" if len(plan["servers"]) == 1 else f"-{i}"
    port = args.vllm_port + i if args.vllm_port else free_port()
    cmd = server_command(args, model_path, port, share)
    # A CPU server takes one core, whole: its worker (which busy-polls for a second after each
    # engine step) and its HTTP and engine front end, which would otherwise preempt the
    # trainer on the other cores (measured on 2 cores: async 1.15x -> 1.62x the samples/s of
    # --sync on average; --sync itself unchanged).
    cores = None
    if plan["cpu_server"] and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = {i % (os.cpu_count() or 1)}
    adapter_dir = Path(out_dir).resolve() / f"vllm-adapter{suffix}"
    env = server_env(args, share, cores, adapter_dir)
    log_path = Path(out_dir) / f"vllm{suffix}.log"
    with open(log_path, "ab") as log:
        # --resume appends to the log: what this server says begins here
        log_start = log.tell()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=functools.partial(_server_preexec, cores),
        )
    proc.log_path = log_path
    proc.log_start = log_start
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def server_env(args, share, cores, adapter_dir):
    """The environment of a server started here: this process's, with vLLM's development routes,
    WeightSyncExtension importable, and the server's GPUs (`share`), core and adapter folder."""
    # this folder first: vLLM's workers import WeightSyncExtension from it
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = dict(
        os.environ,
        # the /pause, /resume, /collective_rpc routes
        VLLM_SERVER_DEV_MODE="1",
        PYTHONPATH=path,
    )
    if args.plan["cpu_server"]:
        # GiB; the default takes a large share of RAM
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if share:
        env["CUDA_VISIBLE_DEVICES"] = share
    if args.lora_sync == "adapter":
        # the adapter is served at run time (/v1/load_lora_adapter); its workers write it
        # into the run's folder (receive_adapter)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env[ADAPTER_DIR] = str(adapter_dir)
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(*cores)
    return env


def server_command(args, model_path, port, share):
    """The command line of a server started here on `port`, on the GPUs of `share` or on the CPU:
    ours, then --vllm-args (which may override ours)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--seed", str(args.seed)]
    cmd += ["--served-model-name", SERVED_MODEL]
    cmd += ["--worker-extension-cls", "vllm_server.WeightSyncExtension"]
    # log-probs after temperature and truncation: those of what was sampled from
    cmd += ["--logprobs-mode", "processed_logprobs"]
    optional = {
        "--max-model-len": args.max_model_len,
        "--tensor-parallel-size": share and len(share.split(",")),
        "--gpu-memory-utilization": args.plan["gpu_memory"],
    }
    for flag, value in optional.items():
        if value:
            cmd += [flag, str(value)]
    if args.plan["cpu_server"]:
        cmd += cpu_server_flags(args)
    if args.lora_sync == "adapter":
        # the adapter's rank rounded up to one vLLM takes
        cmd += ["--enable-lora"]
        if vllm_flag(args, "--max-lora-rank") is None:
            cmd += ["--max-lora-rank", str(max_lora_rank(args.lora_rank))]
    cmd += family_flags(checkpoint_config(model_path))
    return cmd + shlex.split(args.vllm_args)


def cpu_server_flags(args):
    """What a CPU server is started with where --vllm-args does not say otherwise."""
    flags = []
    if vllm_flag(args, "--dtype") is None:
        # fp32 on CPU: bf16 arithmetic without AVX-512 is slow (a 25M-parameter
        # model here generated 150 tokens/s in bf16, 680-780 in fp32), and an fp32
        # server holds exactly the trainer's weights
        flags += ["--dtype", "float32"]
    compiled = vllm_flag(args, "--enforce-eager", "-O", "--compilation-config", "--optimization-level")
    if args.model is None and compiled is None:
        # the built-in model's server eager: from an empty home it was up after 82 s against 133 s
        # compiled (40 s of that "Warming up model for the compilation"), and its 60 steps took 22 s
        # against 32
        flags += ["--enforce-eager"]
    if vllm_flag(args, "--enable-chunked-prefill", "--no-enable-chunked-prefill") is None:
        # so that it takes seeded requests: served_config
        flags += ["--no-enable-chunked-prefill"]
    return flags


# --- Families vLLM 0.32 serves otherwise than transformers 5 computes them (docs/architectures.md) ---


def checkpoint_config(model_path):
    """The checkpoint's transformers config, or None (a GGUF file, a folder vLLM
    alone reads: vLLM says)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path)
    except Exception:
        return None


def family_flags(config):
    """The vLLM flags a family's checkpoint needs to be served as transformers 5 computes it.
    DeepSeek-V3 as transformers 5 saves it names no topk_method nor scoring_func (transformers
    routes every DeepSeek-V3 by sigmoid scores, chosen with e_score_correction_bias); vLLM 0.32
    reads their absence as softmax routing without that bias, and then fails to load the bias
    (KeyError 'layers.1.mlp.gate.e_score_correction_bias')."""
    if config is None or config.model_type != "deepseek_v3":
        return []
    routing = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    missing = {key: value for key, value in routing.items() if not hasattr(config, key)}
    return ["--hf-overrides", json.dumps(missing)] if missing else []


# the head sizes of vLLM 0.32's multi-head latent attention
# (MLACommonBackend.get_supported_head_sizes): the latent and rotary parts of
# DeepSeek-V3's keys (576 in its checkpoints)
MLA_LATENTS = (320, 512, 576)


def family_refused(config, args, context):
    """Why a server of vLLM 0.32 would not sample from the model the trainer computes (transformers
    5's) for this checkpoint, in sequences of up to `context` tokens, in one line naming the family,
    or None. Checked before a server starts (it would fail to start with a traceback in its log, or
    serve another model than the one trained) and on --vllm-url servers (weights_arrive). Each found
    on the family's tiny checkpoint (test_async_grpo.py's SERVED_MATRIX)."""
    if config is None:
        return None
    family = (getattr(config, "architectures", None) or [config.model_type])[0]
    text = config.get_text_config()
    layers = getattr(text, "layer_types", None) or []
    window = getattr(text, "sliding_window", None)
    latent = getattr(text, "kv_lora_rank", 0) and text.kv_lora_rank + text.qk_rope_head_dim
    # vLLM's Cohere 2 gives its sliding layers window + 1 tokens (its comment: "to
    # match the training convention"), transformers 5 (the trainer) window tokens: they
    # differ from the window's first token on
    if family == "Cohere2ForCausalLM" and "sliding_attention" in layers and context > window:
        why = (
            f"vLLM 0.32's sliding layers attend to {window + 1} tokens, transformers 5's (the trainer's) to "
            f"{window} (sliding_window): sequences past {window} tokens would be sampled from another model "
            f"than the one trained; --max-model-len {window} at most"
        )
    elif latent and latent not in MLA_LATENTS:
        why = (
            f"vLLM 0.32's multi-head latent attention takes a latent of {', '.join(map(str, MLA_LATENTS))} "
            f"(kv_lora_rank + qk_rope_head_dim), and this checkpoint's is {latent}: its engine dies at the first request"
        )
    elif family == "StableLmForCausalLM" and getattr(text, "qk_layernorm", False):
        why = "vLLM 0.32's StableLM has no per-head QK norms (qk_layernorm): it does not load the checkpoint"
    elif family == "Qwen2ForCausalLM" and len(set(layers)) > 1 and text.max_window_layers != len(layers):
        windowed = layers.count("sliding_attention")
        why = (
            f"vLLM 0.32 takes a sliding window on every layer or on none, and this checkpoint has one on "
            f"{windowed} of {len(layers)} (max_window_layers {text.max_window_layers})"
        )
    # (a --vllm-url server may have chunked prefill on, and take unseeded requests)
    elif family == "FalconH1ForCausalLM" and args.plan["cpu_server"] and not args.vllm_url:
        why = (
            "vLLM 0.32 serves its Mamba-2 layers only with chunked prefill, which a CPU server started here is "
            "without (seeded requests crash it there); serve it on a GPU"
        )
    else:
        return None
    return f"{family}: {why}"


def wait_healthy(procs, timeout, t0):
    """Wait until every server answers /health, saying every 10 s where the first still
    starting is. One that exits, or is not healthy after `timeout` seconds
    (--vllm-startup-timeout), raises with its log."""
    deadline = time.monotonic() + timeout
    starting = list(procs)
    # when to say that it is still starting, and where it is
    report = t0 + 10
    while starting:
        for proc in list(starting):
            refuse_failed_start(proc, deadline, timeout)
            with contextlib.suppress(OSError, http_client.HTTPException):
                urllib.request.urlopen(f"{proc.url}/health", timeout=5).close()
                print(f"vLLM is up after {time.monotonic() - t0:.0f} s at {proc.url}", flush=True)
                proc.segments = shared_memory_of(proc.pid)
                starting.remove(proc)
        if starting:
            time.sleep(1)
            # even the built-in model's takes a minute on 2 cores: show progress
            if time.monotonic() > report:
                waited = time.monotonic() - t0
                print(f"waiting for vLLM: {waited:.0f} s, {log_now(starting[0])}", flush=True)
                report += 10


def refuse_failed_start(proc, deadline, timeout):
    """A starting server that exited, or is past its deadline, raises: its log says why."""
    if proc.poll() is not None:
        raise RuntimeError(
            f"the vLLM server {proc.url} exited with code {proc.returncode} during "
            f"start-up. Its log, {proc.log_path}:\n{log_tail(proc)}"
        )
    if time.monotonic() > deadline:
        raise TimeoutError(
            f"the vLLM server {proc.url} was not healthy after {timeout} s "
            f"(--vllm-startup-timeout). Its log, {proc.log_path}:\n{log_tail(proc)}"
        )


def _server_preexec(cores=None):
    # If the trainer is killed outright (SIGKILL), the server still gets SIGTERM from the kernel.
    with contextlib.suppress(OSError, AttributeError):
        # PR_SET_PDEATHSIG
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    if cores:
        os.sched_setaffinity(0, cores)


def log_now(proc):
    """What a starting server last logged, without its prefix ('(APIServer pid=1) INFO 11-27
    06:46:52 [model.py:733] ') and cut short: where its start-up is (loading, compiling, ...)."""
    with contextlib.suppress(OSError), open(proc.log_path, "rb") as log:
        log.seek(max(proc.log_start, log.seek(0, os.SEEK_END) - 4096))
        prefix = re.compile(r"^\(\w[^)]*\) +[A-Z]+ +[\d-]+ [\d:]+ \[[^]]*\] *")
        text = log.read().decode(errors="replace")
        # vLLM's own lines, not the warnings and progress bars of what it imports
        lines = [prefix.sub("", line) for line in text.splitlines() if prefix.match(line)]
        if lines:
            return f"its log says: {lines[-1].strip()[:90]}"
    return "its log is empty"


def log_tail(proc, n=25):
    """What a server's log says of why it failed: the n lines from just before the first error this
    run's server logged (the cause: the engine's own traceback, or that it exited; then come the
    errors of every request it failed), or else its last n lines."""
    with contextlib.suppress(OSError), open(proc.log_path, "rb") as log:
        log.seek(proc.log_start)
        lines = log.read().decode(errors="replace").splitlines(keepends=True)
        error = re.compile(r" ERROR |Traceback|unexpectedly")
        first = next((i for i, line in enumerate(lines) if error.search(line)), None)
        if first is None:
            return "".join(lines[-n:])
        return "".join(lines[max(0, first - 3) : first + n - 3])
    return "(no log)"


def stop_vllm(proc, grace=15):
    """SIGTERM to the server's whole process group (its engine and workers too),
    SIGKILL if needed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        # a stopped server could not act on the SIGTERM
        os.killpg(proc.pid, signal.SIGCONT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        # workers that outlived the parent share its group
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # SIGKILL is delivered asynchronously: go on once the group is really empty
    for _ in range(100):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    # a server that was killed (a fault, SIGKILL past the grace) leaves its message queues'
    # shared memory in /dev/shm, which only it would have removed
    for path in getattr(proc, "segments", ()):
        with contextlib.suppress(OSError):
            os.unlink(path)


def shared_memory_of(pgid):
    """The /dev/shm files the processes of a process group map (a vLLM server's message queues
    between its API server, engine and workers, made at its start)."""
    paths = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.getpgid(int(pid)) == pgid:
                with open(f"/proc/{pid}/maps") as maps:
                    paths.update(line.split()[-1] for line in maps if " /dev/shm/" in line)
    return sorted(path for path in paths if path.startswith("/dev/shm/"))


def server_failure(urls, servers):
    """Why a server is gone, or None: its process exited (servers: those started here), or its
    engine died. vLLM's API server outlives a dead engine (a GPU out-of-memory, say), answering
    /health with 503 and waiting for the open connections to close; a server that merely does not
    answer in time is left to the bound of whatever waits on it."""
    procs = {server.url: server for server in servers}
    for url in urls:
        proc = procs.get(url)
        cause = health_failure(url)
        if proc is not None and proc.poll() is not None:
            cause = f"exited with code {proc.returncode}"
        if not cause:
            continue
        log = log_tail(proc) if proc else ""
        # 503: the API server outlives its engine
        died = re.search("EngineDeadError|engine core exited unexpectedly", log)
        if cause.endswith("503") or died:
            cause += ": its engine died"
        if proc:
            return f"the vLLM server {url} {cause}. Its log, {proc.log_path}:\n{log}"
        return f"the vLLM server {url} {cause}."


def health_failure(url):
    """What a server's /health says is wrong with it, or None: it answers with an error, refuses or
    drops the connection. No answer in time is None: left to the bound of what waits on it."""
    try:
        urllib.request.urlopen(f"{url}/health", timeout=10).close()
    except urllib.error.HTTPError as e:
        return f"answers /health with {e.code}"
    # one shutting down after its engine died resets them
    except (OSError, http_client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError):
            return "refuses connections"
        if not isinstance(reason, TimeoutError):
            return f"drops connections ({type(reason).__name__})"
    return None


def cpu_threads(world_size=1, reserve=1):
    """Torch threads per rank on CPU: every core but one a server here polls busy
    (reserve); a trainer thread there holds up every parallel op (measured on 2 cores:
    2.7x slower steps, 2.2x slower syncs)."""
    return max(1, ((os.cpu_count() or 2) - reserve) // world_size)


@contextlib.contextmanager
def share_idle_core(layers, version, idle_after=1.0):
    """CPU, one trainer: around a training step, the trainer takes the server's core too whenever
    vLLM has had no request of ours for idle_after seconds (its worker busy-polls for a second after
    its last step), and gives it back as soon as one is in flight; decided before each decoder
    layer's forward and backward. Generation is hidden behind training and then waits for the sync,
    so the server's core is often idle for much of a step."""
    # the trainer's own threads, and every core
    busy = torch.get_num_threads()
    every = os.cpu_count() or 1

    def decide(*_):
        quiet = time.perf_counter() - version.idle_since
        idle = not version.in_flight and quiet > idle_after
        torch.set_num_threads(max(every, busy) if idle else busy)

    # the hook on a layer's output runs just before the layer's backward
    def before_backward(module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: decide())

    hooks = []
    # a model's decoder layers (async_grpo.decoder_layers)
    for layer in layers:
        hooks.append(layer.register_forward_pre_hook(decide))
        hooks.append(layer.register_forward_hook(before_backward))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        torch.set_num_threads(busy)


# --- Checked and watched: --vllm-url servers as start_vllm would start them, and a watchdog for all ---


def http(url, payload=None, timeout=60, bound="its bound"):
    """One request to a server, bounded by `timeout` seconds (`bound`: the flag that sets
    them). A failure is a ConnectionError that names the server, what it was asked and what
    went wrong: a socket traceback says none of it."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=data, headers=headers)
    asked = f"{request.get_method()} {url}"
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
            # vLLM answers /v1/load_lora_adapter in plain text
            text = response.headers.get_content_type() != "application/json"
    except urllib.error.HTTPError as e:
        answer = e.read()[:300].decode(errors="replace")
        raise ConnectionError(f"{asked} answered {e.code}: {answer}") from None
    # refused, reset, or no answer in time
    except (OSError, http_client.HTTPException) as e:
        waited = time.monotonic() - t0
        why = getattr(e, "reason", None) or e or type(e).__name__
        limit = f"{bound}: {timeout:.0f} s"
        raise ConnectionError(f"{asked} failed after {waited:.0f} s ({limit}): {why}") from None

    if text:
        return body.decode(errors="replace")
    return json.loads(body) if body else None


def watch_servers(run, every=1.0):
    """Rank 0's watchdog thread: a server that fails is noticed within seconds wherever the run
    is (generating, waiting for data, syncing, evaluating). One started here is then killed,
    which fails at once every request that waits on it; the error handler (save_after_error)
    reports run.server_failure as the cause."""
    stop_seen = False
    while not run.server_failure and run.urls:
        time.sleep(every)
        # said here: the signal handler cannot print (_stop_after_step)
        if run.stop and not stop_seen:
            says = "stopping after this step, with a checkpoint (again: at once)"
            print(f"signal {run.stop[0]}: {says}", flush=True)
            stop_seen = True
        failure = server_failure(run.urls, run.servers)
        if failure:
            run.server_failure = failure
            # SIGKILL: a graceful stop would wait for the requests that wait on it
            for server in run.servers:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGKILL)


def served_config(url, lora_rank=0):
    """(context length, dtype, its workers' devices, whether it takes seeded requests) of a
    server, checked to be one that start_vllm would start (--vllm-url may be anything):
    data-parallel engines would join the sync under the same ranks, and pipeline stages
    hold part of the weights each; with lora_rank (--lora-sync adapter), one that serves
    adapters of that rank loaded at run time."""
    how = (
        f"start it with --served-model-name {SERVED_MODEL} "
        "--worker-extension-cls vllm_server.WeightSyncExtension "
        "--logprobs-mode processed_logprobs and VLLM_SERVER_DEV_MODE=1, as README.md shows"
    )
    try:
        models = {m["id"]: m for m in http(f"{url}/v1/models", timeout=30)["data"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--vllm-url {url}: no vLLM server answers there ({quoted(e)})")
    if SERVED_MODEL not in models:
        raise SystemExit(f"--vllm-url {url} serves {sorted(models)}, not {SERVED_MODEL!r}: {how}")
    try:
        workers = http(f"{url}/collective_rpc", {"method": "served_config"}, timeout=30)["results"]
        dtype, logprobs_mode, _, stages, seeds = workers[0]
        # the server's world with its data-parallel engines, then without
        sizes = []
        for dp in ("true", "false"):
            sizes.append(http(f"{url}/get_world_size?include_dp={dp}", timeout=30)["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--vllm-url {url}: its workers cannot take weights ({quoted(e)}): {how}")
    # raw log-probs ignore temperature and truncation: ratios would be off
    if logprobs_mode != "processed_logprobs":
        raise SystemExit(f"--vllm-url {url} returns {logprobs_mode}: {how}")
    if sizes[0] != sizes[1] or stages > 1:
        engines = sizes[0] // sizes[1]
        raise SystemExit(
            f"--vllm-url {url} runs {engines} data-parallel engines of {stages} pipeline stages: "
            "a weight sync reaches one tensor-parallel engine whole; "
            "start a server per engine and list every URL"
        )
    if lora_rank:
        check_served_lora(url, lora_rank)
    devices = [worker[2] for worker in workers]
    return models[SERVED_MODEL]["max_model_len"], dtype, devices, seeds


def quoted(error):
    """An exception as a refusal quotes it: its type and the start of what it says."""
    return f"{type(error).__name__}: {str(error)[:200]}"


def max_lora_rank(rank):
    """The --max-lora-rank a server needs for an adapter of `rank` (<= 512,
    parse_args checks): the least vLLM takes."""
    return next(r for r in LORA_RANKS if r >= rank)


def check_served_lora(url, rank):
    """--lora-sync adapter: the server at url serves adapters of `rank` loaded at run time, or
    SystemExit says how to start one that does."""
    how = (
        f"start it with --enable-lora --max-lora-rank {max_lora_rank(rank)} and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, or pass --lora-sync merged"
    )
    try:
        answer = http(f"{url}/collective_rpc", {"method": "served_lora"}, timeout=30)
        served_rank, runtime = answer["results"][0]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--vllm-url {url}: cannot tell what LoRA it serves ({quoted(e)}): {how}")
    if not served_rank:
        raise SystemExit(f"--vllm-url {url} serves no LoRA adapter (--lora-sync adapter): {how}")
    if not runtime:
        loads = "loads no LoRA adapter at run time (--lora-sync adapter)"
        raise SystemExit(f"--vllm-url {url} {loads}: {how}")
    if served_rank < rank:
        below = f"serves LoRA ranks up to {served_rank}, below --lora-rank {rank}"
        raise SystemExit(f"--vllm-url {url} {below}: {how}")


def load_adapter(url, folder, timeout):
    """--lora-sync adapter: serve the adapter a worker wrote to `folder` as SERVED_ADAPTER. Unloaded
    and loaded again, not in place: a request names the adapter as it was loaded, and one loaded in
    place (load_inplace) is read from its folder again at every engine step
    (vllm/lora/worker_manager.py, add_adapter). vLLM is paused: no request waits on the name in
    between, and its cache of what the old adapter computed was cleared."""
    served = {m["id"] for m in http(f"{url}/v1/models", timeout=timeout)["data"]}
    if SERVED_ADAPTER in served:
        unload = {"lora_name": SERVED_ADAPTER}
        http(f"{url}/v1/unload_lora_adapter", unload, timeout, "--sync-timeout")
    load = {"lora_name": SERVED_ADAPTER, "lora_path": folder}
    http(f"{url}/v1/load_lora_adapter", load, timeout, "--sync-timeout")


def url_sync_backend(urls, devices, ours):
    """The sync's backend for --vllm-url servers, from their workers' devices (served_config)
    and ours (the trainer ranks' GPUs here): NCCL where all have GPUs, else gloo; a server on
    one of ours is refused (NCCL refuses it)."""
    for url, found in zip(urls, devices):
        if set(found) & set(ours):
            raise SystemExit(
                f"--vllm-url {url} runs on a GPU that a trainer rank uses: start it on another, "
                "or leave --vllm-url out to share trainer rank 0's GPU "
                "with a server started here (its memory planned)"
            )
    on_gpus = all(d != "cpu" for found in devices for d in found)
    return "nccl" if ours and on_gpus else "gloo"


# --- The sync group, where the trainer and the servers' workers meet ---------------------------------


def local_address(host):
    """This machine's address on its route to host: a UDP connect sends nothing,
    it picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def sync_endpoint(urls, host=None):
    """Where the servers meet the sync group: --sync-host, or this machine's address on its route to
    the first server (the hostname's lookup is often 127.0.1.1); and a socket for its store, on
    every interface unless on the loopback one."""
    host = host or local_address(urllib.parse.urlparse(urls[0]).hostname)
    interface = "127.0.0.1" if host == "127.0.0.1" else "0.0.0.0"
    return host, socket.create_server((interface, 0))


def sync_group(host, port, rank, world_size, backend, timeout, listener=None):
    """The weight-sync group: the trainer (rank 0) and every worker of every server, outside the
    training ranks' default world. Rank 0 hosts its store on `listener`, a socket it bound (torch's
    rendezvous would join torchrun's store). gloo takes CUDA tensors too, through pinned host
    memory: the path where a server shares the trainer's GPU."""
    timeout = timedelta(seconds=timeout)
    gloo = backend == "gloo"
    hosting = listener is not None
    fd = listener and listener.detach()
    store = dist.TCPStore(host, port, world_size, hosting, timeout, master_listen_fd=fd)
    if gloo:
        options = dist.ProcessGroupGloo._Options()
        # this machine's address on its route to host, not the hostname's
        address = local_address(host)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        kind = dist.ProcessGroup.BackendType.GLOO
        make_backend = dist.ProcessGroupGloo
        # the devices whose tensors this group's broadcasts take
        devices = ("cpu", "cuda")
    else:
        options = dist.ProcessGroupNCCL.Options()
        kind = dist.ProcessGroup.BackendType.NCCL
        make_backend = dist.ProcessGroupNCCL
        devices = ("cuda",)
    # the backend's own bound, above send_weights': Python ends a failed sync first
    options._timeout = 2 * timeout
    backend = make_backend(store, rank, world_size, options)
    backend._set_sequence_number_for_group()
    group = dist.ProcessGroup(store, rank, world_size)
    group._set_default_backend(kind)
    for device in devices:
        group._register_backend(torch.device(device), kind, backend)
    return group


def arrived(work, store):
    """A worker's wait for a broadcast of the sync group, which ends in an error where the
    trainer has aborted the sync (its `abort` key in the group's store, or the store gone with
    it): NCCL's wait would hold until its watchdog."""
    checked = 0.0
    while not work.is_completed():
        # a round trip to the trainer's store: not every millisecond
        if time.monotonic() - checked > 0.05:
            checked = time.monotonic()
            try:
                why = store.check(["abort"]) and store.get("abort").decode()
            # the trainer's store is gone: so is the sync
            except Exception as e:
                why = f"the trainer's store is gone ({type(e).__name__})"
            if why:
                raise ConnectionError(f"the trainer aborted the sync: {why}")
        time.sleep(0.001)
    # raises the backend's error, if it failed
    work.wait()


# --- Do the weights arrive? Every server's log-probs against the trainer's, at start and after the first sync


class NotArrived(ConnectionError):
    """The servers do not hold the weights the trainer sent them (a family whose
    tensors vLLM does not all take)."""


def refuse_unknown_names(urls, names, rpc, model_type):
    """Before the first sync: every server has a parameter for every name it will receive
    (unknown_weight_names, after its own renaming and fusing), or NotArrived: a wrong name would
    fail halfway through a load, or be dropped."""
    unknown = set()
    for url in urls:
        for worker in rpc(url, "unknown_weight_names", names=names).result()["results"]:
            unknown.update(worker)
    if unknown:
        raise NotArrived(
            f"{model_type}: the vLLM server's model has no parameter for {len(unknown)} "
            f"of the {len(names)} trained weights, e.g. {sorted(unknown)[:3]}: "
            "they would not arrive (not the same architecture on both sides?)"
        )


def fixed_samples(vocab, count=4, length=24):
    """A few fixed sequences of token ids below `vocab` (seeded), as collate takes them: the
    log-probs of every token after the first."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (count, length), generator=g).tolist()
    blank = {
        "n_prompt": 1,
        "mask": [1] * (length - 1),
        "logprobs": [0.0] * (length - 1),
        "advantage": 0.0,
    }
    return [dict(blank, ids=row) for row in ids]


def served_logprobs(url, samples, model, timeout):
    """[samples, length - 1]: the server's log-probs of each sample's tokens after the
    first, in one request (prompt_logprobs: the model's own distribution, whatever
    --logprobs-mode and the sampling flags)."""
    prompts = [s["ids"] for s in samples]
    request = {"model": model, "prompt": prompts, "max_tokens": 1, "prompt_logprobs": 0}
    answer = http(f"{url}/v1/completions", request, timeout, "--sync-timeout")
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    rows = []
    for c, s in zip(choices, samples):
        # each position's entry holds the log-prob of the token there, keyed by its id
        entries = zip(c["prompt_logprobs"][1:], s["ids"][1:])
        rows.append([entry[str(t)]["logprob"] for entry, t in entries])
    return torch.tensor(rows)


def weights_arrive(urls, args, run, collate, token_logprobs):
    """The live check of a run's weights (async_grpo.py's collate and token_logprobs: the
    trainer's log-probs as train_step takes them): the mean |log-prob gap| between every server
    and the trainer on fixed_samples, measured now, while the servers hold the trainer's weights
    (loaded from its checkpoint, or just synced whole): the served dtype's rounding as these
    servers and this trainer compute it. Returns the check the first sync of moved weights runs
    (WeightSync): a server whose gap then exceeds 16x its rounding plus half the dtype's eps
    does not sample from the weights the trainer holds, and the run stops with NotArrived.
    Measured (the matrix's test, every weight moved by ~20%, bf16): a gap 1-10x the one at start
    where the sync is exact (OlmoE's 10x); where it was not (before the worker's fixes),
    GPT-OSS's experts 0.23 against a rounding of 0.0025 (its sinks alone, 0.025, pass in bf16),
    Qwen3-MoE's experts on CPU 0.24 against 1e-7 (fp32), a doubled down_proj 0.79 against 7e-7
    (fp32). One request a server: a fraction of a second."""
    config = run.policy.config
    # --vllm-url servers: what start_vllm refuses, for the sequences they take
    context = min(http(f"{url}/v1/models")["data"][0]["max_model_len"] for url in urls)
    why = family_refused(config, args, context)
    if why:
        raise NotArrived(why)
    samples = fixed_samples(min(len(run.tok), config.get_text_config().vocab_size))
    model_type = config.model_type
    dtype = run.served_dtype
    eps = torch.finfo(dtype).eps

    def gaps():
        with torch.no_grad():
            batch = collate(samples, run.pad_id, run.device)
            ours = token_logprobs(run.policy, batch)[0].float().cpu()
        gap = {}
        for url in urls:
            theirs = served_logprobs(url, samples, args.request_model, args.sync_timeout)
            gap[url] = (theirs - ours).abs().mean().item()
        return gap

    rounding = gaps()
    # 64 eps: SmolLM2-135M's bf16 server measured 0.078 (10 eps) on the same
    # weights; another model differs by nats
    wrong = {url: gap for url, gap in rounding.items() if not gap <= 64 * eps}
    # a --vllm-url server that holds other weights after the whole sync, or a
    # server of another model
    if wrong:
        raise NotArrived(
            f"{model_type}: the log-probs of {', '.join(wrong)} differ from the trainer's "
            f"on the same weights by {max(wrong.values()):.3g} "
            f"(mean, over {64 * eps:.3g}, 64 of {dtype}'s eps): "
            "the server does not compute the trainer's model"
        )

    def check():
        after = gaps()
        bounds = {url: 16 * rounding[url] + eps / 2 for url in urls}
        # NaN: not within
        wrong = [url for url in urls if not after[url] <= bounds[url]]
        if wrong:
            worst = max(wrong, key=lambda url: after[url])
            raise NotArrived(
                f"{model_type}: after the first sync of moved weights the log-probs of {', '.join(wrong)} "
                f"differ from the trainer's by {after[worst]:.3g} "
                f"(mean; {rounding[worst]:.2g} at start, bound {bounds[worst]:.2g}): "
                "the servers do not sample from the trainer's weights, some do not arrive"
            )
        print(
            "the first sync of moved weights arrived: the servers' log-probs are the trainer's "
            f"within {max(after.values()):.2g} (mean; {max(rounding.values()):.2g} at start)",
            flush=True,
        )

    return check


# --- The sync's receiving end, inside every vLLM worker ----------------------------------------------


# the tensors a family's vLLM load_weights copies into its parameters itself
# (param.copy_), not by a weight_loader: vLLM 0.32's reload_weights does not see them
# (GPT-OSS's experts, their biases, its attention sinks)
SELF_COPIED = {"GptOssForCausalLM": (".mlp.experts.", ".sinks")}


def noted_processing(process, processed, layer):
    """An MoE method's process_weights_after_loading during a reload: it runs,
    and the layer is noted."""
    process(layer)
    processed[id(layer)] = layer


def experts_loaded(module, reprocess):
    """An MoE layer's weights were loaded again: its kernel's own post-load step runs again (vLLM
    0.32's weight update skips it, so on CPU the new experts went unpacked into the kernel's
    pre-packed layout); with `reprocess` (loaded into the live parameters) the layer's whole
    post-load processing first, as at start-up."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    if kernel is None:
        return
    if reprocess:
        module.quant_method.process_weights_after_loading(module)
    kernel.fused_experts.process_weights_after_loading(module)


class WeightSyncExtension:
    """Mixed into every vLLM worker (--worker-extension-cls); its methods run via
    /collective_rpc."""

    def init_weight_sync(self, host, port, world_size, timeout, backend, first_rank=1):
        """Join the sync group: this worker's rank is its server's first rank (1
        for the first server) plus its own."""
        rank = first_rank + self.rank
        self.weight_sync_group = sync_group(host, port, rank, world_size, backend, timeout=timeout)
        bound = timedelta(seconds=timeout)
        self.weight_sync_store = dist.TCPStore(host, port, is_master=False, timeout=bound)
        # the trainer's first broadcast, one element: NCCL makes its communicator now,
        # not in the first bucket's (through arrived: a trainer whose warm-up fails
        # aborts it, which NCCL's wait would not see)
        warm_up = self.weight_sync_group.broadcast(torch.empty(1, device=self.device), 0)
        arrived(warm_up, self.weight_sync_store)

    def served_config(self):
        """(dtype, log-probs mode, device, pipeline stages, whether it takes seeded requests): the
        weights travel in the server's dtype (the trainer rounds its logits to it) over a backend
        that suits the device (a GPU's UUID, or 'cpu'). On CPU a seeded request whose prompt is
        prefilled in chunks kills the engine (vLLM 0.32: "CPU Generator does not use offset"), so a
        CPU server takes seeds only without chunked prefill."""
        config = self.vllm_config.model_config
        device = "cpu"
        if self.device.type == "cuda":
            device = str(torch.cuda.get_device_properties(self.device).uuid)
        stages = self.vllm_config.parallel_config.pipeline_parallel_size
        chunked = self.vllm_config.scheduler_config.enable_chunked_prefill
        seeds = device != "cpu" or not chunked
        dtype = str(config.dtype).removeprefix("torch.")
        return dtype, config.logprobs_mode, device, stages, seeds

    def unknown_weight_names(self, names):
        """The names among `names` that this server's model has no parameter for, after
        vLLM's own renaming (hf_to_vllm_mapper) and fusing (q/k/v_proj into qkv_proj,
        ...). Checked before the first sync: a wrong name would otherwise fail halfway
        through a load, or be silently dropped."""
        model = self.model_runner.get_model()
        # the model's renaming, or its inner model's (GraniteMoE's: its experts
        # under their legacy names)
        mappers = {}
        for m in model.modules():
            if hasattr(m, "hf_to_vllm_mapper"):
                mappers[id(m.hf_to_vllm_mapper)] = m.hf_to_vllm_mapper
        # each part of a fused module (q_proj) -> the module (qkv_proj)
        packed = getattr(model, "packed_modules_mapping", {})
        fused = {part: whole for whole, parts in packed.items() for part in parts}
        # a server with --enable-lora holds each adapted layer's own weights
        # under base_layer (reload_weights too)
        parameters = model.named_parameters(remove_duplicate=False)
        known = {n.replace(".base_layer.", ".") for n, _ in parameters}

        def served(name):
            renamed = any(known_as(mapper.map_name(name)) for mapper in mappers.values())
            return renamed or known_as(name)

        def known_as(name):
            # the mapper drops it: vLLM would ignore it
            if name is None:
                return False
            module, _, leaf = name.rpartition(".")
            parent, _, last = module.rpartition(".")
            # MoE layers hold all experts in one tensor (GPT-OSS's 3D ones are
            # renamed under it again)
            experts = re.sub(r"\.experts\.(\d+\.)?.*", ".experts.", name)
            if name in known or f"{parent}.{fused.get(last, last)}.{leaf}" in known:
                return True
            return experts != name and any(k.startswith(experts) for k in known)

        def unknown(name):
            # the name as the family's checkpoints hold it (one or several tensors)
            stored = self.checkpoint_format([(name, self.hf_tensor(name))])
            return not all(served(c) for c, _ in stored)

        return [n for n in names if unknown(n)]

    def hf_tensor(self, name):
        """The trainer's tensor `name` on the meta device (its shape), from the
        family's transformers model."""
        # makes hf_meta_model
        list(self.checkpoint_format([]))
        try:
            return self.hf_meta_model.get_parameter(name)
        # not the family's name (or no such model): served() says so
        except AttributeError:
            return torch.empty(0, device="meta")

    def served_lora(self):
        """(the largest LoRA rank this server serves, 0 without --enable-lora;
        whether it loads adapters at run time)."""
        import vllm.envs

        lora = self.vllm_config.lora_config
        rank = lora.max_lora_rank if lora else 0
        return rank, vllm.envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING

    def _received(self, buckets):
        """The (name, tensor) pairs of the trainer's broadcasts, as they arrive: bucket k+1 is on
        its way while the caller takes bucket k."""

        def receive(bucket):
            dtype = getattr(torch, bucket["dtype"])
            flat = torch.empty(bucket["numel"], dtype=dtype, device=self.device)
            return flat, self.weight_sync_group.broadcast(flat, 0)

        arriving = receive(buckets[0])
        for k, bucket in enumerate(buckets):
            flat, work = arriving
            arrived(work, self.weight_sync_store)
            if k + 1 < len(buckets):
                arriving = receive(buckets[k + 1])
            parts = flat.split([math.prod(shape) for _, shape in bucket["params"]])
            for (name, shape), part in zip(bucket["params"], parts):
                yield name, part.view(shape)

    def receive_adapter(self, buckets, config):
        """--lora-sync adapter: the trainer's adapter (peft's lora_A/lora_B tensors) written as
        peft saves one (adapter_model.safetensors, adapter_config.json: `config`) into a folder
        on the server's host: the run's (ADAPTER_DIR) where the run started the server, else one
        made at the first sync and removed when the worker exits normally. Returns the folder
        (the server's first worker; the others None), which the trainer then loads under
        SERVED_ADAPTER (/v1/load_lora_adapter)."""
        import atexit
        from safetensors.torch import save_file

        try:
            # the parts are views of one buffer, which safetensors refuses: a
            # copy each (an adapter is small)
            received = self._received(buckets)
            tensors = {name: part.to("cpu", copy=True) for name, part in received}
        except BaseException:
            self.weight_sync_group.abort()
            raise
        if self.rank:
            return None
        if os.environ.get(ADAPTER_DIR):
            self.adapter_dir = os.environ[ADAPTER_DIR]
            os.makedirs(self.adapter_dir, exist_ok=True)
        elif not hasattr(self, "adapter_dir"):
            self.adapter_dir = tempfile.mkdtemp(prefix="async_grpo_adapter_")
            atexit.register(shutil.rmtree, self.adapter_dir, ignore_errors=True)
        save_file(tensors, os.path.join(self.adapter_dir, "adapter_model.safetensors"))
        with open(os.path.join(self.adapter_dir, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        return self.adapter_dir

    def receive_weights(self, buckets):
        try:
            self.load_received(self._received(buckets))
        # out of step with the trainer: aborted, or NCCL's watchdog would end this worker
        except BaseException:
            self.weight_sync_group.abort()
            raise

    def load_received(self, weights):
        """Load (name, tensor) pairs in the trainer's names (its transformers model's)
        into the live model, every family's tensors where vLLM's reload leaves some
        out (each gap: docs/architectures.md)."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        # the pairs the family's load_weights copies itself
        copied = []
        copies = SELF_COPIED.get(type(model).__name__, ())

        def noted(pairs):
            for name, tensor in pairs:
                if any(part in name for part in copies):
                    copied.append((name, tensor))
                else:
                    yield name, tensor

        # the MoE layers (name -> layer holding the experts) and those the
        # reload processes again (noted as it does)
        moe = {}
        for name, m in model.named_modules():
            if hasattr(m, "w13_weight") and hasattr(m, "quant_method"):
                moe[name] = m
        processed = {}
        methods = {id(m.quant_method): m.quant_method for m in moe.values()}.values()
        # an instance attribute over the method, until the reload ends
        for method in methods:
            process = method.process_weights_after_loading
            noting = functools.partial(noted_processing, process, processed)
            method.process_weights_after_loading = noting

        try:
            # reload_weights, unlike plain load_weights, re-runs the post-load
            # processing of each layer it loads...
            pairs = noted(self.checkpoint_format(weights))
            self.reload_weights(weights_iterator=pairs, is_checkpoint_format=True)
        finally:
            for method in methods:
                del method.process_weights_after_loading
        with set_current_vllm_config(self.vllm_config):
            for layer in processed.values():
                experts_loaded(layer, reprocess=False)
            # ...on parameters it holds on the meta device meanwhile, where a family's own
            # param.copy_ (GPT-OSS's experts and sinks) lands nowhere: those load now, into the live
            # parameters, then their layer is processed as at start-up
            if copied:
                model.load_weights(copied)
            for name, layer in moe.items():
                experts = name.rpartition(".experts")[0] + ".experts."
                if any(n.startswith(experts) for n, _ in copied):
                    experts_loaded(layer, reprocess=True)
            # ...but only of the layer that loaded a tied weight. A module sharing it (lm_head tied
            # to the embedding) keeps what it derived from the old values (on CPU, a pre-packed GEMM
            # copy): vLLM would sample from the old head.
            #
            # parameter -> the modules that hold it
            owners = defaultdict(list)
            for name, param in model.named_parameters(remove_duplicate=False):
                owners[id(param)].append(model.get_submodule(name.rpartition(".")[0]))
            sharing = [m for modules in owners.values() if len(modules) > 1 for m in modules]
            for module in sharing:
                if hasattr(module, "quant_method"):
                    module.quant_method.process_weights_after_loading(module)

    def checkpoint_format(self, weights):
        """The pairs under the names and layout of the family's checkpoints, which vLLM's loaders
        take: transformers 5 holds some families' experts fused under other names (Mixtral's
        mlp.experts.gate_up_proj, its checkpoints' block_sparse_moe.experts.0.w1/w3), and reverts
        them itself when it saves (revert_weight_conversion)."""
        from transformers import AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion

        # the family's conversions read the model's config and modules only
        if not hasattr(self, "hf_meta_model"):
            try:
                hf_config = self.vllm_config.model_config.hf_config
                with torch.device("meta"):
                    self.hf_meta_model = AutoModelForCausalLM.from_config(hf_config)
                conversions = get_model_conversion_mapping(self.hf_meta_model, add_legacy=False)
                # as save_pretrained does for a model not made by from_pretrained
                conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
                self.hf_meta_model._weight_conversions = conversions or None
            # not a causal LM class of transformers (an image-text model): its names as they are
            except Exception:
                self.hf_meta_model = None
        if self.hf_meta_model is None or self.hf_meta_model._weight_conversions is None:
            yield from weights
            return
        for name, tensor in weights:
            reverted = revert_weight_conversion(self.hf_meta_model, {name: tensor})
            yield from reverted.items()
