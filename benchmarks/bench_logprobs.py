"""Peak memory and time of per-token log-prob + entropy: a full float32 log_softmax, TRL's helpers, ours.

Methods (each computes the log-prob of the sampled token and the full-vocabulary entropy at every position):

- ``naive``: ``log_softmax`` of the whole ``(N, V)`` logits in float32, gather, ``-(p log p).sum``;
- ``trl``: TRL's ``selective_log_softmax`` + ``entropy_from_logits`` (their CPU path: row-chunked loops);
- ``chunked``: :func:`lightning_rlvr.ops.token_logprobs_and_entropy`, from the logits, 16 MiB chunks;
- ``fused``: :func:`lightning_rlvr.ops.fused_logprobs.hidden_logprobs_and_entropy`, from the final hidden
  states and the output weight: the logits never exist (64 MiB chunks, which are also its matmul tiles).

Two views. ``--start logits``: the model's logits are given (as after ``model(...)``); the extra memory is what the
log-prob/entropy computation adds on top of them. ``--start hidden``: the final hidden states are given; the logits
methods first run the output projection (its memory and time count), which is the comparison that matters for the
fused path. With ``--grad``, the log-probs' sum is backpropagated (to the logits, or to the hidden states and
the weight), the entropy being a detached diagnostic as in training. Each measurement runs in a fresh process:
its peak RSS over the RSS just before the computation is the extra memory (measured with glibc's mmap threshold
fixed, so that freed blocks leave the RSS); the time, from a second process with the default allocator, is the
median of 3 runs.

    python benchmarks/bench_logprobs.py                       # V = 32k, 64k, 152k at T = 1024, both views
    python benchmarks/bench_logprobs.py --vocab 151936 --start hidden --json logprobs.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("naive", "trl", "chunked", "fused")


def _naive(logits, labels):
    import torch

    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _trl(logits, labels):
    import torch
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    logp = selective_log_softmax(logits, labels)
    with torch.no_grad():
        entropy = entropy_from_logits(logits)
    return logp, entropy


def _chunked(logits, labels):
    from lightning_rlvr.ops import token_logprobs_and_entropy
    from lightning_rlvr.ops.fused_logprobs import chunk_rows

    stats = token_logprobs_and_entropy(logits, labels, chunk_size=chunk_rows(logits.shape[-1]))
    return stats.logprobs, stats.entropy


def worker(method: str, rows: int, vocab: int, hidden_size: int, start: str, grad: bool) -> dict:
    import torch

    from lightning_rlvr.ops import token_logprobs_and_entropy  # noqa: F401  (imports before the baseline)
    from lightning_rlvr.ops.fused_logprobs import hidden_logprobs_and_entropy

    torch.set_num_threads(2)
    torch.manual_seed(0)
    hidden = torch.randn(rows, hidden_size, requires_grad=grad and start == "hidden")
    # In place: a temporary (V, H) would raise the RSS high-water mark above the baseline and hide small peaks.
    weight = torch.randn(vocab, hidden_size).mul_(0.05).requires_grad_(grad and start == "hidden")
    labels = torch.randint(0, vocab, (rows,))
    given = None
    if start == "logits":
        if method == "fused":
            raise ValueError("the fused method starts from hidden states")
        with torch.no_grad():
            given = (hidden @ weight.T).requires_grad_(grad)

    compute = {"naive": _naive, "trl": _trl, "chunked": _chunked}.get(method)
    if method == "trl":
        import trl.trainer.utils  # noqa: F401  (imported before the baseline: its import is not the method's memory)

    def run() -> None:
        with torch.set_grad_enabled(grad):
            if method == "fused":
                logp = hidden_logprobs_and_entropy(hidden, weight, labels).logprobs
            else:
                logits = given if given is not None else hidden @ weight.T
                logp, _ = compute(logits, labels)
            if grad:
                logp.sum().backward()
        for tensor in (hidden, weight, given):
            if tensor is not None:
                tensor.grad = None

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(3):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
        if len(times) == 1:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"extra_mib": (peak - before) / 1024, "seconds": statistics.median(times)}


def _run_worker(method: str, rows: int, vocab: int, hidden_size: int, start: str, grad: bool, env: dict) -> dict:
    command = [sys.executable, __file__, "--worker", method, "--rows", str(rows), "--vocab", str(vocab),
               "--hidden-size", str(hidden_size), "--start", start] + (["--grad"] if grad else [])
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(method: str, rows: int, vocab: int, hidden_size: int, start: str, grad: bool) -> dict:
    """Memory and time from two processes: the allocator setting that makes RSS exact also slows allocation."""
    # Memory: every large block straight from mmap and back on free. glibc otherwise raises its mmap threshold
    # after the first freed chunk and keeps later ones in its heap, so the RSS peak would depend on history.
    exact_rss = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    memory = _run_worker(method, rows, vocab, hidden_size, start, grad, exact_rss)
    timing = _run_worker(method, rows, vocab, hidden_size, start, grad, dict(os.environ))
    return {"extra_mib": memory["extra_mib"], "seconds": timing["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", nargs="+", type=int, default=[32_000, 65_536, 151_936])
    parser.add_argument("--rows", type=int, default=1024, help="B x T positions (default: one 1k-token sequence)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--start", nargs="+", choices=("logits", "hidden"), default=["logits", "hidden"])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--grad", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.rows, args.vocab[0], args.hidden_size, args.start[0], args.grad)))
        return

    rows = []
    for start in args.start:
        for vocab in args.vocab:
            for grad in (False, True):
                methods = [m for m in args.methods if not (start == "logits" and m == "fused")]
                results = {m: measure(m, args.rows, vocab, args.hidden_size, start, grad) for m in methods}
                naive = results.get("naive")
                for method, result in results.items():
                    rows.append({
                        "start": start, "rows": args.rows, "vocab": vocab, "grad": grad, "method": method, **result,
                        "memory_vs_naive": result["extra_mib"] / naive["extra_mib"] if naive else None,
                        "time_vs_naive": result["seconds"] / naive["seconds"] if naive else None,
                    })
                print(f"{start} V={vocab} grad={grad}: " + ", ".join(
                    f"{m} {r['extra_mib']:.0f} MiB {r['seconds'] * 1e3:.0f} ms" for m, r in results.items()),
                    file=sys.stderr, flush=True)

    print(f"\nN = {args.rows} positions, hidden size {args.hidden_size}; extra memory = peak RSS over the start")
    print("| start | V | grad | method | extra MiB | ms | memory × naive | time × naive |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = lambda key: "—" if row[key] is None else f"{row[key]:.3f}"  # noqa: E731
        print(f"| {row['start']} | {row['vocab']} | {'yes' if row['grad'] else 'no'} | {row['method']} | "
              f"{row['extra_mib']:.0f} | {row['seconds'] * 1e3:.0f} | {ratio('memory_vs_naive')} | "
              f"{ratio('time_vs_naive')} |")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
