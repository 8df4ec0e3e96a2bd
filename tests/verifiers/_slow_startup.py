"""Helper for tests/verifiers/test_runner.py: a verifier whose module takes seconds to import.

It stands in for a verifier with heavy imports (sympy, torch, ...). It is imported only inside a spawned
verifier worker (never by the test process itself), so the sleep models worker start-up time.
"""

from __future__ import annotations

import time

from lightning_rlvr.verifiers.base import Verifier

IMPORT_SECONDS = 5.5
time.sleep(IMPORT_SECONDS)


class EqualityVerifier(Verifier):
    isolation = "process"

    def score(self, completion: str, answer: str) -> float:
        return float(completion == answer)
