"""Serve admission: how much of a burst the serve job admits, sized by time against a fixed queue.

The serve app (sdflow_image.serving.serve_app) on a real socket, with a stand-in pipeline that takes
`--request_s` per request (no torch work, so the figures measure the admission, not the model),
gets bursts of N concurrent requests. For each burst size: the share answered 200, the share
refused (429 busy), and the burst's wall time against N x request_s (the work itself). Two
servers side by side: the default (admission by time; --max_queue 1000 only guards memory)
and `--max_queue 8`, the fixed queue that was the only rule before (1 running + 8 waiting).

`--limit_s` (default SageMaker's 60) lowers the invocation limit so that a burst past it runs in
seconds: with 0.2 s requests and a 10 s limit, about 45 of a burst of 100 fit (9 s of budget).

Ratios only: the run's absolute times depend on this machine's load.

usage: python bench/bench_serve_admission.py [--request_s 0.2] [--bursts 5,20,100] [--limit_s 60]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "training_image"), str(REPO)]

from sdflow_image.serving import serve  # noqa: E402
from sdflow_image.serving.serve_model import ServeSettings, StepTiming  # noqa: E402
from tests.image.serve_fixtures import (  # noqa: E402
    InstantPipeline,
    SteppingPipeline,
    fixed_timing,
    open_invocation,
    read_status,
    served_on_port,
)

STEPS = 2


def burst(port: int, count: int) -> tuple[list[int], float]:
    started = time.monotonic()
    socks = [
        open_invocation(port, {"prompt": f"p{i}", "num_inference_steps": STEPS, "width": 64, "height": 64})
        for i in range(count)
    ]
    try:
        statuses = [read_status(sock)[0] for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    return statuses, time.monotonic() - started


def measure(request_s: float, bursts: list[int], max_queue: int, limit_s: float) -> list[dict[str, Any]]:
    step_s = request_s / STEPS
    pipe = SteppingPipeline(InstantPipeline(), step_delay_s=step_s)
    settings = ServeSettings(model_dir=Path("/nonexistent"), max_queue=max_queue, invocation_limit_s=limit_s)
    app = serve.create_app(settings, loader=lambda s: pipe, calibrator=fixed_timing(StepTiming(64, step_s, 0.0)))
    rows = []
    with served_on_port(app) as port:
        for count in bursts:
            statuses, wall_s = burst(port, count)
            ok = statuses.count(200)
            rows.append(
                {
                    "max_queue": max_queue,
                    "limit_s": limit_s,
                    "burst": count,
                    "answered_200": round(ok / count, 3),
                    "refused_429": round(statuses.count(429) / count, 3),
                    "other": round((count - ok - statuses.count(429)) / count, 3),
                    "wall_over_work": round(wall_s / (ok * request_s), 2) if ok else None,
                    "scale": round(app.state.server.admission.scale, 2),
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request_s", type=float, default=0.2)
    parser.add_argument("--bursts", default="5,20,100")
    parser.add_argument("--limit_s", type=float, default=60.0)
    args = parser.parse_args()
    bursts = [int(part) for part in args.bursts.split(",")]
    for max_queue in (1000, 8):
        for row in measure(args.request_s, bursts, max_queue, args.limit_s):
            print(json.dumps(row), flush=True)
    print(
        "answered_200 / refused_429: shares of the burst; wall_over_work: the burst's wall time over the "
        "work it got done (1.0 = no overhead); scale: measured / estimated service time after the bursts"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
