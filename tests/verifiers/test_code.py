"""CodeVerifier: test parsing, program extraction, scoring, and hostile programs contained by the sandbox.

Written to the rules of ``shared/DESIGN.md`` § 4: the tests run as root, so every hostile program is bounded
on its own (the fork bomb forks at most 200 times, the memory bomb stops at 2 GiB, the output is 100 MB), the
network test targets only a listener this test opened on 127.0.0.1, and every test checks that no sandboxed
process outlives its run. Each hostile program is run both ways the sandbox contains code: dropping root for a
fresh uid (how it runs as root) and a user namespace without capabilities (how it runs as a normal user).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from lightning_rlvr.data import FileSource
from lightning_rlvr.verifiers import CodeVerifier, VerifierRunner
from lightning_rlvr.verifiers import code as code_module
from lightning_rlvr.verifiers._sandbox_main import _SANDBOX_ID_BASE
from lightning_rlvr.verifiers.code import SandboxError, extract_program, parse_tests, run_tests

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces")

LIMITS = dict(test_timeout_s=2.0, cpu_time_s=1.0, memory_mb=256, max_processes=8, max_output_kb=256, disk_mb=16)
ADD = "def add(a, b):\n    return a + b\n"
WAYS = ["drop_root", "user_namespace"] if os.geteuid() == 0 else ["user_namespace"]


def sandboxed_processes() -> list[int]:
    """PIDs on the host whose uid is one the sandbox hands out (none should outlive a run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            uid_line = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) >= _SANDBOX_ID_BASE:
            found.append(int(entry.name))
    return found


@pytest.fixture(params=WAYS)
def run(request):
    """Runs a program against one stdin/stdout test expecting ``expected``; asserts nothing is left running."""

    def run_one(program: str, expected: str = "contained? no", stdin: str = "", **limits) -> dict:
        started = time.monotonic()
        (result,) = run_tests(program, [{"kind": "stdio", "input": stdin, "output": expected}],
                              user_namespace=request.param == "user_namespace", **{**LIMITS, **limits})
        result["wall"] = time.monotonic() - started
        assert sandboxed_processes() == []
        return result

    return run_one


# ------------------------------------------------------------------------------------------------ parsing
def test_extract_program_takes_the_last_python_block():
    text = "First try:\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\n```bash\nls\n```"
    assert extract_program(text) == "print(2)\n"


def test_extract_program_accepts_an_untagged_block_and_bare_code():
    assert extract_program("```\nx = 1\n```") == "x = 1\n"
    assert extract_program("x = 1\nprint(x)") == "x = 1\nprint(x)"


def test_extract_program_finds_nothing_when_only_other_languages_are_fenced():
    assert extract_program("```bash\nrm -rf /\n```") == ""


def test_extract_program_none_mode_keeps_the_text():
    assert extract_program("```python\nx\n```", "none") == "```python\nx\n```"


def test_parse_tests_reads_every_documented_form():
    asserts = parse_tests(json.dumps(["assert f(1) == 2", "assert f(2) == 3"]))
    assert asserts == [{"kind": "assert", "code": "assert f(1) == 2"}, {"kind": "assert", "code": "assert f(2) == 3"}]
    stdio = parse_tests(json.dumps([{"input": "1 2\n", "output": "3\n"}]))
    assert stdio == [{"kind": "stdio", "input": "1 2\n", "output": "3\n"}]
    apps = parse_tests(json.dumps({"inputs": ["1\n", ["2", "3"]], "outputs": ["1\n", "5"]}))
    assert apps == [{"kind": "stdio", "input": "1\n", "output": "1\n"},
                    {"kind": "stdio", "input": "2\n3", "output": "5"}]
    assert parse_tests("def check():\n    assert f(1) == 2\ncheck()") == [
        {"kind": "assert", "code": "def check():\n    assert f(1) == 2\ncheck()"}]


@pytest.mark.parametrize(("answer", "message"), [
    ("[]", "no tests"),
    ("  ", "no tests"),
    (json.dumps([{"input": "1"}]), "test 0"),
    (json.dumps(["assert True", 3]), "test 1"),
    (json.dumps({"inputs": ["1"], "outputs": []}), "one length"),
    (json.dumps({"fn_name": "f", "inputs": [], "outputs": []}), "call-based"),
    ("42", "got int"),
])
def test_parse_tests_rejects_malformed_tests_saying_what_is_wrong(answer, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(answer)


# ------------------------------------------------------------------------------------------------ scoring
def test_pass_fraction_and_all_pass_scoring():
    tests = json.dumps(["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(2, 2) == 5"])
    completion = f"```python\n{ADD}```"
    assert CodeVerifier(**LIMITS).score(completion, tests) == pytest.approx(2 / 3)
    assert CodeVerifier(scoring="all", **LIMITS).score(completion, tests) == 0.0
    assert CodeVerifier(scoring="all", **LIMITS).score(completion, json.dumps(["assert add(1, 2) == 3"])) == 1.0


def test_stdin_stdout_tests_compare_lines_ignoring_trailing_whitespace():
    program = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b, ' ')\nprint()\n"
    tests = json.dumps([{"input": "1 2\n", "output": "3"}, {"input": "5 5", "output": "10\n"},
                        {"input": "1 1", "output": "3"}])
    results = CodeVerifier(**LIMITS).run(program, tests)
    assert [r["status"] for r in results] == ["passed", "passed", "wrong_answer"]
    assert results[2]["stdout"].split() == ["2"]


def test_a_program_ended_with_an_error_code_fails_even_with_the_right_output():
    tests = json.dumps([{"input": "", "output": "3"}])
    assert CodeVerifier(**LIMITS).score("print(3)\nimport sys\nsys.exit(1)", tests) == 0.0
    assert CodeVerifier(**LIMITS).score("print(3)\nimport sys\nsys.exit(0)", tests) == 1.0


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "exit()"])
def test_exiting_before_the_asserts_does_not_pass_them(exit_call):
    verifier = CodeVerifier(**LIMITS)
    results = verifier.run(f"{ADD}{exit_call}\n", json.dumps(["assert add(1, 2) == 3"]))
    assert results[0]["passed"] is False
    assert results[0]["status"] in ("error", "exited_early")


def test_a_completion_without_python_scores_zero_without_running():
    results = CodeVerifier(**LIMITS).run("```bash\necho 3\n```", json.dumps([{"input": "", "output": "3"}]))
    assert results == [{"passed": False, "status": "no_program", "seconds": 0.0}]


def test_programs_may_import_the_standard_library_and_use_their_private_tmp():
    program = ("import fractions, json, pathlib\n"
               "pathlib.Path('scratch.txt').write_text(json.dumps(str(fractions.Fraction(1, 3) * 3)))\n"
               "print(json.loads(pathlib.Path('/tmp/scratch.txt').read_text()))\n")
    assert CodeVerifier(**LIMITS).score(program, json.dumps([{"input": "", "output": "1"}])) == 1.0


def test_tests_do_not_share_state():
    program = "import os\nprint(os.path.exists('mark'))\nopen('mark', 'w').close()\n"
    results = CodeVerifier(**LIMITS).run(program, json.dumps([{"input": "", "output": "False"}] * 2))
    assert [r["passed"] for r in results] == [True, True]


def test_runner_scores_a_batch_in_threads_and_counts_a_malformed_reference():
    runner = VerifierRunner(CodeVerifier(**LIMITS), timeout_s=20.0, num_workers=2)
    try:
        tests = json.dumps(["assert add(2, 3) == 5"])
        rewards, errors = runner.score_batch([ADD, "def add(a, b):\n    return a - b\n", ADD, ADD],
                                             [tests, tests, tests, "[]"])
    finally:
        runner.close()
    assert (rewards, errors) == ([1.0, 0.0, 1.0, 0.0], 1)


def test_code_datasets_keep_structured_tests_as_json(tmp_path):
    rows = [{"question": f"Write add ({i}).", "tests": ["assert add(1, 1) == 2", "assert add(0, 3) == 3"]}
            for i in range(4)]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    source = FileSource(str(path), prompt_field="question", answer_field="tests", held_out_fraction=0.25)
    problem = source.train_problems()[0]
    assert json.loads(problem.answer) == rows[0]["tests"]
    assert CodeVerifier(**LIMITS).score(ADD, problem.answer) == 1.0


# ------------------------------------------------------------------------------------------------ hostile programs
def test_infinite_loop_is_stopped_by_the_cpu_limit(run):
    result = run("while True:\n    pass\n", cpu_time_s=1.0)
    assert result["status"] == "cpu_time_limit"
    assert result["wall"] < 15.0  # bounded (the loop is endless); wide: a loaded 2-core machine starts slowly


def test_sleeping_forever_is_stopped_by_the_wall_clock(run):
    result = run("import time\nwhile True:\n    time.sleep(1)\n", test_timeout_s=1.0)
    assert result["status"] == "wall_time_limit"
    assert result["wall"] < 15.0  # bounded (the program sleeps forever)


def test_fork_bomb_is_stopped_at_the_process_limit(run):
    # Bounded: at most 200 children, each sleeping a little and exiting; it prints how many forks succeeded.
    program = ("import os, time\nforked = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
               "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n"
               "    forked += 1\nprint(forked)\n")
    result = run(program, expected="200", max_processes=8)
    assert result["status"] == "wrong_answer"
    assert 1 <= int(result["stdout"]) <= 7  # the program itself is one of the 8


def test_memory_bomb_hits_the_address_space_limit(run):
    program = "blocks = []\nfor _ in range(32):\n    blocks.append(bytearray(64 << 20))\nprint('allocated 2 GiB')\n"
    result = run(program, expected="allocated 2 GiB", memory_mb=256)
    assert result["status"] == "error"
    assert "MemoryError" in result["stderr"]


def test_100_mb_of_output_is_cut_at_the_output_cap(run):
    program = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    result = run(program, max_output_kb=256)
    assert result["status"] == "output_limit"
    assert result["wall"] < 15.0


def test_network_is_unreachable_even_on_the_hosts_loopback(run):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    program = (f"import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
               "    s.sendall(b'leak')\n    print('connected')\nexcept OSError as err:\n    print('blocked', err)\n")
    try:
        result = run(program, expected="connected")
        assert result["stdout"].startswith("blocked")
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_writing_outside_its_directory_fails_and_leaves_the_host_untouched(run, tmp_path):
    open_dir = tmp_path / "world_writable"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    targets = [open_dir / "pwned", Path("/var/tmp") / f"lightning_rlvr_pwned_{uuid.uuid4().hex}",
               Path(code_module.__file__).with_name("pwned.py")]
    program = ("import sys\nwritten = []\n"
               f"for path in {[str(t) for t in targets]!r}:\n"
               "    try:\n        open(path, 'w').write('x')\n        written.append(path)\n"
               "    except OSError:\n        pass\nprint('wrote', written)\n")
    result = run(program, expected="wrote everything")
    assert result["stdout"].strip() == "wrote []"
    assert not any(target.exists() for target in targets)


def test_parent_environment_is_not_visible(run, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("LIGHTNING_RLVR_TEST_SECRET", secret)
    program = (f"import os, glob\nsecret = {secret!r}\n"
               "seen = [k for k, v in os.environ.items() if secret in v]\n"
               "for path in glob.glob('/proc/*/environ'):\n"
               "    try:\n        if secret.encode() in open(path, 'rb').read():\n            seen.append(path)\n"
               "    except OSError:\n        pass\n"
               "print('found' if seen else 'not found', sorted(os.environ))\n")
    result = run(program, expected="found")
    assert result["stdout"].strip() == ("not found ['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', "
                                        "'OPENBLAS_NUM_THREADS', 'PATH']")


def test_the_program_holds_no_privilege(run):
    program = ("import os\nstatus = open('/proc/self/status').read().splitlines()\n"
               "print(*[line.split()[1] for line in status if line.startswith(('CapEff', 'CapPrm', 'CapBnd'))],"
               " os.getgroups())\n")
    result = run(program, expected="root")
    assert result["stdout"].strip() == "0000000000000000 0000000000000000 0000000000000000 []"


def test_a_daemon_started_by_the_program_does_not_outlive_it(run):
    program = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        time.sleep(60)\n    os._exit(0)\nprint('detached')\n")
    assert run(program, expected="detached")["passed"]  # and the fixture found no process left


def test_verifier_keeps_working_after_hostile_programs():
    verifier = CodeVerifier(**LIMITS)
    tests = json.dumps([{"input": "", "output": "ok"}])
    assert verifier.score("while True:\n    pass\n", tests) == 0.0
    assert verifier.score("print('ok')", tests) == 1.0


# ------------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(scoring="mean"), "scoring"),
    (dict(extract="markdown"), "extract"),
    (dict(test_timeout_s=0), "test_timeout_s"),
    (dict(cpu_time_s=-1), "cpu_time_s"),
    (dict(memory_mb=16), "memory_mb"),
    (dict(max_processes=0), "max_processes"),
    (dict(max_output_kb=0), "max_output_kb"),
    (dict(disk_mb=0), "disk_mb"),
])
def test_constructor_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CodeVerifier(**kwargs)


def test_construction_fails_with_the_kernels_reason_when_the_sandbox_cannot_be_set_up(tmp_path, monkeypatch):
    launcher = tmp_path / "refusing_launcher.py"
    launcher.write_text("import json\nprint(json.dumps({'setup_error': 'unshare failed: Operation not permitted'}))\n")
    monkeypatch.setattr(code_module, "_LAUNCHER", launcher)
    with pytest.raises(SandboxError, match="Operation not permitted"):
        CodeVerifier()


def test_a_launcher_that_never_reports_is_killed_and_reported(tmp_path, monkeypatch):
    launcher = tmp_path / "hanging_launcher.py"
    launcher.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(code_module, "_LAUNCHER", launcher)
    monkeypatch.setattr(code_module, "_REPORT_SLACK_S", 0.5)
    started = time.monotonic()
    with pytest.raises(SandboxError, match="did not report back"):
        run_tests("print(1)", [{"kind": "stdio", "input": "", "output": "1"}], test_timeout_s=0.5)
    assert time.monotonic() - started < 30.0  # the launcher sleeps 60 s
