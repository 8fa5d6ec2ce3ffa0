"""Asynchronous GRPO with tool calling, in one file.

    python async_grpo.py                          # CPU, no network: tiny built-in model + arithmetic task
    python async_grpo.py --tools                  # the same task, with a calculator the model can call
    python async_grpo.py --task guess             # a game, an environment (tools.py) that answers each guess
    python async_grpo.py --env python             # a code interpreter per rollout, in a sandbox (sandbox.py)
    python async_grpo.py --model Qwen/Qwen3-0.6B --tools                        # 1 GPU: vLLM shares it
    python async_grpo.py --model Qwen/Qwen3-0.6B --tools --vllm-gpus 1          # 2 GPUs: 1 trains, 1 serves
    torchrun --nproc-per-node 4 async_grpo.py --model Qwen/Qwen3-0.6B --tools --vllm-gpus 4,5,6,7
    torchrun --nproc-per-node 4 async_grpo.py --model Qwen/Qwen3-8B --fsdp --vllm-gpus 4,5  # sharded, not copied
    python async_grpo.py --model M --vllm-url http://host:8000   # servers started as README.md shows

The shape of a run: rank 0 starts a vLLM server and a producer thread. The
producer, on its own asyncio loop, samples G rollouts per prompt (token ids in,
token ids and log-probs out, each token stamped with the policy version that
sampled it), runs tool calls (and an environment's turns), scores each group
with the reward functions, computes group-relative advantages, and queues the
group. Every rank trains: rank 0 takes the groups in the order they started and
hands each rank its share; the loss is the clipped surrogate against the
sampler's log-probs. Every --sync-every steps rank 0 pauses vLLM, broadcasts the
weights over a process group of its own, resumes it, and the policy version
grows. Generation never waits for training and training waits only for data,
within one bound: the producer does not start a group whose tokens would be more
than --max-staleness versions old when trained (0: synchronous, --sync).

The file reads in the order a reader needs it: the algorithm (the rollout and
its tool loop, rewards and advantages, the producer and its staleness gate, the
loss, the training step, the weight sync), the run's phases (main, and what it
calls in order), then the machinery, in sections named as such. Beside it:
tools.py (tools, environments, a call's arguments), rewards.py (rewards, tasks),
data.py (rows), models.py (loading the policy, the start-up probes and layout,
packed attention), compute.py (checkpointing, compile, bf16 compute),
output_layer.py (log-probs in chunks), tiny_model.py (the built-in model),
vllm_server.py (the servers, the device plan, the sync group and its receiving
end), sandbox.py (the interpreter's sandbox), mfu.py (a step's FLOPs).

`# FORK:` marks where a forker edits (README.md lists them)."""

import argparse, asyncio, contextlib, dataclasses, functools, inspect, itertools, json, math, os, queue, random
import re, shutil, signal, sys, threading, time, traceback
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import aiohttp
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
import torch.utils.checkpoint

import data as data_module
import mfu
from compute import set_up_compute
from models import decoder_layers, dequantise_gguf, load_policy, load_sharded, with_lora
from models import choose_layout, logprobs_refused, packed_segments, segments_refused, shared_rows_mask
from output_layer import chunked_logprobs, sampler_logprobs
import rewards as rewards_module
import sandbox
import tiny_model
import tools as tools_module
from tools import JSON, MAX_ARGUMENT_DEPTH, argument_errors, decode_json, function_call, typed
from tools import PROBE, ROUND_TRIP, ROUND_TRIP_TOOL

# vllm_server.py: the servers (started, checked, watched),
# the device plan, the sync group
from vllm_server import SERVED_MODEL, cpu_threads, http, memory_share, plan_devices, served_config, server_failure
from vllm_server import share_idle_core, start_vllm, stop_vllm, sync_endpoint, sync_group, url_sync_backend, vllm_flag
from vllm_server import LORA_RANKS, SERVED_ADAPTER, load_adapter, refuse_unknown_names, watch_servers, weights_arrive

HERE = Path(__file__).resolve().parent
# What --sampling-args may hold: parameters that end a generation but
# leave its distribution as the trainer computes it (min_tokens
# changes it: the trainer holds the stop tokens back in the same
# places). Seeds come from --seed (request_seed).
SAMPLING_ARGS = {"min_tokens", "stop", "ignore_eos"}


# --- The rollout: generate, run the tool calls, append their results, generate again ---


@dataclass
class RolloutContext:
    """What every rollout needs, computed before vLLM starts (rollout_context),
    and the servers' limits once they are up (start_servers)."""

    # --tools' schemas (None: no tools), and their functions' schemas by name
    schemas: list
    schemas_by_name: dict
    # {name: class} of --env and --mcp; the schemas offered to
    # each one's rows (None: rows without one)
    environments: dict
    offered: dict
    # per row id, the prompt's token ids, rendered with the
    # tools its row is offered
    prompt_ids: dict
    # the token ids a generation stops on (stop_token_ids)
    stop_ids: list
    # how the template writes tool calls (chat_format): the parser's format, the
    # texts that end an assistant turn, how many calls a turn may hold
    format: str = None
    turn_ends: list = ()
    max_calls: int = None
    # the servers' context length, and whether they take
    # seeded requests (served_config)
    max_model_len: int = None
    seeded: bool = False
    # environment instances: the idle ones, per environment;
    # every one made (closed at the end)
    idle: dict = field(default_factory=dict)
    alive: list = field(default_factory=list)


@dataclass
class RolloutTokens:
    """A rollout's token ids and, per token after the prompt: mask (1: sampled,
    trained on; 0: context, a tool's result or the environment's turn), the
    sampler's log-prob and the version that sampled it."""

    ids: list
    n_prompt: int
    mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)

    def add_sampled(self, turn):
        """A turn's (token id, log-prob, version that sampled it) triples."""
        for token, logprob, sampled_by in turn:
            self.ids.append(token)
            self.mask.append(1)
            self.logprobs.append(logprob)
            self.versions.append(sampled_by)

    def add_context(self, ids, version):
        """Tokens not sampled: log-prob 0.0, the version now
        (every list has one length)."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)


# FORK: the tool loop (what a turn may do, when a rollout ends); the tools and environments themselves are in tools.py
async def rollout(session, url, tok, row, args, ctx, version, greedy=False, seed=(), env=None, prompt_ids=None):
    """Sample one conversation, in `env` if the row has an environment
    (an instance, reset). Keeps the exact token ids: the prompt's
    (prompt_ids if reset added to it), then per turn the sampled ids
    and the tools' results or the environment's turn. `seed`: the
    rollout's key in the run (request_seed)."""
    prompt = list(prompt_ids or ctx.prompt_ids[row["id"]])
    tokens = RolloutTokens(ids=prompt, n_prompt=len(prompt))
    # the turns, as the rewards see them
    messages = []
    stats = {"tool_calls": 0, "tool_failures": 0, "tool_seconds": 0.0, "turns": 0, "interrupted": 0}
    # until the model answers
    stats["truncated"] = True
    # tool name -> [calls, failures]
    stats["per_tool"] = {}
    # the tools this row is offered: --tools, and its environment's
    offered = ctx.offered[tools_module.environment_of(row, ctx.environments)]
    offered_by_name = {s["function"]["name"]: s["function"] for s in offered}
    functions = {name: tools_module.TOOLS[name] for name in ctx.schemas_by_name}
    if env is not None:
        # its tools: its methods, bound to this rollout's instance
        functions.update({name: getattr(env, name) for name in tools_module.environment_tools(type(env))})
    while len(tokens.ids) < ctx.max_model_len:
        budget = min(args.max_tokens, ctx.max_model_len - len(tokens.ids))
        turn, finish_reason, interruptions = await generate_turn(
            session, url, tokens.ids, budget, version, args=args, ctx=ctx, greedy=greedy, seed=seed
        )
        tokens.add_sampled(turn)
        new = [token for token, _, _ in turn]
        stats["turns"] += 1
        stats["interrupted"] += interruptions
        # stopped on a stop token (not a --sampling-args string):
        # it stands for the template's end of turn
        stopped = finish_reason == "stop" and bool(new) and new[-1] in ctx.stop_ids
        text = tok.decode(new[:-1] if stopped else new, skip_special_tokens=False)
        if offered:
            before = tokens.ids[: -len(new)]
            message = parse_assistant(text, tok, before, offered_by_name, ctx.format, max_calls=ctx.max_calls)
        else:
            # the parser runs only with tools: without them
            # any template (or none) trains
            message = {"role": "assistant", "content": text, "tool_calls": [], "tool_call_errors": []}
        messages.append(message)
        # How the turn ends: out of tokens; an answer, unless the environment
        # replies to it (the one end that cuts nothing short); out of turns;
        # else the tools' results, or the reply, follow.
        if finish_reason != "stop":
            break
        calls = bool(message["tool_calls"] or message["tool_call_errors"])
        reply = None if calls else await env_reply(env, message, args, stats)
        if not calls and reply is None:
            stats["truncated"] = False
            break
        if stats["turns"] > args.max_tool_turns:
            break
        if calls:
            added = await run_tool_calls(message, offered_by_name, functions, args, stats)
        else:
            added = [reply]
        history = row["prompt"] + messages
        suffix = tool_result_ids(tok, history, added, offered, ctx.turn_ends, stopped=stopped)
        messages += added
        if len(tokens.ids) + len(suffix) >= ctx.max_model_len:
            # no room left to answer: end here rather than
            # send vLLM a request it rejects
            break
        tokens.add_context(suffix, version.value)
    return {**vars(tokens), "messages": messages, **stats}


async def generate_turn(session, url, ids, budget, version, args, ctx, greedy, seed):
    """One assistant turn of at most `budget` tokens after `ids`: its (token
    id, log-prob, version) triples, why it ended, and how often a sync
    stopped it. A stopped turn goes on from its tokens with the new weights,
    or under --sync-mode abort starts over."""
    turn = []
    interruptions = 0
    while True:
        async with version.request() as sampled_by:
            new = [token for token, _, _ in turn]
            part, part_logprobs, finish_reason = await generate(
                session,
                url,
                ids + new,
                budget - len(turn),
                args,
                stop_ids=ctx.stop_ids,
                greedy=greedy,
                generated=len(turn),
                seed=request_seed(*seed, len(ids) + len(turn)) if ctx.seeded else None,
            )
            if finish_reason == "abort" and version.open:
                raise RuntimeError("vLLM aborted a request outside a weight sync: is another client using it?")
        if finish_reason == "abort" and args.sync_mode == "abort":
            turn = []
        else:
            turn += [(token, logprob, sampled_by) for token, logprob in zip(part, part_logprobs)]
        interruptions += finish_reason == "abort"
        if finish_reason != "abort" or len(turn) >= budget:
            return turn, finish_reason, interruptions


# FORK: the sampling parameters (each one that shapes the distribution must also shape the trainer's: sampler_logprobs)
async def generate(session, url, ids, max_tokens, args, stop_ids, greedy=False, generated=0, seed=None):
    """One completion from vLLM: token ids in; sampled ids, their log-probs and
    why it ended out ('abort': a sync stopped it, the ids kept). `generated`:
    the tokens a stopped request produced."""
    # Every parameter that shapes the distribution is sent: vLLM fills
    # missing ones from the checkpoint's generation_config.json (Qwen3's:
    # top_k 20), which the trainer would not know.
    payload = {
        "model": args.request_model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "logprobs": 0,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "return_token_ids": True,
        "stop_token_ids": stop_ids,
        "skip_special_tokens": False,
        "seed": seed,
        **args.sampling_args,
    }
    if greedy:  # evaluation
        payload.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    if "min_tokens" in payload:
        payload["min_tokens"] = max(0, payload["min_tokens"] - generated)
    for attempt in range(3):
        try:
            async with session.post(f"{url}/v1/completions", json=payload) as response:
                if response.status != 200:
                    raise ConnectionError(
                        f"the vLLM server {url} answered a generation request with "
                        f"{response.status}: {(await response.text())[:500]}"
                    )
                choice = (await response.json())["choices"][0]
            return choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["finish_reason"]
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            # a keep-alive connection the server just closed:
            # the request holds its state, resent
            if attempt == 2:
                raise ConnectionError(f"the vLLM server {url} dropped a generation request 3 times ({e})") from None
            await asyncio.sleep(0.5 * 2**attempt)
        except asyncio.TimeoutError:  # the session's bound
            raise ConnectionError(
                f"the vLLM server {url} did not answer a generation request in {args.data_timeout} s (--data-timeout)"
            ) from None


def request_seed(*key):
    """A request's seed, from what identifies it in the run (--seed,
    its group, its sample, the position it continues from): a run
    repeated with the same flags sends the same seeds (README.md:
    when that replays it sample for sample)."""
    return random.Random(repr(key)).getrandbits(31)


async def run_tool_calls(message, schemas_by_name, functions, args, stats):
    """The turn's well-formed calls, run concurrently, then an error for each
    that did not parse: the tool messages the model sees, in order. Counted in
    stats (per tool; 'unknown', 'malformed')."""
    start = time.perf_counter()
    calls = [call_tool(call, schemas_by_name, args.tool_timeout, functions) for call in message["tool_calls"]]
    results, _ = await asyncio.gather(asyncio.gather(*calls), asyncio.sleep(args.tool_latency))
    results += [(f"Error: {error}", False) for error in message["tool_call_errors"]]
    stats["tool_seconds"] += time.perf_counter() - start
    stats["tool_calls"] += len(results)
    stats["tool_failures"] += sum(not ok for _, ok in results)
    names = [call["function"]["name"] for call in message["tool_calls"]]
    keys = [name if name in schemas_by_name else "unknown" for name in names]
    keys += ["malformed"] * len(message["tool_call_errors"])
    names += ["malformed"] * len(message["tool_call_errors"])
    for key, (_, ok) in zip(keys, results):
        counts = stats["per_tool"].setdefault(key, [0, 0])
        counts[0] += 1
        counts[1] += not ok
    # a lone surrogate in a tool's text (from its input or a
    # surrogateescape decode) fails the tokenizer
    return [
        {"role": "tool", "name": n, "content": str(r).encode(errors="replace").decode()}
        for n, (r, _) in zip(names, results)
    ]


async def env_reply(env, message, args, stats):
    """The environment's answer (respond) to a turn without tool calls, or
    None: the rollout ends. A respond that raises or hangs answers with its
    error, a failure counted as respond's."""
    if not hasattr(env, "respond"):
        return None
    reply = tools_module.call_function(env.respond, {"message": message}, "respond", args.tool_timeout)
    (reply, ok), _ = await asyncio.gather(reply, asyncio.sleep(args.tool_latency))
    counts = stats["per_tool"].setdefault("respond", [0, 0])
    counts[0] += 1
    counts[1] += not ok
    return None if reply is None else {"role": "user", "content": str(reply).encode(errors="replace").decode()}


async def call_tool(call, schemas_by_name, timeout, functions=tools_module.TOOLS):
    """Run one well-formed call. Returns (result for the model,
    ok); never raises but EnvironmentGone."""
    name = call["function"]["name"]
    arguments = call["function"]["arguments"]
    if name not in schemas_by_name:
        return f"Error: unknown tool {name!r}; the tools are {', '.join(schemas_by_name)}", False
    errors = argument_errors(schemas_by_name[name], arguments)
    if errors:
        return f"Error: {name}: {'; '.join(errors)}", False
    return await tools_module.call_function(functions[name], arguments, name, timeout)


class PolicyVersion:
    """Which weights vLLM serves: a count the sync advances, a gate it closes
    meanwhile, the requests in flight (at most max_inflight). The sync waits for
    each to answer (finished or stopped) before it changes the weights: the
    version stamped on a token sampled it."""

    def __init__(self, max_inflight=64):
        self.value = 0
        self.open = True
        self.in_flight = 0
        self.lock = threading.Lock()
        # our own bound, not the connection pool's: a request
        # waiting there counts as sent
        self.slots = asyncio.Semaphore(max_inflight)
        self.idle_seconds = 0.0  # vLLM is idle while nothing is in flight
        self.idle_since = time.perf_counter()

    def idle(self):
        """Seconds so far that vLLM had no request of ours
        (paused, or starved of work)."""
        if self.in_flight:
            return self.idle_seconds
        return self.idle_seconds + time.perf_counter() - self.idle_since

    @contextlib.asynccontextmanager
    async def request(self):
        async with self.slots:
            while True:
                # the sync closes the gate under the same
                # lock: no request slips past it
                with self.lock:
                    if self.open:
                        self.idle_seconds = self.idle()
                        self.in_flight += 1
                        break
                await asyncio.sleep(0.01)
            try:
                yield self.value
            finally:
                self.in_flight -= 1
                if not self.in_flight:
                    self.idle_since = time.perf_counter()


# --- Rewards and group-relative advantages ---


async def score_group(samples, row, reward_weights, environments=None):
    """Weighted sum of the reward functions over one group,
    and each function's values."""
    G = len(samples)
    kwargs = {k: [v] * G for k, v in row.items() if k not in ("prompt", "id")}
    kwargs.update(
        prompts=[row["prompt"]] * G,
        completions=[s["messages"] for s in samples],  # data.ROLLOUT_FIELDS
        completion_ids=[s["ids"][s["n_prompt"] :] for s in samples],
        environments=environments or [None] * G,
        **{k: [s[k] for s in samples] for k in ("tool_calls", "tool_failures", "truncated")},
    )
    total, parts = np.zeros(G), {}
    try:
        for name, weight in reward_weights.items():
            fn = rewards_module.REWARDS[name]
            values = await fn(**kwargs) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, **kwargs)
            # None becomes NaN, which would poison the update
            parts[name] = np.asarray(values, dtype=np.float64)
            if parts[name].shape != (G,) or not np.isfinite(parts[name]).all():
                raise ValueError(f"reward {name} returned {str(values)[:200]} for {G} rollouts: a finite number each")
            total += weight * parts[name]
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        raise tools_module.Dropped(f"the rewards of prompt {row['id']} failed: {why}") from None
    return total, parts


# FORK: change the advantages (a group's rewards in, one number per rollout out, weighing its tokens)
def group_advantages(rewards, scale=True, eps=1e-4):
    """GRPO: each rollout's reward relative to its group, in units of its
    spread (scale) or raw (Dr. GRPO: the spread over-weights groups nearly all
    right or wrong); all equal: zero, no signal."""

    rewards = np.asarray(rewards, dtype=np.float64)
    centred = rewards - rewards.mean()
    return centred / (rewards.std() + eps) if scale else centred


# --- The producer: a thread that keeps the queue full, within the staleness bound ---


@dataclass
class ScoredGroup:
    # its number, in the order groups started
    index: int
    # its rollouts, each with its reward and advantage
    samples: list


@dataclass
class DroppedGroup:
    index: int
    # why it is not trained: its environment or its rewards failed
    why: str


def version_at(step, sync_every):
    """The staleness rule: the trainer's version during step `step`,
    a sync following every --sync-every-th step. The gate predicts
    by it (admissible), the drop measures it (lag), --resume
    restarts the count by it (start_sync)."""
    return step // sync_every


class Producer(threading.Thread):
    """Streams scored groups to the trainer, numbered in the order they start;
    the trainer takes them in that order (`take`): the gate knows when a group
    will be trained. With several servers, each group goes to the one with the
    fewest running: its rollouts share the cached prompt."""

    def __init__(self, args, tok, rows, urls, ctx, version, cursor=None):
        super().__init__(daemon=True, name="producer")
        self.args = args
        self.tok = tok
        self.rows = rows
        self.urls = urls
        self.ctx = ctx
        self.version = version
        self.running = dict.fromkeys(urls, 0)  # groups running on each server
        # a ScoredGroup or a DroppedGroup as each group finishes
        self.queue = queue.Queue()
        self.ready = {}  # finished groups by number, until their turn
        # next_index: the next group to hand out; skipped_groups: not trained
        # (equal rewards, too stale, a failed reward); stale_samples,
        # reward_failures: counters. Checkpoints save them.
        self.cursor = {
            "next_index": 0,
            "skipped_groups": 0,
            "stale_samples": 0,
            "reward_failures": 0,
            **(cursor or {}),
        }
        self.failures_in_a_row = 0
        self.scoring = 0  # groups whose rewards are being computed
        self.error = None
        # made here: stop() and evaluate() may use it before run()
        self.loop = asyncio.new_event_loop()

    def run(self):
        try:
            with contextlib.suppress(asyncio.CancelledError):  # stop()
                self.loop.run_until_complete(self._produce())
        except BaseException as e:
            self.error = e

    def stop(self, timeout=10):
        # a callback queued before run() starts the loop runs
        # once _produce's task exists
        if self.is_alive():
            self.loop.call_soon_threadsafe(lambda: cancel_all(asyncio.all_tasks(self.loop)))
            self.join(timeout)

    def prompt_order(self):
        """Rows in a seeded shuffle, epoch after epoch."""
        rng = random.Random(self.args.seed)
        while True:
            rows = list(self.rows)
            rng.shuffle(rows)
            yield from rows

    def admissible(self, index):
        """The staleness gate: start group `index` only if, at the step
        that trains it ((index - skipped) // prompts_per_step, or earlier
        after more skips), the trainer is at most --max-staleness
        versions past the weights vLLM serves now.

        E.g. --prompts-per-step 2 --sync-every 2 --max-staleness 1, vLLM at
        version 0: groups 0-7 (steps 0-3, versions 0, 0, 1, 1) pass; groups 8-11
        (steps 4-5, version 2) wait for version 1."""
        step = (index - self.cursor["skipped_groups"]) // self.args.prompts_per_step
        ahead = version_at(step, self.args.sync_every) - self.version.value
        return ahead <= self.args.max_staleness

    async def _produce(self):
        async with client_session(self.args) as session:
            pending = set()
            # on --resume, groups not trained are redone
            started = self.cursor["next_index"]
            try:
                for row in itertools.islice(self.prompt_order(), started, None):
                    while not self.admissible(started) or self.enough_started(pending):
                        if not pending:
                            await asyncio.sleep(0.01)
                            continue
                        first = asyncio.FIRST_COMPLETED
                        done, pending = await asyncio.wait(pending, timeout=0.05, return_when=first)
                        # each error retrieved (else asyncio
                        # warns); the first stops the producer
                        failed = [task for task in done if not task.cancelled() and task.exception()]
                        if failed:
                            raise failed[0].exception()
                    pending.add(asyncio.create_task(self._group(session, row, started)))
                    started += 1
            finally:
                # on stop or error, no group is left running
                # against a server going away
                cancel_all(pending)
                await asyncio.gather(*pending, return_exceptions=True)
                await tools_module.close_environments(self.ctx, self.args.tool_timeout)

    def enough_started(self, pending):
        """Rollouts started up to twice what vLLM takes at once
        (--max-inflight): the next ones wait ready
        (environments reset) behind PolicyVersion's slots."""
        return len(pending) * self.args.num_generations >= 2 * self.args.max_inflight

    async def _group(self, session, row, index):
        """Group `index`, on the server with the fewest
        groups running, scored and queued."""
        n = self.args.num_generations
        urls = [min(self.urls, key=self.running.get)] * n
        seeds = [(self.args.seed, index, i) for i in range(n)]
        try:
            samples, rewards, parts = await self.rollout_and_score(session, row, urls, seeds, counted=True)
        except tools_module.Dropped as e:
            # the group is not trained (take() reports it), the run goes on
            self.queue.put(DroppedGroup(index, str(e)))
            return
        advantages = group_advantages(rewards, scale=self.args.scale_rewards == "group")
        for i, sample in enumerate(samples):
            sample.update(reward=float(rewards[i]), advantage=float(advantages[i]), prompt_id=row["id"])
            sample["reward_parts"] = {name: float(values[i]) for name, values in parts.items()}
        self.queue.put(ScoredGroup(index, samples))

    async def rollout_and_score(self, session, row, urls, seeds, greedy=False, counted=False):
        """The group pipeline of training and evaluation: environments reset,
        rollout k on urls[k] (`greedy`: the first greedy), the rewards. Returns
        the rollouts, rewards and each reward's values; raises Dropped.
        `counted` (training): running on urls[0], then scoring."""
        n = len(seeds)
        busy = int(counted)
        timeout = self.args.tool_timeout
        async with environment_instances(self.ctx, self.tok, row, n, timeout) as (envs, row, ids):
            group = [
                rollout(
                    session,
                    urls[k],
                    self.tok,
                    row,
                    self.args,
                    ctx=self.ctx,
                    version=self.version,
                    greedy=greedy and k == 0,
                    seed=seeds[k],
                    env=env,
                    prompt_ids=ids,
                )
                for k, env in enumerate(envs)
            ]
            self.running[urls[0]] += busy
            try:
                samples = await all_or_none(group)
            finally:
                self.running[urls[0]] -= busy
            self.scoring += busy
            try:
                rewards, parts = await score_group(samples, row, self.args.reward_weights, envs)
            finally:
                self.scoring -= busy
        return samples, rewards, parts

    def take(self, n, timeout, interrupted=lambda: False):
        """The next n trainable groups in start order, past those of
        equal rewards (--skip-zero-variance) and, warned and counted,
        those too stale (the gate leaves none) or whose rewards failed.
        Raises if the producer died, no batch came in time, every
        recent reward failed or interrupted()."""
        groups = []
        deadline = time.monotonic() + timeout
        # groups skipped for equal rewards, which a timeout's message counts
        equal = 0

        def late():
            skipped = f"; {equal} groups finished with equal rewards, skipped (--skip-zero-variance)" if equal else ""
            return (
                f"no batch from the producer in {timeout} s (--data-timeout) from the vLLM server(s) "
                f"{', '.join(self.urls)}; now {sum(self.running.values())} groups generate "
                f"({self.version.in_flight} requests in vLLM) and {self.scoring} are being scored{skipped}"
            )

        # has the group numbered cursor['next_index']
        # finished? (groups finish out of order)
        def arrived():
            until = time.monotonic() + 0.1
            with contextlib.suppress(queue.Empty):
                while self.cursor["next_index"] not in self.ready:
                    item = self.queue.get(timeout=max(0.0, until - time.monotonic()))
                    self.ready[item.index] = item
            return self.cursor["next_index"] in self.ready

        while len(groups) < n:
            if not self.wait(arrived, deadline, interrupted, late):
                raise KeyboardInterrupt("stopped while waiting for data")
            item = self.ready.pop(self.cursor["next_index"])
            self.cursor["next_index"] += 1
            why_not = self.why_not_trained(item)
            if why_not is None:
                groups.append(item.samples)
            else:
                # admissible() counts every group not trained
                self.cursor["skipped_groups"] += 1
                equal += why_not == "equal rewards"
        return groups

    def why_not_trained(self, item):
        """None for a group to train; else why not (counted;
        warned unless for equal rewards)."""
        if isinstance(item, DroppedGroup):
            self.failures_in_a_row += 1
            self.cursor["reward_failures"] += 1
            print(f"warning: dropped a group: {item.why}", flush=True)
            if self.failures_in_a_row >= 4 * self.args.prompts_per_step:
                # save_after_error ends the run with this one line
                raise tools_module.Dropped(
                    f"{self.failures_in_a_row} groups in a row were dropped (4 x --prompts-per-step), none "
                    f"trained; the last: {' '.join(item.why.split())}"
                )
            return "failed"
        self.failures_in_a_row = 0
        lag = self.lag(item.samples)
        if lag > self.args.max_staleness:
            print(f"warning: dropped a group {lag} versions old (--max-staleness)", flush=True)
            self.cursor["stale_samples"] += len(item.samples)
            return "too stale"
        if self.args.skip_zero_variance and len({s["reward"] for s in item.samples}) == 1:
            return "equal rewards"
        return None

    def lag(self, group):
        """Versions between the trainer now (version_at the step
        that takes it) and the group's oldest trained token:
        what admissible() predicted, measured."""
        versions = [v for s in group for v, m in zip(s["versions"], s["mask"]) if m]
        return self.version.value - min(versions, default=self.version.value)

    def wait(self, done, deadline, interrupted, late):
        """Every wait of the trainer on the producer (data, evaluation):
        until done(), which may block 0.1 s. Raises once the thread has
        ended (with its error) or at the deadline (late()); returns False
        if interrupted() (a stop signal) first."""
        while not done():
            # read before the error, which the thread sets before it ends
            ended = not self.is_alive()
            # a server's fault, which the message names
            if isinstance(self.error, ConnectionError):
                raise self.error
            if self.error or ended:
                why = "".join(traceback.format_exception(self.error)) if self.error else "stopped"
                raise RuntimeError(f"the producer thread failed:\n{why}")
            if time.monotonic() > deadline:
                raise TimeoutError(late())
            if interrupted():
                return False
        return True


# --- The loss: clipped surrogate against the sampler's log-probs, normalised as --loss-type says ---


@dataclass(frozen=True)
class LossSettings:
    """The loss's flags (loss_settings makes it)."""

    # the clip range of the ratio: [1 - epsilon, 1 + epsilon_high]
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    # the --loss-type of grpo_loss's table
    loss_type: str = "token"
    # Dr. GRPO's constant: --max-tokens, a turn's budget
    constant_length: int = 1
    # the sampler's drift: none, tis, mis; where it cuts; per token or sequence
    is_correction: str = "none"
    is_threshold: float = 2.0
    is_level: str = "token"
    # the KL penalty to the reference policy; pi_theta / pi_sampler weighs it
    beta: float = 0.0
    kl_correction: bool = False
    # what drifted too far leaves the loss: none, sequence, token; how far
    off_policy_mask: str = "none"
    off_policy_threshold: float = 0.5


def loss_settings(args):
    names = [f.name for f in dataclasses.fields(LossSettings) if f.name != "constant_length"]
    return LossSettings(constant_length=args.max_tokens, **{name: getattr(args, name) for name in names})


# FORK: change the loss (the terms are named as in the papers; train_step calls this)
def grpo_loss(logp, sampler_logp, advantages, mask, settings, num_tokens=1, num_sequences=1, ref_logp=None):
    """The negated objective of one micro-batch, its share of
    the step's, in the code's names:

        J = 1/Z sum_i sum_t keep (is_weight surrogate - beta kl)
        surrogate = min(ratio A, clipped A)    ratio = exp(logp - old_logp)
        clipped = clamp(ratio, 1 - epsilon, 1 + epsilon_high)

        --loss-type  ratio     surrogate                Z
        token        token     min(ratio A, clipped A)  the step's loss tokens (DAPO)
        sequence     token     min(ratio A, clipped A)  a sequence's tokens x sequences (GRPO)
        constant     token     min(ratio A, clipped A)  --max-tokens x sequences (Dr. GRPO)
        gspo         sequence  min(ratio A, clipped A)  sequences (GSPO)
        cispo        token     sg(clipped) A logp       the step's loss tokens (MiniMax-M1)

    logp (with gradient), sampler_logp (vLLM's), mask: [B, T]; A = advantages:
    [B]. old_logp: sampler_logp, or with --is-correction logp without gradient.
    A sequence's ratio: its tokens' geometric mean. is_weight:
    importance_weights; keep: off_policy_keep; kl: kl_to_reference. num_tokens,
    num_sequences: the whole step's, every micro-batch and rank.

    With --is-correction the clip never binds: a batch gets one update, so
    ratio is 1, inside the clip, and the gradient is is_weight A grad logp
    (decoupled PPO): is_weight bounds it."""
    s = settings
    per_sequence = s.loss_type == "gspo"
    # log pi_trainer / pi_sampler, without gradient: numeric
    # mismatch plus staleness
    log_is_ratio = (logp.detach() - sampler_logp) * mask
    is_ratio, is_weight = importance_weights(log_is_ratio, mask, s)
    old_logp = sampler_logp if s.is_correction == "none" else logp.detach()
    log_ratio = (logp - old_logp) * mask
    # [B, T], or [B, 1] for gspo
    ratio = torch.exp(sequence_mean(log_ratio, mask) if per_sequence else log_ratio)
    clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.epsilon_high)
    A = advantages[:, None]
    if s.loss_type == "cispo":
        # the clipped ratio, without gradient, weighs grad
        # log pi: clipped tokens still count
        surrogate = clipped.detach() * A * logp
    else:
        # PPO's pessimistic bound: the clipped term wherever it is lower
        surrogate = torch.minimum(ratio * A, clipped * A)
    per_token = -is_weight * surrogate
    kl = None
    if s.beta:
        kl = kl_to_reference(logp, ref_logp, sampler_logp, s.kl_correction)
        per_token = per_token + s.beta * (sequence_mean(kl, mask) if per_sequence else kl)
    # What drifted too far leaves the loss; Z still counts it
    keep = off_policy_keep(log_is_ratio, A, mask, s)
    per_token = per_token * keep
    if s.loss_type == "gspo":
        # one clipped ratio per sequence; a sequence without
        # loss tokens counts 0
        loss = (per_token * (mask.sum(1, keepdim=True) > 0)).sum() / num_sequences
    elif s.loss_type == "sequence":
        # the GRPO paper: the mean over each sequence's
        # tokens, then over the sequences
        loss = sequence_mean(per_token, mask).sum() / num_sequences
    elif s.loss_type == "constant":
        # Dr. GRPO: a sequence's length does not change the weight of its tokens
        loss = (per_token * mask).sum() / (num_sequences * s.constant_length)
    else:
        # token (DAPO), and cispo: every loss token of the step weighs the same
        loss = (per_token * mask).sum() / num_tokens
    terms = dict(ratio=ratio, clipped=clipped, keep=keep, kl=kl)
    terms |= dict(log_is_ratio=log_is_ratio, is_ratio=is_ratio, is_weight=is_weight)
    return loss, loss_statistics(mask, s, **terms)


def sequence_mean(x, mask):
    """[B, T] -> [B, 1]: the mean over each sequence's loss tokens."""
    return (x * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)


def importance_weights(log_is_ratio, mask, settings):
    """is_ratio = pi_trainer / pi_sampler, and is_weight, the
    correction's weight: is_ratio truncated at the threshold (tis), 0
    outside [1 / threshold, threshold] (mis), or 1.

    Per sequence (--is-level sequence; gspo), is_ratio is its tokens'
    geometric mean, not their product, which a threshold would cut for
    its length: 1000 ratios within 1% of 1 multiply to e^-10..e^10."""
    s = settings
    per_sequence = s.is_level == "sequence" or s.loss_type == "gspo"
    is_ratio = torch.exp(sequence_mean(log_is_ratio, mask) if per_sequence else log_is_ratio)
    if s.is_correction == "tis":
        return is_ratio, is_ratio.clamp(max=s.is_threshold)
    if s.is_correction == "mis":
        inside = (is_ratio >= 1 / s.is_threshold) & (is_ratio <= s.is_threshold)
        return is_ratio, is_ratio * inside
    return is_ratio, torch.ones_like(is_ratio)


def kl_to_reference(logp, ref_logp, sampler_logp, corrected):
    """Per token, KL(pi_theta || pi_ref) by the k3 estimator (unbiased,
    never negative) under pi_theta. The tokens come from pi_sampler:
    corrected (--kl-correction, DeepSeek-V3.2) weighs each by pi_theta
    / pi_sampler, which makes it unbiased."""
    delta = ref_logp - logp
    kl = torch.exp(delta) - delta - 1
    if corrected:
        kl = torch.exp(logp - sampler_logp) * kl
    return kl


def off_policy_keep(log_is_ratio, A, mask, settings):
    """keep: True where the loss keeps a token. sequence (DeepSeek-V3.2)
    drops a sequence with A < 0 whose mean log(pi_sampler / pi_trainer) is
    past the threshold (it would push down tokens already less likely); token
    (IcePop), a token whose |log is_ratio| is."""
    s = settings
    if s.off_policy_mask == "sequence":
        # [B, 1]
        return ~((sequence_mean(-log_is_ratio, mask) > s.off_policy_threshold) & (A < 0))
    if s.off_policy_mask == "token":
        # [B, T]
        return log_is_ratio.abs() <= s.off_policy_threshold
    return torch.ones_like(A, dtype=torch.bool)


@torch.no_grad()
def loss_statistics(mask, settings, ratio, clipped, log_is_ratio, is_ratio, is_weight, keep, kl):
    """The loss's figures: means over the loss tokens,
    extremes of the token ratios."""
    n = mask.sum().clamp(min=1)
    tokens = mask.bool()
    token_ratio = torch.exp(log_is_ratio)

    def share(x):
        return (x * mask).sum() / n

    stats = {
        "train/clip_fraction": share((ratio - clipped).abs() > 0),
        "is/ratio_mean": share(token_ratio),
        # the k3 estimate of KL(pi_sampler || pi_trainer)
        "is/mismatch_kl": share(token_ratio - 1 - log_is_ratio),
        "is/ratio_min": torch.where(tokens, token_ratio, torch.inf).min(),
        "is/ratio_max": torch.where(tokens, token_ratio, -torch.inf).max(),
        "is/off_policy_masked": share(~keep),
    }
    if settings.is_correction == "tis":
        stats["is/truncated_fraction"] = share(is_ratio > settings.is_threshold)
    elif settings.is_correction == "mis":
        stats["is/masked_fraction"] = share(is_weight == 0)
    if kl is not None:
        stats["train/kl"] = share(kl)
    # one copy to the host; a micro-batch without loss tokens has no extremes
    values = torch.stack(list(stats.values())).tolist()
    return {k: v for k, v in zip(stats, values) if math.isfinite(v)}


# --- The training step: micro-batches, each group's prompt once, the log-probs of what vLLM sampled ---


def train_step(model, optimizer, samples, num_tokens, num_sequences, settings):
    """One optimizer step on this rank's samples: each micro-batch's
    batch, log-probs, loss and backward, then the gradient clipped
    and the update. settings: StepSettings."""
    s = settings
    model.train()
    # its width and window shape the rows (collate)
    config = getattr(model, "module", model).config.get_text_config()
    micros = equal_micro_batches(samples, config.hidden_size, s)
    normalisers = dict(num_tokens=num_tokens, num_sequences=num_sequences)
    # autocast's cache would keep a bf16 copy of each weight
    # (FSDP's gathered ones too) until the backward ends;
    # without it a weight is cast where it is used
    bf16 = s.dtype == torch.bfloat16
    # tokens through the model: each group's prompt once where it is shared
    forwarded = 0
    figures = []
    for i, micro in enumerate(micros):
        batch = collate(micro, s.pad_id, s.device, s.min_tokens, config=config, dtype=s.dtype, **s.layout)
        forwarded += batch["tokens"]
        # DDP all-reduces in the last backward only. FSDP reduce-scatters in
        # each: else every rank would hold the unsharded gradients
        accumulate = i < len(micros) - 1 and hasattr(model, "no_sync")
        with (
            model.no_sync() if accumulate else contextlib.nullcontext(),
            torch.autocast(s.device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False),
        ):
            logps = token_logprobs(model, batch, **s.sampling)
            loss, stats = micro_batch_loss(batch, logps, s, **normalisers)
            # DDP and FSDP average over ranks; the loss is already a global mean
            (loss * s.world_size).backward()
        figures.append((loss.item(), stats, batch["mask"].sum().item()))
    totals = step_statistics(figures, forwarded, samples, s)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_grad_norm).item()
    totals["train/grad_norm"] = grad_norm
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        # one NaN or inf would make every weight NaN, then synced and saved
        print(f"warning: skipped an update whose gradient norm is {grad_norm}", flush=True)
    optimizer.zero_grad(set_to_none=True)
    return totals


def micro_batch_loss(batch, logps, settings, num_tokens, num_sequences):
    """A micro-batch's loss and figures from its
    token_logprobs (logp, removed, entropy)."""
    s = settings
    logp, removed, entropy = logps
    ref_logp = None
    if s.reference is not None:
        with torch.no_grad():
            ref_logp = token_logprobs(s.reference, batch, **s.sampling)[0]
        # FSDP2 keeps a root's weights gathered for a backward, never run here
        if hasattr(s.reference, "reshard"):
            s.reference.reshard()
    mask = batch["mask"]
    sampler_logp = batch["sampler_logp"]
    advantages = batch["advantages"]
    normalisers = dict(num_tokens=num_tokens, num_sequences=num_sequences)
    loss, stats = grpo_loss(logp, sampler_logp, advantages, mask, s.loss, ref_logp=ref_logp, **normalisers)
    n = mask.sum().clamp(min=1)
    stats["is/truncated_mass"] = ((removed * mask).sum() / n).item()
    stats["train/entropy"] = ((entropy * mask).sum() / n).item()
    return loss, stats


# --- The weight sync: pause vLLM, broadcast packed buckets to every worker, resume ---


class SyncPart:
    """What a sync sends (served_weights' `part`; --lora-sync picks MERGED or
    ADAPTER): the weights as vLLM serves them (LoRA: W + scale * B @ A), W
    unmerged, or the adapter (lora_A, lora_B)."""

    MERGED = "merged"
    BASE = "base"
    ADAPTER = "adapter"


class WeightSync:
    """Trainer side of the sync to the servers at `urls`. One group
    (sync_group) holds rank 0 and every worker of every server: one
    broadcast reaches all. Made at the first sync."""

    def __init__(self, urls, args, dtype, version, failure=lambda: None, backend=None):
        self.urls = urls
        self.args = args
        # --sync-timeout: a bound on each sync and each request of it
        self.timeout = args.sync_timeout
        # the servers' (served_config): the weights travel in it
        self.dtype = dtype
        self.version = version
        # gloo or nccl: the device plan's, or what --vllm-url
        # servers allow (Run.sync_backend)
        self.backend = backend or args.plan["sync_backend"]
        # why a server failed, from the watchdog (watch_servers), or None
        self.failure = failure
        self.group = None
        # the group's store: how the workers learn of an abort
        self.store = None
        self.pool = ThreadPoolExecutor(len(urls))
        # the live check of the first sync of moved weights
        # (weights_arrive; start_sync sets it)
        self.check = None
        # the bytes the last sync sent
        self.sent_bytes = 0

    def _rpc(self, url, method, **kwargs):
        """Call `method` on every worker of one server; a future
        (on the pool's threads: the workers block in the
        collective until the trainer joins it)."""
        payload = {"method": method, "kwargs": kwargs}
        where = f"{url}/collective_rpc"
        return self.pool.submit(http, where, payload, self.timeout, "--sync-timeout")

    def _all(self, path):
        for url in self.urls:
            http(f"{url}/{path}", {}, self.timeout, "--sync-timeout")

    def _connect(self, model):
        """The first sync: every server must know every name
        it will receive; then the group."""
        names = [name for name, _, _ in served_weights(model, include_frozen=True)]
        refuse_unknown_names(self.urls, names, self._rpc, model.config.model_type)
        # workers per server
        sizes = [http(f"{url}/get_world_size")["world_size"] for url in self.urls]
        host, listener = sync_endpoint(self.urls, self.args.sync_host)
        port = listener.getsockname()[1]
        world_size = 1 + sum(sizes)
        joined = [
            self._rpc(
                url,
                "init_weight_sync",
                host=host,
                port=port,
                world_size=world_size,
                backend=self.backend,
                first_rank=1 + sum(sizes[:i]),
                timeout=self.timeout,
            )
            for i, url in enumerate(self.urls)
        ]
        self.group = sync_group(host, port, 0, world_size, self.backend, timeout=self.timeout, listener=listener)
        bound = timedelta(seconds=self.timeout)
        self.store = dist.TCPStore(host, port, is_master=False, timeout=bound)

        # a server's error answer to its join
        def joining():
            return next((f.exception() for f in joined if f.done() and f.exception()), None)

        # NCCL makes a communicator at its first collective, blocking until
        # every rank is in it: one element here, as the workers join and before
        # vLLM pauses, not in the first bucket's
        device = next(served_weights(model))[1].device
        first = [("warm-up", torch.zeros(1, device=device), None)]
        try:
            send_weights(self.group, [first], torch.float32, self.timeout, joining)
            for future in joined:
                future.result(self.timeout)
        except Exception as e:
            self._abort(e)
            servers = ", ".join(self.urls)
            raise ConnectionError(f"the weight sync group with {servers} failed to start: {e}") from None

    def __call__(self, model, include_frozen=False):
        """One sync: close the gate (no request leaves until the new weights
        serve), drain vLLM, send the weights (include_frozen: all, not only the
        trained), resume, advance the version."""
        t0 = time.perf_counter()
        if self.group is None:
            self._connect(model)
        deadline = time.monotonic() + self.timeout
        with self.version.lock:
            self.version.open = False
        self._drain(deadline)
        self.sent_bytes = 0
        try:
            self._send_weights(model, deadline, include_frozen)
        except BaseException:
            # also after a failure: --vllm-url servers outlive the run, and
            # a paused one serves no one; a dead server answers no resume,
            # and its failure is what the run reports
            with contextlib.suppress(Exception):
                self._all("resume")
            raise
        self._all("resume")
        self.version.value += 1
        # the first sync of moved weights: do the servers now sample from them?
        if self.check:
            self.check = self.check()
        with self.version.lock:
            self.version.open = True
        return time.perf_counter() - t0

    def _drain(self, deadline):
        """Pause every server (which clears the old weights' caches) and
        stop the requests in flight: rollout() continues what they
        generated (keep) or starts over (abort)."""
        mode = "wait" if self.args.sync_mode == "wait" else "abort"
        self._all(f"pause?mode={mode}")
        # a request that reached vLLM after the pause waits
        # in its queue: stop it
        while self.version.in_flight:
            if time.monotonic() > deadline:
                late = f"{self.version.in_flight} requests did not answer the pause"
                raise TimeoutError(f"{late} in {self.timeout} s (--sync-timeout)")
            self._all("abort_requests")
            time.sleep(0.01)

    def _send_weights(self, model, deadline, include_frozen):
        """The weights, merged. --lora-sync adapter: the adapter, after W where
        the servers may hold other weights (include_frozen)."""
        if self.args.lora_sync == SyncPart.MERGED:
            self._send(model, "receive_weights", deadline, SyncPart.MERGED, include_frozen)
            return
        if include_frozen:
            self._send(model, "receive_weights", deadline, SyncPart.BASE, include_frozen)
        config = model.peft_config["default"].to_dict()
        config = json.loads(json.dumps(config, default=sorted))
        answers = self._send(model, "receive_adapter", deadline, SyncPart.ADAPTER, config=config)
        # each server's first worker wrote it; the folder is
        # on that server's host
        for url, workers in zip(self.urls, answers):
            load_adapter(url, workers[0], self.timeout)

    def _send(self, model, method, deadline, part, include_frozen=False, **kwargs):
        """Broadcast the weights of `part` (served_weights) to every worker,
        which loads them in `method`; each server's workers' answers."""
        size = self.args.sync_bucket_bytes
        buckets = pack_buckets(model, size, self.dtype, include_frozen, part)
        numel = sum(p.numel() for b in buckets for _, p, _ in b)
        self.sent_bytes += numel * self.dtype.itemsize
        meta = [
            {
                "dtype": str(self.dtype).removeprefix("torch."),
                "numel": sum(p.numel() for _, p, _ in b),
                "params": [(n, list(p.shape)) for n, p, _ in b],
            }
            for b in buckets
        ]
        received = [self._rpc(url, method, buckets=meta, **kwargs) for url in self.urls]

        # why the workers cannot finish: a server's error
        # answer (naming it), or the watchdog's
        def failed():
            answer = next((f.exception() for f in received if f.done() and f.exception()), None)
            return answer or self.failure()

        try:
            left = deadline - time.monotonic()
            send_weights(self.group, buckets, self.dtype, left, failed)
            # the last bucket loads: bounded by the request's own timeout (http)
            return [future.result()["results"] for future in received]
        except Exception as e:
            self._abort(e)
            servers = ", ".join(self.urls)
            raise ConnectionError(f"the weight sync to {servers} failed: {e}") from None

    def _abort(self, error):
        """The workers are out of step: the group is aborted (a next sync makes
        a new one), and every worker told through its store (arrived): NCCL's
        abort reaches no other rank, and a worker waiting on a broadcast would
        hold its server until its watchdog ended it."""
        with contextlib.suppress(Exception):
            self.store.set("abort", str(error))
        self.group.abort()
        self.group = None


def pack_buckets(model, bucket_bytes, dtype, include_frozen=False, part=SyncPart.MERGED):
    """The weights to send (served_weights) in buckets of
    about bucket_bytes: one broadcast each."""
    buckets = []
    current = []  # the bucket being filled
    size = 0  # its bytes
    for name, param, lora in served_weights(model, include_frozen, part):
        if current and size + param.numel() * dtype.itemsize > bucket_bytes:
            buckets.append(current)
            current = []
            size = 0
        current.append((name, param, lora))
        size += param.numel() * dtype.itemsize
    return buckets + [current] if current else buckets


def served_weights(model, include_frozen=False, part=SyncPart.MERGED):
    """(name as vLLM knows it, weight, its LoRA layer or None) for each
    weight a sync sends: the trained ones (vLLM holds a frozen vision
    tower); --lora-rank: those of the modules holding an adapted layer
    (vLLM fuses q/k/v into qkv_proj, reloads it whole), with
    include_frozen all. Part BASE: every weight as it is (W); ADAPTER:
    lora_A and lora_B, named as peft saves them."""
    if not hasattr(model, "peft_config"):
        yield from ((name, p, None) for name, p in model.named_parameters() if p.requires_grad)
        return
    from peft.tuners.lora import LoraLayer
    from peft.utils import get_peft_model_state_dict

    if part == SyncPart.ADAPTER:
        yield from ((name, p, None) for name, p in get_peft_model_state_dict(model).items())
        return

    # peft's names: ...q_proj.base_layer.weight (W),
    # ...q_proj.lora_A.default.weight
    base = model.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    parents = {name.rpartition(".")[0] for name in adapted}
    for name, p in base.named_parameters():
        module, _, leaf = name.replace(".base_layer", "").rpartition(".")
        if ".lora_" not in name and (include_frozen or module.rpartition(".")[0] in parents):
            lora = adapted.get(module) if leaf == "weight" and part == SyncPart.MERGED else None
            yield f"{module}.{leaf}", p, lora


@torch.no_grad()
def merged(p, lora):
    """The weight vLLM serves: p (gathered under --fsdp), or
    W + scale * B @ A, a new tensor."""
    p = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
    return p + lora.get_delta_weight("default") if lora else p


def flatten(bucket, dtype):
    """One bucket's full weights in one buffer. Under --fsdp
    full_tensor() gathers a parameter's shards, a collective: every rank
    flattens the same buckets in order (help_sync)."""
    flat = torch.empty(sum(p.numel() for _, p, _ in bucket), dtype=dtype, device=bucket[0][1].device)
    for (_, p, lora), part in zip(bucket, flat.split([p.numel() for _, p, _ in bucket])):
        part.copy_(merged(p, lora).flatten())  # casts in the same pass
    return flat


def send_weights(group, buckets, dtype, timeout, failed=lambda: None):
    """Rank 0's broadcast of the buckets, one flat buffer each: bucket k+1 is
    packed while bucket k travels. Rank 0 never waits in a collective it cannot
    leave: it polls each broadcast, watching failed() (why the workers cannot
    finish, or None) and `timeout`, and raises before the backend's own timeout,
    at which NCCL's watchdog would end the process, nothing saved."""

    deadline = time.monotonic() + timeout

    def wait(work):
        while not work.is_completed():
            why = failed()
            if not why and time.monotonic() > deadline:
                why = f"not all sent in the {timeout:.0f} s left of --sync-timeout"
            if why:
                raise ConnectionError(why)
            time.sleep(0.001)
        work.wait()  # raises the backend's error, if it failed

    sending = None  # (the buffer on its way, its broadcast)
    for bucket in buckets:
        flat = flatten(bucket, dtype)  # of detached weights: no autograd
        if sending:
            wait(sending[1])
        sending = flat, group.broadcast(flat, 0)
    wait(sending[1])


def help_sync(model, args, dtype):
    """The other ranks' part of rank 0's sync under --fsdp:
    gathering each bucket with it."""
    for bucket in pack_buckets(model, args.sync_bucket_bytes, dtype):
        flatten(bucket, dtype)


# --- The run: main's phases in the order they run; a teardown that leaves nothing running ---


def main(argv=None):
    run = set_up(argv)  # ranks, device, seeds, the output directory
    load_data(run)  # the model's files, tokenizer, rows; the chat template checked before vLLM starts
    load_policy_and_optimizer(run)  # on its device, sharded or replicated; --resume's state
    handlers = stop_on_signals(["before training"])  # until training starts, Ctrl-C/SIGTERM stop at once
    try:
        start_generation(run)  # rank 0: vLLM, the weight sync, the producer, the evaluation at step 0
        stop_on_signals(run.stop)  # from here a first Ctrl-C/SIGTERM finishes the step, saves a checkpoint and stops
        for step in range(run.start_step, run.args.steps):
            train_one_step(run, step)  # take a batch, update, sync, evaluate, log, checkpoint
        finish(run)  # the ranks' weights compared, the last checkpoint, summary.json
    except (Exception, KeyboardInterrupt) as e:
        save_after_error(run, e)
        raise
    finally:
        tear_down(run, handlers)


@dataclass
class Run:
    """What lives through a run, filled by main's phases in order;
    rank 0 holds servers, producer, logs."""

    args: argparse.Namespace
    rank: int
    world_size: int
    device: torch.device
    out_dir: Path
    model_path: str = None  # what vLLM serves and the trainer loads: --model, the built-in one, or a checkpoint
    initial_model: str = None  # --beta's reference policy
    resumed: dict = None  # the trainer state --resume continues from
    tok: object = None
    pad_id: int = 0
    ctx: RolloutContext = None
    train_rows: list = None
    eval_rows: list = None
    policy: object = None  # the bare module: what is synced and saved
    model: object = None  # what is trained: the policy, or DDP around it
    reference: object = None
    saved_with: object = None  # the tokenizer, or an image-text model's processor, saved with the weights
    optimizer: object = None
    scheduler: object = None
    start_step: int = 0
    servers: list = field(default_factory=list)  # the vLLM servers started here
    urls: list = field(default_factory=list)  # every server's, started here or --vllm-url
    server_failure: str = None  # why a server failed, from watch_servers
    # collate's rows: a group's prompt once (share: --share-prefix, unless the
    # model refuses it), packed where a varlen kernel runs (choose_layout)
    layout: dict = None
    layout_reasons: dict = None  # each choice of the layout: "on", or why not
    served_dtype: object = None  # the dtype the servers compute in
    step_settings: object = None  # what every train_step takes, once the servers' dtype is known
    sync_backend: str = None  # the weight sync's: the device plan's, or what --vllm-url servers allow
    version: object = None  # the PolicyVersion the weight sync advances
    sync: object = None
    producer: object = None
    share_core: object = contextlib.nullcontext  # around a training step: share_idle_core on CPU
    logs: dict = field(default_factory=dict)  # metrics.jsonl, rollouts.jsonl, the wandb run
    stop: list = field(default_factory=list)  # a signal asked to stop after this step
    unlogged: object = None  # the last trained step's PendingLine, until log_step writes it
    updating: bool = False  # mid-update: the weights may be half-changed, not to be saved
    completed: int = 0  # steps finished
    done_cursor: dict = None  # the data cursor as of the last finished step: what a checkpoint saves
    history: list = field(default_factory=list)
    clock: dict = field(default_factory=dict)
    is_main = property(lambda self: self.rank == 0)  # not a field: what only one process should do
    # --fsdp over several ranks: each holds a shard (on one GPU, --fsdp is bf16 compute)
    sharded = property(lambda self: self.args.fsdp and self.world_size > 1)


def set_up(argv):
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # and the device plan, checked before anything loads
    args = parse_args(argv, world_size)
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if args.plan["trainer"] == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads(world_size, reserve=int(args.plan["cpu_server"])))
    if world_size > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.collective_timeout)
        )
    run = Run(args, rank, world_size, device, Path(args.output_dir), model_path=args.model)
    # its checkpoints would collide with this run's
    if not args.resume and (run.out_dir / "metrics.jsonl").exists():
        raise SystemExit(
            f"--output-dir {run.out_dir} holds a run already: continue it with --resume, or pass another --output-dir"
        )
    if run.is_main and args.resume and (run.out_dir / "args.json").exists():
        was, now = json.loads((run.out_dir / "args.json").read_text()), vars(args)
        order = "seed dataset task max_operand terms operations eval_size prompts_per_step sync_every".split()
        order += ["dataset_split", "dataset_columns"]
        changed = [f"--{k.replace('_', '-')} {was[k]}" for k in order if was.get(k, now[k]) != now[k]]
        if changed:
            raise SystemExit(
                f"--resume: the run in {run.out_dir} was started with {', '.join(changed)}: its data cursor and "
                "staleness gate count prompts in the order and steps these flags make; resume with the same ones"
            )
    if run.is_main:
        try:
            run.out_dir.mkdir(parents=True, exist_ok=True)
            (run.out_dir / "args.json").write_text(json.dumps(vars(args), indent=1))
        except OSError as e:
            raise SystemExit(f"--output-dir {run.out_dir} is not writable ({e}); pass a directory you can write to")
    # the checkpoint holds the model and tokenizer too: both
    # vLLM and the trainer load it
    if args.resume:
        if not (run.out_dir / "checkpoint" / "trainer_state.pt").exists():
            raise SystemExit(f"--resume: no checkpoint in {run.out_dir / 'checkpoint'}")
        run.model_path = str((run.out_dir / "checkpoint").resolve())
        # to CPU, whatever device wrote it; mapped: each rank
        # reads only the tensors it uses
        run.resumed = torch.load(Path(run.model_path) / "trainer_state.pt", "cpu", mmap=True, weights_only=False)
    # each rank its own streams, and on --resume the step's
    # too: none repeats its draws
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(args.seed + rank + world_size * (run.resumed["step"] if run.resumed else 0))
    return run


def load_data(run):
    from transformers import AutoTokenizer

    args = run.args
    # checked before a model is built or loaded
    run.train_rows, run.eval_rows = data_module.load_rows(args)
    environments = tools_module.load_environments(args, run.out_dir / "mcp.log" if run.is_main else None)
    # the columns each environment's reset needs, before vLLM and the model
    tools_module.check_columns(environments, run.train_rows + run.eval_rows, args)
    # rank 0 builds it; the others wait for its path
    if run.model_path is None or run.model_path.endswith(".gguf"):
        box = [None]
        if run.is_main and args.model is None:
            box = [tiny_model.build(args.cache_dir)]
        elif run.is_main:
            box = [dequantise_gguf(args.model, args.cache_dir)]
        if run.world_size > 1:
            dist.broadcast_object_list(box, 0)
        run.model_path = box[0]
    run.initial_model = run.resumed["initial_model"] if run.resumed else run.model_path
    try:
        run.tok = tok = AutoTokenizer.from_pretrained(run.model_path)
    except Exception as e:
        raise SystemExit(
            f"--model {run.model_path}: cannot load its tokenizer ({type(e).__name__}: {str(e)[:300]}); "
            "pass a local directory or hub name of a causal LM"
        )
    # masked: any id does
    run.pad_id = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
    schemas = tool_schemas(args.tool_names) if args.tool_names else None
    stop_ids = stop_token_ids(tok, run.model_path)
    # fails here, before vLLM starts
    report = prepare_chat_template(tok, args, schemas, stop_ids, run.model_path, environments=environments)
    if run.is_main:
        print(report, flush=True)
    rows = run.train_rows + run.eval_rows
    run.ctx = rollout_context(tok, schemas, rows, stop_ids=stop_ids, environments=environments)


def load_policy_and_optimizer(run):
    """The policy on this rank's device, whole or its shards (run.policy;
    run.model: DDP around it), probed and laid out; --beta's frozen
    reference; the optimizer; --resume's state."""
    from transformers import AutoProcessor

    args = run.args
    # the server shares this GPU: the trainer takes only what it leaves
    if run.is_main and args.plan["shared"]:
        limit_memory(run)
    if run.resumed and run.resumed.get("lora_rank", 0) != args.lora_rank:
        rank = run.resumed.get("lora_rank", 0)
        raise SystemExit(f"--resume: this checkpoint was trained with --lora-rank {rank}; resume with it")
    # a LoRA checkpoint holds merged weights (vLLM's): the
    # adapter goes on the initial model
    resumed_lora = args.lora_rank and run.resumed
    model = load_checked(run, run.initial_model if resumed_lora else run.model_path)
    prompts = [len(ids) for ids in run.ctx.prompt_ids.values()]
    run.layout, run.layout_reasons = choose_layout(
        model, args, run.device, prompts=prompts, logprobs=probe_logprobs, verbose=run.is_main
    )
    # after the probes (fp32, eager): --activation-checkpointing,
    # --compile, --fsdp's bf16 on one GPU
    model = set_up_compute(model, args, run.device)
    check_prompts_fit(run, model)
    if args.lora_rank:
        model = with_lora(model, args, run.resumed and Path(run.model_path) / "adapter")
    run.policy = run.model = model
    # vLLM serves an image-text checkpoint only with its
    # image processor: checkpoints keep it
    image_text = hasattr(model.config, "vision_config")
    run.saved_with = AutoProcessor.from_pretrained(run.model_path) if image_text else run.tok
    if args.beta:
        run.reference = load_on_device(run, run.initial_model).requires_grad_(False)
    if run.layout["packed"] and run.reference:
        # the reference's attention to packed rows too (the
        # verdict was the policy's)
        segments_refused(run.reference, probe_logprobs)
    if run.world_size > 1 and not args.fsdp:
        devices = [run.device.index] if run.device.type == "cuda" else None
        run.model = torch.nn.parallel.DistributedDataParallel(run.policy, device_ids=devices)
    make_optimizer(run)


def limit_memory(run):
    """Rank 0 beside a server on its GPU: the share of its
    memory the trainer may take (memory_share), from the model's
    shapes (on the meta device: nothing read)."""
    shapes = load_policy(run.model_path, empty=True)
    sizes = [p.numel() for p in shapes.parameters()]
    trained = 0 if run.args.lora_rank else sum(p.numel() for p in shapes.parameters() if p.requires_grad)
    total = torch.cuda.get_device_properties(run.device).total_memory
    share = memory_share(run.args, total, sum(sizes), trained, max(sizes))
    torch.cuda.set_per_process_memory_fraction(share, run.device)


def load_on_device(run, path):
    """The model at `path` on this rank's device: whole, or
    its shards (--fsdp, several ranks)."""
    if run.sharded:
        return load_sharded(path, run.device)
    return load_policy(path).to(run.device)


def load_checked(run, path):
    """The policy, loaded and probed: its log-probs must be
    what its output layer computes."""
    try:
        model = load_on_device(run, path)
    except Exception as e:
        raise SystemExit(
            f"--model {run.model_path}: cannot load it as a causal or image-text LM "
            f"({type(e).__name__}: {str(e)[:300]})"
        )
    wrong = logprobs_refused(model, probe_logprobs)
    if wrong:
        why = "a transform after its output layer it cannot reproduce"
        raise SystemExit(f"--model {run.model_path}: {wrong}: {why}")
    return model


def check_prompts_fit(run, model):
    """Every prompt must fit the context: --max-model-len, or the model's."""
    context = run.args.max_model_len or getattr(model.config, "max_position_embeddings", None)
    lengths = {i: len(ids) for i, ids in run.ctx.prompt_ids.items()}
    too_long = [(i, n) for i, n in lengths.items() if context and n >= context]
    if too_long:
        raise SystemExit(
            f"{len(too_long)} prompts do not fit the context of {context} tokens (the first: row id "
            f"{too_long[0][0]}, {too_long[0][1]} tokens); shorten them in --dataset or raise --max-model-len"
        )


def make_optimizer(run):
    """AdamW over the trained parameters, the learning rate's
    warm-up; --resume: their state, the step."""
    args = run.args
    # Fused AdamW: foreach's step holds 4 bytes a trained parameter on CUDA
    # (memory_share), loops on CPU (0.35 -> 0.08 s a step, SmolLM2-135M:
    # docs/performance.md). Not on CPU under --fsdp: untested.
    fused = run.device.type == "cuda" or not args.fsdp
    trained = [p for p in run.policy.parameters() if p.requires_grad]
    run.optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay, fused=fused)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(
        run.optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1))
    )
    resumed = run.resumed
    if not resumed:
        return
    saved_fsdp = resumed.get("fsdp", False)
    if saved_fsdp != run.args.fsdp:
        saved = "with" if saved_fsdp else "without"
        raise SystemExit(f"--resume: this checkpoint's optimizer state was saved {saved} --fsdp; resume {saved} it")
    # rank 0 reads the full state and sends each rank its shards
    if run.args.fsdp:
        set_optimizer_state_dict(
            run.policy,
            run.optimizer,
            resumed["optimizer"] if run.is_main else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
    else:  # each tensor to its parameter's device
        run.optimizer.load_state_dict(resumed["optimizer"])
    del resumed["optimizer"]  # applied: not held for the run
    run.scheduler.load_state_dict(resumed["scheduler"])
    run.start_step = run.completed = resumed["step"]
    if run.is_main:
        print(f"resuming at step {run.start_step} from {run.model_path}", flush=True)


def start_generation(run):
    """Rank 0: the vLLM servers, the weight sync, the producer, the logs, step
    0's evaluation. Every rank learns the servers' dtype: it packs the weights
    and rounds the logits as they compute."""
    args = run.args
    dtype = [start_servers(run) if run.is_main else None]
    if run.world_size > 1:
        dist.broadcast_object_list(dtype, 0)
    run.served_dtype = getattr(torch, dtype[0])
    state = dict(layout=run.layout, reference=run.reference, stop_ids=run.ctx.stop_ids, pad_id=run.pad_id)
    run.step_settings = step_settings(args, run.device, run.world_size, served_dtype=run.served_dtype, **state)
    if run.is_main:
        # On CPU fp32 even with native bf16: autocast there halved the step
        # but moved the log-probs from fp32's by a mismatch KL of 2e-2 to
        # 7e-2 (2.5e-3 with a bf16 server), and the recipe learnt less on
        # both seeds measured (docs/performance.md)
        trainer_dtype = "fp32"
        if run.device.type == "cuda":
            bf16_policy = args.fsdp and not run.sharded
            trainer_dtype = "bf16 over fp32 weights (FSDP2)" if bf16_policy else "bf16 autocast"

        print(f"the trainer computes in {trainer_dtype}, the servers in {dtype[0]}", flush=True)
        start_sync(run)
        start_producer(run)
        open_logs(run)
    elif args.fsdp and args.vllm_url:
        # rank 0's first sync gathers the weights from every rank's shards
        help_sync(run.policy, args, run.served_dtype)
    run.clock = {
        "start": time.perf_counter(),
        "samples": 0,
        "waited": 0.0,
        "cpu_start": time.process_time(),
        "idle_start": run.version.idle() if run.is_main else 0.0,
    }


def start_servers(run):
    """The servers, started here or --vllm-url's, and watched; their
    limits in run.ctx. Returns their dtype."""
    args = run.args
    adapter = args.lora_sync == SyncPart.ADAPTER
    if args.vllm_url:
        run.urls = args.vllm_url.split(",")
    else:
        # --lora-sync adapter: the servers hold the base
        # model, never --resume's merged checkpoint
        run.servers = start_vllm(args, run.initial_model if adapter else run.model_path, run.out_dir)
        run.urls = [server.url for server in run.servers]
    threading.Thread(target=watch_servers, args=(run,), daemon=True, name="watch_servers").start()
    configs = [served_config(url, args.lora_rank if adapter else 0) for url in run.urls]
    run.ctx.max_model_len = min(length for length, _, _, _ in configs)
    run.ctx.seeded = all(seeds for _, _, _, seeds in configs)
    if not run.ctx.seeded:
        print(
            "warning: requests go unseeded, so a run does not replay: a CPU server with chunked prefill "
            "crashes on seeded ones (vLLM 0.32); start it with --no-enable-chunked-prefill, as start_vllm does",
            flush=True,
        )
    # the sync's backend follows the devices these servers
    # report (the plan cannot know them)
    if args.vllm_url:
        ours = range(int(os.environ.get("LOCAL_WORLD_SIZE", 1))) if run.device.type == "cuda" else []
        ours = [str(torch.cuda.get_device_properties(i).uuid) for i in ours]
        devices = [devices for _, _, devices, _ in configs]
        run.sync_backend = url_sync_backend(run.urls, devices, ours)
    return configs[0][1]


def start_sync(run):
    """The policy version and the weight sync; a first sync
    where servers may hold other weights."""
    args = run.args
    adapter = args.lora_sync == SyncPart.ADAPTER
    run.version = PolicyVersion(args.max_inflight)
    # the watchdog's finding, read at each sync: names a
    # server that fails mid-sync
    failure = functools.partial(getattr, run, "server_failure")
    run.sync = WeightSync(run.urls, args, run.served_dtype, run.version, failure, backend=run.sync_backend)
    # a server we did not start may hold other weights: all of them;
    # --lora-sync adapter: and the adapter (B = 0, or --resume's),
    # loaded before the first request names it
    if args.vllm_url or adapter:
        run.sync(run.policy, include_frozen=bool(args.vllm_url))
    # the servers' log-probs against the trainer's, now and at the first
    # sync of moved weights; not under --fsdp on several ranks (a
    # forward takes every rank) nor --lora-sync adapter (vLLM 0.32's CPU
    # LoRA kernel fails on prompt log-probs)
    if not (run.sharded or adapter):
        run.sync.check = weights_arrive(run.urls, args, run, collate, token_logprobs)
    # the servers hold the weights of the step the run starts at
    # (or newer, after a failed sync: a count saved with them
    # would lag, and the gate would wait forever)
    run.version.value = version_at(run.start_step, args.sync_every)


def start_producer(run):
    """The producer thread, from --resume's data cursor; on a
    CPU server's core, the idle core shared."""
    cursor = run.resumed and run.resumed["data"]
    rows = run.train_rows
    run.producer = Producer(run.args, run.tok, rows, run.urls, run.ctx, version=run.version, cursor=cursor)
    run.producer.start()
    if run.args.plan["cpu_server"] and run.world_size == 1:
        run.share_core = functools.partial(share_idle_core, decoder_layers(run.policy), run.version)
    run.done_cursor = dict(run.producer.cursor)


def open_logs(run):
    """wandb, metrics.jsonl and rollouts.jsonl (--resume: cut
    back to its step); step 0's evaluation."""
    args = run.args
    if args.wandb_project:
        import wandb

        run.logs["wandb"] = wandb.init(project=args.wandb_project, config=vars(args), dir=str(run.out_dir))
    for name in ("metrics", "rollouts"):
        # --resume: the steps after the checkpoint again
        cut_back(run.out_dir / f"{name}.jsonl", run.start_step)
        run.logs[name] = open(run.out_dir / f"{name}.jsonl", "a")
    # every curve starts at step 0, the model as loaded
    if args.eval_every and not run.start_step:
        metrics = {"step": 0, "policy_version": 0, **evaluate(run)}
        write_metrics(run, metrics)
        print(f"step    0/{args.steps} | eval {metrics.get('eval/reward', math.nan):.3f}", flush=True)


@dataclass
class PendingLine:
    """A step's metrics line until log_step writes it
    (Run.unlogged), or save_after_error."""

    step: int
    groups: list
    metrics: dict
    trained_version: int


def train_one_step(run, step):
    """One step: take a batch, update the weights, sync them to vLLM,
    evaluate, log, checkpoint. What a save pairs (weights, step count,
    data cursor, the step's line) is set while run.updating: a signal
    at any line saves the last step whole."""
    args = run.args
    t_step = time.perf_counter()
    groups, samples, num_tokens = take_batch(run)
    wait_seconds = time.perf_counter() - t_step
    num_sequences = args.prompts_per_step * args.num_generations
    normalisers = dict(num_tokens=max(num_tokens, 1), num_sequences=num_sequences)
    # an error in the update may leave the weights
    # half-changed: not saved while `updating`
    run.updating = True
    with run.share_core():
        metrics = train_step(run.model, run.optimizer, samples, settings=run.step_settings, **normalisers)
    run.scheduler.step()
    if run.is_main:
        run.done_cursor = dict(run.producer.cursor)
        metrics |= {"train/loss_tokens": num_tokens, "perf/wait_seconds": wait_seconds}
        metrics["sync/seconds"] = 0.0
        # the step's FLOPs (every rank's) over its seconds and the devices' peak
        metrics |= mfu.step_metrics(
            run.policy.config.get_text_config(),
            [s for group in groups for s in group],
            seconds=time.perf_counter() - t_step - wait_seconds,
            device=run.device,
            world_size=run.world_size,
            share=run.layout["share"],
            lora=bool(args.lora_rank),
            tokens=metrics["train/tokens"],
        )
        metrics["perf/step_seconds"] = time.perf_counter() - t_step
        # save_after_error writes this line if the sync or the evaluation fails
        run.unlogged = PendingLine(step + 1, groups, metrics, run.version.value)
    run.completed = step + 1
    run.updating = False
    sync_seconds = 0.0
    if (step + 1) % args.sync_every == 0:
        sync_seconds = sync_weights(run)
    if run.is_main:
        pending = run.unlogged
        pending.metrics["sync/seconds"] = sync_seconds
        pending.metrics["perf/step_seconds"] = time.perf_counter() - t_step
        if args.eval_every and (step + 1) % args.eval_every == 0:
            pending.metrics.update(evaluate(run))
        # the line before the checkpoint: a saved step has its line
        log_step(run, pending)
    # Read once, so that the checkpoint and the exit agree; a later signal stops
    # the next step. Rank 0, which gets the signals, decides.
    stopping = bool(run.stop)
    due = [bool(args.save_every and (step + 1) % args.save_every == 0 or stopping)]
    if args.fsdp:
        dist.broadcast_object_list(due, 0)
    if due[0] and (run.is_main or args.fsdp):
        checkpoint(run, step + 1)
    if run.is_main and stopping:
        # torchrun stops the other ranks when this one exits
        raise SystemExit(
            f"stopped at step {step + 1} by signal {run.stop[0]}; continue with --resume --output-dir {run.out_dir}"
        )


def take_batch(run):
    """Rank 0 takes whole groups off the queue and deals each
    rank an equal share: the groups (rank 0's), this rank's
    samples, the step's loss tokens."""
    groups = None
    payload = [None, None]
    if run.is_main:
        groups = run.producer.take(run.args.prompts_per_step, run.args.data_timeout, lambda: bool(run.stop))
        fields = ("ids", "n_prompt", "mask", "logprobs", "advantage")
        to_train = [{k: s[k] for k in fields} for group in groups for s in group]
        shares = [to_train[r :: run.world_size] for r in range(run.world_size)]
        payload = [shares, sum(sum(s["mask"]) for s in to_train)]
    if run.world_size > 1:
        dist.broadcast_object_list(payload, 0)
    return groups, payload[0][run.rank], payload[1]


def sync_weights(run):
    """Rank 0 sends the weights to every server (WeightSync): returns its
    seconds. Under --fsdp every rank gathers its shards with it."""
    seconds = 0.0
    if run.is_main:
        seconds = run.sync(run.policy)
    elif run.args.fsdp:
        help_sync(run.policy, run.args, run.served_dtype)
    if run.world_size > 1:
        dist.barrier()
    return seconds


def log_step(run, pending):
    """A trained step's line (PendingLine) in metrics.jsonl and
    wandb, a few rollouts in rollouts.jsonl, one line printed.
    `pending` is left as is (a retry writes it)."""
    args = run.args
    clock = run.clock
    cursor = run.done_cursor
    samples = [s for g in pending.groups for s in g]
    clock["samples"] += len(samples)
    clock["waited"] += pending.metrics["perf/wait_seconds"]
    wall = time.perf_counter() - clock["start"]
    metrics = {**pending.metrics, **rollout_metrics(pending.groups, pending.trained_version)}
    metrics |= {
        "step": pending.step,
        "policy_version": run.version.value,
        "train/lr": run.scheduler.get_last_lr()[0],
        "staleness/dropped_samples": cursor["stale_samples"],
        "rollout/skipped_groups": cursor["skipped_groups"],
        "rollout/reward_failures": cursor["reward_failures"],
        "perf/samples_per_second": clock["samples"] / wall,
        "perf/wall_seconds": wall,
        # shares of the wall time
        "perf/trainer_idle": clock["waited"] / wall,
        "perf/generator_idle": (run.version.idle() - clock["idle_start"]) / wall,
        # this process's, producer included
        "perf/cpu_seconds": time.process_time() - clock["cpu_start"],
        # so far: calls that found every tool thread held (tools.bounded)
        "tools/refused": tools_module.TOOLS_REFUSED[0],
    }
    for s in samples[: args.log_rollouts]:
        completion = run.tok.decode(s["ids"][s["n_prompt"] :])
        versions = [v for v, m in zip(s["versions"], s["mask"]) if m]
        record = {"step": pending.step, "trained_version": pending.trained_version}
        record |= {"prompt_id": s["prompt_id"], "reward": s["reward"]}
        record |= {"advantage": s["advantage"], "completion": completion, "versions": versions}
        print(json.dumps(record), file=run.logs["rollouts"], flush=True)
    write_metrics(run, metrics)
    # once written: a signal before this line writes it again, never not at all
    run.unlogged = None
    run.history.append(metrics)
    print(
        f"step {pending.step:4d}/{args.steps} | reward {metrics['reward/mean']:6.3f} | loss {metrics['loss']:+.4f} | "
        f"{metrics['perf/samples_per_second']:6.1f} samples/s | staleness {metrics['staleness/mean']:.2f} | "
        f"sync {metrics['sync/seconds']:.2f}s | tools {metrics['tools/call_frequency']:.2f}"
        + (f" | eval {metrics['eval/reward']:.3f}" if "eval/reward" in metrics else ""),
        flush=True,
    )


def cut_back(log, step):
    """A log's lines up to `step` (they are in step order),
    and none cut short by a crash."""
    with contextlib.suppress(FileNotFoundError), open(log, "rb+") as lines:
        for line in iter(lines.readline, b""):
            if not line.endswith(b"\n") or json.loads(line)["step"] > step:
                lines.truncate(lines.tell() - len(line))
                break


def write_metrics(run, metrics):
    if "wandb" in run.logs:
        run.logs["wandb"].log(metrics, step=metrics["step"])
    # last: what log_step's signal window holds
    print(json.dumps(metrics), file=run.logs["metrics"], flush=True)


def rollout_metrics(groups, trained_version):
    """The step's rollouts; staleness per trained token: the
    trainer's version minus the token's."""
    samples = [s for g in groups for s in g]
    metrics = mean_over_union(
        [
            {
                "reward/mean": s["reward"],
                "rollout/completion_tokens": sum(s["mask"]),
                "rollout/sequence_tokens": len(s["ids"]),
                "rollout/turns": s["turns"],
                "rollout/truncated": float(s["truncated"]),
                "rollout/interrupted": s["interrupted"],
                "tools/call_frequency": float(s["tool_calls"] > 0),
                "tools/calls_per_rollout": s["tool_calls"],
                "tools/seconds": s["tool_seconds"],
                "tools/failure_frequency": s["tool_failures"] / max(s["tool_calls"], 1),
                **{f"reward/{k}": v for k, v in s["reward_parts"].items()},
            }
            for s in samples
        ]
    )
    staleness = [trained_version - v for s in samples for v, m in zip(s["versions"], s["mask"]) if m] or [0]
    values, counts = np.unique(staleness, return_counts=True)
    metrics.update(
        {
            "staleness/mean": float(np.mean(staleness)),
            "staleness/max": int(max(staleness)),
            **{f"staleness/tokens_{v}_behind": c / len(staleness) for v, c in zip(values, counts)},
        }
    )
    for s in samples:  # per-tool totals over the step
        for name, (calls, failures) in s["per_tool"].items():
            metrics[f"tools/{name}/calls"] = metrics.get(f"tools/{name}/calls", 0) + calls
            metrics[f"tools/{name}/failures"] = metrics.get(f"tools/{name}/failures", 0) + failures
    metrics["reward/std"] = float(np.std([s["reward"] for s in samples]))
    zero_variance = [np.std([s["reward"] for s in g]) == 0 for g in groups]
    metrics["rollout/zero_variance_groups"] = float(np.mean(zero_variance))
    return metrics


def mean_over_union(dicts):
    """Mean of each key over the dicts that have it (samples
    with and without tools differ)."""
    keys = dict.fromkeys(k for d in dicts for k in d)  # in the order first seen
    return {k: sum(d[k] for d in dicts if k in d) / sum(k in d for d in dicts) for k in keys}


def evaluate(run):
    """A greedy rollout of each held-out row through training's group pipeline,
    on the producer's loop; with --eval-samples K also K sampled, for pass@1 and
    pass@K of each reward (passed: > 0). Bounded by --data-timeout; none ({})
    once a stop signal came: the checkpoint first."""
    if run.stop:
        return {}
    args = run.args
    # rollouts per row, the greedy one first
    n = 1 + args.eval_samples
    # rows at once: as many rollouts as training holds
    slots = asyncio.Semaphore(max(1, 2 * args.max_inflight // n))

    # row i's rewards, greedy rollout first; the servers in turn
    async def scored(session, i):
        servers = run.producer.urls
        urls = [servers[(i * n + k) % len(servers)] for k in range(n)]
        # the same at every evaluation: the checkpoints are compared alike
        seeds = [(args.seed, "eval", i, k) for k in range(n)]
        row = run.eval_rows[i]
        try:
            async with slots:
                _, rewards, parts = await run.producer.rollout_and_score(session, row, urls, seeds, greedy=True)
            return rewards, parts
        except tools_module.Dropped as e:
            # its environment did not reset or its rewards
            # failed: counted, eval/failed
            return str(e)

    async def all_rows():
        async with client_session(args) as session:
            return await all_or_none(scored(session, i) for i in range(len(run.eval_rows)))

    future = asyncio.run_coroutine_threadsafe(all_rows(), run.producer.loop)
    finished = threading.Event()
    future.add_done_callback(lambda _: finished.set())
    deadline = time.monotonic() + args.data_timeout
    late = f"the evaluation did not end in {args.data_timeout} s (--data-timeout)"
    try:
        if not run.producer.wait(lambda: finished.wait(0.1), deadline, lambda: bool(run.stop), lambda: late):
            return {}
        results = future.result()
    finally:
        # its rollouts end with it, whatever ended the wait
        future.cancel()
    failed = [result for result in results if isinstance(result, str)]
    if failed:
        print(f"warning: {len(failed)} held-out rows not evaluated (eval/failed); the first: {failed[0]}", flush=True)
    metrics = []
    for total, parts in [result for result in results if not isinstance(result, str)]:
        row = {f"eval/{name}": values[0] for name, values in {"reward": total, **parts}.items()}
        for name, values in parts.items() if args.eval_samples else []:
            passed = int((values[1:] > 0).sum())
            row[f"eval/pass@1/{name}"] = pass_at_k(args.eval_samples, passed, 1)
            row[f"eval/pass@{args.eval_samples}/{name}"] = pass_at_k(args.eval_samples, passed, args.eval_samples)
        metrics.append(row)
    return {**mean_over_union(metrics), "eval/failed": len(failed)}


def pass_at_k(n, c, k):
    """The unbiased pass@k from n samples of which c passed
    (Chen et al., 2021)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def finish(run):
    args = run.args
    # DDP ranks must hold identical weights; a silent divergence (a
    # missed all-reduce) fails here. FSDP ranks hold different shards:
    # their checksums are recorded, not compared.
    checksum = [sum((p.to_local() if args.fsdp else p).double().sum().item() for p in run.policy.parameters())]
    checksums = checksum * run.world_size
    if run.world_size > 1:
        dist.all_gather_object(checksums, checksum[0])
    if run.is_main or args.fsdp:
        checkpoint(run, args.steps)
    if run.is_main:
        wall, history = time.perf_counter() - run.clock["start"], run.history
        audit = (
            {
                "mismatch_kl": float(np.mean([m["is/mismatch_kl"] for m in history])),
                "ratio_mean": float(np.mean([m["is/ratio_mean"] for m in history])),
                "ratio_min": min(m.get("is/ratio_min", 1.0) for m in history),
                "ratio_max": max(m.get("is/ratio_max", 1.0) for m in history),
            }
            if history
            else {}
        )
        summary = {"steps": args.steps, "train_seconds": wall, "rank_checksums": checksums, "trainer_vs_vllm": audit}
        summary["layout"] = run.layout_reasons
        (run.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"done: {args.steps} steps in {wall:.0f} s; model in {run.out_dir / 'checkpoint'}")
        if args.audit:
            print(
                "audit (trainer vs vLLM log-probs of the sampled tokens): "
                + ", ".join(f"{k} {v:.3g}" for k, v in audit.items())
            )
    if len(set(checksums)) > 1 and not args.fsdp:
        raise RuntimeError(f"ranks ended with different weights (checksums {checksums})")


def save_after_error(run, error):
    """Nothing is lost: the last finished step is saved, unless the error came
    mid-update (or under --fsdp on several ranks: saving takes them all, and
    others may be gone). A failed server is named as the cause, with its log:
    the error is only what it did to a request (a reset, a timeout)."""
    failure = run.server_failure or server_failure(run.urls, run.servers)
    # an engine's death fails requests before /health says it
    if not failure and isinstance(error, ConnectionError):
        time.sleep(3)
        failure = run.server_failure or server_failure(run.urls, run.servers)
    if run.is_main and run.producer and not run.updating and run.completed > run.start_step and not run.sharded:
        # its sync or evaluation failed (sync/seconds 0, no
        # eval/ metrics); a line that cannot be written (a full
        # disk, wandb) does not cost the checkpoint
        with contextlib.suppress(Exception):
            if run.unlogged:
                log_step(run, run.unlogged)
        checkpoint(run, run.completed)
        print(
            f"saved the checkpoint of step {run.completed} in {run.out_dir / 'checkpoint'}; continue with --resume",
            flush=True,
        )
    logs = f"the vLLM server logs: {', '.join(str(server.log_path) for server in run.servers)}" if run.servers else ""
    # what failed, group after group: a reset, a reward
    if isinstance(error, tools_module.Dropped) and not failure:
        raise SystemExit(f"error: {error}")
    # a server failed, or did not answer in time; a file that
    # could not be written (a full disk)
    if failure or isinstance(error, OSError):
        seen = f" after {type(error).__name__}: {(str(error) or '-').splitlines()[0][:300]}" if failure else ""
        raise SystemExit(f"error: {failure or error}\nThe run stopped at step {run.completed}{seen}. {logs}")
    # it came as the trainer waited for data, or twice, or before
    # training (vLLM's start, step 0's eval)
    if isinstance(error, KeyboardInterrupt):
        saved = (run.out_dir / "checkpoint").exists()
        resume = f"; continue with --resume --output-dir {run.out_dir}" if saved else " (no checkpoint to resume from)"
        signum = run.stop[0] if run.stop else str(error).removeprefix("signal ")
        raise SystemExit(f"stopped at step {run.completed} by signal {signum}{resume}")
    if logs:
        print(logs, flush=True)


def tear_down(run, handlers):
    # Signals ignored: one here would skip the rest, and the
    # exit wait for every tool thread
    for sig in handlers:
        signal.signal(sig, signal.SIG_IGN)
    error = sys.exc_info()[1]
    # ends watch_servers: the servers are stopped next, which is not a failure
    run.urls = []
    # the producer first: its environments are closed, each
    # within --tool-timeout
    parts = [functools.partial(run.producer.stop, 2 * run.args.tool_timeout + 10)] if run.producer else []
    parts += [functools.partial(stop_vllm, server) for server in run.servers]
    if "wandb" in run.logs:
        parts.append(functools.partial(run.logs["wandb"].finish, exit_code=int(error is not None)))
    # the interpreters' copy of Python in /dev/shm: os._exit below skips atexit
    parts.append(sandbox.remove_images)
    # --fsdp on one GPU made a group of one rank (compute.bf16_policy)
    if dist.is_initialized():
        parts.append(dist.destroy_process_group)
    # one part's error does not skip the others
    for part in parts:
        try:
            part()
        except Exception as e:
            print(f"warning: the teardown's {getattr(part, 'func', part).__name__} failed: {e}", flush=True)
    # The run ends here, not in the interpreter's teardown, which waits
    # for every tool and reward thread (one stuck in I/O would keep the
    # process and its GPUs alive), where freeing DDP's reducer can
    # deadlock (its gloo destructor joins a thread waiting for the GIL;
    # seen on rank 1) and the sync group's objects can abort the process
    # ("terminate called without an active exception")
    if __name__ == "__main__":
        # printed as the interpreter would; the run's own
        # errors (SystemExit) without traceback
        if isinstance(error, SystemExit):
            print(error, file=sys.stderr)
        elif error is not None:
            traceback.print_exception(error)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(error is not None))
    # a run called in-process gets its handlers back
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def checkpoint(run, step):
    """checkpoint-<step>/: the model (safetensors), tokenizer and trainer state,
    written whole under a temporary name, then the `checkpoint` link swapped to
    it in one rename: a crash never leaves a broken one. The data cursor is the
    last finished step's: --resume redoes every group after it. Under --fsdp
    every rank sends its shards, a tensor at a time, to rank 0's CPU memory."""
    weights, optim = None, run.optimizer.state_dict()
    if run.args.fsdp:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(run.policy, options=options)
        optim = get_optimizer_state_dict(run.policy, run.optimizer, options=options)
    name, link = f"checkpoint-{step:06d}", run.out_dir / "checkpoint"
    # the other ranks' part ends here
    if not run.is_main or link.is_symlink() and os.readlink(link) == name:
        return
    tmp = run.out_dir / f"{name}.tmp"
    previous = os.readlink(link) if link.is_symlink() else None
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        # merged weights; the adapter in adapter/
        # (from_pretrained applies one beside them)
        if run.args.lora_rank:
            # ("auto" asks the hub)
            run.policy.save_pretrained(tmp / "adapter", save_embedding_layers=False)
            weights = {
                name: merged(p, lora).cpu() for name, p, lora in served_weights(run.policy, include_frozen=True)
            }
        (run.policy.get_base_model() if run.args.lora_rank else run.policy).save_pretrained(tmp, state_dict=weights)
        run.saved_with.save_pretrained(tmp)
        torch.save(
            {
                "step": step,
                "data": run.done_cursor,
                "initial_model": run.initial_model,
                "optimizer": optim,
                "fsdp": run.args.fsdp,
                "lora_rank": run.args.lora_rank,
                "scheduler": run.scheduler.state_dict(),
            },
            tmp / "trainer_state.pt",
        )
        # a save of this step cut off before its swap

        shutil.rmtree(run.out_dir / name, ignore_errors=True)
        os.replace(tmp, run.out_dir / name)
        (run.out_dir / "checkpoint.tmp").unlink(missing_ok=True)
        os.symlink(name, run.out_dir / "checkpoint.tmp")
        os.replace(run.out_dir / "checkpoint.tmp", link)
    except BaseException as e:
        # a full disk (OSError from safetensors, RuntimeError
        # from torch.save), or a signal
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, (OSError, RuntimeError)):
            raise
        # + AdamW's moments
        needed = 3 * sum(p.numel() * p.element_size() for p in run.policy.parameters()) / 2**20
        # SystemExit: the error handler does not catch it,
        # nor write the same checkpoint again
        raise SystemExit(
            f"error: could not write the checkpoint of step {step} in {run.out_dir} "
            f"({str(e).splitlines()[0][:200]}): it needs about {needed:.0f} MiB and "
            f"{shutil.disk_usage(run.out_dir).free / 2**20:.0f} MiB are free. The partial one is removed; "
            f"the last complete checkpoint: {run.out_dir / previous if previous else 'none'} (--resume "
            "continues from it)"
        )
    # every other one: one a signal left between a swap and
    # this line, a .tmp a hard kill left
    for old in run.out_dir.glob("checkpoint-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def stop_on_signals(stop):
    """SIGINT and SIGTERM ask to stop after this step
    (_stop_after_step); returns their handlers."""
    stopping = functools.partial(_stop_after_step, stop)
    return {sig: signal.signal(sig, stopping) for sig in (signal.SIGINT, signal.SIGTERM)}


def _stop_after_step(stop, signum, frame):
    """A signal asks to stop after this step; one that finds `stop` set (a
    second, or any before training) at once. Silent: a print here, inside the
    main thread's, raises "reentrant call"."""
    if stop:
        raise KeyboardInterrupt(f"signal {signum}")
    stop.append(signum)


# --- Machinery: the step's settings and batches (collate's rows), the log-probs, the layout probed at start ---


@dataclass(frozen=True)
class StepSettings:
    """What every train_step takes besides its samples
    (step_settings makes it): layout, collate's rows (Run.layout);
    reference, --beta's reference policy."""

    loss: LossSettings
    # token_logprobs' keywords: how vLLM sampled (a ratio to its log-probs then
    # measures the policy, not the truncation), the dtype it rounds logits in
    sampling: dict
    layout: dict
    min_tokens: int
    pad_id: int
    micro_batch_size: int
    micro_batch_tokens: float
    max_grad_norm: float
    device: torch.device
    world_size: int
    # bf16 (autocast) on a GPU, fp32 on CPU (start_generation says why)
    dtype: torch.dtype
    reference: object = None


def step_settings(
    args, device, world_size=1, layout=None, reference=None, stop_ids=(), pad_id=0, served_dtype=torch.bfloat16
):
    """StepSettings from the arguments and the run's state (a
    test may leave it out)."""
    sampling = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p")}
    sampling |= {"stop_ids": stop_ids, "served_dtype": served_dtype}
    return StepSettings(
        loss=loss_settings(args),
        sampling=sampling,
        layout=layout or {"share": args.share_prefix, "packed": False},
        min_tokens=args.sampling_args.get("min_tokens", 0),
        pad_id=pad_id,
        micro_batch_size=args.micro_batch_size,
        micro_batch_tokens=args.micro_batch_tokens,
        max_grad_norm=args.max_grad_norm,
        device=device,
        world_size=world_size,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        reference=reference,
    )


def equal_micro_batches(samples, width, settings):
    """This rank's micro-batches, as many as any rank's: DDP and FSDP
    communicate in every forward and backward. width: the hidden size."""
    s = settings
    bounds = dict(tokens=s.micro_batch_tokens, width=width, **s.layout)
    micros = micro_batches(samples, s.micro_batch_size, 1, **bounds)
    if s.world_size > 1:
        count = torch.tensor(len(micros), device=s.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        # this rank splits its largest micro-batches until it has as many
        if count > len(micros):
            micros = micro_batches(samples, s.micro_batch_size, int(count), **bounds)
    return micros


def step_statistics(figures, forwarded, samples, settings):
    """The step's figures, merged once from the micro-batches' (loss,
    stats, loss tokens): the loss summed, means weighted by loss tokens,
    extremes over all; the tokens forwarded."""
    loss_tokens = max(1, sum(sum(s["mask"]) for s in samples))
    totals = {"loss": 0.0}
    for loss, stats, share in figures:
        totals["loss"] += loss
        for k, v in stats.items():
            if k.endswith("_min"):
                totals[k] = min(totals.get(k, v), v)
            elif k.endswith("_max"):
                totals[k] = max(totals.get(k, v), v)
            else:
                totals[k] = totals.get(k, 0.0) + v * share / loss_tokens
    counts = [forwarded, sum(len(s["ids"]) for s in samples)]
    tokens = torch.tensor(counts, dtype=torch.float64, device=settings.device)
    # the step's, over every rank
    if settings.world_size > 1:
        dist.all_reduce(tokens)
    forwarded, unshared = tokens.tolist()
    totals |= {"train/tokens": forwarded, "train/tokens_unshared": unshared}
    totals["train/tokens_saved"] = 1 - forwarded / unshared
    return totals


def micro_batches(samples, size, count=1, share=True, tokens=math.inf, width=None, packed=False):
    """The samples in micro-batches of at most `size` sequences and `tokens`
    tokens forwarded; unpacked, at most size x 1.25 x the median length (a
    longer sequence alone): a long tail is not mostly padding. Shortest first, a
    prompt's together. At least `count`: the largest halved."""

    samples = sorted(
        samples, key=lambda s: (s["n_prompt"], s["ids"][: s["n_prompt"]], len(s["ids"])) if share else len(s["ids"])
    )
    padding = size * 1.25 * np.median([len(s["ids"]) for s in samples])
    batches = [[]]
    for s in samples:
        # their lengths
        rows = rows_of(batches[-1] + [s], share, None if packed else width)[1]
        forwarded = sum(rows) if packed else len(rows) * max(rows)
        limit = tokens if packed else min(tokens, padding)
        if batches[-1] and (len(batches[-1]) == size or forwarded > limit):
            batches.append([])
        batches[-1].append(s)
    while len(batches) < count:
        i = max(
            (i for i, b in enumerate(batches) if len(b) > 1),
            key=lambda i: len(batches[i]) * len(batches[i][-1]["ids"]),
        )
        batches[i : i + 1] = [batches[i][: len(batches[i]) // 2], batches[i][len(batches[i]) // 2 :]]
    return batches


def rows_of(samples, share=True, width=None):
    """collate's rows (lists of sample indices) and their lengths: a prompt
    once, then its samples' completions (share). A dense row (width: the hidden
    size) takes a completion of c tokens where that saves (n prompt tokens, ~12
    width^2 multiply-adds each) more than it adds (~2 width a pair of its c and
    the row's c' tokens): 2 c c' < n (6 width + n)."""
    rows = []
    lengths = []
    open_row = {}  # prompt -> the row its next completion may join
    for i, s in enumerate(samples):
        n = s["n_prompt"]
        key = tuple(s["ids"][:n]) if share else i
        r = open_row.get(key)
        if r is None or width and 2 * (len(s["ids"]) - n) * (lengths[r] - n) >= n * (6 * width + n):
            r = open_row[key] = len(rows)
            rows.append([])
            lengths.append(n)
        rows[r].append(i)
        lengths[r] += len(s["ids"]) - n
    return rows, lengths


def collate(samples, pad_id, device, min_tokens=0, share=True, config=None, packed=False, dtype=torch.float32):
    """The micro-batch as the model takes it: rows_of's rows, each token at
    its position and seeing what it sees alone (its prompt, its completion):
    the same log-probs, and the prompt gets every completion's gradient. A
    prompt p0 p1 p2, completions a0 a1, b0 b1 b2:

        input_ids     p0 p1 p2 a0 a1 b0 b1 b2
        position_ids   0  1  2  3  4  3  4  5
        segment        0  0  0  1  1  2  2  2    (a token sees segment 0 and its own, causally)
        cols          a: [2, 3]   b: [2, 5, 6]   (the columns whose hidden states predict each token)

    packed: the rows as one, in segments (packed_segments); else padded
    rows, with a 4D mask where completions share one (shared_rows_mask).
    Per-token tensors: completion_tensors."""
    width = None if packed else getattr(config, "hidden_size", None)
    rows = rows_of(samples, share, width)[0]
    # per row its ids, each token's segment (0: the prompt, i + 1: sample i's
    # completion) and position; per segment its query count and key columns; per
    # sample its row and the columns that predict its tokens
    ids = []
    segment = []
    position = []
    segments = []
    at = {}
    for members in rows:
        n = samples[members[0]]["n_prompt"]
        if not packed or not ids:
            ids.append([])
            segment.append([])
            position.append([])
        prompt = range(len(ids[-1]), len(ids[-1]) + n)
        ids[-1] += samples[members[0]]["ids"][:n]
        segment[-1] += [0] * n
        position[-1] += range(n)
        segments.append((n, prompt))
        for i in members:
            completion = samples[i]["ids"][n:]
            own = range(len(ids[-1]), len(ids[-1]) + len(completion))
            at[i] = (len(ids) - 1, [prompt[-1], *own[:-1]])
            if own:
                segments.append((len(own), [*prompt, *own]))
            ids[-1] += completion
            segment[-1] += [i + 1] * len(completion)
            position[-1] += range(n, n + len(completion))
    # Padding continues each row's count: transformers 5 reads a position that
    # does not rise by one as a packed sequence's start, and builds a dense
    # [B, 1, T, T] mask (no flash attention)
    longest = max(1, *map(len, position))
    for p in position:
        start = p[-1] + 1 if p else 0
        p += range(start, start + longest - len(p))
    position = padded(position, torch.long).to(device)
    # what the model takes
    batch = {"input_ids": padded(ids, torch.long, pad_id), "position_ids": position}
    if packed:
        batch |= packed_segments(segments, device)
    elif any(len(members) > 1 for members in rows):
        # -1: padding, which attends to the prompt: no row is all masked
        segment = padded(segment, torch.long, -1).to(device)
        batch["attention_mask"] = shared_rows_mask(segment, position, config, dtype)
    batch |= completion_tensors(samples, at, min_tokens, pad_id)
    batch["tokens"] = sum(map(len, ids))
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def padded(rows, kind=torch.float, value=0):
    """Lists as a [len(rows), the longest] tensor, `value`
    past each one's end; 1 column at least."""
    out = torch.full((len(rows), max(1, *map(len, rows))), value, dtype=kind)
    for r, row in enumerate(rows):
        out[r, : len(row)] = torch.tensor(row, dtype=kind)
    return out


def completion_tensors(samples, at, min_tokens, pad_id):
    """[B, T] over each completion: token t is predicted at
    hidden[rows, cols[t]] (-1: padding)."""
    mask = padded([s["mask"] for s in samples])
    # a turn: a run of generated tokens; in_turn counts those
    # of its turn up to here
    generated = mask.cumsum(1)
    # vLLM held the stop tokens back for min_tokens
    in_turn = generated - (generated * (1 - mask)).cummax(1).values
    return {
        "rows": torch.tensor([[at[i][0]] for i in range(len(samples))]),
        "cols": padded([at[i][1] for i in range(len(samples))], torch.long, -1),
        "mask": mask,
        "stop_masked": (0 < in_turn) & (in_turn <= min_tokens),
        "sampler_logp": padded([s["logprobs"] for s in samples]),
        "targets": padded([s["ids"][s["n_prompt"] :] for s in samples], torch.long, pad_id),
        "advantages": torch.tensor([s["advantage"] for s in samples], dtype=torch.float),
    }


# what a batch (collate) hands the model
MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask", "segments")


def reference_logprobs(model, batch, temperature=1.0, **truncation):
    """token_logprobs' three [B, T] values, plainly: the model's logits at the
    columns that predict each completion token, through sampler_logprobs
    (log_softmax over what vLLM could sample, the target's entry). [rows,
    columns, V] logits: ~0.6 MB a token at V = 151,936."""
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    logits = model(**inputs, use_cache=False).logits
    real = batch["cols"] >= 0
    # [B, T, V]
    logits = logits[batch["rows"], batch["cols"].clamp(min=0)].float()
    stop_masked = batch["stop_masked"]
    values = sampler_logprobs(logits, batch["targets"], temperature, stop_masked=stop_masked, **truncation)
    # 0 past a completion, as token_logprobs
    return [torch.where(real, x, 0.0) for x in values]


def token_logprobs(model, batch, temperature=1.0, chunk=2**28, **truncation):
    """reference_logprobs' numbers, in less memory: the model's head gets one
    position a row (head_input_kept), then the completions' hidden states alone
    go through it in chunks of ~`chunk` logits (output_layer.py)."""
    bare = getattr(model, "module", model)  # DDP's
    head = bare.get_output_embeddings()
    # what the forward hands its head, and its head's output
    # there (before any transform)
    hidden = []
    keep_input = head.register_forward_pre_hook(functools.partial(head_input_kept, hidden))
    raw = []
    keep_output = head.register_forward_hook(lambda head, args, out: raw.append(out.detach()))
    try:
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        logits = model(**inputs, use_cache=False).logits.detach()
    finally:
        keep_input.remove()
        keep_output.remove()
    real = batch["cols"] >= 0  # [B, T]: the completions' tokens, not padding
    # [tokens, width]
    states = hidden[0][batch["rows"].expand_as(real)[real], batch["cols"][real]]
    # Gemma's softcapping, which the model's forward applies after its head
    softcap = getattr(bare.config.get_text_config(), "final_logit_softcapping", None)
    scale = forward_scale(logits, raw[0])
    targets = batch["targets"][real]
    stop_masked = batch["stop_masked"][real]
    per_token = chunked_logprobs(
        states, head, targets, stop_masked, scale, softcap, chunk, temperature=temperature, **truncation
    )
    return [torch.zeros(real.shape, device=real.device).masked_scatter(real, x) for x in per_token]


def head_input_kept(hidden, head, args):
    """token_logprobs' pre-hook on the head: keeps its input in `hidden`, hands
    it one position a row (a new tensor: a view would keep them all)."""
    hidden.append(args[0])
    return (args[0][:, -1:].clone(),)


def forward_scale(logits, raw):
    """What a forward does after its head, as the least-squares scale from its
    output `raw` to `logits` (Granite's 1 / logits_scaling, Cohere's
    logit_scale, ...); logprobs_refused checks."""
    fit = (logits.double() * raw).sum() / (raw.double() ** 2).sum().clamp_min(1e-300)
    return fit.float()


def probe_logprobs(model, samples, **layout):
    """[len(samples), the longest completion] log-probs as
    the trainer computes them."""
    config = model.config.get_text_config()
    with torch.no_grad():
        return token_logprobs(model, collate(samples, 0, model.device, config=config, **layout))[0]


# --- Machinery: arguments, checked before anything loads (the device plan: vllm_server.py) ---


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    # "(default: X)", unless the help says it or there is none to say
    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == "" or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None, world_size=1, cuda_count=None, local_ranks=None, heads=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model",
        help="hub name or local path of a causal LM or an image-text model (its vision tower "
        "frozen), or a .gguf file (dequantised once into --cache-dir); default: the tiny built-in model",
    )
    g.add_argument(
        "--dataset",
        help='rows {"prompt": str or chat messages, ...}: a JSONL, Parquet, CSV or JSON file, a '
        "save_to_disk folder or a Hub name (data.py); other columns reach the rewards by name. Default: --task",
    )
    g.add_argument("--dataset-split", help="--dataset's split; default: train, or its only one")
    g.add_argument(
        "--dataset-columns",
        help="NAME=COLUMN,...: columns under the names the run reads, e.g. prompt=question,answer=solution "
        "(prompt=messages: a chat, its final assistant turn cut, becomes the `answer`)",
    )
    g.add_argument(
        "--task",
        choices=["arithmetic", "countdown", "guess"],
        default="arithmetic",
        help="built-in task without --dataset: 'What is 3 + 4?', reach a target from given numbers, or "
        "guess a number told higher or lower (the environment GuessNumber)",
    )
    g.add_argument("--max-operand", type=int, default=4, help="built-in task: the largest operand")
    g.add_argument("--terms", type=int, default=2, help="built-in task: operands per problem")
    g.add_argument("--operations", default="+-", help="built-in task: the operators to draw from, of '+-*/'")
    g.add_argument("--eval-size", type=int, default=64, help="rows held out from the dataset for --eval-every")
    g.add_argument("--system-prompt", help="system message put before every prompt")
    g.add_argument("--chat-template", help="Jinja file that replaces the tokenizer's chat template")
    g.add_argument(
        "--cache-dir",
        default=os.path.expanduser("~/.cache/async_grpo"),
        help="where dequantised GGUF models (and the built-in model, once its recipe changed) are built once",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of data order, sampling and init (rank adds to it)")

    g = p.add_argument_group("rollout (the trainer's log-probs use the same temperature and truncation)")
    g.add_argument("--num-generations", type=int, default=8, help="rollouts per prompt (G, the group size)")
    g.add_argument("--prompts-per-step", type=int, default=8, help="groups per optimizer step")
    g.add_argument("--max-tokens", type=int, default=48, help="most tokens generated per assistant turn")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the most likely tokens up to this mass")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens with this share of the top one's probability")
    g.add_argument("--max-inflight", type=int, default=64, help="most generation requests open at once")
    g.add_argument(
        "--sampling-args",
        type=json.loads,
        default={},
        help=f"more vLLM sampling parameters as JSON, of {sorted(SAMPLING_ARGS)}, e.g. '{{\"min_tokens\": 4}}'",
    )

    g = p.add_argument_group("tools")
    g.add_argument(
        "--tools",
        nargs="?",
        const="all",
        help=f"offer tools to the model: 'all' (the bare flag) or a comma list of {sorted(tools_module.TOOLS)}",
    )
    g.add_argument("--env", help="environments (tools.py), a comma list of names or path/to/file.py:Class; see README")
    g.add_argument("--mcp", help="an MCP server as the environment `mcp`: a command line (stdio) or a URL; see README")
    g.add_argument(
        "--max-tool-turns",
        type=int,
        default=3,
        help="most turns of tool calls (or of an environment's answers) in a rollout; then one more answer",
    )
    g.add_argument("--tool-timeout", type=float, default=10.0, help="seconds one tool call may take")
    g.add_argument("--python-memory", type=int, default=512, help="--env python: MiB each process of it may map")
    g.add_argument(
        "--python-sandbox",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--env python's interpreters in namespaces (sandbox.py); --no-python-sandbox where user "
        "namespaces are disabled: limits only (the start-up message lists what is not isolated)",
    )
    g.add_argument(
        "--tool-latency",
        type=float,
        default=0.0,
        help="seconds every tool-calling turn takes at least: stands in for a remote tool (bench.py)",
    )

    g = p.add_argument_group("reward")
    g.add_argument(
        "--rewards",
        help=f"comma list of NAME[:WEIGHT] of {sorted(rewards_module.REWARDS)}; default: correct_answer:1.0,"
        "format_reward:0.2, or countdown:1.0 for --task countdown, env_reward:1.0 for --task guess",
    )
    g.add_argument(
        "--skip-zero-variance",
        action="store_true",
        help="skip groups whose rewards are all equal (zero advantage, no signal) and train on the next ones",
    )

    g = p.add_argument_group("loss and optimizer (see grpo_loss)")
    g.add_argument("--steps", type=int, default=60, help="optimizer steps")
    g.add_argument("--lr", type=float, help="AdamW learning rate; default: 3e-4 tiny model, 1e-6 --model; x10 LoRA")
    g.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--epsilon", type=float, default=0.2, help="lower clip range of the ratio: 1 - epsilon")
    g.add_argument("--epsilon-high", type=float, default=0.28, help="upper clip range of the ratio: 1 + epsilon-high")
    g.add_argument(
        "--loss-type",
        choices=["token", "sequence", "constant", "gspo", "cispo"],
        default="token",
        help="token (DAPO), sequence (GRPO), constant (Dr. GRPO), gspo (one clipped ratio per sequence), cispo "
        "(MiniMax-M1: the ratio clipped to [1 - epsilon, 1 + epsilon-high] weighs log pi, without gradient)",
    )
    g.add_argument(
        "--scale-rewards",
        choices=["group", "none"],
        default="group",
        help="divide advantages by the group's reward std (GRPO) or not (Dr. GRPO)",
    )
    g.add_argument(
        "--is-correction",
        choices=["none", "tis", "mis"],
        default="none",
        help="weigh the surrogate by pi_trainer / pi_vLLM, truncated at --is-threshold (tis) or masked outside "
        "[1/threshold, threshold] (mis); the ratio is then against the policy before this update, 1 (one update a "
        "batch): the clip never binds. none: the ratio is against vLLM's log-probs",
    )
    g.add_argument(
        "--is-threshold", type=float, default=2.0, help="truncation / masking bound of the importance weights"
    )
    g.add_argument(
        "--is-level",
        choices=["token", "sequence"],
        default="token",
        help="importance weight per token, or per sequence: its tokens' geometric mean (always with gspo), "
        "not their product, so that --is-threshold means the same for a sequence of any length",
    )
    g.add_argument(
        "--off-policy-mask",
        choices=["none", "sequence", "token"],
        default="none",
        help="drop from the loss what drifted past --off-policy-threshold from the sampler: sequences of "
        "negative advantage whose mean log(pi_sampler / pi_trainer) is past it (DeepSeek-V3.2), or tokens whose "
        "|log(pi_trainer / pi_sampler)| is (IcePop)",
    )
    g.add_argument("--off-policy-threshold", type=float, default=0.5, help="the bound of --off-policy-mask, in nats")
    g.add_argument(
        "--beta", type=float, default=0.0, help="weight of a KL penalty to the frozen initial policy (0: off)"
    )
    g.add_argument(
        "--kl-correction",
        action="store_true",
        help="weigh the KL penalty's k3 estimate by pi_theta / pi_sampler: unbiased for tokens an older or "
        "different policy sampled (DeepSeek-V3.2; off by default, as in TRL)",
    )
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=16,
        help="most sequences per forward/backward (gradient accumulation); fewer where lengths vary",
    )
    g.add_argument(
        "--share-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="forward each group's prompt once, its completions on top of it (exact: collate); "
        "--no-share-prefix forwards every sequence whole",
    )
    g.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=32768,
        help="most tokens forwarded per micro-batch, padding included (a longer sequence goes alone): its "
        "activations (checkpointed whole: ~4 x hidden size x layers bytes a token) and a mask's size",
    )
    g.add_argument(
        "--activation-checkpointing",
        choices=["full", "selective", "none"],
        help="recompute a decoder layer's activations in backward: all, or the elementwise ops' (selective: "
        "the matrix products' and attention's kept), to save memory (default: full with CUDA, else none)",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="torch.compile each decoder layer; a failed compile: one line, eager (default: on with CUDA)",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="shard weights, gradients and optimizer state over the torchrun ranks (FSDP2, a unit per "
        "decoder layer) instead of a copy on each (DDP); on one GPU: bf16 compute over fp32 weights "
        "(MixedPrecisionPolicy)",
    )
    g.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train a LoRA adapter of this rank (peft) instead of every weight (0: full fine-tuning)",
    )
    g.add_argument("--lora-alpha", type=float, help="LoRA's scale: alpha / rank; default: 2 x --lora-rank")
    g.add_argument(
        "--lora-targets",
        help="comma list of the Linear layers LoRA adapts, by name (e.g. "
        "q_proj,v_proj); default: every Linear layer of the decoder layers (attention and MLP projections)",
    )
    g.add_argument(
        "--lora-sync",
        choices=[SyncPart.MERGED, SyncPart.ADAPTER],
        default=SyncPart.MERGED,
        help="what a LoRA sync sends: merged, W + scale * B @ A of each adapted module (served as the base "
        "model); adapter, lora_A and lora_B alone (4.6%% of the bytes on SmolLM2-135M at rank 16), served "
        "as a runtime LoRA adapter (--enable-lora; 0.2-0.4x the tokens/s on CPU: docs/performance.md)",
    )

    g = p.add_argument_group("asynchrony and weight sync")
    g.add_argument("--sync-every", type=int, default=1, help="optimizer steps between weight syncs to vLLM")
    g.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="most policy versions a trained token may lag the trainer; the producer waits rather than exceed it",
    )
    g.add_argument(
        "--sync",
        action="store_true",
        help="synchronous baseline: generate a batch, train on it, sync, repeat (= --max-staleness 0)",
    )
    g.add_argument(
        "--sync-mode",
        choices=["keep", "wait", "abort"],
        default="keep",
        help="requests in flight at a sync: stopped and continued with the new weights (keep), finished "
        "before the sync (wait), or restarted with the new weights (abort)",
    )
    g.add_argument("--sync-bucket-mb", type=float, default=16, help="MiB per packed buffer the weights travel in")
    g.add_argument(
        "--sync-timeout", type=float, default=300, help="seconds a weight sync may take before the run fails"
    )
    g.add_argument(
        "--data-timeout", type=float, default=600, help="seconds the trainer waits for a batch or an evaluation"
    )
    g.add_argument(
        "--sync-host",
        default=os.environ.get("ASYNC_GRPO_SYNC_HOST"),
        help="address the servers reach the "
        "sync group at (or env ASYNC_GRPO_SYNC_HOST); default: this machine's on its route to the first one",
    )

    g = p.add_argument_group("vLLM server")
    g.add_argument("--vllm-url", help="use these running servers (a comma list of URLs) instead of starting any")
    g.add_argument(
        "--vllm-servers",
        type=int,
        default=0,
        help="servers to start, each on an equal share of --vllm-gpus, tensor parallel (0: one per GPU)",
    )
    g.add_argument(
        "--vllm-gpus",
        help="CUDA devices of the servers started here, e.g. '1' or '4,5,6,7'; "
        "default: those the trainer ranks leave free, or, none free, trainer rank 0's GPU, shared",
    )
    g.add_argument(
        "--vllm-gpu-memory",
        type=float,
        help="share of its GPUs' memory a server started here may use (its "
        "--gpu-memory-utilization); default: 0.3 on a GPU shared with the trainer, else vLLM's (0.92)",
    )
    g.add_argument("--vllm-port", type=int, default=0, help="port of the first server started here (0: free ones)")
    g.add_argument(
        "--vllm-startup-timeout", type=float, default=600, help="seconds to wait for the server to be healthy"
    )
    g.add_argument("--vllm-args", default="", help='extra arguments for the server, e.g. "--enforce-eager"')
    g.add_argument("--max-model-len", type=int, help="context length of the server (default: the model's)")

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--output-dir", help="metrics.jsonl, checkpoints and the server log (default: runs/<time>)")
    g.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="greedy evaluation on the held-out rows before the first step and every N steps (0: off)",
    )
    g.add_argument(
        "--eval-samples",
        type=int,
        default=0,
        help="also K samples per held-out row at the run's temperature: pass@1 and pass@K of each reward",
    )
    g.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="save a checkpoint every N steps (0: only at the end, on Ctrl-C/SIGTERM and on errors)",
    )
    g.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its latest checkpoint")
    g.add_argument("--wandb-project", help="also log to this wandb project (WANDB_MODE=offline works)")
    g.add_argument("--log-rollouts", type=int, default=4, help="rollouts per step written to rollouts.jsonl")
    g.add_argument(
        "--audit",
        action="store_true",
        help="keep the weights fixed (--lr 0) and report how far the trainer's log-probs are from vLLM's",
    )

    args = p.parse_args(argv)
    unsupported = sorted(set(args.sampling_args) - SAMPLING_ARGS) if isinstance(args.sampling_args, dict) else []
    at_least = {
        "prompts_per_step": 1,
        "max_tokens": 1,
        "max_inflight": 1,
        "micro_batch_size": 1,
        "micro_batch_tokens": 1,
        "sync_every": 1,
        "steps": 0,
        "eval_size": 0,
        "warmup_steps": 0,
        "max_tool_turns": 0,
        "max_staleness": 0,
        "eval_every": 0,
        "eval_samples": 0,
        "save_every": 0,
        "log_rollouts": 0,
        "tool_latency": 0,
        "vllm_port": 0,
        "vllm_servers": 0,
        "lora_rank": 0,
        "python_memory": 64,
    }
    checks = [(getattr(args, k) < low, f"--{k.replace('_', '-')} must be >= {low}") for k, low in at_least.items()]
    checks += [
        (getattr(args, k) <= 0, f"--{k.replace('_', '-')} must be > 0")
        for k in ("tool_timeout", "sync_timeout", "data_timeout", "vllm_startup_timeout", "sync_bucket_mb")
    ]
    checks += [
        (args.num_generations < 2, "--num-generations must be at least 2: advantages are relative to the group"),
        (args.eval_every and not args.eval_size, "--eval-every: --eval-size 0 holds no rows out to evaluate"),
        (args.epsilon_high < args.epsilon, "--epsilon-high must be >= --epsilon"),
        (
            (args.prompts_per_step * args.num_generations) % world_size,
            f"--prompts-per-step x --num-generations = "
            f"{args.prompts_per_step * args.num_generations} samples per step must divide evenly over {world_size} ranks",
        ),
        (
            args.lora_rank and args.fsdp,
            "--lora-rank with --fsdp: not supported (merging and saving the adapter take "
            "whole weights); drop --fsdp (DDP: a copy on each rank) or train every weight, --lora-rank 0",
        ),
        (
            (args.lora_alpha is not None or args.lora_targets) and not args.lora_rank,
            "--lora-alpha and --lora-targets need --lora-rank R > 0",
        ),
        (
            args.lora_sync == "adapter" and not 0 < args.lora_rank <= LORA_RANKS[-1],
            f"--lora-sync adapter sends a LoRA adapter: it needs --lora-rank R, 0 < R <= {LORA_RANKS[-1]}",
        ),
        (args.is_threshold <= 1, "--is-threshold must be > 1"),
        (args.off_policy_threshold <= 0, "--off-policy-threshold must be > 0"),
        (
            args.off_policy_mask == "token" and args.loss_type == "gspo",
            "--off-policy-mask token with --loss-type gspo: gspo has one ratio per sequence; use --off-policy-mask "
            "sequence",
        ),
        (
            args.temperature <= 0 or not 0 < args.top_p <= 1 or args.top_k < 0 or not 0 <= args.min_p < 1,
            "--temperature must be > 0, --top-p in (0, 1], --top-k >= 0 and --min-p in [0, 1)",
        ),
        (not isinstance(args.sampling_args, dict), "--sampling-args must be a JSON object"),
        (
            unsupported,
            f"--sampling-args: {unsupported} not supported: the trainer's log-probs would not be those of "
            f"the distribution vLLM samples from. Supported: {sorted(SAMPLING_ARGS)}; temperature, top_p, top_k and "
            "min_p have flags of their own (--temperature, --top-p, --top-k, --min-p)",
        ),
        (
            args.max_operand < 1 or args.terms < 2 or not args.operations or set(args.operations) - set("+-*/"),
            "--max-operand must be >= 1, --terms >= 2, and --operations a non-empty string of '+-*/'",
        ),
        (args.resume and not args.output_dir, "--resume needs the --output-dir of the run to continue"),
        (
            vllm_flag(args, "--gpu-memory-utilization"),
            "--vllm-args: pass the servers' memory share as --vllm-gpu-memory",
        ),
        (
            {vllm_flag(args, "--data-parallel-size", "-dp"), vllm_flag(args, "--pipeline-parallel-size", "-pp")}
            - {None, "1"},
            "--vllm-args: the engines of a data-parallel server would join the weight sync under the same ranks, and "
            "a pipeline stage holds part of the weights a sync sends whole; start several servers instead, "
            "--vllm-servers N",
        ),
    ]
    args.tool_names = []
    if args.tools == "all":
        args.tool_names = list(tools_module.TOOLS)
    elif args.tools is not None:
        args.tool_names = [name.strip() for name in args.tools.split(",")]
    unknown = sorted(set(args.tool_names) - set(tools_module.TOOLS))
    checks.append((unknown, f"--tools: unknown tool(s) {unknown}; tools.py defines {sorted(tools_module.TOOLS)}"))
    args.env_names = args.env.split(",") if args.env else ["GuessNumber"] * (args.task == "guess")
    unknown = [n for n in args.env_names if n not in tools_module.ENVIRONMENTS and not os.path.isfile(n.split(":")[0])]
    checks.append(
        (unknown, f"--env: {unknown} neither in {sorted(tools_module.ENVIRONMENTS)} nor path/to/file.py:Class")
    )
    args.rewards = args.rewards or {"countdown": "countdown:1.0", "guess": "env_reward:1.0"}.get(
        args.task, "correct_answer:1.0,format_reward:0.2"
    )
    try:
        args.reward_weights = {
            name.strip(): float(weight or 1.0)
            for name, _, weight in (item.partition(":") for item in args.rewards.split(","))
        }
    except ValueError:
        p.error(f"--rewards {args.rewards}: a WEIGHT is not a number")
    unknown = sorted(set(args.reward_weights) - set(rewards_module.REWARDS))
    checks.append(
        (unknown, f"--rewards: unknown reward(s) {unknown}; rewards.py defines {sorted(rewards_module.REWARDS)}")
    )
    gguf = args.model if args.model and args.model.endswith(".gguf") else None
    checks += [
        (path and not os.path.isfile(path), f"{flag}: no file {path}")
        for flag, path in [("--chat-template", args.chat_template), ("--model", gguf)]
    ]
    dataset_error = data_module.check_flags(args)
    checks.append((dataset_error, dataset_error))
    for failed, message in checks:
        if failed:
            p.error(message)
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    # the trainer ranks on this node
    local_ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    args.plan = plan_devices(args, cuda_count, local_ranks, p.error, heads)
    if args.fsdp and world_size < 2 and args.plan["trainer"] != "cuda":
        p.error("--fsdp on one rank takes a GPU; on CPU launch with torchrun --nproc-per-node N, N >= 2")
    args.activation_checkpointing = args.activation_checkpointing or ("full" if cuda_count else "none")
    args.compile = bool(cuda_count) if args.compile is None else args.compile
    args.max_staleness = 0 if args.sync else args.max_staleness
    args.sync_bucket_bytes = int(args.sync_bucket_mb * 2**20)
    # The other ranks' bound in a collective while rank 0
    # alone starts vLLM, waits for data or syncs: twice rank
    # 0's bounds, not torch's (NCCL's 10 min)
    args.collective_timeout = 2 * (args.vllm_startup_timeout + args.data_timeout + args.sync_timeout)
    args.output_dir = args.output_dir or time.strftime("runs/%Y%m%d-%H%M%S")
    args.lora_alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    # what every request names: the synced weights, or the
    # adapter vLLM serves on them
    args.request_model = SERVED_ADAPTER if args.lora_sync == "adapter" else SERVED_MODEL
    if args.audit:
        args.lr = 0.0
    elif args.lr is None and args.lora_rank:
        # an adapter, B = 0 at the start, needs about 10x (docs/performance.md)
        args.lr = 3e-3 if args.model is None else 1e-5
    elif args.lr is None:
        args.lr = 3e-4 if args.model is None else 1e-6
    return args


# --- Machinery: the producer's asyncio helpers; environment instances per group ---


def client_session(args):
    """The producer's and the evaluation's HTTP session: idle
    connections closed before vLLM closes them (5 s); a request may take
    as long as the trainer waits for data."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3)
    timeout = aiohttp.ClientTimeout(total=args.data_timeout)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def all_or_none(coros):
    """asyncio.gather whose first error cancels the rest and waits for
    them: gather alone leaves them running against a closing session, to
    fail later with a traceback nobody reads."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        cancel_all(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)


def cancel_all(tasks):
    for task in tasks:
        task.cancel()


@contextlib.asynccontextmanager
async def environment_instances(ctx, tok, row, n, timeout):
    """n instances of the row's environment (None without one), idle ones
    reused, reset to the row; the row as its rollouts see it (with what reset
    said) and its prompt's ids. Idle again once the group is done. Raises
    Dropped where a reset fails or the resets differ."""
    name = tools_module.environment_of(row, ctx.environments)
    if name is None:
        yield [None] * n, row, ctx.prompt_ids[row["id"]]
        return
    idle = ctx.idle[name]
    envs = [idle.pop() for _ in range(min(n, len(idle)))]
    try:
        try:
            # on the loop, not in a thread: each instance
            # made is closed at the end
            while len(envs) < n:
                ctx.alive.append(ctx.environments[name]())
                envs.append(ctx.alive[-1])
            said = await all_or_none(tools_module.bounded_reset(env, row, timeout) for env in envs)
        except tools_module.EnvironmentGone:
            raise
        except Exception as e:
            raise tools_module.Dropped(
                f"--env {name}: a reset to prompt {row['id']} failed: {type(e).__name__}: {e}"
            ) from None
        if any(text != said[0] for text in said):
            raise tools_module.Dropped(f"--env {name}: reset said different things to a group, {said[0]!r} and others")
        prompt_ids = ctx.prompt_ids[row["id"]]
        if said[0]:  # appended to the prompt's last message
            last = {**row["prompt"][-1], "content": row["prompt"][-1]["content"] + str(said[0])}
            row = {**row, "prompt": row["prompt"][:-1] + [last]}
            prompt_ids = render_prompt(tok, row["prompt"], ctx.offered[name], row["id"])
        yield envs, row, prompt_ids
    finally:
        # the group is done: what an instance holds until its
        # next reset may go (release)
        releasing = [tools_module.call_method(e.release, {}, timeout) for e in envs if hasattr(e, "release")]
        await asyncio.gather(*releasing, return_exceptions=True)
        idle += [env for env in envs if id(env) not in tools_module.HUNG]


# --- Machinery: chat templates: rendering, start-up checks, the exact tool-result tokens ---


def rollout_context(tok, schemas, rows, max_model_len=None, stop_ids=None, environments=None):
    """The RolloutContext of a run; max_model_len is the server's context
    length, known once it is up. environments: {name: class} of --env and --mcp
    (their instances: environment_instances)."""
    stop_ids = stop_ids or stop_token_ids(tok)
    environments = environments or {}
    offered = {None: schemas or []}
    for name, cls in environments.items():
        offered[name] = (schemas or []) + tools_module.environment_schemas(cls)
    all_tools = tools_module.every_tool(schemas, environments)
    # an environment that answers the model with a user turn
    # needs the turn ends too
    talks = any(hasattr(cls, "respond") for cls in environments.values())
    prompt_ids = {}
    for row in rows:
        row_tools = offered[tools_module.environment_of(row, environments)]
        prompt_ids[row["id"]] = render_prompt(tok, row["prompt"], row_tools, row["id"])
    return RolloutContext(
        schemas=schemas,
        schemas_by_name={s["function"]["name"]: s["function"] for s in schemas or []},
        environments=environments,
        offered=offered,
        prompt_ids=prompt_ids,
        stop_ids=stop_ids,
        max_model_len=max_model_len,
        idle={name: [] for name in environments},
        **(chat_format(tok, all_tools, stop_ids) if all_tools or talks else {}),
    )


def tool_schemas(names):
    """JSON schemas of the tools, from their signatures and
    docstrings (transformers)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(tools_module.TOOLS[n]) for n in names]


def render(tok, messages, schemas=None, generation_prompt=False):
    """Conversation -> text. A tokenizer without a chat template (a
    base model) gets the contents one per line: enough to train
    without tools, all such a model can do here."""
    if tok.chat_template is None:
        return "\n".join(str(m.get("content") or "") for m in messages) + "\n"
    return tok.apply_chat_template(
        messages, tools=schemas or None, add_generation_prompt=generation_prompt, tokenize=False
    )


def render_prompt(tok, messages, schemas, row_id=None):
    try:
        return tok.encode(render(tok, messages, schemas, generation_prompt=True), add_special_tokens=False)
    except Exception as e:
        # a template that refuses a role, say; the run has not started yet
        raise SystemExit(
            f"the chat template cannot render the prompt of row {row_id!r} ({type(e).__name__}: {e}); "
            "change the row, --system-prompt or --chat-template"
        )


def tool_result_ids(tok, history, tool_messages, schemas, turn_ends, stopped=True):
    """Token ids of the tool-result turn plus the next assistant header.
    Only this suffix is tokenised and appended to the generated ids:
    re-tokenising the whole conversation would change earlier tokens, which
    the model never sampled. It starts where the template ends an assistant
    turn: after its end-of-turn token (the model's stop token stands for
    it), or before it if the model stopped otherwise. Tool output is data
    (tools.result_ids); where not exact, Dropped."""
    try:
        before = render(tok, history, schemas)
        after = render(tok, history + tool_messages, schemas, generation_prompt=True)
    except Exception as e:
        raise tools_module.Dropped(f"the chat template cannot render a tool result ({type(e).__name__}: {e})")
    end = next(((end, n) for end, n in sorted(turn_ends, key=lambda e: -len(e[0])) if before.endswith(end)), None)
    if end is None or not after.startswith(before):
        raise tools_module.Dropped(
            f"the chat template ends an assistant turn in {before[-120:]!r}, or rewrites it when a tool "
            "result follows, unlike at its start-up check: results cannot be appended; pass --chat-template"
        )
    head = end[0][end[1] if stopped else 0 :]

    def marked(turns):
        return render(tok, history + turns, schemas, generation_prompt=True)[len(before) :]

    return tools_module.result_ids(tok, head, after[len(before) :], tool_messages, marked)


def stop_token_ids(tok, model_path=None):
    """Every token that ends a generation: the tokenizer's eos and pad, and
    the generation config's eos list (Llama 3: <|eot_id|> and <|eom_id|>;
    Qwen3: <|im_end|> and <|endoftext|>)."""
    ids = {tok.eos_token_id, tok.pad_token_id}
    if model_path:
        from transformers import GenerationConfig

        # a checkpoint without generation_config.json
        with contextlib.suppress(Exception):
            eos = GenerationConfig.from_pretrained(model_path).eos_token_id
            ids |= set(eos if isinstance(eos, list) else [eos])
    return sorted(ids - {None})


def prepare_chat_template(tok, args, schemas, stop_ids, model=None, environments=None):
    """Check, before vLLM starts, that the chat template can do what the run
    needs; the training template where the original is not prefix-preserving.
    Returns a line for the log. model: the checkpoint's path. environments:
    {name: class}: their tools rendered too."""
    model = model or args.model
    source = f"--chat-template {args.chat_template}" if args.chat_template else f"the template of {model}"
    if args.chat_template:
        tok.chat_template = Path(args.chat_template).read_text()
    schemas = tools_module.every_tool(schemas, environments or {})
    talks = any(hasattr(cls, "respond") for cls in (environments or {}).values())
    # any template (or none) renders prompts; nothing is parsed
    if not schemas and not talks:
        return f"chat template: {source if tok.chat_template else 'none (plain text prompts)'}"
    fix = "pass a Jinja template that renders `tools`, assistant `tool_calls` and `tool` messages with --chat-template PATH"
    if tok.chat_template is None:
        raise SystemExit(f"--tools, --env and --mcp need a chat template, and {model} has none: {fix}")
    if schemas:  # the tools, a call and a result rendered
        try:
            text, ignores_tools = (
                render(tok, PROBE[:3], schemas),
                render(tok, PROBE[:1], schemas) == render(tok, PROBE[:1]),
            )
        except Exception as e:
            raise SystemExit(f"{source} cannot render tool calls ({type(e).__name__}: {e}): {fix}")
        missing = [
            what
            for what, absent in [
                ("the tools", ignores_tools),
                ("the tool call", "6 * 7" not in text),
                ("the tool result", "42" not in text),
            ]
            if absent
        ]
        if missing:
            raise SystemExit(f"{source} does not render {', '.join(missing)}: {fix}")
    report = f"chat template: {source} (prefix-preserving)"
    if not prefix_preserving(tok, schemas):
        original, tok.chat_template = tok.chat_template, training_template(tok.chat_template)
        if tok.chat_template == original or not prefix_preserving(tok, schemas):
            raise SystemExit(
                f"{source} rewrites earlier turns when a message is appended (not prefix-preserving), "
                f"so tool results cannot be appended to the generated tokens exactly: {fix}, one that "
                f"renders every turn the same way whatever follows it"
            )
        report = f"chat template: {source} is not prefix-preserving; using its training variant (think blocks kept)"
    try:
        chat = chat_format(tok, schemas, stop_ids)
    except ValueError as e:
        raise SystemExit(f"{source}: {e}\n{fix}, in a format listed in the README (Tools and chat templates)")
    if not schemas:
        return f"{report}; an environment's user turns appended exactly"
    return f"{report}; tool calls: {chat['format']}{', one per turn' if chat['max_calls'] else ''}, round trip exact"


def prefix_preserving(tok, schemas):
    """True if rendering a conversation one message longer only appends
    tokens, as the tool loop needs (it tokenises only what the template adds).
    Without tools, the probe's turns without."""
    probe = PROBE if schemas else [m for m in PROBE if m["role"] != "tool" and not m.get("tool_calls")]
    renders = (tok.encode(render(tok, probe[:n], schemas), add_special_tokens=False) for n in range(1, len(probe) + 1))
    return all(longer[: len(shorter)] == shorter for shorter, longer in itertools.pairwise(renders))


def training_template(template):
    """Qwen3's template drops an assistant turn's think block once another
    message follows it; this variant renders every turn the same way always."""
    patched = template.replace("{%- if loop.index0 > ns.last_query_index %}", "{%- if true %}")
    return patched.replace("{%- if loop.last or (not loop.last and reasoning_content) %}", "{%- if true %}")


def chat_format(tok, schemas, stop_ids):
    """What the tool loop needs to know of a template, read off renders of probe turns:
      format     how it writes tool calls: 'tagged' (<tool_call> JSON or XML), 'mistral' ([TOOL_CALLS]),
                 'json' (Llama: bare JSON opens the turn), 'transformers' (the tokenizer's own parser)
      turn_ends  what it writes after an assistant turn, from its last stop token on ('<|im_end|>\\n'),
                 with that token's length: a generated stop token, whichever, stands for it
      max_calls  1 if it refuses several calls in one turn (Llama 3's templates), else None
    and the round trip: the probe turns' calls, cut out of the render as the model would generate
    them, must parse back equal, with their types. Raises ValueError saying what went wrong.
    Without schemas (an environment that answers the model): turn_ends alone."""
    tools = bool(schemas)
    schemas = (schemas or []) + [ROUND_TRIP_TOOL] if tools else None
    user, stops = [{"role": "user", "content": "Use the tools."}], [tok.decode([i]) for i in stop_ids]
    prompt = render(tok, user, schemas, generation_prompt=True)
    try:
        render(tok, user + [{"role": "assistant", "content": "", "tool_calls": ROUND_TRIP[1][1]}], schemas)
        max_calls = None
    except Exception:
        max_calls = 1
    turns, turn_ends = [], set()
    # a text turn: most end alike
    for content, calls in [("4wq8z", [])] + (ROUND_TRIP[:max_calls] if tools else []):
        text = render(tok, user + [{"role": "assistant", "content": content, "tool_calls": calls}], schemas)
        stop, at = max(((s, text.rfind(s)) for s in stops if s), key=lambda x: x[1], default=("", -1))
        # the stop token must come after the turn's last call
        last = "round_trip_probe" if calls else content
        if at < 0 or at < text.rfind(last) + len(last):
            raise ValueError(f"it does not end an assistant turn with a stop token ({stops}): {text[-200:]!r}")
        if not text.startswith(prompt):
            raise ValueError(
                f"its generation prompt {prompt[-60:]!r} does not begin the assistant turn {text[-200:]!r}"
            )
        turn_ends.add((text[at:], len(stop)))
        # the text the model would have generated
        turns.append((text[len(prompt) : at], content, calls))
    if not tools:
        return {"format": None, "turn_ends": sorted(turn_ends), "max_calls": None}
    with_calls = turns[1][0]
    if getattr(tok, "response_template", None):
        fmt = "transformers"
    elif "<tool_call>" in with_calls:
        fmt = "tagged"
    elif "[TOOL_CALLS]" in with_calls:
        fmt = "mistral"
    elif re.match(r"\s*(<\|python_tag\|>|\{)", remove_think(with_calls, False)[1]):
        fmt = "json"
    else:
        raise ValueError(f"it writes tool calls in a format this parser does not read: {with_calls!r}")
    problems = []
    by_name = {s["function"]["name"]: s["function"] for s in schemas}
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    for generated, content, calls in turns[1:]:
        message = parse_assistant(generated, tok, prompt_ids, by_name, fmt, max_calls=max_calls)
        if message["tool_calls"] != calls or message["tool_call_errors"] or message["content"] not in ("", content):
            errors = message["tool_call_errors"]
            problems.append(
                f"the turn {generated[:600]!r} parses back as calls {json.dumps(message['tool_calls'])}"
                + (f", {len(errors)} error(s), the first: {errors[0]}" if errors else "")
                + f", content {message['content'][:100]!r}; expected the calls {json.dumps(calls)}"
            )
    if problems:
        raise ValueError(
            "tool calls do not survive a round trip through it and the parser:\n  " + "\n  ".join(problems)
        )
    return {"format": fmt, "turn_ends": sorted(turn_ends), "max_calls": max_calls}


# --- Machinery: tool-call parsing, every format, as input validation ---


def parse_assistant(text, tok=None, prompt_ids=(), schemas_by_name=None, fmt="tagged", max_calls=None):
    """Generated text -> {'role', 'content', 'reasoning_content' (if any),
    'tool_calls', 'tool_call_errors'}: well-formed calls in the OpenAI shape,
    and one message per call that did not parse (or past max_calls, which the
    template cannot render). Never raises."""
    schemas_by_name = schemas_by_name or {}
    message = {"role": "assistant", "content": "", "tool_calls": [], "tool_call_errors": []}
    try:
        # the tokenizer's own parser; the schemas type the arguments
        if fmt == "transformers":
            parsed = tok.parse_response(
                text,
                prefix=tok.decode(prompt_ids),
                tools=[{"type": "function", "function": s} for s in schemas_by_name.values()],
            )
            found = [
                (c.get("function", c) if isinstance(c, dict) else c, str(c)) for c in parsed.get("tool_calls") or []
            ]
            content = parsed.get("content") or ""
            reasoning = parsed.get("reasoning_content")
            errors = []
        else:
            opened = bool(prompt_ids) and tok.decode(list(prompt_ids[-16:])).rstrip().endswith("<think>")
            reasoning, text = remove_think(text, opened)
            if fmt == "tagged":
                content, found, errors = parse_tagged(text, schemas_by_name)
            elif fmt == "mistral":
                content, found, errors = parse_mistral(text)
            else:
                content, found, errors = parse_bare_json(text)
        calls = []
        # each call stands or fails alone: one bad call never
        # costs the turn's others
        for value, quote in found:
            try:
                calls.append(parse_call(value))
            except Exception as e:
                errors.append(f"could not parse the tool call {quote[:200]!r}: {e}")
        errors += [
            f"not run: call one tool per turn ({json.dumps(c)[:200]})" for c in calls[max_calls or len(calls) :]
        ]
        message.update(content=content.strip(), tool_calls=calls[: max_calls or len(calls)], tool_call_errors=errors)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
    except Exception as e:
        # a parser bug must not end the run either: the model
        # sees it as an error
        message.update(
            content=text.strip(),
            tool_calls=[],
            tool_call_errors=[f"could not parse the turn ({type(e).__name__}: {str(e)[:200]})"],
        )
    return message


def remove_think(text, opened):
    """(reasoning or None, the rest). A think block is one
    the prompt opened (`opened`) or the turn opens at its
    start; a '</think>' anywhere else is text."""
    if not opened and not text.lstrip().startswith("<think>"):
        return None, text
    reasoning, closed, rest = (text if opened else text.lstrip()[len("<think>") :]).partition("</think>")
    return reasoning.strip(), rest if closed else ""


# Parsing is input validation: a model under RL writes anything. Nothing here
# raises; a call that does not parse becomes an error message the model sees,
# the rest is content. Each format's parser (parse_tagged, parse_mistral,
# parse_bare_json) returns (content, decoded calls with their text, errors).
def parse_call(call):
    """A decoded call {'name', 'arguments' or 'parameters'}
    -> OpenAI's shape; raises."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ValueError("a call needs a string 'name'")
    arguments = call.get("arguments", call.get("parameters", {}))
    # the OpenAI wire format: arguments as a JSON string
    if isinstance(arguments, str):
        arguments = JSON.decode(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("'arguments' must be an object")
    # walked without recursion: the point is to refuse what is too deep
    stack = [(call["name"], 0), (arguments, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_ARGUMENT_DEPTH:
            raise ValueError(f"arguments nested deeper than {MAX_ARGUMENT_DEPTH} levels")
        if isinstance(item, str):
            # a lone surrogate ("\\ud800") is JSON but not
            # text: a tokenizer would refuse it
            item.encode()
        elif isinstance(item, (dict, list)):
            stack += [(x, depth + 1) for x in (list(item) + list(item.values()) if isinstance(item, dict) else item)]
    return function_call(call["name"], arguments)


# An XML value may hold the format's own tags (a file with tool calls in
# it). A real </parameter> is followed by <parameter= or
# </function></tool_call> (or the turn's end) and no closing tag before the
# next <tool_call> (CLEAN; else it is text).
CLEAN = r"(?=(?:(?!</?tool_call>|</function>|</parameter>)[\s\S])*(?:<tool_call>|\Z))"


XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
XML_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
XML_END = re.compile(r"\s*</function>\s*(?:</tool_call>|\Z)" + CLEAN)


XML_CLOSE = re.compile(r"</parameter>(?=\s*<parameter=[^>\n]+>|" + XML_END.pattern + ")")


XML_TAGS = re.compile(r"<parameter=([^>\n]+)>|</parameter>|</tool_call>" + CLEAN)


# a JSON string (one cut off runs to the end): a tag inside it is text
STRING = r'"(?:[^"\\]|\\[\s\S])*"?|'


TAGGED_END, MISTRAL_END = re.compile(STRING + r"</?tool_call>"), re.compile(STRING + r"\[TOOL_CALLS\]")


# at the end of the turn, a call is whole without its closing tag
TAGGED_CLOSE = re.compile(r"\s*(?:</tool_call>|\Z)")


MISTRAL_NAME = re.compile(r"\s*([^\[\]\s]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


def xml_value_end(text, pos):
    """(the </parameter> that ends the value at text[pos:], whether the
    value's tags balance): the first real one (XML_CLOSE) closing no
    <parameter=...> the value opened (calls quoted whole in a value stay in
    it); else the first real one (None if none)."""
    depth, first = 0, None
    for tag in XML_TAGS.finditer(text, pos):
        if tag.group() == "</parameter>" and XML_CLOSE.match(text, tag.start()):
            if depth == 0:
                return tag, True
            first = first or tag
        # a </tool_call>: 0
        depth = max(0, depth + 1 if tag.group(1) else depth - (tag.group() == "</parameter>"))
    return first, False


def parse_xml_call(text, start, schemas_by_name):
    """<function=NAME> <parameter=KEY>VALUE</parameter>... </function> at
    text[start:] (Qwen3.5, Qwen3-Coder) -> ({'name', 'arguments'}, end). Raises
    ValueError(message, how far the call reaches), also where a value holds a
    <parameter=KEY> not yet given, or an unbalanced </tool_call> (a </parameter>
    missing before it, or text: the parser does not guess)."""
    head = XML_FUNCTION.match(text, start)
    if not head:
        raise ValueError("expected <function=NAME>", start)
    name = head.group(1)
    arguments = {}
    # the first thing wrong; the call is read to its end all the same
    error = None
    pos = head.end()
    keys = schemas_by_name[name].get("parameters", {}).get("properties", {}) if name in schemas_by_name else None
    while not XML_END.match(text, pos):
        param = XML_PARAMETER.match(text, pos)
        if not param:
            error = error or f"expected <parameter=KEY> or </function>, got {text[pos : pos + 40].strip()!r}"
            value = XML_PARAMETER.search(text, pos)
            opening = text.find("<tool_call>", pos)
            # no value begins before the next call: this one ends here
            if not value or 0 <= opening < value.start():
                raise ValueError(error, pos)
            # read on from the next value: a call inside it is text
            pos = value.start()
            continue
        key = param.group(1)
        close, balanced = xml_value_end(text, param.end())
        if not close:  # a value never closed runs to the end of the turn
            raise ValueError(
                f"<parameter={key}> has no </parameter> that a parameter or the call's end follows", len(text)
            )
        for tag in itertools.takewhile(lambda t: t.start() < close.start(), XML_TAGS.finditer(text, param.end())):
            opens_another = tag.group(1) not in (None, key, *arguments) and (keys is None or tag.group(1) in keys)
            if opens_another or (tag.group() == "</tool_call>" and not balanced):
                error = (
                    error or f"the value of {key!r} holds {tag.group()!r}: a </parameter> missing before it, or text?"
                )
        error = error or (key in arguments and f"parameter {key!r} given twice")
        # the format puts it on lines of its own
        value = re.sub(r"\A\n|\n\Z", "", text[param.end() : close.start()])
        arguments[key] = typed(value, (keys or {}).get(key))
        pos = close.end()
    end = text.index("</function>", pos) + len("</function>")
    if error:
        raise ValueError(error, end)
    return {"name": name, "arguments": arguments}, end


def parse_tagged(text, schemas_by_name):
    """<tool_call>BODY</tool_call>, any number, BODY JSON (Qwen/Hermes) or XML.
    JSON is decoded from the opening tag: a '</tool_call>' in a string does not
    end the call. A call that does not parse ends at its closing tag or the next
    opening one (not one in its strings or values)."""
    content = []  # the text between the calls
    found = []
    errors = []
    pos = 0
    while (start := text.find("<tool_call>", pos)) >= 0:
        content.append(text[pos:start])
        body = start + len("<tool_call>")
        xml = text[body:].lstrip().startswith("<function=")
        try:
            value, end = parse_xml_call(text, body, schemas_by_name) if xml else decode_json(text, body)
            close = TAGGED_CLOSE.match(text, end)
            if not close:
                raise ValueError(f"unexpected {text[end:].lstrip()[:40]!r} after the call", end)
            pos = close.end()
            found.append((value, text[start:pos]))
        except Exception as e:
            # this call's error; the turn's other calls stand
            message, read = e.args if len(e.args) == 2 else (str(e), body)
            tag = next((t for t in TAGGED_END.finditer(text, read if xml else body) if t.group()[0] == "<"), None)
            if not tag:
                pos = len(text)
            else:
                pos = tag.end() if tag.group() == "</tool_call>" else tag.start()
            errors.append(f"could not parse the tool call {text[start:pos][:200]!r}: {message}")
    content.append(text[pos:])
    return "".join(content), found, errors


def parse_mistral(text):
    """Content, then [TOOL_CALLS] followed by a JSON list of calls (Mistral v3)
    or name[ARGS]{json} (v11; an optional [CALL_ID]id), repeated."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, [], []
    found = []
    errors = []
    pos = start
    while pos < len(text):
        at = pos
        try:
            if not text.startswith("[TOOL_CALLS]", pos):
                raise ValueError("ignored: only calls may follow a call")
            pos += len("[TOOL_CALLS]")
            if text[pos:].lstrip()[:1] in ("[", "{"):
                value, pos = decode_json(text, pos)
            else:
                head = MISTRAL_NAME.match(text, pos)
                if not head:
                    raise ValueError("expected NAME[ARGS]{...}")
                arguments, pos = decode_json(text, head.end())
                value = {"name": head.group(1), "arguments": arguments}
            found += [(v, text[at:pos]) for v in (value if isinstance(value, list) else [value])]
        except ValueError as e:
            # on at the next [TOOL_CALLS], not one inside a
            # JSON string of this call
            pos = next((t.start() for t in MISTRAL_END.finditer(text, pos + 1) if t.group()[0] == "["), len(text))
            errors.append(f"could not parse the tool call {text[at:pos][:200]!r}: {e}")
        pos += len(text[pos:]) - len(text[pos:].lstrip())
    return text[:start], found, errors


def parse_bare_json(text):
    """Llama 3: the turn is the call, JSON {"name", "parameters"} (after
    <|python_tag|>), several separated by ';'. A turn that starts otherwise is
    content; text after the calls is ignored, the model told."""

    body = text.lstrip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").lstrip()
    if not tagged and not re.match(r"\{\s*\"", body):
        return text, [], []
    found, pos = [], 0
    while pos < len(body):
        try:
            value, end = decode_json(body, pos)
        except ValueError as e:
            return "", found, [f"could not parse the tool call {body[pos : pos + 200]!r}: {e.args[0]}"]
        found.append((value, body[pos:end]))
        rest = body[end:].lstrip()
        # prose, not another call: `I used {searchTool}`
        if rest and not re.match(r';|\{\s*"', rest):
            return "", found, [f"ignored the text after a tool call, {rest[:200]!r}: only calls may follow one"]
        pos = len(body) - len(rest.removeprefix(";").lstrip())
    return "", found, []


if __name__ == "__main__":
    main()
