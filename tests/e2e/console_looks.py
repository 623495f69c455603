"""What a person checks on a console page, for the browser tests (test_console_browser.py): a
full-page screenshot kept under the test's folder (its path printed, to be looked at), no stack
trace or escaped JSON in the visible text, every panel within a sane height, and the duration of
every ended state the same across two loads some seconds apart."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A Python traceback, Lambda's error JSON, a JSON string shown with its escapes.
FORBIDDEN_TEXT = ("Traceback", 'File "/', "stackTrace", '\\"', "errorMessage")
MAX_PANEL_PX = 2000
PANELS = "section.card, .map-counts, [data-testid=state-panel], [data-testid=results]"
ENDED = ("succeeded", "failed", "caught", "aborted")
WAIT_MS = 120_000

_PANEL_HEIGHTS = """sel => [...document.querySelectorAll(sel)].map(el =>
  [el.getAttribute('data-testid') || el.className, Math.round(el.getBoundingClientRect().height)])"""
# The text each ended state shows under its name (type · duration), and the run's own figures;
# states coloured from a Map's children show counts, not a duration of their own.
_ENDED_TEXTS = """ended => {
  const out = {};
  for (const g of document.querySelectorAll('g.state')) {
    if (ended.includes(g.getAttribute('data-status')) && g.getAttribute('data-from-children') !== 'true') {
      out[g.getAttribute('data-state')] = g.querySelector('.state-sub').textContent;
    }
  }
  const meta = document.querySelector('[data-testid=run-header] .run-meta');
  if (meta) out['(run)'] = meta.innerText;
  return out;
}"""


def visible_text_problems(text: str) -> list[str]:
    """Each forbidden string found in the visible text, with what surrounds it."""
    found = []
    for forbidden in FORBIDDEN_TEXT:
        at = text.find(forbidden)
        if at >= 0:
            found.append(f"{forbidden!r} in …{text[max(0, at - 80) : at + 80]!r}…")
    return found


def look(page: Any, folder: Path, name: str, report: Callable[[str], None]) -> Path:
    """Screenshot the whole page as <folder>/<name>.png and check it as a person would."""
    page.wait_for_load_state("networkidle")
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    report(f"console screenshot, {name}: {path}")
    text = str(page.evaluate("document.body.innerText"))
    problems = visible_text_problems(text)
    assert not problems, f"{name}: the page shows what no person should have to read: {problems}"
    heights = page.evaluate(_PANEL_HEIGHTS, PANELS)
    tall = [(panel, height) for panel, height in heights if height > MAX_PANEL_PX]
    assert not tall, f"{name}: panels taller than {MAX_PANEL_PX} px: {tall}"
    return path


def shoot(locator: Any, folder: Path, name: str, report: Callable[[str], None]) -> Path:
    """One panel's screenshot, for a closer look than the full page gives."""
    path = folder / f"{name}.png"
    # The sticky top bar would cover the panel's heading in a shot of the panel alone.
    locator.screenshot(path=str(path), style=".topbar, .banner-host { visibility: hidden; }")
    report(f"console screenshot, {name}: {path}")
    return path


def ended_texts(page: Any) -> dict[str, str]:
    return dict(page.evaluate(_ENDED_TEXTS, list(ENDED)))


def wait_painted(page: Any) -> None:
    """The run page has drawn the run's states (after a load or a reload)."""
    page.wait_for_selector('[data-testid="run-status"]', timeout=WAIT_MS)
    page.wait_for_selector("g.state:not([data-status=not_reached])", timeout=WAIT_MS)


def durations_fixed(page: Any, pause_ms: int = 2500) -> dict[str, str]:
    """Every ended state's duration (and the ended run's) is the same after a reload a few
    seconds later: from its own events, never counted up to now."""
    wait_painted(page)
    first = ended_texts(page)
    assert len(first) > 1, f"no ended state to compare: {first}"
    page.wait_for_timeout(pause_ms)
    page.reload()
    wait_painted(page)
    page.wait_for_function(
        "n => document.querySelectorAll('g.state:not([data-status=not_reached])').length >= n",
        arg=len(first) - 1,
        timeout=WAIT_MS,
    )
    second = ended_texts(page)
    assert second == first, f"durations of ended states changed between loads:\n{json.dumps([first, second])}"
    return first
