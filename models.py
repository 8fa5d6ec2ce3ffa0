"""Loading the policy (async_grpo.py's load_policy_and_optimizer): a
checkpoint as the class whose parameter names vLLM serves (a causal
LM, or an image-text model with its vision tower frozen), a GGUF file
dequantised once, a LoRA adapter on it, under --fsdp its FSDP2
shards, read by rank 0 alone, and the attention function of packed
rows."""

import functools
import itertools
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.attention.varlen import varlen_attn


def load_policy(path, empty=False):
    """A causal LM, or an image-text checkpoint (Qwen2-VL, SmolVLM,
    ...) as its *ForConditionalGeneration class: its parameter names
    are the checkpoint's, which vLLM's loader maps to its own (a bare
    AutoModel drops the `model.` prefix). Text-only RL trains its
    language model and output head; the vision tower and projector
    get no gradient from text, so they are frozen: not optimised, not
    synced. empty: only the shapes, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    kind = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    attention = {}
    # torch's SDPA has no softcapping: transformers 5 drops Gemma 2's
    # attention softcapping there without a word, and vLLM applies it
    # (a LoRA-moved tiny Gemma 2: 0.047 nats apart). Eager applies it.
    if getattr(config.get_text_config(), "attn_logit_softcapping", None):
        attention["attn_implementation"] = "eager"
    if empty:
        with torch.device("meta"):
            model = kind.from_config(config, dtype=torch.float32, **attention)
    else:
        model = kind.from_pretrained(path, dtype=torch.float32, **attention)
    if kind is AutoModelForImageTextToText:
        language = (model.get_decoder(), model.get_output_embeddings())
        trained = {id(p) for m in language for p in m.parameters()}
        for p in model.parameters():
            p.requires_grad_(id(p) in trained)
    return model


def with_lora(model, args, adapter=None):
    """--lora-rank: a LoRA adapter (peft) on the --lora-targets,
    B = 0, or the one saved in `adapter` (--resume)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter:
        return PeftModel.from_pretrained(model, adapter, is_trainable=True)
    linear = trained_linear_names(model)
    targets = args.lora_targets.split(",") if args.lora_targets else linear
    unknown = sorted(set(targets) - set(linear))
    if unknown:
        raise SystemExit(
            f"--lora-targets: no Linear layer {unknown} in the decoder layers; theirs: {','.join(linear)}"
        )
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def trained_linear_names(model):
    """The names (the last part: q_proj, ...) of the trained Linear
    layers in the decoder layers, sorted."""
    names = set()
    for layer in decoder_layers(model):
        for name, m in layer.named_modules():
            if isinstance(m, torch.nn.Linear) and m.weight.requires_grad:
                names.add(name.rpartition(".")[2])
    return sorted(names)


def load_sharded(path, device):
    """--fsdp: rank 0 alone reads the checkpoint (the whole model,
    fp32, in its host memory); every rank builds it on the meta
    device, shards it and receives its shards, a tensor at a time,
    and the buffers outside the state dict whole."""
    full = load_policy(path) if dist.get_rank() == 0 else None
    model = shard(load_policy(path, empty=True)).to_empty(device=device)
    set_model_state_dict(
        model,
        full.state_dict() if full else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    for name, buffer in model.named_buffers():
        if full:
            buffer.copy_(full.get_buffer(name))
        dist.broadcast(buffer, 0)
    return model


def shard(model, policy=None):
    """FSDP2: each decoder layer is one unit, whose weights are
    gathered only while it computes; the root unit holds the rest
    (embeddings, head). Done in place: the module keeps its names,
    its parameters become DTensor shards. policy: a
    MixedPrecisionPolicy (compute.bf16_policy's), or none."""
    kwargs = {"mp_policy": policy} if policy else {}
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def decoder_layers(model):
    """The model's repeated blocks (transformers names their classes
    in _no_split_modules)."""
    return [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]


def dequantise_gguf(path, cache_dir):
    """A GGUF file as a plain checkpoint, built once into cache_dir:
    vLLM and the trainer load that, and a sync sends plain weights.
    transformers reads GGUF but marks the model quantised and will
    not save it: a fresh model of its config takes the dequantised
    weights, saved in bf16 (half fp32's size; both sides load the
    same values)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).resolve()
    out = Path(cache_dir) / f"{path.stem}-{path.stat().st_size}"
    if (out / "config.json").exists():
        return str(out)
    print(f"dequantising {path} into {out} (once)", flush=True)
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        read = AutoModelForCausalLM.from_pretrained
        quantised = read(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as e:
        raise SystemExit(
            f"--model {path}: cannot read it as a GGUF causal LM ({type(e).__name__}: {str(e)[:300]}); "
            "reading GGUF needs the gguf and accelerate packages (requirements.txt)"
        )
    del quantised.config.quantization_config
    model = type(quantised)(quantised.config)
    model.load_state_dict(quantised.state_dict())
    return save_whole(out, model.to(torch.bfloat16), tok)


def save_whole(path, *parts):
    """Save under a temporary name, then rename: a half-built model
    is never picked up."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    for part in parts:
        part.save_pretrained(tmp)
    os.replace(tmp, path)
    return str(path)


# what a model's layers hand their attention function that leaves its
# result alone (dropout: 0 but in training)
IGNORED_ATTENTION_ARGUMENTS = ("dropout", "position_ids", "use_cache", "output_router_logits", "output_attentions")


def segment_attention(module, query, key, value, mask, scaling=None, sliding_window=None, segments=None, **kw):
    """Attention within collate's segments (query
    [1, heads, T, head_dim]): a segment's queries see its keys
    (kv_index: a completion's prompt and itself, in position order)
    causally, aligned at the ends; on CUDA in one varlen flash kernel
    (only the pairs needed), elsewhere through SDPA a segment at a
    time (the same metadata, tested on CPU). GPT-OSS's sinks (s_aux:
    a logit a head in every softmax) take the SDPA path: the varlen
    kernel has no such term."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sinks = kw.pop("s_aux", None)
    unknown = [name for name, x in kw.items() if x is not None and name not in IGNORED_ATTENTION_ARGUMENTS]
    # what this function or SDPA would silently leave out
    if unknown or (sinks is not None and segments is None):
        raise ValueError(f"{type(module).__name__} passes {unknown or ['s_aux']} to its attention")
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kw)
    cu_q, cu_k, kv_index, max_q, max_k = segments
    q = query[0].transpose(0, 1)  # [T, heads, head_dim]
    # [every segment's keys, kv heads, head_dim]
    k = key[0].transpose(0, 1)[kv_index]
    v = value[0].transpose(0, 1)[kv_index]
    if q.is_cuda and sinks is None:
        out = varlen_segments(q, k, v, segments, scaling, sliding_window)
    else:
        out = sdpa_segments(q, k, v, segments, scaling, sliding_window, sinks)
    return out[None], None


def varlen_segments(q, k, v, segments, scaling, sliding_window):
    """segment_attention in one varlen flash kernel (CUDA):
    [T, heads, head_dim]."""
    cu_q, cu_k, _, max_q, max_k = segments
    # flash kernels take half precision (under autocast, rotary
    # embeddings leave q and k in fp32)
    half = torch.bfloat16 if q.dtype == torch.float32 else q.dtype
    # (-1, 0): causal, aligned at the end
    window = (sliding_window - 1 if sliding_window else -1, 0)
    tensors = [x.to(half) for x in (q, k, v)]
    sizes = (cu_q, cu_k, max_q, max_k)
    out = varlen_attn(*tensors, *sizes, scale=scaling, window_size=window, enable_gqa=True)
    return out.to(q.dtype)


def sdpa_segments(q, k, v, segments, scaling, sliding_window, sinks):
    """segment_attention through SDPA a segment at a time (the same
    metadata as the varlen kernel's), with GPT-OSS's sinks where
    given: [T, heads, head_dim]."""
    cu_q, cu_k = segments[:2]
    out = []
    bounds = zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())
    for a, b, c, d in bounds:
        # [queries, keys]: how far back
        behind = torch.arange(d - c - (b - a), d - c)[:, None] - torch.arange(d - c)
        seen = (behind >= 0) & (behind < (sliding_window or d - c))
        # 4D: SDPA's CPU flash kernel takes no other
        qkv = [x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d])]
        # a sink: a key of zeros with a value of zeros, seen by all,
        # whose bias is the head's sink
        if sinks is not None:
            qkv[1:] = [torch.cat([x, torch.zeros_like(x[:, :, :1])], 2) for x in qkv[1:]]
            bias = torch.where(seen, 0.0, -torch.inf).to(q.dtype).expand(len(sinks), -1, -1)
            sink = sinks[:, None, None].expand(-1, b - a, 1).to(q.dtype)
            seen = torch.cat([bias, sink], -1)[None]
        attend = torch.nn.functional.scaled_dot_product_attention
        part = attend(*qkv, attn_mask=seen, scale=scaling, enable_gqa=True)
        out.append(part[0].transpose(0, 1))
    return torch.cat(out)


def packed_segments(segments, device):
    """segment_attention's inputs: each segment's query count and key
    columns, for collate's row (3, [0 1 2]), (2, [0 1 2 3 4]), (3, [0
    1 2 5 6 7]), as a varlen kernel takes them."""
    queries, keys = zip(*segments)
    key_counts = [len(k) for k in keys]
    int32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    query_starts = int32([0, *itertools.accumulate(queries)])
    key_starts = int32([0, *itertools.accumulate(key_counts)])
    # kv_index: each segment's keys
    kv_index = torch.tensor([column for k in keys for column in k], device=device)
    inputs = (query_starts, key_starts, kv_index, max(queries), max(key_counts))
    # segment_attention reads the segments, no mask. An empty
    # 4D one is passed on as it is: without it, packed
    # positions (restarting at each completion) make
    # transformers build a [1, 1, T, T] mask that nothing reads
    empty = torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)
    return {"segments": inputs, "attention_mask": empty}


def shared_rows_mask(segment, position, config, dtype):
    """Shared rows' 4D mask, built on the device (host work linear in
    T) as the float bias SDPA would make of it in every layer, once,
    in `dtype`; with the model's sliding window."""
    size = segment.shape[1]
    causal = torch.ones(size, size, dtype=torch.bool, device=segment.device).tril()
    own = (segment[:, None] == 0) | (segment[:, None] == segment[..., None])
    full = (causal & own)[:, None]
    attend = {"full_attention": full}
    window = getattr(config, "sliding_window", None)
    # the window, in the mask that replaces the
    # model's own: over positions; per layer type
    if window:
        distance = position[:, None, :, None] - position[:, None, None, :]
        types = set(getattr(config, "layer_types", None) or ["sliding_attention"])
        attend = {t: full & (distance < window) if t == "sliding_attention" else full for t in types}
    bias = {t: torch.where(a, 0.0, -torch.inf).to(dtype) for t, a in attend.items()}
    return bias if len(bias) > 1 else next(iter(bias.values()))


# The start-up probes: async_grpo.py's load_policy_and_optimizer
# runs them on the loaded model, through `logprobs`, its
# probe_logprobs (the trainer's own log-prob path). A probe compares
# that path with another on a few tokens and refuses what differs by
# more than PROBE_MARGIN times the rounding it measures beside the
# comparison (probe_rounding): a bound of its own on every
# processor, thread count and dtype. Measured (docs/performance.md):
# honest gaps reach 2.1 times that rounding (SmolLM2 on another
# processor of this kind), a tiny random FalconH1's Mamba layers
# give 190 times it, a planted bias 10^5.
PROBE_MARGIN = 20


def probe_sample(ids, n_prompt):
    """A sample (async_grpo.py's collate takes it) of ids whose
    completion (after n_prompt) is all sampled tokens."""
    n = len(ids) - n_prompt
    return {"ids": ids, "n_prompt": n_prompt, "mask": [1] * n, "logprobs": [0.0] * n, "advantage": 0}


def probe_rounding(model, samples, dtype, logprobs):
    """What float rounding alone moves these samples' log-probs by,
    measured: their rows in one batch against each in a batch of its
    own, and shared against shared beside a longer row (other shapes,
    other kernels' blocking), and at least one unit in the last place
    of `dtype` (what the compared path computes in) at their
    magnitude."""
    whole = logprobs(model, samples, share=False)
    alone = [logprobs(model, [s], share=False)[0] for s in samples]
    shared = logprobs(model, samples)
    longer = probe_sample(list(range(9, 9 + len(samples[0]["ids"]) + 4)), samples[0]["n_prompt"])
    beside = logprobs(model, samples + [longer])[: len(samples), : shared.shape[1]]
    ulp = torch.finfo(dtype).eps * whole.abs().max().item()
    gaps = [largest_gap(whole[i, : len(x)], x) for i, x in enumerate(alone)]
    return max(*gaps, largest_gap(shared, beside), ulp)


def largest_gap(a, b):
    """The largest absolute difference between two tensors of
    log-probs, a float."""
    return (a - b).abs().max().item()


def reshard(model):
    """FSDP2 leaves the root's weights gathered after a forward (for
    the backward): a probe reshards them, so that what comes next
    (the optimizer, made after the probes) holds its shards. Others:
    nothing."""
    if hasattr(model, "reshard"):
        model.reshard()


def probe_gap(gap, rounding, what):
    """Why a probe refuses (what differs by `gap`, against
    PROBE_MARGIN times `rounding`), or None."""
    if gap <= PROBE_MARGIN * rounding:
        return None
    return f"{what} by {gap:.2g}, {gap / rounding:.0f} times the rounding measured beside it ({rounding:.2g})"


def sharing_refused(model, logprobs):
    """Why shared rows (collate) would not give this model's
    log-probs, or None. Sharing rests on the model attending as the
    4D mask says at the positions given (a sliding window included:
    collate): linear attention, recurrent layers, a mask left unread
    or a position scheme of its own do not. Two checks on a probe
    group, in the model's dtype: a completion's log-probs must not
    move when another completion's tokens change (rounding cancels
    there: the same kernels run), and shared rows must give what rows
    of their own give."""
    prompt = [1, 2, 3]
    probe = [probe_sample(prompt + c, 3) for c in ([4, 5, 6], [7, 8])]
    moved = [probe_sample(prompt + [40, 50, 60], 3), probe[1]]
    rounding = probe_rounding(model, probe, next(model.parameters()).dtype, logprobs)
    shared = logprobs(model, probe)
    leak = largest_gap(shared[1], logprobs(model, moved)[1])
    gap = largest_gap(shared, logprobs(model, probe, share=False))
    reshard(model)
    why = probe_gap(leak, rounding, "a completion's log-probs move with another's tokens")
    return why or probe_gap(gap, rounding, "a probe's log-probs differ shared")


def logprobs_refused(model, logprobs):
    """Why the trainer's log-probs (token_logprobs) are not the
    log-softmax of the model's own logits, or None: a family whose
    forward does after its head what token_logprobs does not (a
    transform that is not a scale). On a probe, in the model's dtype;
    the rounding measured on the model's own logits (the trainer's
    path fits the scale it reproduces, which a wrong transform would
    move too)."""
    ids = torch.arange(1, 8, device=model.device)[None]
    with torch.no_grad():
        # [rows, 7, V]: the probe alone, and beside another row (other
        # shapes)
        logits = [model(input_ids=x).logits[:1, 2:-1].float() for x in (ids, torch.cat([ids, ids.flip(1)]))]
    own = [x.log_softmax(-1).gather(-1, ids[:, 3:, None])[0, :, 0] for x in logits]
    ours = logprobs(model, [probe_sample(ids[0].tolist(), 3)], share=False)[0]
    reshard(model)
    ulp = torch.finfo(next(model.parameters()).dtype).eps * own[0].abs().max().item()
    rounding = max(largest_gap(own[0], own[1]), ulp)
    kind = model.config.get_text_config().model_type
    what = f"the trainer's log-probs of {kind} differ from its own logits'"
    return probe_gap(largest_gap(ours, own[0]), rounding, what)


def segments_refused(model, logprobs):
    """None, the model's attention now segment_attention (packed
    rows); else why not, its own attention kept: it takes no
    registered function, passes an argument segment_attention does
    not implement, or a probe's packed log-probs are not those of
    rows of their own (StableLM's layers do not hand the segments
    on)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register("segments", segment_attention)
    # what masks SDPA gets where there are no segments
    AttentionMaskInterface.register("segments", sdpa_mask)
    config = model.config.get_text_config()
    before = config._attn_implementation
    probe = [probe_sample([1, 2, 3] + c, 3) for c in ([4, 5, 6], [7, 8])]
    moved = [probe_sample([1, 2, 3, 40, 50, 60], 3), probe[1]]
    # CUDA's varlen kernel computes in bf16
    dtype = torch.bfloat16 if model.device.type == "cuda" else next(model.parameters()).dtype
    rounding = probe_rounding(model, probe, dtype, logprobs)
    rows = logprobs(model, probe, share=False)
    model.set_attn_implementation("segments")
    try:
        packed = logprobs(model, probe, packed=True)
        leak = largest_gap(packed[1], logprobs(model, moved, packed=True)[1])
        why = probe_gap(leak, rounding, "a segment's log-probs move with another's tokens")
        why = why or probe_gap(largest_gap(packed, rows), rounding, "a probe's log-probs differ packed")
    except ValueError as e:
        why = str(e)
    # layers that do not hand the attention the segments
    # leave SDPA the packed rows' empty mask
    except RuntimeError as e:
        why = f"its layers do not hand their attention the segments ({str(e).splitlines()[0][:80]})"
    reshard(model)
    if why or config._attn_implementation != "segments":
        model.set_attn_implementation(before)
    return why or (config._attn_implementation != "segments" and "no attention function")


def choose_layout(model, args, device, prompts, logprobs, verbose=True):
    """async_grpo.py's collate rows (its Run.layout) and why each is
    on or off (summary.json): a prompt once (--share-prefix), packed
    where the varlen kernel runs, if the model takes them. prompts:
    the prompts' lengths, for what a refused sharing costs."""
    config = model.config.get_text_config()
    why = {"share": None if args.share_prefix else "--no-share-prefix"}
    why["share"] = why["share"] or sharing_refused(model, logprobs)
    why["packed"] = why["share"] and "no shared rows"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        why["packed"] = why["packed"] or "no varlen flash kernel on this device (CUDA, compute capability 8+)"
    if getattr(config, "attn_logit_softcapping", None):
        why["packed"] = why["packed"] or "attention softcapping"
    refused = not why["packed"] and segments_refused(model, logprobs)
    if refused and verbose:
        print(f"packed rows are off for {config.model_type}: {refused}; a mask instead", flush=True)
    why["packed"] = why["packed"] or refused
    if args.share_prefix and why["share"] and verbose:
        prompt = sum(prompts) / len(prompts)
        group = args.num_generations
        # a group's tokens forwarded whole against shared, at
        # completions of --max-tokens
        more = group * (prompt + args.max_tokens) / (prompt + group * args.max_tokens)
        print(
            f"--share-prefix is off for {config.model_type}: {why['share']}; every sequence is forwarded "
            f"whole: ~{more:.1f} times the tokens (a prompt of {prompt:.0f} tokens {group} times a group, "
            f"completions of up to {args.max_tokens})",
            flush=True,
        )
    layout = {"share": not why["share"], "packed": not why["packed"]}
    return layout, {k: why[k] or "on" for k in why}
