"""Admission by time: the serve job admits what it can finish within SageMaker's 60 s limit at the
model's measured speed, and tells the rest when to retry (429, Retry-After, retry_after_s)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sdflow_image.serving import serve
from sdflow_image.serving.serve_admission import Admission, RefusedError
from sdflow_image.serving.serve_model import ServeSettings, StepTiming
from tests.image.serve_fixtures import (
    InstantPipeline,
    SteppingPipeline,
    fixed_timing,
    open_invocation,
    read_response,
    read_status,
    served_on_port,
    wait_until,
)

pytestmark = [pytest.mark.image]

TWO_STEPS = {"num_inference_steps": 2, "width": 64, "height": 64}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _admission(workers: int = 1, **options: Any) -> tuple[Admission, FakeClock]:
    clock = FakeClock()
    return Admission(60.0, workers, clock=clock, **options), clock


# --- the rule, on a fake clock --------------------------------------------------------------------


def test_admission_work_within_limit_less_margin_admitted_past_it_refused_with_retry_after() -> None:
    admission, _ = _admission()
    assert admission.margin_s == pytest.approx(6.0)
    tickets = [admission.admit(10.0) for _ in range(5)]  # the fifth ends at 50 s of the 54 s budget
    assert admission.admitted == 5
    with pytest.raises(RefusedError) as refused:
        admission.admit(10.0)  # would end at 60 s
    assert refused.value.retry_after_s == 6
    assert "60 s limit" in str(refused.value)
    assert len(tickets) == admission.admitted


def test_admission_running_request_counts_only_its_remainder() -> None:
    admission, clock = _admission()
    first = admission.admit(10.0)
    for _ in range(4):
        admission.admit(10.0)
    admission.start(first)
    clock.now += 5.9
    with pytest.raises(RefusedError) as refused:
        admission.admit(10.0)
    assert refused.value.retry_after_s == 1, "0.1 s short: retry in a second, never 0"
    clock.now += 0.1
    admission.admit(10.0)  # 4.0 s left of the first + 40 + 10 = 54 s
    assert admission.admitted == 6


def test_admission_free_pipeline_admits_even_a_request_longer_than_the_budget() -> None:
    # plan() has already refused (400) what cannot finish alone; a free pipeline starts the rest.
    admission, _ = _admission()
    admission.admit(58.0)
    with pytest.raises(RefusedError):
        admission.admit(0.5)


def test_admission_pipelines_share_the_work_ahead() -> None:
    one, _ = _admission(workers=1)
    four, _ = _admission(workers=4)
    admitted = {}
    for name, admission in (("one", one), ("four", four)):
        try:
            while True:
                admission.admit(10.0)
        except RefusedError:
            admitted[name] = admission.admitted
    # Four pipelines: the n-th request starts when 10 (n - 1) / 4 s of work has drained and ends
    # 10 s later: within 54 s up to n = 18 (one pipeline: 5).
    assert admitted == {"one": 5, "four": 18}


def test_admission_measured_service_time_moves_the_estimate_both_ways() -> None:
    slow, _ = _admission()
    for _ in range(10):
        slow.record(estimate_s=1.0, elapsed_s=3.0)
    assert slow.scale == pytest.approx(3.0, rel=0.05)
    fast, _ = _admission()
    for _ in range(10):
        fast.record(estimate_s=1.0, elapsed_s=0.5)
    admitted = {}
    for name, admission in (("slow", slow), ("fast", fast)):
        try:
            while True:
                admission.admit(1.0)
        except RefusedError:
            admitted[name] = admission.admitted
    # 54 s of budget: about 18 requests of 3 s, about 108 of 0.5 s (the calibration alone: 54).
    assert 17 <= admitted["slow"] <= 19
    assert 100 <= admitted["fast"] <= 110


def test_admission_one_outlier_measurement_is_bounded() -> None:
    admission, _ = _admission()
    admission.record(estimate_s=0.01, elapsed_s=30.0)  # a first request's lazy initialisation
    assert admission.scale == pytest.approx(1.0 + 0.3 * (10.0 - 1.0))
    admission.record(estimate_s=0.0, elapsed_s=1.0)  # nothing to learn from a zero estimate
    assert admission.scale == pytest.approx(3.7)


def test_admission_max_waiting_guards_memory_whatever_the_time() -> None:
    admission, _ = _admission(max_waiting=2)
    admission.start(admission.admit(0.01))  # running on the free pipeline
    for _ in range(2):
        admission.admit(0.01)
    with pytest.raises(RefusedError) as refused:
        admission.admit(0.01)
    assert "at most 2" in str(refused.value)
    assert refused.value.retry_after_s == 1


def test_admission_release_frees_the_work() -> None:
    admission, _ = _admission()
    tickets = [admission.admit(10.0) for _ in range(5)]
    admission.release(tickets[0])
    admission.admit(10.0)
    assert admission.admitted == 5


# --- served ---------------------------------------------------------------------------------------


def _post_all(port: int, count: int) -> list[tuple[int, bytes]]:
    """`count` requests sent at once on their own connections; their answers in order."""
    socks = [open_invocation(port, {"prompt": f"p{i}", **TWO_STEPS, "seed": i}) for i in range(count)]
    try:
        return [read_status(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def test_invocations_twenty_concurrent_short_requests_all_admitted_and_answered_200() -> None:
    """20 requests of 0.2 s are 4 s of work: well within 60 s (a fixed queue of 8 refused 11)."""
    pipe = SteppingPipeline(InstantPipeline(), step_delay_s=0.1)  # 2 steps: 0.2 s a request
    app = serve.create_app(
        ServeSettings(model_dir=Path("/nonexistent")),
        loader=lambda s: pipe,
        calibrator=fixed_timing(StepTiming(64, 0.1, 0.0)),
    )
    with served_on_port(app) as port:
        answers = _post_all(port, 20)
    assert [status for status, _ in answers] == [200] * 20, [body[:200] for _, body in answers]
    assert pipe.calls == 20


def test_invocations_refusal_is_429_with_retry_after_in_header_and_body() -> None:
    gate = threading.Event()
    pipe = InstantPipeline()

    def held(**kwargs: Any) -> Any:
        assert gate.wait(30)
        return pipe(**kwargs)

    # 20 s a request (estimated): two fit in the 54 s budget behind a running one, a fourth does not.
    app = serve.create_app(
        ServeSettings(model_dir=Path("/nonexistent")),
        loader=lambda s: held,
        calibrator=fixed_timing(StepTiming(64, 10.0, 0.0)),
    )
    with served_on_port(app) as port:
        socks = [open_invocation(port, {"prompt": f"p{i}", **TWO_STEPS}) for i in range(2)]
        wait_until(lambda: app.state.server.admitted == 2, "two requests to be admitted")
        late = open_invocation(port, {"prompt": "late", **TWO_STEPS})
        status, headers, body = read_response(late)
        gate.set()
        assert [read_status(sock)[0] for sock in socks] == [200, 200]
        for sock in (*socks, late):
            sock.close()
    answer = json.loads(body)
    assert status == 429
    assert answer["status"] == "busy"
    # 40 s ahead + 20 s own = 60 s, 6 s past the budget (less what the first has run).
    assert 5 <= answer["retry_after_s"] <= 6
    assert headers["retry-after"] == str(answer["retry_after_s"])


def test_invocations_service_time_measured_from_real_requests_feeds_admission() -> None:
    """The calibration said 0.02 s a request; the model really takes about 0.2 s: the scale learns it."""
    pipe = SteppingPipeline(InstantPipeline(), step_delay_s=0.1)
    app = serve.create_app(
        ServeSettings(model_dir=Path("/nonexistent")),
        loader=lambda s: pipe,
        calibrator=fixed_timing(StepTiming(64, 0.01, 0.0)),
    )
    with served_on_port(app) as port:
        for _ in range(3):
            assert _post_all(port, 1)[0][0] == 200
        scale = app.state.server.admission.scale
    assert scale > 3.0, "three requests 10x slower than calibrated move the scale well up"


def test_invocations_waited_past_the_limit_never_runs() -> None:
    """SageMaker has answered a request still waiting at the limit: it is dropped, not run."""
    gate = threading.Event()
    pipe = InstantPipeline()

    def held(**kwargs: Any) -> Any:
        assert gate.wait(30)
        return pipe(**kwargs)

    app = serve.create_app(
        ServeSettings(model_dir=Path("/nonexistent"), invocation_limit_s=1.0),
        loader=lambda s: held,
        calibrator=fixed_timing(StepTiming(64, 0.001, 0.0)),
    )
    with served_on_port(app) as port:
        first = open_invocation(port, {"prompt": "first", **TWO_STEPS})
        wait_until(lambda: app.state.server.admitted == 1, "the first request to be admitted")
        queued = open_invocation(port, {"prompt": "queued", **TWO_STEPS})
        wait_until(lambda: app.state.server.admitted == 2, "the second request to wait")
        time.sleep(1.2)  # past both requests' 1 s limit
        gate.set()
        status, body = read_status(queued)
        read_status(first)
        for sock in (first, queued):
            sock.close()
    assert status == 503
    assert json.loads(body)["status"] == "timed_out"
    assert "not started" in json.loads(body)["error"]
    assert pipe.calls == 1, "only the first request reached the pipeline"
