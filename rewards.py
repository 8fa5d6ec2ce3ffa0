"""Reward functions: write one, register it in REWARDS below, and pass `--rewards NAME:WEIGHT,...`.

Every reward function is called once per group with keyword arguments, each a list with one entry
per rollout of the group, and returns one float per rollout (`async def` works too):
    prompts         the prompt as chat messages
    completions     the messages the rollout added: assistant turns, tool results, an environment's user
                    turns. An assistant turn is {"role": "assistant", "content": str, "tool_calls": [...],
                    "tool_call_errors": [...]} (and "reasoning_content": str if it had a think block):
                    tool_calls holds only the well-formed calls, each {"type": "function", "function":
                    {"name": str, "arguments": dict}}; tool_call_errors one message (str) per call that
                    did not parse. A tool result is {"role": "tool", "name": str, "content": str}.
    completion_ids  the token ids after the prompt (generated and tool-result tokens)
    tool_calls      number of tool calls the rollout made, malformed ones included
    tool_failures   number of those calls that failed (malformed, unknown tool, bad arguments, error,
                    timeout)
    truncated       True if the rollout ran out of tokens, context or turns before it finished
    environments    each rollout's environment instance (tools.py), or None for rows without one
    <column>        every other column of the dataset row (e.g. `answer` for the built-in task)
Accept **kwargs so that new arguments never break an old function.

task_rows, at the end, builds the rows of the built-in tasks (--task) with the columns their rewards read.
"""

import asyncio
import contextlib
import ctypes
import itertools
import json
import logging
import os
import random
import re
import resource
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import tools
from tools import GuessNumber, calculator, reward_method

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_EXPRESSION = re.compile(r"[\d\s+\-*/()]+")


def final_text(messages):
    """Content of the last assistant turn: where the answer is."""
    turns = [m for m in messages if m["role"] == "assistant"]
    return (turns[-1].get("content") or "") if turns else ""


def correct_answer(completions, answer, **kwargs):
    """1 if the last number in the final assistant turn equals `answer` (a dataset column)."""
    rewards = []
    for messages, target in zip(completions, answer):
        numbers = _NUMBER.findall(final_text(messages))
        rewards.append(float(bool(numbers) and float(numbers[-1]) == float(target)))
    return rewards


# a comparison's bound: past it the judge is killed and the rollout scores 0
MATH_SECONDS = 5.0
# judge processes at most: a slow answer holds one, while the other groups are judged by the others
JUDGES = 4
_JUDGES = {"idle": [], "slots": threading.BoundedSemaphore(JUDGES)}


def math_answer(completions, answer, **kwargs):
    """1 if the final assistant turn's answer equals `answer` (a dataset column) as Hugging Face's
    math-verify judges it (TRL's and open-r1's accuracy reward): the answer is the last \\boxed{...}, else
    the last formula or number; `answer` is a number, a LaTeX expression, or a worked solution that boxes
    it. Equal forms are equal: 1/2, \\frac{1}{2} and 0.5, (x+1)^2 and x^2+2x+1, x=3 and 3. Judged in a
    process of its own, one comparison at most MATH_SECONDS: sympy on what a model writes (9^{9^{9^9}}) can
    hold the interpreter in one C call for hours."""
    # groups are scored on several threads: each takes a judge of its own (one answers one question at a time)
    with _JUDGES["slots"]:
        judge = None
        with contextlib.suppress(IndexError):
            judge = _JUDGES["idle"].pop()
        try:
            scores = []
            for messages, gold in zip(completions, answer):
                judge, score = _judged(judge, str(gold), final_text(messages))
                scores.append(score)
            return scores
        finally:
            if judge is not None:
                _JUDGES["idle"].append(judge)


def _judged(process, gold, text):
    """(the judge, its score): a judge started where `process` is None or dead; None after it was killed."""
    # it died between questions
    if process is not None and process.poll() is not None:
        _ended(process)
        process = None
    process = process or _started_judge()
    # the answer is at the end
    question = json.dumps([gold, text[-4000:]]) + "\n"
    try:
        process.stdin.write(question.encode())
        process.stdin.flush()
        if _readable(process.stdout, MATH_SECONDS):
            return process, float(process.stdout.readline().strip() == b"1")
    # it died (its memory bound): the next question starts another
    except OSError:
        pass
    _ended(process)
    return None, 0.0


def _started_judge():
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import rewards; rewards.judge()"
    command = [sys.executable, "-c", code]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    # its imports (sympy) take seconds, more on a loaded machine: not counted in a comparison's bound
    try:
        if _readable(process.stdout, 120) and process.stdout.readline() == b"ready\n":
            return process
    except BaseException:
        _ended(process)
        raise
    _ended(process)
    raise RuntimeError("math_answer: its judge did not start in 120 s")


def _readable(pipe, seconds):
    # poll, not select.select: the trainer's descriptors may be numbered past 1,024
    poll = select.poll()
    poll.register(pipe, select.POLLIN)
    return bool(poll.poll(seconds * 1000))


def _ended(process):
    """Killed, reaped, its pipes closed: nothing of a judge is left behind."""
    process.kill()
    process.wait()
    process.stdin.close()
    process.stdout.close()


def judge():
    """The judge's process (math_answer): a line [gold, text] in, a line 1 or 0 out, until its input
    closes. It dies with the run (PR_SET_PDEATHSIG) and holds at most 2 GiB."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    resource.setrlimit(resource.RLIMIT_AS, (2**31, 2**31))
    # its notes that the timeouts are ours (its own, signal.alarm, need a main thread)
    logging.disable(logging.WARNING)
    from math_verify import parse, verify

    answers = os.fdopen(os.dup(1), "w")
    # what the libraries print goes to stderr, not into the answers
    os.dup2(2, 1)
    print("ready", file=answers, flush=True)
    for line in sys.stdin:
        gold, text = json.loads(line)
        try:
            # a gold without $...$ or \\boxed is read as one formula first: (1, 2) is a pair, not its last
            # number
            expected = None
            if "$" not in gold and "\\boxed" not in gold:
                expected = parse(f"${gold}$", parsing_timeout=None)
            expected = expected or parse(gold, parsing_timeout=None)
            found = parse(text, parsing_timeout=None)
            equal = bool(expected and found) and verify(expected, found, timeout_seconds=None)
        # what it cannot read is not equal
        except Exception:
            equal = False
        print(int(equal), file=answers, flush=True)


def format_reward(completions, truncated, **kwargs):
    """1 if the rollout finished by itself with a final turn that is a bare number."""
    return [
        float(not cut and bool(re.fullmatch(r"\s*-?\d+(?:\.\d+)?\s*", final_text(messages))))
        for messages, cut in zip(completions, truncated)
    ]


def countdown(completions, numbers, target, **kwargs):
    """1 if the final assistant turn's last expression uses each of `numbers` exactly once and equals
    `target` (the columns of the built-in countdown task), evaluated exactly by the calculator tool's
    arithmetic."""
    rewards = []
    for messages, given, goal in zip(completions, numbers, target):
        candidates = _EXPRESSION.findall(final_text(messages))
        expressions = [e.strip() for e in candidates if re.search(r"\d\s*[-+*/]", e)]
        try:
            last = expressions[-1]
            uses_each_once = sorted(map(int, re.findall(r"\d+", last))) == sorted(given)
            ok = uses_each_once and calculator(last) == str(goal)
        # no expression, or one that is not arithmetic (unbalanced, division by zero, ...)
        except Exception:
            ok = False
        rewards.append(float(ok))
    return rewards


def tool_use(tool_calls, tool_failures, **kwargs):
    """1 for at least one tool call with no failures, 0 for no call, -0.5 per failed call."""
    return [float(calls > 0 and fails == 0) - 0.5 * fails for calls, fails in zip(tool_calls, tool_failures)]


async def env_reward(environments, **kwargs):
    """Each rollout's environment's score of its final state: its reward() method, or TRL's get_reward()
    (tools.py), bounded by --tool-timeout and, if sync, in a thread: never on the event loop, which every
    rollout in flight shares."""

    def score(environment):
        method = getattr(environment, reward_method(environment))
        return tools.call_method(method, {}, tools.METHOD_TIMEOUT)

    return await asyncio.gather(*[score(environment) for environment in environments])


# FORK: add a reward (a function above, its name here; --rewards NAME:WEIGHT picks it)
REWARDS = {fn.__name__: fn for fn in (correct_answer, math_answer, format_reward, countdown, tool_use, env_reward)}


# FORK: add a task (its rows here, its reward above and in REWARDS)
def task_rows(n, seed, task="arithmetic", max_operand=4, terms=2, operations="+-"):
    """The built-in tasks, as dataset rows with the columns their rewards read. arithmetic:
    'What is 3 + 4?', the answer a column (reward correct_answer); with the defaults, 50 distinct
    problems, few enough for the tiny model to learn in a few dozen steps. countdown: reach a target from
    given numbers, each used once (reward countdown): a search, not a recall. `terms` operands up to
    max_operand, operators drawn from `operations`. guess: the game of tools.GuessNumber, the number to
    find a column (reward env_reward)."""
    rng, rows = random.Random(seed), []
    if task == "guess":
        largest = GuessNumber.largest
        game = f"Guess my number from 1 to {largest}. If wrong, I say higher or lower and what is left."
        return [{"id": i, "prompt": game, "secret": rng.randint(1, largest)} for i in range(n)]
    for attempt in itertools.count():
        if len(rows) == n:
            return rows
        if attempt == 1000 * n:
            raise SystemExit(
                f"--task {task} --max-operand {max_operand} --terms {terms} --operations {operations}: "
                f"too few problems have a whole{' positive' * (task == 'countdown')} answer; widen them"
            )
        numbers = [rng.randint(0 if task == "arithmetic" else 1, max_operand) for _ in range(terms)]
        expression = str(numbers[0])
        # countdown nests at random: its target is not simply read left to right
        for x in numbers[1:]:
            expression = f"{expression} {rng.choice(operations)} {x}"
            expression = f"({expression})" if task == "countdown" and rng.random() < 0.5 else expression
        # ValueError: longer than the calculator takes
        with contextlib.suppress(ZeroDivisionError, ValueError):
            value = calculator(expression)
            if task == "arithmetic" and re.fullmatch(r"-?\d+", value):
                rows.append({"id": len(rows), "prompt": f"What is {expression}?", "answer": int(value)})
            # a positive whole target
            elif task == "countdown" and value.isdigit() and value != "0":
                rng.shuffle(numbers)
                given = ", ".join(map(str, numbers))
                prompt = (
                    f"Using the numbers {given}, each exactly once, and the operations "
                    f"{' '.join(operations)}, write an expression equal to {value}."
                )
                rows.append({"id": len(rows), "numbers": numbers, "target": int(value), "prompt": prompt})
