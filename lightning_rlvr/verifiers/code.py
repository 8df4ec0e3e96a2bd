"""Code verifier: runs the generated Python program against test cases in a sandbox; reward = tests passed.

The reference answer of a problem holds its tests, in one of these forms (JSON unless it is plain code):

- a list of Python snippets, each one test run after the program: ``["assert add(1, 2) == 3", ...]``
  (MBPP style);
- a list of ``{"input": ..., "output": ...}`` objects: the program reads ``input`` on stdin and must print
  ``output`` (compared line by line, trailing whitespace ignored);
- an object ``{"inputs": [...], "outputs": [...]}`` (APPS / TACO / CodeContests style stdin/stdout tests);
- anything else that is not JSON: one block of Python test code run after the program.

Every test runs in a fresh child process of a sandbox (see ``_sandbox_main.py`` for what contains it and why):
new PID, mount, network, IPC and UTS namespaces; no network at all; a read-only file system but for a private,
size-capped ``/tmp`` working directory; a fresh ``/proc`` that shows nothing outside; an empty environment;
an unprivileged uid (root ignores process limits) or, for a normal user, a user namespace without capabilities;
limits on CPU time, wall time, address space, output size and the number of processes. A program that breaks
a limit fails that test. Linux only: the sandbox is checked when the verifier is built, and if the kernel
refuses a step (user namespaces disabled), construction fails with the reason rather than running code
unconfined.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

from lightning_rlvr.verifiers.base import Verifier

__all__ = ["CodeVerifier", "SandboxError", "extract_program", "parse_tests", "run_tests"]

_LAUNCHER = Path(__file__).with_name("_sandbox_main.py")
# Past its own per-test kills the launcher needs a few seconds; past this slack it is taken to hang and is killed.
_REPORT_SLACK_S = 10.0
_FENCED = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

ProgramExtraction = Literal["fenced", "none"]
Scoring = Literal["fraction", "all"]


class SandboxError(RuntimeError):
    """The sandbox could not be set up (the kernel refused a containment step) or did not report back."""


def extract_program(completion: str, mode: ProgramExtraction = "fenced") -> str:
    """The program in a completion.

    ``"fenced"``: the last fenced code block tagged ``python``/``py`` (or untagged), else the whole text when it
    has no fence at all (a model that answers with bare code); ``"none"``: the whole text.

    Example::

        >>> extract_program("Here:\\n```python\\nprint(1)\\n```\\nDone.")
        'print(1)\\n'
    """
    if mode == "none":
        return completion
    if mode != "fenced":
        raise ValueError(f"unknown program extraction mode {mode!r}")
    blocks = [code for language, code in _FENCED.findall(completion) if language.lower() in ("", "python", "py")]
    if blocks:
        return blocks[-1]
    return "" if "```" in completion else completion


def parse_tests(answer: str) -> list[dict]:
    """The test cases a reference answer holds (see the module docstring for the accepted forms).

    Returns:
        dicts ``{"kind": "assert", "code": str}`` or ``{"kind": "stdio", "input": str, "output": str}``.

    Raises:
        ValueError: if the tests are empty or of a form not listed, saying which.
    """
    try:
        data = json.loads(answer)
    except json.JSONDecodeError:
        data = answer
    if isinstance(data, str):
        tests = [{"kind": "assert", "code": data}] if data.strip() else []
    elif isinstance(data, dict):
        if "fn_name" in data:
            raise ValueError("call-based tests ('fn_name') are not supported; give asserts or stdin/stdout tests")
        if not {"inputs", "outputs"} <= set(data) or len(data["inputs"]) != len(data["outputs"]):
            raise ValueError(f"a test object needs 'inputs' and 'outputs' lists of one length, got keys {sorted(data)}")
        tests = [_stdio(i, o) for i, o in zip(data["inputs"], data["outputs"])]
    elif isinstance(data, list):
        tests = []
        for index, item in enumerate(data):
            if isinstance(item, str):
                tests.append({"kind": "assert", "code": item})
            elif isinstance(item, dict) and {"input", "output"} <= set(item):
                tests.append(_stdio(item["input"], item["output"]))
            else:
                raise ValueError(f"test {index} is neither Python code nor an {{'input', 'output'}} object: {item!r}")
    else:
        raise ValueError(f"tests must be code, a list or an object, got {type(data).__name__}")
    if not tests:
        raise ValueError("the reference holds no tests")
    return tests


def _stdio(given, expected) -> dict:
    as_text = lambda value: value if isinstance(value, str) else "\n".join(map(str, value))  # noqa: E731
    return {"kind": "stdio", "input": as_text(given), "output": as_text(expected)}


def run_tests(program: str, tests: list[dict], *, test_timeout_s: float = 2.0, cpu_time_s: float = 2.0,
              memory_mb: int = 512, max_processes: int = 8, max_output_kb: int = 1024,
              disk_mb: int = 32, user_namespace: bool = False) -> list[dict]:
    """Runs ``program`` against each test in the sandbox; one result dict per test.

    Run as root, the sandbox drops to a fresh unprivileged uid; run as anyone else, it enters a user namespace
    and drops every capability. ``user_namespace=True`` takes the second way even as root (how the tests check
    it on machines where they run as root).

    Each result has ``passed`` (bool), ``status`` (``passed``, ``wrong_answer``, ``error``, ``exited_early``,
    ``cpu_time_limit``, ``wall_time_limit``, ``output_limit``, ``killed`` or ``signal NAME``) and ``seconds``;
    a failed one also the head of its stdout and the tail of its stderr.

    Raises:
        SandboxError: if the sandbox could not be set up or did not report back in time.
    """
    job = {"program": program, "tests": tests, "wall_s": float(test_timeout_s), "cpu_s": float(cpu_time_s),
           "memory_bytes": int(memory_mb) << 20, "max_processes": int(max_processes),
           "max_output_bytes": int(max_output_kb) << 10, "disk_bytes": int(disk_mb) << 20,
           "user_namespace": bool(user_namespace)}
    deadline = test_timeout_s * max(1, len(tests)) + _REPORT_SLACK_S
    process = subprocess.Popen(
        [sys.executable, "-I", str(_LAUNCHER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True,
        text=True)
    try:
        stdout, stderr = process.communicate(json.dumps(job), timeout=deadline)
    except subprocess.TimeoutExpired:
        # The harness dies with the launcher (PR_SET_PDEATHSIG), and every program process with the harness.
        os.killpg(process.pid, 9)
        process.communicate()
        raise SandboxError(f"the sandbox did not report back within {deadline:.0f}s") from None
    try:
        report = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SandboxError(f"the sandbox ended without a report (exit {process.returncode}): {stderr[-500:]}") from None
    if "setup_error" in report:
        raise SandboxError(f"the sandbox could not be set up: {report['setup_error']}")
    return report["results"]


class CodeVerifier(Verifier):
    """Reward = share of test cases the generated program passes (or 1 only if it passes them all).

    .. math::
        r = \\frac{1}{|T|} \\sum_{t \\in T} \\mathbb{1}[\\text{program passes } t]
        \\quad\\text{or}\\quad r = \\prod_{t \\in T} \\mathbb{1}[\\text{program passes } t]

    All-pass is the reward of the code RLVR papers (DeepCoder, Skywork-OR1); the pass fraction is a denser
    signal for small models. Every test runs sandboxed (module docstring).

    The :class:`~lightning_rlvr.verifiers.base.VerifierRunner` calls it in threads; its per-call limit
    (``verifier_timeout_s`` of the DataModule) should exceed ``number of tests × test_timeout_s`` plus about a
    second, or slow but honest programs are cut short. The sandbox kills each test at ``test_timeout_s`` on
    its own, so an abandoned call never leaves a program running.

    Args:
        scoring: ``"fraction"`` (share of tests passed) or ``"all"`` (1 only if every test passes).
        extract: where the program is in the completion: ``"fenced"`` (last ```python block) or ``"none"``.
        test_timeout_s: wall-clock limit of one test.
        cpu_time_s: CPU-time limit of one test (defaults to ``test_timeout_s``).
        memory_mb: address-space limit of the program, MiB.
        max_processes: most processes (and threads) the program may have at once, itself included.
        max_output_kb: largest output (stdout, stderr or any file written), KiB.
        disk_mb: size of the private ``/tmp`` it works in, MiB.

    Example::

        >>> verifier = CodeVerifier()
        >>> verifier.score("```python\\ndef add(a, b):\\n    return a + b\\n```",
        ...                '["assert add(1, 2) == 3", "assert add(2, 2) == 5"]')
        0.5
    """

    isolation = "thread"  # each call waits on its own sandboxed subprocess

    def __init__(self, scoring: Scoring = "fraction", extract: ProgramExtraction = "fenced",
                 test_timeout_s: float = 2.0, cpu_time_s: float | None = None, memory_mb: int = 512,
                 max_processes: int = 8, max_output_kb: int = 1024, disk_mb: int = 32) -> None:
        if scoring not in ("fraction", "all"):
            raise ValueError(f"CodeVerifier.scoring must be 'fraction' or 'all', got {scoring!r}")
        if extract not in ("fenced", "none"):
            raise ValueError(f"CodeVerifier.extract must be 'fenced' or 'none', got {extract!r}")
        cpu_time_s = test_timeout_s if cpu_time_s is None else cpu_time_s
        for name, value in (("test_timeout_s", test_timeout_s), ("cpu_time_s", cpu_time_s)):
            if not value > 0:
                raise ValueError(f"CodeVerifier.{name} must be > 0, got {value}")
        for name, value, least in (("memory_mb", memory_mb, 64), ("max_processes", max_processes, 1),
                                   ("max_output_kb", max_output_kb, 1), ("disk_mb", disk_mb, 1)):
            if value < least:
                raise ValueError(f"CodeVerifier.{name} must be >= {least}, got {value}")
        if not sys.platform.startswith("linux"):
            raise SandboxError(f"CodeVerifier's sandbox needs Linux namespaces; this is {sys.platform}")
        self.scoring = scoring
        self.extract = extract
        self.limits = dict(test_timeout_s=float(test_timeout_s), cpu_time_s=float(cpu_time_s),
                           memory_mb=int(memory_mb), max_processes=int(max_processes),
                           max_output_kb=int(max_output_kb), disk_mb=int(disk_mb))
        # Refuse now, with the kernel's reason, rather than score every completion 0 in the middle of a run.
        probe = run_tests("print(input())", [{"kind": "stdio", "input": "ok", "output": "ok"}], **self.limits)
        if not probe[0]["passed"]:
            raise SandboxError(f"the sandbox could not run a trivial program: {probe[0]}")

    def answer_key(self, completion: str) -> str:
        """The extracted program with whitespace normalised: identical programs vote together in maj@k."""
        return " ".join(extract_program(completion, self.extract).split())

    def run(self, completion: str, answer: str) -> list[dict]:
        """Per-test results of the completion's program (see :func:`run_tests`)."""
        tests = parse_tests(answer)
        program = extract_program(completion, self.extract)
        if not program.strip():
            return [{"passed": False, "status": "no_program", "seconds": 0.0} for _ in tests]
        return run_tests(program, tests, **self.limits)

    def score(self, completion: str, answer: str) -> float:
        results = self.run(completion, answer)
        passed = sum(result["passed"] for result in results)
        if self.scoring == "all":
            return float(passed == len(results))
        return passed / len(results)
