"""VerifierRunner: failures (raise, non-finite, hang) become reward 0 and are counted; CallableVerifier."""

from __future__ import annotations

import importlib
import math
import operator
import threading
import time

import pytest

from lightning_rlvr.verifiers import CallableVerifier, Verifier, VerifierRunner

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # the runner warns once per failing verifier

HANG = "hang"


# ----------------------------------------------------------------------------- module-level helpers
# (picklable by reference: a spawned worker imports this module by its name to unpickle them)
def score_or_sleep(completion: str, answer: str) -> float:
    """Equality reward; sleeps 30 s on the completion "hang" (interruptible by SIGALRM)."""
    if completion == HANG:
        time.sleep(30)
    return float(completion == answer)


def _load_slow_verifier() -> Verifier:
    return importlib.import_module(f"{__package__}._slow_startup").EqualityVerifier()


class _VerifierWithSlowImport(Verifier):
    """Pickles as "import the slow module in the worker", so only the worker pays the import."""

    isolation = "process"

    def score(self, completion: str, answer: str) -> float:  # pragma: no cover - replaced in the worker
        raise AssertionError("must be scored in a worker")

    def __reduce__(self):
        return (_load_slow_verifier, ())


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture
def make_runner():
    runners: list[VerifierRunner] = []

    def make(verifier, **kwargs) -> VerifierRunner:
        runner = VerifierRunner(verifier, **kwargs)
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()


@pytest.fixture
def release():
    """An event a thread-isolation "hang" waits on; set at teardown so no leaked thread outlives the test
    (leaked pool threads are joined at interpreter exit, which would otherwise stall pytest for 30 s)."""
    event = threading.Event()
    yield event
    event.set()


def _hanging_in_thread(release: threading.Event):
    def fn(completion: str, answer: str) -> float:
        if completion == HANG:
            release.wait(30)
        return float(completion == answer)

    return fn


def _eq_unless(bad: str, action):
    def fn(completion: str, answer: str) -> float:
        if completion == bad:
            return action()
        return float(completion == answer)

    return fn


def _boom():
    raise RuntimeError("verifier crashed")


# ----------------------------------------------------------------------------- CallableVerifier
def test_callable_verifier_returns_float_of_function_value():
    v = CallableVerifier(lambda c, a: len(c) / 4)
    value = v.score("abc", "x")
    assert type(value) is float and value == 0.75
    assert CallableVerifier(lambda c, a: c == a).score("x", "x") == 1.0


def test_callable_verifier_default_isolation_is_thread():
    assert CallableVerifier(operator.eq).isolation == "thread"


def test_callable_verifier_accepts_module_function_string():
    v = CallableVerifier("operator:eq")
    assert v.fn is operator.eq
    assert v.score("7", "7") == 1.0
    assert v.score("7", "8") == 0.0
    w = CallableVerifier(f"{__name__}:score_or_sleep", isolation="inline")
    assert w.fn is score_or_sleep


def test_callable_verifier_rejects_string_without_colon():
    with pytest.raises(ValueError, match="module:function"):
        CallableVerifier("operator.eq")


@pytest.mark.parametrize("fn", [42, "math:pi"])
def test_callable_verifier_rejects_non_callable(fn):
    with pytest.raises(TypeError, match="callable"):
        CallableVerifier(fn)


def test_callable_verifier_rejects_unknown_isolation():
    with pytest.raises(ValueError, match="isolation"):
        CallableVerifier(operator.eq, isolation="subprocess")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize("timeout_s", [0, 0.0, -1.0])
def test_runner_rejects_non_positive_timeout(timeout_s):
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierRunner(CallableVerifier(operator.eq), timeout_s=timeout_s)


def test_runner_rejects_zero_workers():
    with pytest.raises(ValueError, match="num_workers"):
        VerifierRunner(CallableVerifier(operator.eq), num_workers=0)


@pytest.mark.parametrize("isolation", ["inline", "thread"])
def test_runner_rejects_mismatched_lengths(make_runner, isolation):
    runner = make_runner(CallableVerifier(operator.eq, isolation=isolation))
    with pytest.raises(ValueError, match="2 completions but 3 answers"):
        runner.score_batch(["a", "b"], ["a", "b", "c"])


# ----------------------------------------------------------------------------- scoring and failures
@pytest.mark.parametrize("isolation", ["inline", "thread"])
def test_rewards_pass_through_in_order(make_runner, isolation):
    runner = make_runner(CallableVerifier(lambda c, a: int(c) / int(a), isolation=isolation), num_workers=2)
    completions = [str(i) for i in range(9)]
    rewards, errors = runner.score_batch(completions, ["8"] * 9)
    assert rewards == [i / 8 for i in range(9)]
    assert errors == 0


@pytest.mark.parametrize("isolation", ["inline", "thread"])
def test_empty_batch(make_runner, isolation):
    runner = make_runner(CallableVerifier(operator.eq, isolation=isolation))
    assert runner.score_batch([], []) == ([], 0)


@pytest.mark.parametrize("isolation", ["inline", "thread"])
def test_raising_verifier_gives_zero_and_is_counted(make_runner, isolation):
    runner = make_runner(CallableVerifier(_eq_unless("boom", _boom), isolation=isolation), timeout_s=2.0)
    rewards, errors = runner.score_batch(["a", "boom", "b", "boom", "c"], ["a", "a", "b", "b", "x"])
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert errors == 2


@pytest.mark.parametrize("isolation", ["inline", "thread"])
@pytest.mark.parametrize("bad_value", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_gives_zero_and_is_counted(make_runner, isolation, bad_value):
    runner = make_runner(CallableVerifier(_eq_unless("bad", lambda: bad_value), isolation=isolation), timeout_s=2.0)
    rewards, errors = runner.score_batch(["a", "bad", "b"], ["a", "a", "x"])
    assert rewards == [1.0, 0.0, 0.0]
    assert errors == 1


def test_inline_isolation_catches_exceptions_and_keeps_working(make_runner):
    runner = make_runner(CallableVerifier(_eq_unless("boom", _boom), isolation="inline"))
    assert runner.score_batch(["boom"], ["boom"]) == ([0.0], 1)
    assert runner.score_batch(["a", "b"], ["a", "a"]) == ([1.0, 0.0], 0)


def test_non_numeric_return_value_is_counted(make_runner):
    runner = make_runner(CallableVerifier(lambda c, a: "not a number", isolation="thread"), timeout_s=2.0)
    assert runner.score_batch(["a"], ["a"]) == ([0.0], 1)


def test_thread_isolation_hang_times_out_and_runner_keeps_working(make_runner, release):
    runner = make_runner(CallableVerifier(_hanging_in_thread(release), isolation="thread"),
                         timeout_s=0.3, num_workers=2)
    start = time.monotonic()
    rewards, errors = runner.score_batch(["a", HANG, "b", "c"], ["a", "a", "b", "x"])
    elapsed = time.monotonic() - start
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    assert errors == 1
    assert elapsed < 15.0  # the hung call sleeps up to 30 s
    # the next batch is scored normally (by a fresh pool: the hung thread still occupies the old one)
    start = time.monotonic()
    assert runner.score_batch(["x", "y", "z"], ["x", "x", "z"]) == ([1.0, 0.0, 1.0], 0)
    assert time.monotonic() - start < 15.0


def test_thread_isolation_hang_does_not_zero_calls_queued_behind_it(make_runner, release):
    # Regression: with one worker, the calls queued behind a hung call once never started before the batch
    # deadline and were reported as timed out (reward 0, counted) although they would have returned promptly.
    # The contract is that only the call past its limit gets 0 and is counted.
    runner = make_runner(CallableVerifier(_hanging_in_thread(release), isolation="thread"),
                         timeout_s=0.3, num_workers=1)
    rewards, errors = runner.score_batch([HANG, "a", "b"], ["a", "a", "b"])
    assert rewards == [0.0, 1.0, 1.0]
    assert errors == 1


def test_process_isolation_hang_is_interrupted_by_sigalrm_and_runner_keeps_working(make_runner):
    # One of the two spawn-pool tests in this file. The per-call limit (1 s) is enforced in the worker by
    # SIGALRM. The batch deadline (timeout_s * 16 rounds + 5 s) counts the worker's start-up too (see the
    # next test), so the batch is long enough for a cold start on a loaded machine; its calls are instant.
    runner = make_runner(CallableVerifier(score_or_sleep, isolation="process"), timeout_s=1.0, num_workers=1)
    completions = ["a", HANG] + [f"c{i}" for i in range(14)]
    answers = ["a", "a"] + [f"c{i}" if i % 2 else "x" for i in range(14)]
    start = time.monotonic()
    rewards, errors = runner.score_batch(completions, answers)
    elapsed = time.monotonic() - start
    assert rewards == [1.0, 0.0] + [float(i % 2) for i in range(14)]
    assert errors == 1
    assert elapsed < 25.0  # well below the 30 s sleep: the call was interrupted
    assert runner.score_batch(["x", "y"], ["x", "z"]) == ([1.0, 0.0], 0)
    assert runner.score_batch([HANG, "q"], ["hang", "q"]) == ([0.0, 1.0], 1)


@pytest.mark.slow
def test_process_isolation_worker_start_up_does_not_count_against_call_timeout(make_runner):
    # Regression: the batch deadline was once measured from submission, so the spawn + import time of a cold pool
    # (here >= 5.5 s; in practice torch + lightning + sympy take 5-15 s on a small machine) counted against it:
    # every call of the first batch timed out although each takes microseconds, and the pool was then killed, so
    # the next batch paid the start-up again. The warm-up imports the verifier's modules in the workers (a bare
    # ping did not, and this passed only on an idle machine).
    runner = make_runner(_VerifierWithSlowImport(), timeout_s=0.3, num_workers=1)
    assert runner.score_batch(["a", "b"], ["a", "a"]) == ([1.0, 0.0], 0)


def test_close_is_idempotent_and_runner_restarts_its_pool(make_runner):
    runner = make_runner(CallableVerifier(operator.eq, isolation="thread"))
    assert runner.score_batch(["a"], ["a"]) == ([1.0], 0)
    runner.close()
    runner.close()
    assert runner.score_batch(["a"], ["b"]) == ([0.0], 0)


# ----------------------------------------------------------------------------- named reward components
def correctness_and_format(completion: str, answer: str) -> dict[str, float]:
    """Two named components: 1 for the right answer, 0.1 for an all-digit answer."""
    return {"correct": float(completion == answer), "format": 0.1 if completion.isdigit() else 0.0}


@pytest.mark.parametrize("isolation", ["inline", "thread", "process"])
def test_named_components_are_kept_and_sum_to_the_reward(make_runner, isolation):
    runner = make_runner(CallableVerifier(correctness_and_format, isolation=isolation), num_workers=1)
    verdicts = runner.verify_batch(["12", "13", "x"], ["12", "12", "12"])
    assert [v.components for v in verdicts] == [{"correct": 1.0, "format": 0.1}, {"correct": 0.0, "format": 0.1},
                                                {"correct": 0.0, "format": 0.0}]
    assert [v.reward for v in verdicts] == [1.1, 0.1, 0.0]
    assert not any(v.failed for v in verdicts)
    assert runner.score_batch(["12"], ["12"]) == ([1.1], 0)


@pytest.mark.parametrize("name", ["mean", "accuracy", "verifier_errors", "", "a/b"])
def test_a_component_name_that_cannot_be_logged_fails_naming_it(make_runner, name):
    runner = make_runner(CallableVerifier(lambda c, a: {name: 1.0}, isolation="inline"))
    with pytest.raises(ValueError, match=f"component named {name!r}"):
        runner.verify_batch(["a"], ["a"])


def test_a_non_finite_component_fails_the_call_without_components(make_runner):
    runner = make_runner(CallableVerifier(lambda c, a: {"correct": 1.0, "format": math.nan}, isolation="inline"))
    (verdict,) = runner.verify_batch(["a"], ["a"])
    assert (verdict.reward, verdict.components, verdict.failed) == (0.0, {}, True)
