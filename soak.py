"""Soak: a long run under faults, with what it holds sampled over time. A run that leaks grows in one of these
columns.

    python soak.py --part python --minutes 6     # --env python, an evaluation every 2 steps
    python soak.py --part mcp --minutes 6        # --mcp over stdio (a process a session), one killed every 5 s

Each part runs async_grpo.py as a user does (its own vLLM server, the built-in model and task), samples the
trainer every --every seconds: its open descriptors, threads, resident memory, child processes (interpreters'
bwraps, MCP servers, the math judge, the vLLM server), and the steps done; then stops it with a Ctrl-C and
checks that it ended with the stop's line and left no process. Prints a table; nothing is asserted by time.
"""

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).parent

MCP_SERVER = '''
"""A calculator over MCP stdio (one process a session), for the soak."""
from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator", log_level="WARNING")


@server.tool()
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: An arithmetic expression, e.g. "3 + 4".
    """
    if len(expression) > 40 or set(expression) - set("0123456789+-*/() "):
        raise ValueError("only arithmetic")
    return str(eval(expression))


server.run("stdio")
'''


def live_processes():
    """{pid: the fields of /proc/pid/stat after the command's name} of the live processes, zombies aside (the
    state is field 0, the parent's PID 1, the process group 2)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            found[int(stat.parent.name)] = fields
    return found


def children_of(pid):
    """PIDs of the live processes (zombies aside) whose parent is pid."""
    return [child for child, fields in live_processes().items() if int(fields[1]) == pid]


def processes_in_group(pgid):
    """PIDs of the live processes (zombies aside) whose process group is pgid."""
    return [member for member, fields in live_processes().items() if int(fields[2]) == pgid]


def sample(pid):
    """(descriptors, threads, resident MB, children's PIDs) of a live process."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    descriptors = len(os.listdir(f"/proc/{pid}/fd"))
    return descriptors, int(status["Threads"]), int(status["VmRSS"].split()[0]) / 1024, children_of(pid)


def running(text):
    """PIDs of live processes whose command line holds text."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            pass
    return found


def killer(trainer, script, every, stop, killed, started):
    """Kills one of the trainer's MCP server processes (the script's) every `every` seconds, at random,
    once the run has started (the file `started` exists): a crash. One at start would end the run, as it
    should."""
    while not stop.wait(every):
        if not started.exists():
            continue
        pids = [pid for pid in children_of(trainer) if pid in running(str(script))]
        if pids:
            os.kill(random.choice(pids), signal.SIGKILL)
            killed.append(time.monotonic())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["python", "mcp"], required=True, help="the environment under soak")
    parser.add_argument("--minutes", type=float, default=6.0, help="how long the run goes on before its Ctrl-C")
    parser.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    parser.add_argument("--kill-every", type=float, default=5.0, help="--part mcp: seconds between two kills")
    parser.add_argument("--output-dir", default="soak_runs", help="where the run writes (a folder per part)")
    args, extra = parser.parse_known_args()
    out = Path(args.output_dir).resolve() / args.part
    out.mkdir(parents=True, exist_ok=True)
    script = out / "mcp_calculator.py"
    flags = ["--steps", "100000", "--eval-every", "2", "--eval-size", "16", "--output-dir", str(out / "run")]
    if args.part == "python":
        flags += ["--env", "python"]
    else:
        script.write_text(MCP_SERVER)
        flags += ["--mcp", f"{sys.executable} {script}", "--tool-timeout", "20"]
    command = [sys.executable, str(HERE / "async_grpo.py"), *flags, *extra]
    print("$", " ".join(command), flush=True)
    log = open(out / "run.log", "w")
    proc = subprocess.Popen(command, cwd=HERE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stop, killed, seen = threading.Event(), [], set()
    if args.part == "mcp":
        threading.Thread(
            target=killer,
            args=(proc.pid, script, args.kill_every, stop, killed, out / "run" / "metrics.jsonl"),
            daemon=True,
        ).start()
    start = time.monotonic()
    print(f"{'seconds':>8} {'step':>5} {'fds':>5} {'threads':>7} {'rss MB':>7} {'children':>8} {'killed':>6}")
    while proc.poll() is None and time.monotonic() - start < 60 * args.minutes:
        time.sleep(args.every)
        metrics = out / "run" / "metrics.jsonl"
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        try:
            fds, threads, rss, children = sample(proc.pid)
        except (OSError, KeyError):
            break
        seen.update(children)
        print(
            f"{time.monotonic() - start:8.0f} {steps:5d} {fds:5d} {threads:7d} {rss:7.0f} {len(children):8d} "
            f"{len(killed):6d}",
            flush=True,
        )
    stop.set()
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    last = (out / "run.log").read_text().strip().splitlines()[-1:]
    time.sleep(1)
    # what the trainer started (sampled) and the MCP servers: none outlives it
    left = [pid for pid in seen | set(running(str(script))) - {proc.pid} if Path(f"/proc/{pid}").exists()]
    print(f"exit {proc.returncode}: {last[0] if last else ''}; processes left: {len(left)}", flush=True)
    sys.exit(0 if proc.returncode in (0, 1) and not left and "stopped at step" in "".join(last) else 1)


if __name__ == "__main__":
    main()
