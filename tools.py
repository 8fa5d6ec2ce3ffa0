"""Tools and environments the model can use.

Tools: add a function with type hints and a Google-style docstring, register it in TOOLS below, and
`--tools NAME` offers it to the model. Its JSON schema is derived from the signature and docstring by
transformers' `get_json_schema`, so the description the model sees is the one written here. Sync tools run in
a thread pool, `async def` tools are awaited; both get `--tool-timeout`. A tool signals bad input by raising:
the message goes back to the model and the call counts as a failure.

Environments: a class, registered in ENVIRONMENTS below (`--env NAME`) or anywhere
(`--env path/to/file.py:Class`). Each rollout has an instance of its own, never shared by two in flight; an
instance is reused after a reset, so no more exist than rollouts in flight (evaluation included). An instance
runs one call at a time: calls in one turn run in the order the model wrote them. Every method may be sync (in
a thread, never on the event loop) or `async def`, bounded by --tool-timeout (a reset by the class's
start_timeout where longer); an async call past it is cancelled and the instance released (its state unknown:
its session or process ends), a sync one (reward() and release() too) holds its thread and the instance, which
takes no further call and is not reused (a TimeoutError it raises itself is an error, not ours):
    reset(**row)      the dataset row, every column (a parameter without a default names a column that every
                      row of the environment must have: checked at start). Returns None, or text appended to
                      the prompt's last message: the same for the G rollouts of a group (they answer one
                      task), else the group is dropped
    public methods    typed and documented as tools are: the tools the model sees in this environment's rows
    respond(message)  optional: the model ended a turn without a tool call (message: that turn, as the rewards
                      see it). Text is the user's next turn; None ends the rollout. Turns are bounded by
                      --max-tool-turns
    reward()          optional: its score of its final state, the reward `env_reward`; every reward function
                      gets the instances as `environments`. TRL's name, get_reward(), where reward() is absent
    release()         optional: its group is done (scored), or a call timed out; what it holds until its next
                      reset may go (a process, a session). A method called after it must work again (start
                      afresh), or raise
    close()           optional: called once per instance at the end of the run, also after an error or Ctrl-C;
                      it and release() run in a thread of their own if sync: never refused for want of a tool
                      thread
    configured(args)  optional classmethod: the class to run with, given the run's flags; may refuse the run
                      (SystemExit)
A method that raises or hangs is an error message to the model and a counted failure; a reset that does drops
its group (counted). One that raises EnvironmentGone (its server or process is gone) ends the run, the last
finished step saved. --mcp makes an environment of an MCP server (MCPSession), --env python one of a code
interpreter (Python, in the sandbox of sandbox.py); with several environments, a row's column `env` names its
own (TRL's `environment`, where `env` is absent). A class written to TRL's environment_factory contract
(reset, tools, get_reward) runs unchanged.

What a tool may do, since its arguments are whatever the model wrote: a sync tool may wait (I/O, a lock),
better with a timeout of its own: at `--tool-timeout` the model gets an error, but Python cannot stop the
thread, which stays held until the call returns; a call that finds all 64 threads held is refused at once and
counted (`tools/refused`). It may not compute for long: CPU-bound work holds the interpreter lock (a C-level
operation on a huge number holds it for its whole length), which stops the run's event loop, its timeouts and
its signal handlers. Bound the work by the size of the input, as the calculator bounds its numbers, or run it
in a process of its own, as a code interpreter must (generated code is hostile input). An `async def` tool
runs on the run's event loop: it must never block.
"""

import ast
import asyncio
import concurrent.futures
import contextlib
import functools
import importlib.util
import inspect
import json
import logging
import math
import operator
import os
import random
import re
import resource
import shlex
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import sandbox

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
    ast.FloorDiv: operator.floordiv,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# of a numerator or denominator (1,233 digits): (9**64)**64 alone would take 13,000
MAX_BITS = 4096


def _bits(value):
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def _evaluate(node):
    # Walk the syntax tree ourselves instead of calling eval(): only numbers and arithmetic pass.
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > 64):
            raise ValueError("exponents must be integers of at most 64")
        # A product's size is bounded before it is computed: one power of a huge number is a
        # single C call that holds the interpreter lock for hours ((((9**64)**64)**64)**64 took
        # 13 s), and no timeout can interrupt it.
        if isinstance(node.op, ast.Pow):
            size = _bits(left) * abs(right)
        elif isinstance(node.op, (ast.Mult, ast.Div)):
            size = _bits(left) + _bits(right)
        # + - % // add their operands' sizes at most, which the expression's 200 characters bound
        else:
            size = 0
        if size > MAX_BITS:
            raise ValueError(f"numbers of more than {MAX_BITS} bits are not supported")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    got = ast.dump(node)[:60]
    raise ValueError(f"only numbers and + - * / // % ** are allowed, got {got}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: An arithmetic expression with numbers, parentheses and + - * / // % **, e.g. "12 * (3 + 4)".
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _evaluate(ast.parse(expression, mode="eval"))
    return (
        str(value.numerator)
        if value.denominator == 1
        else f"{value.numerator}/{value.denominator} (= {float(value):.6g})"
    )


_UNITS = {
    "mm": 0.001,
    "cm": 0.01,
    "m": 1.0,
    "km": 1000.0,
    "in": 0.0254,
    "ft": 0.3048,
    "mi": 1609.344,
    "g": 0.001,
    "kg": 1.0,
    "lb": 0.45359237,
    "oz": 0.028349523125,
    "s": 1.0,
    "min": 60.0,
    "h": 3600.0,
}
_DIMENSION = {
    "mm": "length",
    "cm": "length",
    "m": "length",
    "km": "length",
    "in": "length",
    "ft": "length",
    "mi": "length",
    "g": "mass",
    "kg": "mass",
    "lb": "mass",
    "oz": "mass",
    "s": "time",
    "min": "time",
    "h": "time",
}


def convert_units(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a quantity between units of length, mass or time.

    Args:
        value: The quantity to convert.
        from_unit: Unit of the value, one of mm, cm, m, km, in, ft, mi, g, kg, lb, oz, s, min, h.
        to_unit: Unit to convert to, of the same dimension as from_unit.
    """
    for unit in (from_unit, to_unit):
        if unit not in _UNITS:
            raise ValueError(f"unknown unit {unit!r}; known: {', '.join(_UNITS)}")
    have = _DIMENSION[from_unit]
    want = _DIMENSION[to_unit]
    if have != want:
        raise ValueError(f"cannot convert {have} ({from_unit}) to {want} ({to_unit})")
    return f"{value * _UNITS[from_unit] / _UNITS[to_unit]:.6g} {to_unit}"


_FACTS = {
    "water boiling point": "100 degrees Celsius at sea level",
    "speed of light": "299792458 m/s",
    "earth radius": "6371 km",
    "pi": "3.14159265358979",
}


async def lookup(topic: str) -> str:
    """Look up a reference fact (an example of an async tool that waits on I/O).

    Args:
        topic: The fact to look up, e.g. "speed of light".
    """
    # stands in for a network round trip; the event loop keeps running
    await asyncio.sleep(0.05)
    key = topic.strip().lower()
    if key not in _FACTS:
        raise KeyError(f"no entry for {topic!r}; known topics: {', '.join(_FACTS)}")
    return _FACTS[key]


# FORK: add a tool (a function above, its name here; --tools NAME offers it)
TOOLS = {fn.__name__: fn for fn in (calculator, convert_units, lookup)}


# --- Environments: their contract is this file's docstring ------------------------------------------


# A call's arguments as a tool receives them: strict JSON (async_grpo.py's parsers decode with it), of the
# types its schema names.
# deeper arguments are refused: rendering or printing them could exhaust the stack
MAX_ARGUMENT_DEPTH = 16


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of range")
    return value


def _no_duplicates(pairs):
    obj = dict(pairs)
    if len(obj) < len(pairs):
        raise ValueError(f"duplicate key in {str(pairs)[:100]}")
    return obj


JSON_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
    "null": type(None),
}


JSON = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=_no_duplicates)


def is_json_type(value, kind, unknown=True):
    """JSON schema's type check (a bool is not a number); `unknown` for a type it does not name."""
    return (
        unknown
        if kind not in JSON_TYPES
        else isinstance(value, JSON_TYPES[kind]) and not (isinstance(value, bool) and kind in ("integer", "number"))
    )


def schema_types(schema):
    """The JSON types a schema allows (none: any), through type lists, anyOf/oneOf and nullable
    (Optional[int])."""
    schema = schema if isinstance(schema, dict) else {}
    kinds = [schema["type"]] if isinstance(schema.get("type"), str) else list(schema.get("type", []))
    kinds += [t for part in schema.get("anyOf", []) + schema.get("oneOf", []) for t in schema_types(part)]
    return kinds + ["null"] * bool(kinds and schema.get("nullable"))


def decode_json(text, start=0):
    """Strict JSON value at text[start:] (whitespace skipped) -> (value, end). Raises ValueError."""
    start = len(text) - len(text[start:].lstrip())
    try:
        return JSON.raw_decode(text, start)
    except RecursionError:
        raise ValueError(f"JSON nested too deeply at {text[start : start + 40]!r}...")
    except ValueError as e:
        raise ValueError(f"not JSON ({e})")


def argument_errors(schema, arguments):
    """What is wrong with a call's arguments against the tool's JSON schema (empty: nothing)."""
    properties = schema["parameters"].get("properties", {})
    required = schema["parameters"].get("required", [])
    errors = [f"missing argument {k!r}" for k in required if k not in arguments]
    errors += [f"unknown argument {k!r}" for k in arguments if k not in properties]
    for key, value in arguments.items():
        types = schema_types(properties.get(key))
        if types and not any(is_json_type(value, t) for t in types):
            errors.append(f"argument {key!r} must be {' or '.join(types)}, got {json.dumps(value)[:50]}")
    return errors


def typed(value, schema):
    """An XML parameter's text as a non-string type its JSON schema allows (`5` is 5 where an integer
    may go, `null` None where null may); else the text (the argument check says where a string may not go)."""
    with contextlib.suppress(ValueError):
        parsed, end = decode_json(value)
        if end == len(value.rstrip()) and any(
            is_json_type(parsed, kind, unknown=False) for kind in schema_types(schema) if kind != "string"
        ):
            return parsed
    return value


# The turns and the tool a chat template is checked with at start (async_grpo.py's prepare_chat_template). A
# call's arguments are data, never Python keywords: a tool may have one called `name`.
def function_call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


PROBE = [
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": "", "tool_calls": [function_call("calculator", {"expression": "6 * 7"})]},
    {"role": "tool", "name": "calculator", "content": "42"},
    {"role": "assistant", "content": "<think>\nThe tool said 42.\n</think>\n\n42"},
    {"role": "user", "content": "And 6 * 8?"},
    {"role": "assistant", "content": "48"},
]


# A tool with every JSON type (a union; an argument called `name`), and calls to it (one and three
# a turn) that the start-up check renders with the run's template and parses back, equal.
ROUND_TRIP_TOOL = {
    "type": "function",
    "function": {
        "name": "round_trip_probe",
        "description": "Stands in for the run's tools in the start-up check.",
        "parameters": {
            "type": "object",
            "required": ["text"],
            "properties": {
                "text": {"type": "string"},
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "flag": {"type": "boolean"},
                "items": {"type": "array"},
                "options": {"type": "object"},
                "name": {"type": ["string", "null"]},
            },
        },
    },
}


ROUND_TRIP = [
    ("", [function_call("round_trip_probe", {"text": "6 * 7"})]),
    (
        "Three at once.",
        [
            function_call(
                "round_trip_probe", {"text": 'say "hi"\nthen <b>stop</b> {}', "count": 3, "ratio": -2.5, "flag": True}
            ),
            function_call(
                "round_trip_probe",
                {"text": "x", "items": [1, "two", [3.5]], "options": {"k": {"deep": [False, None]}}},
            ),
            function_call("round_trip_probe", {"name": None, "text": ""}),
        ],
    ),
]


class TimedOut(TimeoutError):
    """One of our bounds passed (a call's, a reset's, a wait for its instance), told apart
    from a TimeoutError that a tool raises itself (a socket's, say): that one is the tool's
    error, which the model sees as it is."""


class EnvironmentGone(ConnectionError):
    """Raised by an environment that cannot go on (its server or process is gone): the run
    ends with this message, its last finished step saved, where any other error would only
    be the model's to see, call after call."""


class GuessNumber:
    """A game whose next observation depends on the last guess: find a whole number from 1 to 7 in 3
    guesses, told after a wrong one "Higher" or "Lower" and what is left ("Higher: 5 to 7."). The rows
    of --task guess hold the number; the reward is 1 for a win. Halving what is left always wins;
    guessing anywhere in it, 2 games in 3."""

    largest = 7
    guesses = 3

    def reset(self, secret, **row):
        self.secret = secret
        self.low = 1
        self.high = self.largest
        self.tries = 0
        self.solved = False

    def respond(self, message):
        """The game's answer to the last number in the model's turn; None once the game is over."""
        numbers = re.findall(r"\d+", message["content"])
        # the last number, unless it is a million digits long
        guess = None
        if numbers and len(numbers[-1]) < 20:
            guess = int(numbers[-1])
        self.tries += 1
        self.solved = guess == self.secret
        if self.solved or self.tries == self.guesses:
            return None
        if guess is None:
            return f"Say a number from {self.low} to {self.high}."
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
            return f"Higher: {self.low} to {self.high}."
        self.high = min(self.high, guess - 1)
        return f"Lower: {self.low} to {self.high}."

    def reward(self):
        return float(self.solved)


class MCPSession:
    """The tools of an MCP server as an environment (--mcp), through the official `mcp` package. An instance
    holds one session: to a URL over streamable HTTP, or with a process of its own started from a command line
    (stdio). Each reset opens a new session (a rollout's calls may have changed the last one's state) and
    release() ends it: an idle instance holds none. A session that closes under a call (its server crashed) is
    a failed call and a new session; EnvironmentGone only where none opens. mcp_environment() makes the
    subclass whose methods are the server's tools."""

    # the --mcp value
    server = None
    # a started server's stderr goes there
    log = None
    # seconds a request may take (--tool-timeout): cancelling one does not stop the mcp package
    timeout = 10.0
    # seconds a session may take to open (its reset's bound): a stdio server is a process to start, and many
    # start at once after an evaluation or a crash (16 took 12.6 s on 2 cores), at most OPENING at a time
    start_timeout = 60.0

    async def reset(self, **row):
        # a server that crashed as its session opened: once more, else it is gone
        for attempt in range(2):
            await self.close()
            self.closing = asyncio.Event()
            opened = asyncio.get_running_loop().create_future()
            async with opening():
                self.session = asyncio.create_task(self._hold(opened))
                try:
                    self.client = await opened
                    return
                except EnvironmentGone:
                    if attempt:
                        raise

    async def _hold(self, opened):
        # anyio, under mcp, closes a session in the task that opened it: this one, which
        # lives as long as the session
        import mcp
        from mcp.client.stdio import StdioServerParameters, stdio_client

        try:
            with open(self.log or "/dev/null", "ab") as log:
                if re.match(r"https?://", self.server):
                    transport = self.server
                else:
                    command, *args = shlex.split(self.server)
                    parameters = StdioServerParameters(command=command, args=args)
                    transport = stdio_client(parameters, errlog=log)
                # the handshake protocol: its sessions (Mcp-Session-Id) are what a server keeps state in
                connecting = mcp.Client(transport, mode="legacy", read_timeout_seconds=self.start_timeout)
                async with connecting as client:
                    opened.set_result(client)
                    await self.closing.wait()
        except Exception as e:
            # anyio's task groups wrap the cause in groups
            while getattr(e, "exceptions", None):
                e = e.exceptions[0]
            if not opened.done():
                why = f"--mcp {self.server}: no session ({type(e).__name__}: {e})"
                opened.set_exception(EnvironmentGone(why))

    async def _call(self, name, arguments):
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        # released after a call that timed out: a fresh session
        if not getattr(self, "session", None):
            await self.reset()
        try:
            result = await self.client.call_tool(name, arguments, read_timeout_seconds=self.timeout)
        except MCPError as e:
            if e.code != CONNECTION_CLOSED:
                raise
            # its process crashed (now, or while the rollout's model wrote its turn): a failed call and a
            # fresh session, the run ended only where none opens
            try:
                await self.reset()
            except EnvironmentGone as gone:
                raise EnvironmentGone(f"the MCP server {self.server} is gone: {e}; {gone}") from None
            ended = f"the MCP server's session ended during the call ({e})"
            raise RuntimeError(f"{ended}: a new one is open") from None
        text = "\n".join(getattr(part, "text", f"[{part.type}]") for part in result.content)
        if result.is_error:
            raise RuntimeError(text)
        return text

    async def release(self):
        # the session ends now, its process too: one kept until the next reset would stay open for good if the
        # instance is not reused (an evaluation's, idle after it), and a call may have changed its state
        await self.close()

    async def close(self):
        if getattr(self, "session", None):
            # an open session closes itself, in its task; one opening ends within `timeout`
            self.closing.set()
            await asyncio.gather(self.session, return_exceptions=True)
            self.session = None


# the event loop -> its Semaphore: sessions opening at once
OPENING = weakref.WeakKeyDictionary()


def opening():
    """The running loop's bound on sessions opening at once: a stdio server's start is a
    process's (CPU-bound)."""
    loop = asyncio.get_running_loop()
    if loop not in OPENING:
        OPENING[loop] = asyncio.Semaphore(os.cpu_count() or 1)
    return OPENING[loop]


# what listing an MCP server's tools at start may take, with its start
LISTING_SECONDS = 20.0


def mcp_environment(server, log=None, timeout=10.0):
    """The environment class of `--mcp server`: a method per tool the server lists now, its schema the
    server's; `timeout`: the seconds a request may take."""
    cls = type("mcp", (MCPSession,), {"server": server, "log": log, "timeout": timeout})
    # its warnings (a session that could not be closed on a dead server, one per rollout) would bury the one
    # message that ends the run: what goes wrong reaches the run as exceptions
    logging.getLogger("mcp").setLevel(logging.CRITICAL)

    def method(tool):
        async def call(self, **arguments):
            return await self._call(tool.name, arguments)

        # what a timeout's message names
        call.__name__ = tool.name
        call.__qualname__ = tool.name
        function = {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.input_schema,
        }
        # what environment_schemas() takes for this tool
        call.schema = {"type": "function", "function": function}
        return call

    async def listed():
        probe = cls()
        try:
            # one server, started alone (16 at once took 12.6 s on 2 cores): a bound of its own, not
            # a session's two tries of start_timeout
            seconds = max(timeout, LISTING_SECONDS)
            try:
                async with asyncio.timeout(seconds):
                    await probe.reset()
            except TimeoutError:
                # its handshake would wait out start_timeout
                probe.session.cancel()
                raise TimeoutError(f"no session in {seconds:.0f} s, its start included") from None
            page = await probe.client.list_tools()
            tools = list(page.tools)
            # pages, a bound that a server paging forever cannot pass
            for _ in range(100):
                if page.next_cursor:
                    page = await probe.client.list_tools(cursor=page.next_cursor)
                    tools += page.tools
        finally:
            await probe.close()
        return tools

    for tool in asyncio.run(listed()):
        if hasattr(cls, tool.name) or tool.name.startswith("_"):
            clash = f"its tool {tool.name!r} has the name of a method of MCPSession"
            raise ValueError(f"{clash}; rename it")
        setattr(cls, tool.name, method(tool))
    return cls


class Python:
    """--env python: a code interpreter per rollout, each in a sandbox of its own (sandbox.py: what
    it isolates, and how). reset starts the rollout's interpreter, which boots while the model
    writes its first turn; release ends it and all it started (its scratch directory too). Its
    methods are async: a call waits on the event loop, not in one of the 64 tool threads, so that
    every rollout in flight may run code at once."""

    # --tool-timeout: a call gets 0.9 of it, so that the model sees the interpreter's own error
    timeout = 10.0
    # --python-memory
    memory_mb = 512
    # --no-python-sandbox: False
    sandboxed = True
    interpreter = None

    @classmethod
    def configured(cls, args):
        # refuses the run where the sandbox cannot start
        sandbox.check(args.python_memory, args.python_sandbox)
        flags = {
            "timeout": args.tool_timeout,
            "memory_mb": args.python_memory,
            "sandboxed": args.python_sandbox,
        }
        return type("python", (cls,), flags)

    async def reset(self, **row):
        await self.release()
        self.interpreter = sandbox.Interpreter(self.memory_mb, self.sandboxed)

    async def python(self, code: str) -> str:
        """Run Python code in your own interpreter, as a notebook cell: variables, imports and files stay from call to
        call. Shows what it prints and its last expression's value, or the traceback, cut at 1000 characters.

        Args:
            code: Python source, e.g. "print(3 + 4)".
        """
        # released after a call that timed out: a fresh interpreter
        if self.interpreter is None:
            self.interpreter = sandbox.Interpreter(self.memory_mb, self.sandboxed)
        return await self.interpreter.run(code, 0.9 * self.timeout)

    async def release(self):
        if self.interpreter is not None:
            self.interpreter.stop()
            self.interpreter = None

    async def close(self):
        await self.release()
        # the run ends: every stopped interpreter's bwrap reaped (a thread does it), so
        # that none outlives the run
        await asyncio.to_thread(sandbox.reaped)


# --- Tools and environment instances at work: bounded calls, threads, one call at a time, lifecycle methods

# a sync tool that waits holds a thread, not the loop
TOOL_THREADS = ThreadPoolExecutor(64, thread_name_prefix="tool")
# A slot per thread, taken by a call past its timeout until it returns, late or never (Python cannot stop a
# thread): with every thread so held, a call is refused at once and counted (tools/refused), not queued behind
# them to time out unseen; calls merely busy queue. What a sync tool may do (computing holds the interpreter,
# not a thread): tools.py.
TOOL_SLOTS = threading.BoundedSemaphore(64)
# calls refused so far
TOOLS_REFUSED = [0]
# ids of the environment instances whose sync call went on past its timeout: never reused
# (async_grpo.environment_instances)
HUNG = set()


async def call_function(fn, arguments, name, timeout):
    """(fn(**arguments), True) within `timeout` seconds, or (the error for the model, False). Raises
    EnvironmentGone alone: an environment that cannot go on ends the run (tools.py)."""
    try:
        # after the calls to its instance before it
        async with one_call_at_a_time(fn, timeout, HUNG):
            return await bounded(fn, arguments, timeout), True
    except TimedOut:
        return f"Error: {name} timed out after {timeout} s", False
    except EnvironmentGone:
        raise
    except Exception as e:
        # a tool's bug is the model's problem to route around, not the run's
        return f"Error: {type(e).__name__}: {e}", False


async def bounded(fn, arguments, timeout):
    """fn(**arguments) within `timeout` seconds (arguments a dict: one may be called fn): awaited if async,
    else in a thread of TOOL_THREADS, where after a timeout it goes on holding a slot (TOOL_SLOTS) and its
    environment instance, if a method, takes no other call and is not reused; refused at once while every slot
    is held."""
    running = None
    if inspect.iscoroutinefunction(fn):
        pending = fn(**arguments)
    elif TOOL_SLOTS.acquire(blocking=False):
        # a look: some thread is not held by a call past its timeout
        TOOL_SLOTS.release()
        running = TOOL_THREADS.submit(fn, **arguments)
        pending = asyncio.wrap_future(running)
    else:
        TOOLS_REFUSED[0] += 1
        # the first; tools/refused counts them all
        if TOOLS_REFUSED[0] == 1:
            held = "every tool thread is held by a call still running"
            print(f"warning: a tool call refused: {held}", flush=True)
        raise RuntimeError("not run: every tool thread is held by a call that has not returned")
    try:
        async with asyncio.timeout(timeout) as bound:
            return await pending
    except TimeoutError:
        # the tool's own
        if not bound.expired():
            raise
        # one still queued was cancelled with it; one running holds its thread until it returns
        if running is not None and not running.cancelled():
            HUNG.add(id(getattr(fn, "__self__", None)))
        if running is not None and running.running() and TOOL_SLOTS.acquire(blocking=False):
            running.add_done_callback(lambda _: TOOL_SLOTS.release())
        raise TimedOut(f"{named(fn)} took more than {timeout} s") from None


class Dropped(Exception):
    """Why a group is not trained (its environment did not reset, its rewards failed): take() reports and
    counts it."""


# --tool-timeout (load_environments): what reward() may take, called from env_reward
METHOD_TIMEOUT = 10.0
# id(instance) -> (the event loop, an asyncio.Lock): its calls on that loop, one at a time
_LOCKS = {}


def instance_lock(fn):
    """The lock of the instance whose method fn is, on the running loop; None for a plain function (a
    tool of --tools, which holds no state: its calls run concurrently). asyncio's locks are first come,
    first served: the calls of one turn, started in the order the model wrote them, run in that order,
    each seeing what the one before left."""
    instance = getattr(fn, "__self__", None)
    if instance is None or inspect.isclass(instance) or inspect.ismodule(instance):
        return None
    loop = asyncio.get_running_loop()
    held = _LOCKS.get(id(instance))
    # a test may run an instance on several loops, one after another
    if held is None or held[0] is not loop:
        held = (loop, asyncio.Lock())
        _LOCKS[id(instance)] = held
    return held[1]


@contextlib.asynccontextmanager
async def one_call_at_a_time(fn, timeout, hung):
    """Around a call of fn (its bounded run, in async_grpo.py): after the calls to its instance before
    it (a plain function: at once). `hung`: ids of the instances in which a sync call goes on past its
    timeout: they take no other. An async call past its timeout, cancelled, left its instance in a
    state unknown: released, its session or process ends (tools.py's contract), and its next call
    starts afresh: nothing is held per timeout."""
    lock = instance_lock(fn)
    if lock is None:
        yield
        return
    instance = fn.__self__
    try:
        await asyncio.wait_for(lock.acquire(), timeout)
    except TimeoutError:
        waited = f"waited more than {timeout} s for its instance's call before it"
        raise TimedOut(f"{named(fn)} {waited}") from None
    try:
        if id(instance) in hung:
            raise RuntimeError("not run: a call of this environment that timed out still runs in it")
        yield
    except TimedOut:
        if id(instance) not in hung and hasattr(instance, "release"):
            await call_method(instance.release, {}, METHOD_TIMEOUT)
        raise
    finally:
        lock.release()


async def call_method(fn, arguments, timeout):
    """fn(**arguments), a method of an environment's life (reward, release, close), within `timeout`
    seconds: awaited if async, else in a daemon thread of its own, not one of the tool threads, which calls
    past their timeout may all hold: it is never refused nor queued, so close() runs whatever the pool holds
    (and one that hangs keeps a thread the exit does not wait for, and its instance is retired, as a call's:
    HUNG). An awaitable it returns is awaited too. Not run, but close(), in an instance in which a call
    still runs (HUNG): one call at a time."""
    thread = None
    instance = getattr(fn, "__self__", None)
    if instance is not None and id(instance) in HUNG and fn.__name__ != "close":
        hung = "a call of this environment that timed out still runs in it"
        raise RuntimeError(f"{named(fn)} not run: {hung}")
    if inspect.iscoroutinefunction(fn):
        running = fn(**arguments)
    else:
        done = concurrent.futures.Future()

        def target():
            try:
                value = fn(**arguments)
            except BaseException as e:
                value = e
            # its wait ended already
            if not done.set_running_or_notify_cancel():
                return
            if isinstance(value, BaseException):
                done.set_exception(value)
            else:
                done.set_result(value)

        name = f"environment-{fn.__name__}"
        thread = threading.Thread(target=target, daemon=True, name=name)
        thread.start()
        running = asyncio.wrap_future(done)
    try:
        async with asyncio.timeout(timeout) as bound:
            value = await running
            if inspect.isawaitable(value):
                return await value
            return value
    except TimeoutError:
        # its own
        if not bound.expired():
            raise
        # it goes on in its instance
        if thread is not None and thread.is_alive() and instance is not None:
            HUNG.add(id(instance))
        raise TimedOut(f"{named(fn)} took more than {timeout} s (--tool-timeout)") from None


async def close_environments(ctx, timeout):
    """close() every instance made (ctx.alive), once, each within `timeout` seconds, however the run ends."""
    closable = [env for env in ctx.alive if hasattr(env, "close")]
    closing = [call_method(env.close, {}, timeout) for env in closable]
    ctx.alive.clear()
    await asyncio.gather(*closing, return_exceptions=True)


async def bounded_reset(env, row, timeout):
    """env.reset(**row) within `timeout` seconds, or its class's start_timeout where
    longer (an MCP server's start)."""
    seconds = max(timeout, getattr(env, "start_timeout", 0))
    return await bounded(env.reset, row, seconds)


def named(fn):
    """Class.method for an instance's method, else the function's name: what a timeout's message names."""
    instance = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", str(fn))
    if instance is not None and not inspect.ismodule(instance):
        return f"{type(instance).__name__}.{name}"
    return name


# FORK: add an environment (a class above, its name here; --env NAME picks it)
ENVIRONMENTS = {"GuessNumber": GuessNumber, "python": Python}


def environment_class(spec):
    """The class `--env spec` names: one of ENVIRONMENTS, or path/to/file.py:Class."""
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS[spec]
    path, _, name = spec.rpartition(":")
    location = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(location)
    module.__spec__.loader.exec_module(module)
    return getattr(module, name)


def environment_tools(cls):
    """{name: method}: the tools of an environment class, its public methods but the
    contract's (and get_reward)."""
    contract = ("reset", "respond", "reward", "get_reward", "release", "close", "configured")
    names = [n for n in dir(cls) if not n.startswith("_") and n not in contract]
    return {name: getattr(cls, name) for name in names if callable(getattr(cls, name))}


def environment_schemas(cls):
    """Their schemas, by transformers' get_json_schema as for TOOLS, or their own
    (`schema`: an MCP server's)."""
    from transformers.utils import get_json_schema

    return [getattr(fn, "schema", None) or get_json_schema(fn) for fn in environment_tools(cls).values()]


def load_environments(args, log=None):
    """--env and --mcp as {name: class}: from tools.ENVIRONMENTS, from a file
    (path/to/file.py:Class), or an MCP server's (its tools listed now; `log`: a started server's
    stderr). Checked here, before vLLM starts."""
    environments = {}
    for spec in args.env_names:
        try:
            cls = environment_class(spec)
            # its flags; it may refuse the run
            if hasattr(cls, "configured"):
                cls = cls.configured(args)
            environments[cls.__name__] = cls
            environment_schemas(cls)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            raise SystemExit(f"--env {spec}: cannot load it, or its tools' schemas ({why})")
    if args.mcp:
        try:
            environments["mcp"] = mcp_environment(args.mcp, log, args.tool_timeout)
        except Exception as e:
            raise SystemExit(f"--mcp {args.mcp}: cannot list its tools ({e})")
    for name, cls in environments.items():
        clash = sorted(set(environment_tools(cls)) & set(args.tool_names))
        if clash or not hasattr(cls, "reset"):
            needs = f"needs a reset(**row) method, and tools not named as --tools' {clash}"
            raise SystemExit(f"--env {name}: {needs}")
    scored = [reward_method(c) for c in environments.values()]
    # no environment at all: nothing to score either
    if "env_reward" in args.reward_weights and not all(scored or [0]):
        meaning = "every row's environment's reward() or get_reward() (--env, --task guess)"
        raise SystemExit(f"--rewards env_reward: it is {meaning}")

    global METHOD_TIMEOUT
    METHOD_TIMEOUT = args.tool_timeout
    descriptors(args, environments)
    return environments


# an instance's descriptors in the trainer, at most: an interpreter's 3 pipes, bwrap's
# info, a pidfd at its stop
INSTANCE_DESCRIPTORS = 8


def descriptors(args, environments):
    """The soft limit on open descriptors raised to the hard one (1,024 of most installs' soft limit is
    less than a --env python run at the default flags holds), and a run whose instances (training's, up
    to 2 x --max-inflight rollouts and a group; an evaluation's, as many again) and requests cannot fit
    in it refused at start: a shortage mid-run fails rows, resets and new connections to vLLM alike
    (EMFILE), and reads as a failed server."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    instances = (2 + 2 * bool(args.eval_every)) * args.max_inflight + args.num_generations
    # the run's own (512), its instances', and its requests' (connections to vLLM)
    needed = 512 + INSTANCE_DESCRIPTORS * instances * bool(environments) + 4 * args.max_inflight
    if hard != resource.RLIM_INFINITY and needed > hard:
        evaluating = " with --eval-every" if args.eval_every else ""
        raise SystemExit(
            f"--max-inflight {args.max_inflight}{evaluating}: up to {instances} environment instances "
            f"and their requests need about {needed} open descriptors, "
            f"over this process's limit of {hard} (ulimit -Hn): "
            "lower --max-inflight, or raise the hard limit"
        )


def reward_method(env):
    """The name of an environment's (class or instance) score of its final state: reward,
    else TRL's get_reward, else None."""
    for name in ("reward", "get_reward"):
        if callable(getattr(env, name, None)):
            return name
    return None


def check_columns(environments, rows, args):
    """Every row has the columns its environment's reset needs (its parameters without a
    default), or the run stops here, at start, naming the class, the column and a row: not after
    groups failed their resets one by one."""
    source = f"--dataset {args.dataset}" if args.dataset else f"--task {args.task}"
    for name, cls in environments.items():
        needed = needed_columns(cls)
        own = [row for row in rows if environment_of(row, environments) == name]
        for column in needed:
            lacking = [row for row in own if column not in row]
            if lacking:
                first = lacking[0]["id"]
                raise SystemExit(
                    f"--env {name}: {cls.__name__}.reset needs the column `{column}`, "
                    f"which {len(lacking)} of its {len(own)} rows of {source} lack "
                    f"(the first: id {first!r}); add the column, or give the parameter a default"
                )


def needed_columns(cls):
    """The columns an environment class's reset needs: its named parameters without a default."""
    reset = inspect.getattr_static(cls, "reset", None)
    parameters = list(inspect.signature(cls.reset).parameters.values())
    # a plain method: its first parameter is the instance
    if inspect.isfunction(reset):
        parameters = parameters[1:]
    named = (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_ONLY,
    )
    return [p.name for p in parameters if p.default is p.empty and p.kind in named]


def every_tool(schemas, environments):
    """The schemas of --tools and of every environment's tools, once each."""
    every = list(schemas or [])
    for cls in environments.values():
        every += environment_schemas(cls)
    # once each
    return list({s["function"]["name"]: s for s in every}.values())


def environment_of(row, environments):
    """The name of a row's environment: its column `env` (or TRL's `environment`), else the one
    environment of the run (None without any)."""
    if not environments:
        return None
    # the run's one environment, where it has one
    only = next(iter(environments)) if len(environments) == 1 else None
    name = row.get("env", row.get("environment", only))

    if name not in environments:
        names = ",".join(environments)
        raise SystemExit(
            f"row {row['id']!r}: its column `env` must name one of --env {names} (or TRL's `environment`)"
        )
    return name


# --- What tools say goes into the context as data ---------------------------------------------------


def result_ids(tok, head, suffix, messages, render_suffix):
    """Token ids of `head + suffix`, the tool-result turn as the template renders it, in which the messages'
    contents (what tools, environments and MCP servers said) are data: ordinary tokens, never an added token
    of the tokenizer (<|im_end|>, </tool_response>, [TOOL_RESULTS], ...), or a tool's text could write turns,
    roles and framing into the trained context. Where no content holds such a token's text (the common case),
    the text tokenized whole; else the template's own text (found by rendering the messages with markers in
    place of their contents: render_suffix(messages) -> that suffix) keeps its added tokens, and the whole is
    tokenized as the tokenizer would if the contents' were not added tokens (plain_ids). Neither
    split_special_tokens (it leaves added tokens not marked special: Qwen3's <tool_response>) nor tokenizing
    the contents in pieces (a SentencePiece-style tokenizer gives each piece a prefix space) does that. Raises
    Dropped (the group is not trained, the run goes on) where it cannot be done exactly."""
    try:
        added = {i: t for i, t in tok.added_tokens_decoder.items() if len(t.content) > 1}
        contents = [m["content"] for m in messages]
        if not any(t.content in content for content in contents for t in added.values()):
            return tok.encode(head + suffix, add_special_tokens=False)
        # private-use characters: no template writes them
        markers = [f"\ue000{i}\ue001" for i in range(len(messages))]
        marked = render_suffix([{**m, "content": marker} for m, marker in zip(messages, markers)])
        framing = re.split("|".join(map(re.escape, markers)), marked)
        if suffix != interleaved(framing, contents):
            # a template that changes a content as it renders it (escapes, strips)
            contents = rendered_contents(suffix, framing)
        framing[0] = head + framing[0]
        if head + suffix != interleaved(framing, contents):
            raise ValueError("the template's own text is not found around the contents")
        return plain_ids(tok, framing, contents, added)
    except Dropped:
        raise
    # the tokenizer's or the template's: one print must not end the run
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        raise Dropped(f"a tool result could not be tokenized as data ({why})") from None


def interleaved(framing, contents):
    """framing[0] + contents[0] + framing[1] + ...: the text of a turn from its pieces."""
    return "".join(f + c for f, c in zip(framing, [*contents, ""]))


def rendered_contents(suffix, framing):
    """The contents as a template rendered them into `suffix`: what lies between its own pieces."""
    contents = []
    at = len(framing[0])
    for piece in framing[1:]:
        end = suffix.find(piece, at) if piece else len(suffix)
        contents.append(suffix[at : max(end, at)])
        at = max(end, at) + len(piece)
    return contents


def plain_ids(tok, framing, contents, added):
    """Ids of framing[0] + contents[0] + framing[1] + ... tokenized whole, with the added tokens (`added`,
    by id) that the tokenizer finds in each framing piece and none in the contents: each one found stands
    in the text as its marker, the only added token of a copy of the tokenizer (plain_tokenizer), mapped
    back after. So the text between two of the template's added tokens is one piece, as the tokenizer cuts
    it: no prefix space or merge of its own."""
    plain, marker_of, unknown = plain_tokenizer(tok, tuple(sorted(added)))
    text, framed = [], []
    for piece, content in zip(framing, [*contents, ""]):
        at = 0
        encoding = tok.backend_tokenizer.encode(piece, add_special_tokens=False)
        for i, (start, end) in zip(encoding.ids, encoding.offsets):
            if i in added:
                text.append(piece[at:start] + marker_of[i])
                framed.append(i)
                at = end
        text.append(piece[at:] + content)
    original = {marker: i for i, marker in marker_of.items()}
    encoding = plain.encode("".join(text), add_special_tokens=False)
    ids = [original.get(token, i) for token, i in zip(encoding.tokens, encoding.ids)]
    # a content that holds a marker; a model that makes an added token of ordinary text (its unknown token
    # aside)
    found = [i for i in ids if i in added and i != unknown]
    if found != [i for i in framed if i != unknown]:
        raise ValueError("its added tokens are not the template's")
    return ids


@functools.lru_cache(maxsize=4)
def plain_tokenizer(tok, ids):
    """(a copy of tok's tokenizers.Tokenizer without the added tokens of `ids`, {id: marker}, the id of its
    model's unknown token): in the place of each token a marker, eight random private-use characters (no text
    holds them but by chance, which plain_ids refuses), an added token with the same flags (lstrip, rstrip,
    single_word, normalized), so that it cuts the text as that token does."""
    from tokenizers import AddedToken, Tokenizer

    data = json.loads(tok.backend_tokenizer.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] not in ids]
    data["truncation"] = None
    data["padding"] = None
    # nor made by the model of ordinary text: a vocabulary entry (WordPiece, BPE that
    # ignores merges), a merge (BPE)
    model = data["model"]
    removed = {tok.added_tokens_decoder[i].content for i in ids} - {model.get("unk_token")}
    hidden = unseen_text(random.SystemRandom())
    if isinstance(model.get("vocab"), dict):
        model["vocab"] = {piece: i for piece, i in model["vocab"].items() if piece not in removed}
    # Unigram's [piece, score] by id: a piece renamed to one no text holds
    else:
        vocab = []
        for piece, score in model["vocab"]:
            vocab.append([piece + hidden if piece in removed else piece, score])
        model["vocab"] = vocab
    if "merges" in model:
        pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
        merges = []
        for m, pair in zip(model["merges"], pairs):
            if not removed & {*pair, "".join(pair)}:
                merges.append(m)
        model["merges"] = merges
    plain = Tokenizer.from_str(json.dumps(data))
    rng = random.SystemRandom()
    marker_of = {i: unseen_text(rng) for i in ids}
    for i, marker in marker_of.items():
        token = tok.added_tokens_decoder[i]
        names = ("single_word", "lstrip", "rstrip", "normalized")
        flags = {name: getattr(token, name) for name in names}
        plain.add_special_tokens([AddedToken(marker, special=True, **flags)])
    unknown_token = tok.backend_tokenizer.token_to_id(str(model.get("unk_token")))
    unknown = model.get("unk_id", unknown_token)
    return plain, marker_of, unknown


def unseen_text(rng):
    """Eight random private-use characters: a text that nothing holds but by chance."""
    return "".join(chr(rng.randrange(0xF0000, 0xFFFFE)) for _ in range(8))
