"""Decode tok/s of the torch engine with ``async_scheduling`` on and off (the next iteration
launched while the host finishes the current one, or not), runs of the two alternating:
scripts/bench-engine's async scheduling table."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    Col,
    Neighbours,
    Table,
    engine_decode,
    ensure_model,
    prompts_for,
)
from bench.torch_decode import decode_engine


def bench_async(
    name: str, path: Path, dtype: str, args: argparse.Namespace, neighbours: Neighbours
) -> list[dict[str, Any]]:
    engines = {
        on: decode_engine(
            path,
            dtype,
            max(args.async_batches),
            args,
            device=args.async_device,
            async_scheduling=on,
            overlap_on_cpu=True,
        )
        for on in (True, False)
    }
    vocab = engines[True].config.vocab_size
    for b in args.async_batches:
        for engine in engines.values():
            engine_decode(engine, prompts_for(b, args.prompt_len, vocab, seed=99), 4)
    rows = []
    for b in args.async_batches:
        rates: dict[bool, list[float]] = {True: [], False: []}
        before = dataclasses.replace(engines[True].overlap)
        for rep in range(args.reps):
            prompts = prompts_for(b, args.prompt_len, vocab, seed=rep)
            # Alternate which goes first, so a drift in the host's speed hits both alike.
            for on in (True, False) if rep % 2 == 0 else (False, True):
                _, dec = neighbours.timed(engine_decode, engines[on], prompts, args.new_tokens)
                rates[on].append(b * (args.new_tokens - 1) / dec)
        ov = engines[True].overlap
        row = {
            "model": name,
            "dtype": dtype,
            "device": engines[True].device,
            "batch": b,
            "async_tok_s": statistics.median(rates[True]),
            "sync_tok_s": statistics.median(rates[False]),
            "async_samples": rates[True],
            "sync_samples": rates[False],
            # over the timed runs (and their retries): iterations launched ahead, and rows
            # of those used and thrown away
            "launched_ahead": ov.launched - before.launched,
            "rows_used": ov.rows_used - before.rows_used,
            "rows_wasted": ov.rows_wasted - before.rows_wasted,
        }
        row["ratio"] = row["async_tok_s"] / row["sync_tok_s"]
        rows.append(row)
        ASYNC_TABLE.row(row)
    for engine in engines.values():
        engine.close()
    return rows


def _spread(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: f"{min(r[key]):.0f}-{max(r[key]):.0f}"


ASYNC_TABLE = Table(
    [
        Col("model", "model", left=True, width=18),
        Col("dtype", "dtype", left=True, width=9),
        Col("batch", "batch", width=5),
        Col("async_tok_s", "async tok/s", ".1f"),
        Col("sync_tok_s", "sync tok/s", ".1f"),
        Col("ratio", "ratio", ".3f"),
        Col(_spread("async_samples"), "async min-max", width=15),
        Col(_spread("sync_samples"), "sync min-max", width=15),
        Col(lambda r: f"{r['rows_used']}/{r['rows_wasted']}", "ahead used/wasted", width=17),
    ]
)


def run_async_bench(
    plan: list[tuple[str, str]], args: argparse.Namespace, neighbours: Neighbours
) -> list[dict[str, Any]]:
    print(
        f"\nasync scheduling on {args.async_device}: decode tok/s with async_scheduling on vs off,"
        f" {args.prompt_len}-token prompts, {args.new_tokens} new tokens, median of {args.reps}"
        " (runs alternate)\n"
    )
    ASYNC_TABLE.header()
    rows = []
    for name, dtype in plan:
        path = ensure_model(name, args.models_dir)
        rows.extend(bench_async(name, path, dtype, args, neighbours))
    return rows
