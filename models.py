"""Loading the policy (async_grpo.py's load_policy_and_optimizer): a checkpoint as the class whose parameter names
vLLM serves (a causal LM, or an image-text model with its vision tower frozen), a GGUF file dequantised once, a LoRA
adapter on it, and under --fsdp its FSDP2 shards, read by rank 0 alone."""

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard


def load_policy(path, empty=False):
    """A causal LM, or an image-text checkpoint (Qwen2-VL, SmolVLM, ...) as its *ForConditionalGeneration
    class: its parameter names are the checkpoint's, which vLLM's loader maps to its own (a bare AutoModel
    drops the `model.` prefix). Text-only RL trains its language model and output head; the vision tower and
    projector get no gradient from text, so they are frozen: not optimised, not synced. empty: only the
    shapes, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    kind = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device("meta") if empty else contextlib.nullcontext():
        model = (
            kind.from_config(config, dtype=torch.float32) if empty else kind.from_pretrained(path, dtype=torch.float32)
        )
    if kind is AutoModelForImageTextToText:
        trained = {id(p) for m in (model.get_decoder(), model.get_output_embeddings()) for p in m.parameters()}
        for p in model.parameters():
            p.requires_grad_(id(p) in trained)
    return model


def with_lora(model, args, adapter=None):
    """--lora-rank: a LoRA adapter (peft) on the --lora-targets, B = 0, or the one saved in `adapter`
    (--resume)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter:
        return PeftModel.from_pretrained(model, adapter, is_trainable=True)
    linear = sorted(
        {
            name.rpartition(".")[2]
            for layer in decoder_layers(model)
            for name, m in layer.named_modules()
            if isinstance(m, torch.nn.Linear) and m.weight.requires_grad
        }
    )
    targets = args.lora_targets.split(",") if args.lora_targets else linear
    unknown = sorted(set(targets) - set(linear))
    if unknown:
        raise SystemExit(
            f"--lora-targets: no Linear layer {unknown} in the decoder layers; theirs: {','.join(linear)}"
        )
    return get_peft_model(
        model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=targets, task_type="CAUSAL_LM")
    )


def load_sharded(path, device):
    """--fsdp: rank 0 alone reads the checkpoint (the whole model, fp32, in its host memory); every rank
    builds it on the meta device, shards it and receives its shards, a tensor at a time, and the buffers
    outside the state dict whole."""
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


def shard(model):
    """FSDP2: each decoder layer is one unit, whose weights are gathered only while it computes; the root unit
    holds the rest (embeddings, head). Done in place: the module keeps its names, its parameters become
    DTensor shards."""
    for layer in decoder_layers(model):
        fully_shard(layer)
    return fully_shard(model)


def decoder_layers(model):
    """The model's repeated blocks (transformers names their classes in _no_split_modules)."""
    return [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]


def dequantise_gguf(path, cache_dir):
    """A GGUF file as a plain checkpoint, built once into cache_dir: vLLM and the trainer load that, and a
    sync sends plain weights. transformers reads GGUF but marks the model quantised and will not save it: a
    fresh model of its config takes the dequantised weights, saved in bf16 (half fp32's size; both sides load
    the same values)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).resolve()
    out = Path(cache_dir) / f"{path.stem}-{path.stat().st_size}"
    if (out / "config.json").exists():
        return str(out)
    print(f"dequantising {path} into {out} (once)", flush=True)
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        quantised = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
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
    """Save under a temporary name, then rename: a half-built model is never picked up."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    for part in parts:
        part.save_pretrained(tmp)
    os.replace(tmp, path)
    return str(path)
