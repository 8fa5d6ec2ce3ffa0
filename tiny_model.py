"""The built-in model, for the default run and the tests: a ~0.5M-parameter Qwen3 with a byte-level BPE
tokenizer, no network. It ships built (builtin_model/, made by `python tiny_model.py`); a change to its recipe
builds it once into --cache-dir instead until it is remade. async_grpo.py loads it as it would any checkpoint.

Its template: ChatML with Qwen-style tool calls, so the same parser serves this model and Qwen models. Tools
are listed as `name(arg, ...)`: full JSON schemas would make a tiny model's prompts ten times longer.
"""

import json
import os
import random
import shutil
import time
from pathlib import Path

import torch

import rewards
import tools


def schemas(names):
    """The tools' JSON schemas, as async_grpo.py offers them (transformers' get_json_schema)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(tools.TOOLS[name]) for name in names]


CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Tools:\n{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{{ f.name }}({{ f.parameters.properties | join(', ') }})\n{% endfor %}"
    'Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}{% set f = call.function if call.function is defined else call %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": '
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>{{ m.content }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]


VERSION = "tiny-qwen3-v4"  # bump when the recipe below changes, so caches rebuild (and remake SHIPPED)
WARM_START_STEPS = 800
# The built-in model as make() makes it, committed with this file (1.8 MB): the first run loads it instead of
# building it, which took BUILD_SECONDS (measured: the 800 steps of a fresh-home default run, issue 54, on 2
# cores; under a load of 20 on them a rebuild ran at 5-7 s a step).
# test_the_shipped_built_in_model_is_the_one_its_recipe_makes checks that a rebuild makes the same model as
# far as its first 10 steps, against build.json.
SHIPPED = Path(__file__).resolve().parent / "builtin_model"
BUILD_SECONDS = 150


def warm_start_conversations(n, seed):
    """Supervised conversations for the built-in model: answer directly (without tools), or, with tools
    offered (the calculator alone or all of them), call the calculator and copy its result; with --env
    python's tool, print the expression in it and copy what it shows; and games of --task guess, each guess
    anywhere the answers so far leave possible: the moves, not the halving that wins every game."""
    rng = random.Random(seed)
    plain = []  # (conversation, tool schemas): answered directly
    with_tools = []  # answered with the calculator's result
    with_python = []  # answered with what the interpreter printed
    games = []
    # not rng's seed: its guesses would be the numbers
    for row in rewards.task_rows(n, seed + 1, task="guess"):
        game = tools.GuessNumber()
        game.reset(**row)
        conversation = [{"role": "user", "content": row["prompt"]}]
        said = ""
        while said is not None:
            conversation.append({"role": "assistant", "content": str(rng.randint(game.low, game.high))})
            said = game.respond(conversation[-1])
            conversation += [{"role": "user", "content": said}] if said else []
        games.append((conversation, None))
    for row in rewards.task_rows(n, seed, max_operand=9):  # a wider range than the RL task: format, not facts
        user = {"role": "user", "content": row["prompt"]}
        answer = str(row["answer"])
        plain.append(([user, {"role": "assistant", "content": answer}], None))
        call = {
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": row["prompt"][8:-1]}},
        }
        with_tools.append(
            (
                [
                    user,
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "calculator", "content": answer},
                    {"role": "assistant", "content": answer},
                ],
                schemas(rng.choice([["calculator"], list(tools.TOOLS)])),
            )
        )
        code = {
            "type": "function",
            "function": {"name": "python", "arguments": {"code": f"print({row['prompt'][8:-1]})"}},
        }
        with_python.append(
            (
                [
                    user,
                    {"role": "assistant", "content": "", "tool_calls": [code]},
                    {"role": "tool", "name": "python", "content": answer},
                    {"role": "assistant", "content": answer},
                ],
                tools.environment_schemas(tools.Python),
            )
        )
    return plain, with_tools, games, with_python


def build(cache_dir, warm_start_steps=WARM_START_STEPS):
    """The built-in model's directory: SHIPPED, committed with this file, when this recipe made it (its
    build.json names VERSION and warm_start_steps); else one built once into cache_dir by make()."""
    if shipped(warm_start_steps):
        return str(SHIPPED)
    path = Path(cache_dir) / f"{VERSION}-ws{warm_start_steps}"
    if (path / "config.json").exists():
        return str(path)
    print(
        f"building the built-in model into {path}, once: {warm_start_steps} warm-start steps "
        f"({WARM_START_STEPS} took {BUILD_SECONDS} s on 2 idle cores)",
        flush=True,
    )
    make(path, warm_start_steps)
    return str(path)


def shipped(warm_start_steps=WARM_START_STEPS):
    """Whether SHIPPED holds the model this recipe makes with warm_start_steps (a stale one is built anew
    instead)."""
    try:
        record = json.loads((SHIPPED / "build.json").read_text())
    except (OSError, ValueError):
        return False
    same = record.get("version") == VERSION and record.get("warm_start_steps") == warm_start_steps
    return same and (SHIPPED / "model.safetensors").exists()


def recipe():
    """The built-in model before its warm start, and what it is trained on: (conversations of each kind,
    tokenizer, model), the same on every call (seeded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    kinds = warm_start_conversations(4000, seed=12345)  # plain, with tools, games, with python
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    corpus = [json.dumps(c) for kind in kinds[1:] for c, _ in kind[:500]] + [json.dumps(schemas(list(tools.TOOLS)))]
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=512, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # vLLM's CPU attention needs 64
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    return kinds, tok, Qwen3ForCausalLM(config)


def step_loss(model, tok, kinds, step):
    """The warm start's loss at this step: 32 conversations of one kind, the kinds in turn (padding a plain
    batch to tool length would waste most of it)."""
    batch = random.Random(step).sample(kinds[step % len(kinds)], 32)
    batch = tok(
        [tok.apply_chat_template(c, tools=t, tokenize=False) for c, t in batch],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    return model(**batch, labels=batch.input_ids.masked_fill(batch.attention_mask == 0, -100)).loss


def check_losses(model, tok, kinds):
    """The losses of a model on the first batch of each kind: the shipped weights give those their build
    recorded."""
    with torch.no_grad():
        return [round(step_loss(model, tok, kinds, step).item(), 6) for step in range(len(kinds))]


def make(path, warm_start_steps=WARM_START_STEPS):
    """Make the built-in model into path (replaced whole): a ~0.5M-parameter Qwen3 and a byte-level BPE
    tokenizer trained on the task. Random weights would give every rollout the same zero reward, hence no
    signal. A few hundred supervised steps teach the answer format and the tool-call syntax, and leave the
    arithmetic mostly unlearned (~25% greedy accuracy without tools). build.json records the recipe and
    every step's loss, which a test compares a rebuild to."""
    t0 = time.monotonic()
    kinds, tok, model = recipe()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(warm_start_steps):
        loss = step_loss(model, tok, kinds, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 6))
        if (step + 1) % 100 == 0 or step + 1 == warm_start_steps:
            # progress with a measured estimate: a build takes minutes
            took = time.monotonic() - t0
            left = took / (step + 1) * (warm_start_steps - step - 1)
            print(
                f"  warm start {step + 1:4d}/{warm_start_steps} loss {loss.item():.3f} "
                f"({took:.0f} s, ~{left:.0f} s left)",
                flush=True,
            )
    record = {
        "version": VERSION,
        "warm_start_steps": warm_start_steps,
        "seconds": round(time.monotonic() - t0),
        "torch": torch.__version__,
        "check_losses": check_losses(model, tok, kinds),
        "losses": losses,
    }
    path = Path(path)
    # renamed once whole: a half-built model is never loaded
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "build.json").write_text(json.dumps(record) + "\n")
    old = path.with_name(f"{path.name}.old{os.getpid()}")
    if path.exists():  # remaking SHIPPED
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    return record


# --- Tiny random checkpoints of other architectures, each with its family's quirks on (the conformance matrix) -------

SHAPE = dict(
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,  # vLLM's CPU attention needs 64
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])

# architecture -> (config class name, its quirks, the quirks' names): each one in both transformers' and
# vLLM's registry
ARCHITECTURES = {
    "LlamaForCausalLM": ("LlamaConfig", dict(tie_word_embeddings=True), "tied embeddings"),
    "Qwen2ForCausalLM": (
        "Qwen2Config",
        dict(use_sliding_window=True, max_window_layers=1, sliding_window=4),
        "qkv bias, a sliding window on layer 2",
    ),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(tie_word_embeddings=True), "QK norms, tied embeddings"),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(MOE, decoder_sparse_step=1), "MoE routing, QK norms"),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=4), "a sliding window on every layer"),
    "MixtralForCausalLM": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4),
        "MoE routing, sliding window",
    ),
    "Gemma2ForCausalLM": (
        "Gemma2Config",
        dict(SLIDING, final_logit_softcapping=5.0, attn_logit_softcapping=20.0, query_pre_attn_scalar=32),
        "logit and attention softcapping, alternating windows, tied embeddings",
    ),
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        dict(SLIDING, final_logit_softcapping=5.0, query_pre_attn_scalar=32),
        "logit softcapping, QK norms, alternating windows",
    ),
    "Phi3ForCausalLM": ("Phi3Config", dict(partial_rotary_factor=0.5), "fused qkv and gate_up, partial rotary"),
    "StableLmForCausalLM": ("StableLmConfig", dict(partial_rotary_factor=0.25, qk_layernorm=True), "partial rotary"),
    "GraniteForCausalLM": (
        "GraniteConfig",
        dict(logits_scaling=3.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1),
        "logits / logits_scaling, multipliers",
    ),
    "GraniteMoeForCausalLM": (
        "GraniteMoeConfig",
        dict(logits_scaling=0.3, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0),
        "logits / logits_scaling, MoE routing",
    ),
    "CohereForCausalLM": ("CohereConfig", dict(logit_scale=2.5, use_qk_norm=True), "logits * logit_scale, QK norms"),
    "Cohere2ForCausalLM": ("Cohere2Config", dict(SLIDING, logit_scale=0.7), "logits * logit_scale, windows"),
    "GptOssForCausalLM": (
        "GptOssConfig",
        dict(SLIDING, num_local_experts=4, num_experts_per_tok=2),
        "attention sinks, MoE routing, windows",
    ),
    "OlmoeForCausalLM": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2), "MoE routing, QK norms"),
    "Glm4ForCausalLM": ("Glm4Config", dict(partial_rotary_factor=0.5), "partial rotary, extra norms"),
    "Exaone4ForCausalLM": ("Exaone4Config", dict(SLIDING), "QK norms, windows"),
    "HyperCLOVAXForCausalLM": ("HyperCLOVAXConfig", dict(logits_scaling=0.5), "logits * logits_scaling"),
    "FalconH1ForCausalLM": (
        "FalconH1Config",
        dict(lm_head_multiplier=0.5, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16),
        "logits * lm_head_multiplier, Mamba-2 layers beside attention",
    ),
    "DeepseekV3ForCausalLM": (
        "DeepseekV3Config",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=64,
            n_group=1,
            topk_group=1,
            num_key_value_heads=2,
        ),
        "multi-head latent attention, grouped MoE routing",
    ),
}


def tiny_architecture(name, vocab_size=512, seed=0, **extra):
    """A random-weight model of `name` (a key of ARCHITECTURES) in fp32, its quirks on, SHAPE's size."""
    import transformers

    config_class, quirks, _ = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(**{**SHAPE, **quirks, **extra, "vocab_size": vocab_size})
    torch.manual_seed(seed)
    model = getattr(transformers, name)(config).float().eval()
    # Decisive routers: at a random init every router logit is close to the others, and rounding that differs
    # between the trainer's paths (or thread counts) would flip which experts a token takes, a change no path
    # is wrong about
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith((".gate.weight", ".router.weight")):
                p.mul_(50)
    return model


def save_tiny_architecture(name, cache_dir, tokenizer_from):
    """tiny_architecture(name) saved once into cache_dir with the tokenizer of `tokenizer_from` (the
    built-in model's), a checkpoint vLLM serves; its path."""
    from transformers import AutoTokenizer

    path = Path(cache_dir) / f"arch-{name}-v1"
    if (path / "config.json").exists():
        return str(path)
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    special = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    model = tiny_architecture(name, vocab_size=len(tok), **special)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)
    return str(path)


if __name__ == "__main__":
    # Remake the shipped model after a change to its recipe (then bump VERSION): ~150 s on 2 cores
    print(f"remaking {SHIPPED}", flush=True)
    make(SHIPPED)
