"""Example tools: add a function with type hints and a Google-style docstring, register it in TOOLS
below, and `--tools NAME` offers it to the model. Its JSON schema is derived from the signature and docstring
by transformers' `get_json_schema`, so the description the model sees is the one written here.

Sync tools run in a thread pool, `async def` tools are awaited; both get `--tool-timeout`. A tool
signals bad input by raising: the message goes back to the model and the call counts as a failure.

What a tool may do, since its arguments are whatever the model wrote: a sync tool may wait (I/O, a lock), better with
a timeout of its own: at `--tool-timeout` the model gets an error, but Python cannot stop the thread, which stays
held until the call returns; a call that finds all 64 threads held is refused at once and counted (`tools/refused`).
It may not compute for long: CPU-bound work holds the interpreter lock (a C-level operation on a huge number holds it
for its whole length), which stops the run's event loop, its timeouts and its signal handlers. Bound the work by the
size of the input, as the calculator bounds its numbers, or run it in a process of its own, as a code interpreter
must (generated code is hostile input). An `async def` tool runs on the run's event loop: it must never block.
"""

import ast
import asyncio
import operator
from fractions import Fraction

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
MAX_BITS = 4096  # of a numerator or denominator (1,233 digits): (9**64)**64 alone would take 13,000


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
        # A product's size is bounded before it is computed: one power of a huge number is a single C call that holds
        # the interpreter lock for hours ((((9**64)**64)**64)**64 took 13 s), and no timeout can interrupt it.
        if isinstance(node.op, ast.Pow):
            size = _bits(left) * abs(right)
        elif isinstance(node.op, (ast.Mult, ast.Div)):
            size = _bits(left) + _bits(right)
        else:  # + - % // add their operands' sizes at most, which the expression's 200 characters bound
            size = 0
        if size > MAX_BITS:
            raise ValueError(f"numbers of more than {MAX_BITS} bits are not supported")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** are allowed, got {ast.dump(node)[:60]}")


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
    if _DIMENSION[from_unit] != _DIMENSION[to_unit]:
        raise ValueError(f"cannot convert {_DIMENSION[from_unit]} ({from_unit}) to {_DIMENSION[to_unit]} ({to_unit})")
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
    await asyncio.sleep(0.05)  # stands in for a network round trip; the event loop keeps running
    key = topic.strip().lower()
    if key not in _FACTS:
        raise KeyError(f"no entry for {topic!r}; known topics: {', '.join(_FACTS)}")
    return _FACTS[key]


# FORK: add a tool (a function above, its name here; --tools NAME offers it)
TOOLS = {fn.__name__: fn for fn in (calculator, convert_units, lookup)}
