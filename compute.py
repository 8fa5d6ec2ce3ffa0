"""How the trainer computes (issue 60's levers, as async_grpo.py's
flags; gpu_levers.py measures them on a GPU): each decoder layer
compiled (--compile); its activations checkpointed whole,
selectively or not at all (--activation-checkpointing); bf16
compute over fp32 weights through FSDP2's MixedPrecisionPolicy
(--fsdp on one GPU: a one-rank group); a LoRA run's frozen base
in bf16 (CUDA). Applied after the start-up probes, which keep the
model as loaded: fp32, eager, whole."""

import functools
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.checkpoint import CheckpointPolicy, checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from models import decoder_layers, shard

# Selective checkpointing keeps these ops' outputs (the matrix
# products and the attention: most of a layer's FLOPs) and
# recomputes the rest in backward (norms, RoPE, SwiGLU, casts:
# cheap, and most of the bytes)
PRODUCTS = ["mm", "addmm", "bmm"]
# SDPA's kernels (CPU, flash, cuDNN, efficient)
PRODUCTS += ["_scaled_dot_product_flash_attention_for_cpu"]
PRODUCTS += ["_scaled_dot_product_flash_attention", "_flash_attention_forward"]
PRODUCTS += ["_scaled_dot_product_cudnn_attention"]
PRODUCTS += ["_scaled_dot_product_efficient_attention", "_efficient_attention_forward"]
SAVED_OPS = {getattr(torch.ops.aten, name).default for name in PRODUCTS if hasattr(torch.ops.aten, name)}
# the varlen kernel of packed rows (models.varlen_segments)
VARLEN = getattr(torch.ops.torch_attn, "_varlen_attn", None)
SAVED_OPS |= {VARLEN.default} if VARLEN is not None else set()


def set_up_compute(model, args, device):
    """The model as the run trains it (returned; changed in place
    where it can be): a LoRA base in bf16 on CUDA (before
    with_lora, whose adapter peft keeps in fp32), each decoder
    layer checkpointed as --activation-checkpointing says, then
    compiled (--compile), then, under --fsdp on one rank, the bf16
    MixedPrecisionPolicy."""
    if args.lora_rank and device.type == "cuda":
        # frozen: no update to keep in fp32; autocast computes in
        # bf16 anyway
        model.to(torch.bfloat16)
    layers = decoder_layers(model)
    mode = args.activation_checkpointing
    if mode != "none":
        for layer in layers:
            checkpoint_layer(layer, selective=mode == "selective")
    if args.compile:
        compile_layers(layers)
    several = dist.is_initialized() and dist.get_world_size() > 1
    if args.fsdp and not several:
        model = bf16_policy(model, device)
    return model


def checkpoint_layer(layer, selective=False):
    """The layer's forward under torch.utils.checkpoint while it
    trains: its activations recomputed in backward, all of them or
    (selective) only the elementwise ops' (SAVED_OPS kept). The
    layer's own forward, not transformers' checkpointing: a compiled
    layer (compile_layers) then traces the checkpoint with it, which
    torch.compile needs to apply the selective policy."""
    forward = layer.forward
    policy = functools.partial(create_selective_checkpoint_contexts, keep_products)
    context = {"context_fn": policy} if selective else {}

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        # the recompute would write a cache again (transformers'
        # checkpointing drops it too)
        if kwargs.get("past_key_values") is not None:
            kwargs["past_key_values"] = None
        return checkpoint(forward, *args, use_reentrant=False, **context, **kwargs)

    layer.forward = checkpointed


def keep_products(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: SAVED_OPS' outputs kept,
    the rest recomputed."""
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def compile_layers(layers, backend="inductor"):
    """Each layer's forward torch.compile'd (its forward and backward
    fused: the elementwise work that is half of an uncompiled step on
    a GPU; one compile serves every layer alike). Its hooks stay
    outside, eager (FSDP2's, share_idle_core's). A compile that
    fails, forward or backward, prints one line and every layer runs
    eager from then on, the call that failed too. backend:
    torch.compile's (a test injects a failing one)."""
    import torch._functorch.config as aot_autograd

    # the backward compiled with the forward, where a failure is
    # caught (else lazily, in the step's backward; torch 2.13 has it)
    if hasattr(aot_autograd, "force_non_lazy_backward_lowering"):
        aot_autograd.force_non_lazy_backward_lowering = True
    # the failure, once one happened: shared by the layers
    failed = []
    for layer in layers:
        eager = layer.forward
        compiled = torch.compile(eager, backend=backend)
        layer.forward = functools.partial(eager_if_failed, failed, compiled, eager)


def eager_if_failed(failed, compiled, eager, *args, **kwargs):
    """A layer's compiled forward; once torch.compile has failed (in
    any layer), its eager one."""
    from torch._dynamo.exc import TorchDynamoException

    if failed:
        return eager(*args, **kwargs)
    try:
        return compiled(*args, **kwargs)
    except TorchDynamoException as e:
        failed.append(e)
        # the compiler's own error, which torch.compile's wraps
        cause = getattr(e, "inner_exception", None) or e
        first = (str(cause).strip().splitlines() or [""])[0][:200]
        why = f"{type(e).__name__}; {type(cause).__name__}: {first}"
        print(f"--compile: the decoder layers run eager ({why})", file=sys.stderr, flush=True)
        return eager(*args, **kwargs)


def bf16_policy(model, device):
    """FSDP2 on this process alone: each decoder layer and the root
    a unit whose fp32 weights (the master copy AdamW updates) are
    cast to bf16 as it computes, gradients reduced in fp32
    (MixedPrecisionPolicy). The process group of one rank is made
    here where there is none."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return shard(model, bf16)
