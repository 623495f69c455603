"""The local cloud's clock (sdflow/local/clock.py): scaled while idle, real while busy, advanced at will."""

from __future__ import annotations

import threading
import time

import pytest

from sdflow.local.clock import REAL_TIME, Clock, ClockError


def _timed(action: object) -> float:
    started = time.monotonic()
    action()  # type: ignore[operator]
    return time.monotonic() - started


def test_clock_at_real_speed_sleeps_real_seconds() -> None:
    clock = Clock()
    assert _timed(lambda: clock.sleep(0.2)) >= 0.19
    assert abs(clock.time() - time.time()) < 0.5


def test_clock_scaled_sleeps_virtual_hour_in_real_moments() -> None:
    clock = Clock(scale=36_000)
    before = clock.monotonic()
    assert _timed(lambda: clock.sleep(3600)) < 1.5
    assert clock.monotonic() - before >= 3600


def test_clock_scaled_runs_real_speed_while_busy() -> None:
    clock = Clock(scale=1000)
    with clock.busy():
        assert _timed(lambda: clock.sleep(0.3)) >= 0.29
    assert _timed(lambda: clock.sleep(300)) < 1.5


def test_clock_busy_from_another_thread_slows_a_sleeper_already_waiting() -> None:
    clock = Clock(scale=1000)
    done = threading.Event()
    threading.Thread(target=lambda: (clock.sleep(2000.0), done.set()), daemon=True).start()
    for _ in range(200):  # the sleeper is waiting: about 2 s of real time at this scale
        if clock.pending():
            break
        time.sleep(0.01)
    with clock.busy():  # the virtual seconds left are real ones now
        assert not done.wait(0.5)
    assert done.wait(5.0)


def test_clock_advance_wakes_sleeper_due_by_then() -> None:
    clock = Clock()
    woke = threading.Event()
    threading.Thread(target=lambda: (clock.sleep(86_400, what="a day"), woke.set()), daemon=True).start()
    for _ in range(100):
        if clock.pending():
            break
        time.sleep(0.01)
    [pending] = clock.pending()
    assert pending.what == "a day"
    assert 86_000 < pending.due_in_s <= 86_400
    clock.advance(3600)
    assert not woke.wait(0.2)
    clock.advance(86_400)
    assert woke.wait(2.0)
    assert clock.offset_s() >= 89_999


def test_clock_wait_returns_true_when_event_set_before_timeout() -> None:
    clock = Clock()
    event = threading.Event()
    threading.Timer(0.05, event.set).start()
    assert clock.wait(event, 600) is True
    assert clock.pending() == []


def test_clock_wait_times_out_when_advanced_past_timeout() -> None:
    clock = Clock()
    event = threading.Event()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(clock.wait(event, 300, what="token")), daemon=True)
    waiter.start()
    for _ in range(100):
        if clock.pending():
            break
        time.sleep(0.01)
    assert clock.advance_to_next(what="token") is not None
    waiter.join(2.0)
    assert result == [False]


def test_clock_call_later_runs_when_due_and_not_after_cancel() -> None:
    clock = Clock()
    ran: list[str] = []
    clock.call_later(60, lambda: ran.append("kept"), what="kept")
    cancelled = clock.call_later(30, lambda: ran.append("cancelled"), what="cancelled")
    cancelled.cancel()
    clock.advance(61)
    for _ in range(100):
        if ran:
            break
        time.sleep(0.01)
    assert ran == ["kept"]


def test_clock_many_waits_ended_early_leave_no_backlog() -> None:
    clock = Clock()
    done = []
    for _ in range(300):  # waits that end by their event, long before their week-long timeouts
        event = threading.Event()
        threading.Timer(0.001, event.set).start()
        done.append(clock.wait(event, 7 * 86_400))
    assert all(done)
    assert len(clock._heap) < 150  # compacted, not 300 week-long entries


def test_clock_now_and_time_agree() -> None:
    clock = Clock()
    clock.advance(7200)
    assert abs(clock.now().timestamp() - clock.time()) < 0.1
    assert clock.now().tzinfo is not None
    assert 7199 < clock.time() - time.time() < 7201


@pytest.mark.parametrize("scale", [0, 0.5, -1])
def test_clock_scale_below_one_is_refused_with_reason(scale: float) -> None:
    with pytest.raises(ClockError, match="time scale"):
        Clock(scale=scale)


def test_clock_advance_backwards_is_refused() -> None:
    with pytest.raises(ClockError, match="only moves forward"):
        Clock().advance(-1)


def test_clock_closed_ends_every_wait_and_later_waits_at_once() -> None:
    clock = Clock()
    ended = threading.Event()
    threading.Thread(target=lambda: (clock.sleep(86_400), ended.set()), daemon=True).start()
    for _ in range(100):
        if clock.pending():
            break
        time.sleep(0.01)
    clock.close()
    assert ended.wait(2.0), "a stopping cloud releases what waits on its clock"
    assert _timed(lambda: clock.sleep(3600)) < 0.5
    assert clock.wait(threading.Event(), 3600) is False


def test_real_time_clock_wall_clock_stepped_follows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stepped wall clock (NTP, a resumed VM) moves time.time() but not the monotonic clock: the clock of
    a process without a local cloud still reads what time.time() reads."""
    stepped = time.time() + 130.0
    monkeypatch.setattr(time, "time", lambda: stepped)

    assert REAL_TIME.time() == stepped
    assert REAL_TIME.now().timestamp() == pytest.approx(stepped)
