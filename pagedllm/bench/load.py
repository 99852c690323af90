"""What the serving benchmarks share (`bench serve`, and `bench serve --endpoint speech` in speech.py): the
arrival schedule, latency percentiles and the report's ending."""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time


def percentiles(values: list[float]) -> dict:
    """Mean, median and p99 of a load run's latencies (None each when there are none)."""
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    rank = 0.99 * (len(ordered) - 1)  # linear interpolation, as numpy.percentile does
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    p99 = ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p99": p99}


async def send_all(requests: list, request_rate: float, rng: random.Random) -> float:
    """Start each request (a coroutine function) in order, all at once or at Poisson arrivals of
    `request_rate` per second; wait for all; return the seconds from the first start to the last end."""
    start = time.perf_counter()
    tasks = []
    for i, request in enumerate(requests):
        tasks.append(asyncio.create_task(request()))
        if request_rate != float("inf") and i < len(requests) - 1:
            await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
    await asyncio.gather(*tasks)
    return time.perf_counter() - start


def finish_report(args, metrics: dict, errors: list[str]) -> int:
    """The first error (if any), the JSON file (--output-json), the exit status (1 when a request failed)."""
    if errors:
        print(f"first error: {errors[0]}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"settings": vars(args), "metrics": metrics}, f, indent=2, default=str)
    return 0 if not errors else 1
