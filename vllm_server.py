"""The vLLM servers a run starts (async_grpo.py, start_generation): each a `vllm serve` process in a process group of its
own, on its share of the device plan's GPUs or on the CPU, with async_grpo.py as its workers' extension (the weight
sync's receiving end, WeightSyncExtension); waited for until healthy, watched (server_failure) and stopped with every
process it started (stop_vllm): none outlives a run, a test or Ctrl-C. And on the CPU, the cores the trainer
takes beside its server (cpu_threads, share_idle_core)."""

import contextlib, ctypes, functools, http.client as http_client, os, re, shlex, signal, socket, subprocess, sys, time
import urllib.error, urllib.request
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SERVED_MODEL = "policy"  # the name the servers started here serve the weights under, whatever the checkpoint
# Measured: the default run's "vLLM is up after N s" from an empty home directory (vLLM compiles the model into
# ~/.cache/vllm the first time): ~50 s on 2 idle cores (issue 54's run), 406 s on 2 cores under a load of 27-44 (its
# fix's run, half of it in "Warming up model for the compilation")
CPU_START_SECONDS = 50


def vllm_flag(args, *names):
    """The value that --vllm-args gives one of these vLLM flags ('' for a bare one), or None."""
    words = [w for word in shlex.split(args.vllm_args) for w in word.split("=", 1)] + [""]
    return next((words[i + 1] for i, w in enumerate(words[:-1]) if w.replace("_", "-") in names), None)


def free_port():
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def start_vllm(args, model_path, out_dir):
    """Start the `vllm serve` processes of the device plan (args.plan) with this file as their worker extension, each on
    its share of --vllm-gpus or on the CPU, and wait until all are healthy. Returns the processes (.url, .log_path)."""
    plan, n = args.plan, len(args.plan["servers"])
    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",  # the /pause, /resume, /collective_rpc routes
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    )
    if plan["cpu_server"]:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a large share of RAM
    procs, t0 = [], time.monotonic()
    try:
        for i, share in enumerate(plan["servers"]):
            port = args.vllm_port + i if args.vllm_port else free_port()
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--seed", str(args.seed)]
            cmd += ["--served-model-name", SERVED_MODEL, "--worker-extension-cls", "async_grpo.WeightSyncExtension"]
            cmd += [
                "--logprobs-mode",
                "processed_logprobs",
            ]  # log-probs after temperature/top-p: what was sampled from
            optional = {
                "--max-model-len": args.max_model_len,
                "--tensor-parallel-size": share and len(share.split(",")),
                "--gpu-memory-utilization": plan["gpu_memory"],
            }
            cmd += [word for flag, value in optional.items() if value for word in (flag, str(value))]
            if plan["cpu_server"] and vllm_flag(args, "--dtype") is None:
                # fp32 on CPU: bf16 arithmetic without AVX-512 is slow (a 25M-parameter model here generated 150 tokens/s
                # in bf16, 680-780 in fp32), and an fp32 server holds exactly the trainer's weights
                cmd += ["--dtype", "float32"]
            if (
                plan["cpu_server"]
                and vllm_flag(args, "--enable-chunked-prefill", "--no-enable-chunked-prefill") is None
            ):
                cmd += ["--no-enable-chunked-prefill"]  # so that it takes seeded requests: served_config
            if share:
                env["CUDA_VISIBLE_DEVICES"] = share
            # A CPU server takes one core, whole: its worker (which busy-polls for a second after each engine step)
            # and its HTTP and engine front end, which would otherwise preempt the trainer on the other cores
            # (measured on 2 cores: async 1.15x -> 1.62x the samples/s of --sync on average; --sync itself unchanged).
            cores = None
            if plan["cpu_server"] and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                cores = {i % (os.cpu_count() or 1)}
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(*cores)
            cmd += shlex.split(args.vllm_args)
            log_path = Path(out_dir) / ("vllm.log" if n == 1 else f"vllm-{i}.log")
            with open(log_path, "ab") as log:
                log_start = log.tell()  # --resume appends to the log: what this server says begins here
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
            procs.append(proc)
            print(f"starting vLLM (pid {proc.pid}, log {log_path}): {shlex.join(cmd)}", flush=True)
        if plan["cpu_server"]:
            print(
                f"a CPU server takes a while to start (the built-in model's: {CPU_START_SECONDS} s on 2 idle cores "
                "from an empty home directory, minutes on busy ones); progress every 10 s",
                flush=True,
            )
        deadline = time.monotonic() + args.vllm_startup_timeout
        starting = list(procs)
        report = t0 + 10  # when to say that it is still starting, and where it is
        while starting:
            for proc in list(starting):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"the vLLM server {proc.url} exited with code {proc.returncode} during "
                        f"start-up. Its log, {proc.log_path}:\n{log_tail(proc)}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the vLLM server {proc.url} was not healthy after {args.vllm_startup_timeout} s "
                        f"(--vllm-startup-timeout). Its log, {proc.log_path}:\n{log_tail(proc)}"
                    )
                with contextlib.suppress(OSError, http_client.HTTPException):
                    urllib.request.urlopen(f"{proc.url}/health", timeout=5).close()
                    print(f"vLLM is up after {time.monotonic() - t0:.0f} s at {proc.url}", flush=True)
                    starting.remove(proc)
            if starting:
                time.sleep(1)
                if time.monotonic() > report:  # even the built-in model's takes a minute on 2 cores: show progress
                    print(
                        f"waiting for vLLM: {time.monotonic() - t0:.0f} s, {log_now(starting[0])}",
                        flush=True,
                    )
                    report += 10
        return procs
    except BaseException:  # Ctrl-C included: the caller never got the handles, so stop them here
        for proc in procs:
            stop_vllm(proc)
        raise


def _server_preexec(cores=None):
    # If the trainer is killed outright (SIGKILL), the server still gets SIGTERM from the kernel.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if cores:
        os.sched_setaffinity(0, cores)


def log_now(proc):
    """What a starting server last logged, without its prefix ('(APIServer pid=1) INFO 11-27 06:46:52 [model.py:733] ')
    and cut short: where its start-up is (loading, compiling, ...)."""
    with contextlib.suppress(OSError), open(proc.log_path, "rb") as log:
        log.seek(max(proc.log_start, log.seek(0, os.SEEK_END) - 4096))
        prefix = re.compile(r"^\(\w[^)]*\) +[A-Z]+ +[\d-]+ [\d:]+ \[[^]]*\] *")
        # vLLM's own lines, not the warnings and progress bars of what it imports
        lines = [
            prefix.sub("", line) for line in log.read().decode(errors="replace").splitlines() if prefix.match(line)
        ]
        if lines:
            return f"its log says: {lines[-1].strip()[:90]}"
    return "its log is empty"


def log_tail(proc, n=25):
    """What a server's log says of why it failed: the n lines from just before the first error this run's server logged
    (the cause: the engine's own traceback, or that it exited; then come the errors of every request it failed), or
    else its last n lines."""
    with contextlib.suppress(OSError), open(proc.log_path, "rb") as log:
        log.seek(proc.log_start)
        lines = log.read().decode(errors="replace").splitlines(keepends=True)
        first = next((i for i, line in enumerate(lines) if re.search(r" ERROR |Traceback|unexpectedly", line)), None)
        return "".join(lines[-n:] if first is None else lines[max(0, first - 3) : first + n - 3])
    return "(no log)"


def stop_vllm(proc, grace=15):
    """SIGTERM to the server's whole process group (its engine and workers too), SIGKILL if needed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        os.killpg(proc.pid, signal.SIGCONT)  # a stopped server could not act on the SIGTERM
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # workers that outlived the parent share its group
    proc.wait()
    for _ in range(100):  # SIGKILL is delivered asynchronously: return once the group is really empty
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def server_failure(urls, servers):
    """Why a server is gone, or None: its process exited (servers: those started here), or its engine died. vLLM's API
    server outlives a dead engine (a GPU out-of-memory, say), answering /health with 503 and waiting for the open
    connections to close; a server that merely does not answer in time is left to the bound of whatever waits on it."""
    procs = {server.url: server for server in servers}
    for url in urls:
        proc, cause = procs.get(url), None
        try:
            urllib.request.urlopen(f"{url}/health", timeout=10).close()
        except urllib.error.HTTPError as e:
            cause = f"answers /health with {e.code}"
        except (OSError, http_client.HTTPException) as e:  # one shutting down after its engine died resets them
            reason = getattr(e, "reason", e)
            if isinstance(reason, ConnectionRefusedError):
                cause = "refuses connections"
            elif not isinstance(reason, TimeoutError):  # no answer in time: left to the bound of what waits on it
                cause = f"drops connections ({type(reason).__name__})"
        if proc is not None and proc.poll() is not None:
            cause = f"exited with code {proc.returncode}"
        log = log_tail(proc) if proc and cause else ""
        if cause and (cause.endswith("503") or re.search("EngineDeadError|engine core exited unexpectedly", log)):
            cause += ": its engine died"
        if cause:
            return f"the vLLM server {url} {cause}." + (f" Its log, {proc.log_path}:\n{log}" if proc else "")


def cpu_threads(world_size=1, reserve=1):
    """Torch threads per rank on CPU: every core but one a server here polls busy (reserve); a trainer thread there
    holds up every parallel op (measured on 2 cores: 2.7x slower steps, 2.2x slower syncs)."""
    return max(1, ((os.cpu_count() or 2) - reserve) // world_size)


@contextlib.contextmanager
def share_idle_core(layers, version, idle_after=1.0):
    """CPU, one trainer: around a training step, the trainer takes the server's core too whenever vLLM has had no request
    of ours for idle_after seconds (its worker busy-polls for a second after its last step), and gives it back as soon
    as one is in flight; decided before each decoder layer's forward and backward. Generation is hidden behind training
    and then waits for the sync, so the server's core is often idle for much of a step."""
    busy, every = torch.get_num_threads(), os.cpu_count() or 1

    def decide(*_):
        idle = not version.in_flight and time.perf_counter() - version.idle_since > idle_after
        torch.set_num_threads(max(every, busy) if idle else busy)

    def before_backward(module, inputs, output):  # the hook on a layer's output runs just before the layer's backward
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: decide())

    hooks = []
    for layer in layers:  # a model's decoder layers (async_grpo.decoder_layers)
        hooks += [layer.register_forward_pre_hook(decide), layer.register_forward_hook(before_backward)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        torch.set_num_threads(busy)
