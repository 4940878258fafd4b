"""Prompt-ensemble retrieval for one query over a large pool: clova-train against two baselines.

The pool holds ``--prompts`` prompts of one concept (default 100,000 prompts of shape 16 x 768 with 768-d
features: the VQA tool's sizes, 4.9 GB). Methods, timed per query (median over ``--queries`` queries,
after one warm-up query whose time is reported separately as the build cost):

* ``pool (all)``: ``PromptPool.retrieve`` with the paper's ensemble over every stored prompt; the pool
  uses the exact factored form ``(q^T F^T P) / (q^T F^T 1)``, built once per concept.
* ``pool (top-20)``: ``PromptPool.retrieve(top_k=20)`` (cosine scores over all features, then 20 prompts).
* ``direct``: a vectorised implementation without the factoring: cosine against every feature, then the
  weighted sum over every prompt.
* ``loop``: the reference implementation's approach, a Python loop over stored (feature, prompt) pairs
  (timed on one query only: it takes seconds).

All results are checked against ``direct`` (max absolute difference). Results are appended to
``benchmarks/results/pool_retrieval.md``.

    python benchmarks/pool_retrieval.py [--prompts 100000] [--shape 16 768] [--dim 768]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import machine, publish  # noqa: E402

from clova_train.core.pool import PoolSpec, PromptPool  # noqa: E402


def direct(features: torch.Tensor, prompts: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    weights = F.normalize(features, dim=-1) @ F.normalize(query, dim=-1)
    return (weights @ prompts.reshape(len(prompts), -1) / weights.sum()).reshape(prompts.shape[1:])


def loop(features: torch.Tensor, prompts: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    total, weight_sum = torch.zeros_like(prompts[0]), 0.0
    for feature, prompt in zip(features, prompts):
        weight = float(F.cosine_similarity(feature, query, dim=0))
        total += weight * prompt
        weight_sum += weight
    return total / weight_sum


def timed(fn, queries: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for q in queries:
        start = time.perf_counter()
        out = fn(q)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100_000)
    parser.add_argument("--shape", type=int, nargs="+", default=[16, 768])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    features = torch.rand(args.prompts, args.dim, generator=g)  # CLIP-like: mostly positive cosines
    prompts = torch.randn(args.prompts, *args.shape, generator=g)
    pool = PromptPool(PoolSpec("bench", "bench", tuple(args.shape), args.dim))
    pool.add("concept", features, prompts, [str(i) for i in range(args.prompts)])
    features, prompts, _ = pool.entry("concept")  # the pool's own copies (no double memory)
    queries = [torch.rand(args.dim, generator=g) for _ in range(args.queries)]

    start = time.perf_counter()
    pool.retrieve("concept", queries[0])
    build_ms = (time.perf_counter() - start) * 1e3
    pool_ms, pool_out = timed(lambda q: pool.retrieve("concept", q), queries)
    topk_ms, topk_out = timed(lambda q: pool.retrieve("concept", q, top_k=args.top_k), queries)
    direct_ms, direct_out = timed(lambda q: direct(features, prompts, q), queries[:10])
    loop_ms, loop_out = timed(lambda q: loop(features, prompts, q), queries[-1:])

    reference_last = direct(features, prompts, queries[-1])
    weights = F.normalize(features, dim=-1) @ F.normalize(queries[-1], dim=-1)
    top_w, top_i = weights.topk(args.top_k)
    topk_expected = (top_w @ prompts.reshape(len(prompts), -1)[top_i] / top_w.sum()).reshape(args.shape)
    rows = [
        ("pool (all, factored)", pool_ms, float((pool_out - reference_last).abs().max())),
        (f"pool (top-{args.top_k})", topk_ms, float((topk_out - topk_expected).abs().max())),
        ("direct (vectorised, unfactored)", direct_ms, 0.0),
        ("loop (reference implementation)", loop_ms, float((loop_out - reference_last).abs().max())),
    ]
    publish(
        "pool_retrieval", "Pool retrieval benchmark results", f"cpu: {machine()}, {torch.get_num_threads()} threads",
        f"{args.prompts:,} prompts of shape {tuple(args.shape)} with {args.dim}-d features in one concept; "
        f"one query at a time; pool build (first query, once per concept): {build_ms:.0f} ms",
        ["method", "ms per query", "speed-up of pool (all)", "max abs diff vs expected"],
        [f"| {name} | {ms:.2f} | {ms / pool_ms:.1f}x | {diff:.1e} |" for name, ms, diff in rows],
        record=not args.no_record,
    )

if __name__ == "__main__":
    main()
