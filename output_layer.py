"""The trainer's output layer (async_grpo.py's token_logprobs): the
log-probs of the sampled tokens under the distribution vLLM sampled them
from (sampler_logprobs), computed over chunks of the completions' hidden
states by one autograd.Function (ChunkedLogprobs) that never keeps a
chunk's [tokens, V] logits for backward.

Why a Function of its own: autograd through the head would keep every
chunk's logits (~0.6 MB a token at V = 151,936), or, with each chunk
checkpointed, redo its forward (and its entropy) in backward, cast
the head's weight again for every chunk and make a dozen fp32 passes
over each [tokens, V] chunk. Here the head's weight is cast once a
micro-batch (to autocast's dtype), a chunk's forward computes its
log-sum-exp over the kept tokens, the target's log-prob, the mass
truncation removed and the entropy, and saves only the hidden states
and the log-sum-exp; backward recomputes the chunk's logits, takes
d log p / d logits = onehot(target) - p over the kept tokens, and
accumulates the weight's gradient in fp32."""

import math

import torch


def sampler_logprobs(
    logits,
    targets,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    stop_masked=None,
    stop_ids=(),
    served_dtype=torch.bfloat16,
):
    """log pi(target) under the distribution vLLM sampled it from,
    its processed log-probs: logits [B, T, V] with the stop_ids
    masked where min_tokens held them back (stop_masked, [B, T]), /
    temperature, then min-p, top-k and top-p, renormalised over the
    tokens kept. The kept set is chosen on the logits rounded to
    `served_dtype`, the server's: tokens that tie there tie for vLLM,
    and top-k keeps every tie (at a top-p boundary vLLM keeps an
    arbitrary part of a tied group, the trainer all of it). The
    target is always kept: where the trainer would cut it (a token at
    the boundary, the two sides' logits differing in the last bits,
    or a stale one), its log-prob is taken over the kept set and
    itself: finite, and close to vLLM's at the boundary. Returns
    [B, T] log-probs (with gradient), [B, T] the probability mass the
    truncation removed, and [B, T] the entropy of the distribution
    sampled from (train/entropy)."""
    targets = targets[..., None]
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, stop_ids=stop_ids)
    scaled, kept = truncated(logits, targets, stop_masked=stop_masked, served_dtype=served_dtype, **settings)
    return kept_logprobs(scaled, kept, targets)[:3]


def kept_logprobs(scaled, kept, targets):
    """From truncated's (scaled, kept) [..., V] and targets [..., 1]:
    the targets' log-probs over the kept tokens (with gradient), the
    probability mass the truncation removed, the entropy of the
    distribution sampled from, and the log-sum-exp over the kept
    tokens, each [...]."""
    log_kept = kept.logsumexp(-1)
    removed = torch.zeros_like(log_kept)
    if kept is not scaled:
        removed = 1 - (log_kept.detach() - scaled.detach().logsumexp(-1)).exp()
    # what backward keeps is unchanged: these [..., V] temporaries are
    # freed here
    with torch.no_grad():
        # -sum p log p, 0 log 0 = 0
        entropy = torch.special.entr((kept - log_kept[..., None]).exp()).sum(-1)
    logp = kept.gather(-1, targets).squeeze(-1) - log_kept
    return logp, removed, entropy, log_kept


def truncated(logits, targets, temperature, top_k, top_p, min_p, stop_masked, stop_ids, served_dtype):
    """(scaled, kept): logits [..., V] with the stop ids masked where
    min_tokens held them back, / temperature; and the same with the
    tokens truncation cuts at -inf (the one more [..., V] tensor this
    takes), or `scaled` itself where nothing is truncated. targets:
    [..., 1], never cut."""
    if stop_masked is not None and stop_masked.any():
        is_stop = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        is_stop[list(stop_ids)] = True
        logits = logits.masked_fill(stop_masked[..., None] & is_stop & ~is_stop[targets], -torch.inf)
    scaled = logits / temperature
    if top_k <= 0 and top_p >= 1 and min_p <= 0:
        return scaled, scaled
    # Which tokens are kept is a choice, not differentiated; chosen in
    # chunks of rows, so that a sort over a large vocabulary never holds
    # all of them
    with torch.no_grad():
        flat, cut = logits.detach().flatten(0, -2), []
        for chunk in flat.split(max(1, 2**22 // flat.shape[-1])):
            rounded = chunk.to(served_dtype).float() / temperature
            cut.append(rounded < kept_threshold(rounded, top_k, top_p, min_p))
        cut = torch.cat(cut).view_as(logits).scatter_(-1, targets, False)
    return scaled, scaled.masked_fill(cut, -torch.inf)


def kept_threshold(x, top_k=0, top_p=1.0, min_p=0.0):
    """x: [N, V] logits after temperature -> [N, 1]: the smallest
    logit each row keeps, truncated in vLLM's order."""
    threshold = torch.full_like(x[:, :1], -torch.inf)
    # tokens with at least min_p times the top token's probability
    if min_p > 0:
        threshold = x.max(-1, keepdim=True).values + math.log(min_p)
    if 0 < top_k < x.shape[-1]:  # the k largest, ties kept
        threshold = torch.maximum(threshold, x.topk(top_k, -1).values[:, -1:])
    # the most likely tokens whose probability mass before them is below
    # top_p
    if top_p < 1:
        x = x.masked_fill(x < threshold, -torch.inf)
        log_total = x.logsumexp(-1, keepdim=True)
        # the nucleus is usually small: a full sort only if it is not
        for k in (min(1024, x.shape[-1]), x.shape[-1]):
            top = x.topk(k, -1).values  # [N, k], descending
            probs = (top - log_total).exp()
            kept = ((probs.cumsum(-1) - probs) < top_p).sum(-1, keepdim=True)
            if (kept < k).all() or k == x.shape[-1]:
                break
        threshold = torch.maximum(threshold, top.gather(-1, kept - 1))
    return threshold


def head_logits(hidden, weight, bias, scale, softcap):
    """[N, V] fp32 logits as the model's forward makes them: its head
    (weight already in the compute dtype), then what the forward does
    after it: Gemma's softcapping, or a scale (Granite's
    1 / logits_scaling, Cohere's logit_scale), as token_logprobs
    measured it."""
    logits = (hidden.to(weight.dtype) @ weight.T).float()
    if bias is not None:
        logits = logits + bias.float()
    if softcap:
        return torch.tanh(logits / softcap) * softcap
    return logits * scale


class ChunkedLogprobs(torch.autograd.Function):
    """hidden [N, width], the head's weight [V, width] and bias ([V]
    or None) -> sampler_logprobs' three [N] values, `rows` tokens a
    chunk. Only the log-probs have a gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, stop_masked, scale, softcap, sampling, rows):
        device = hidden.device.type
        # autocast's dtype where it is on (bf16 on a GPU): the weight
        # cast once, not once a chunk
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        ctx.settings = (scale, softcap, sampling, rows, dtype)
        out = ([], [], [], [])
        # every product cast by hand (autocast would leave each as it
        # is: it is already in the compute dtype)
        with torch.no_grad():
            cast = weight.to(dtype)
            for h, t, stop in chunks(hidden, targets, stop_masked, rows):
                logits = head_logits(h, cast, bias, scale, softcap)
                scaled, kept = truncated(logits, t, stop_masked=stop, **sampling)
                for x, part in zip(out, kept_logprobs(scaled, kept, t)):
                    x.append(part)
        logp, removed, entropy, log_kept = (torch.cat(x) for x in out)
        ctx.save_for_backward(hidden, weight, bias, targets, stop_masked, log_kept)
        ctx.mark_non_differentiable(removed, entropy)
        return logp, removed, entropy

    @staticmethod
    def backward(ctx, grad_logp, _removed, _entropy):
        hidden, weight, bias, targets, stop_masked, log_kept = ctx.saved_tensors
        scale, softcap, sampling, rows, dtype = ctx.settings
        temperature = sampling["temperature"]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32 whatever the compute dtype: the sum of every chunk's part
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = torch.zeros_like(bias, dtype=torch.float32)
        cast = weight.to(dtype)
        start = 0
        for h, t, stop in chunks(hidden, targets, stop_masked, rows):
            n = len(h)
            grad = grad_logp[start : start + n, None]
            logits = head_logits(h, cast, bias, scale, softcap)
            kept = truncated(logits, t, stop_masked=stop, **sampling)[1]
            p_kept = (kept - log_kept[start : start + n, None]).exp_()
            # d log p(target) / d scaled logits: onehot(target) - p over
            # the kept tokens (0 where cut or masked)
            g = p_kept.mul_(-grad).scatter_add_(-1, t, grad)
            g /= temperature
            # back through what the forward did after its head:
            # d tanh(x / c) c / dx = 1 - (tanh(x / c))^2
            g = g * (1 - (logits / softcap) ** 2) if softcap else g * scale
            if grad_bias is not None:
                grad_bias += g.sum(0)
            g = g.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + n] = g @ cast
            if grad_weight is not None:
                grad_weight += (g.T @ h.to(dtype)).float()
            start += n
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def chunks(hidden, targets, stop_masked, rows):
    """(hidden states, targets [rows, 1], stop_masked) of `rows`
    tokens at a time."""
    return zip(hidden.split(rows), targets[:, None].split(rows), stop_masked.split(rows))


def chunked_logprobs(hidden, head, targets, stop_masked, scale, softcap, chunk, **sampling):
    """sampler_logprobs' three [N] values for the hidden states
    [N, width] through `head` (a Linear), in chunks of ~`chunk`
    logits (ChunkedLogprobs)."""
    rows = max(1, chunk // head.out_features)
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "stop_ids": (), **sampling}
    sampling.setdefault("served_dtype", torch.bfloat16)
    weights = (head.weight, head.bias)
    return ChunkedLogprobs.apply(hidden, *weights, targets, stop_masked, scale, softcap, sampling, rows)
