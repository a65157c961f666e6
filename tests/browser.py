"""Pages in a real browser for tests: headless Chromium from Debian's ``chromium`` package, driven by
Playwright with that system executable (``.ci/run`` installs it; a Playwright-downloaded browser is never
used), and the checks every page owes (labels, contrast, no errors, no overflow).

Source: WCAG 2.2, success criteria 1.4.3 (contrast, 4.5:1), 1.4.11 (non-text contrast, 3:1), 1.3.1
(labels).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.server import ROOT, GunicornServer

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = ROOT / "test-artifacts"
WIDE = {"width": 1280, "height": 900}
NARROW = {"width": 390, "height": 844}

needs_chromium = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK),
    reason=f"{CHROMIUM} is missing: install Debian's chromium package (.ci/run does)",
)

# WCAG 2.x contrast of every visible text (4.5:1) and every chart mark (3:1) against the nearest
# opaque background; controls that are disabled are exempt, as in WCAG.
CONTRAST = """() => {
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => {
    const f = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const ratio = (a, b) => {
    const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p);
    return (x + 0.05) / (y + 0.05);
  };
  const background = (el) => {
    for (let n = el; n; n = n.parentElement) {
      const c = rgb(getComputedStyle(n).backgroundColor);
      if (c.length === 3 || (c.length === 4 && c[3] === 1)) return c.slice(0, 3);
    }
    return [255, 255, 255];
  };
  const visible = (el) => {
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0 && getComputedStyle(el).visibility !== "hidden";
  };
  const failures = [];
  let checked = 0;
  for (const el of document.querySelectorAll("body *")) {
    if (!visible(el) || el.closest("[disabled], .visually-hidden, .skip")) continue;
    const svg = el instanceof SVGElement;
    const hasText = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    const mark = svg && el.classList.contains("mark");
    if (!hasText && !mark) continue;
    const color = rgb(getComputedStyle(el)[svg ? "fill" : "color"]).slice(0, 3);
    const value = ratio(color, background(el));
    checked += 1;
    if (value < (mark ? 3 : 4.5)) {
      const text = el.textContent.trim().slice(0, 30);
      failures.push(`${el.tagName}.${el.getAttribute("class")} "${text}" ${value.toFixed(2)}`);
    }
  }
  return { checked, failures };
}"""

# Every form control has a label, every chart a name, the page a language.
LABELS = """() => ({
  lang: document.documentElement.lang,
  unlabelled: [...document.querySelectorAll("input, textarea, select")]
    .filter((c) => !c.labels.length && !c.getAttribute("aria-label")).map((c) => c.id),
  charts: [...document.querySelectorAll("svg[role=img]")].map((s) => s.getAttribute("aria-label")),
  overflow: document.documentElement.scrollWidth - window.innerWidth,
})"""


def launch() -> Iterator[Browser]:
    """Yield a headless Chromium (the system executable), closed afterwards."""
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Watch:
    """What a page loaded and complained about."""

    def __init__(self, page: Page) -> None:
        self.urls: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda r: self.urls.append(r.url))
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)


def new_page(browser: Browser) -> Iterator[tuple[Page, Watch]]:
    """Yield a wide, light page with a :class:`Watch`, in a context of its own (closed afterwards)."""
    context = browser.new_context(viewport=WIDE, color_scheme="light")
    pg = context.new_page()
    pg.set_default_timeout(15_000)
    yield pg, Watch(pg)
    context.close()


def screenshot(pg: Page, name: str) -> Path:
    """Save a full-page PNG of ``pg`` as ``test-artifacts/<name>`` (gitignored); return its path."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    pg.screenshot(path=str(path), full_page=True)
    return path


def stop_running(pg: Page, server: GunicornServer, selector: str, step_s: float) -> str:
    """Click Stop while the page's one request runs on ``server``; return the text at ``selector``.

    Asserts that the request held the server's one busy slot, that the page then says it stopped
    (``data-state``, the EventSource closed, "Stopped after N tokens." with the meter's N), that
    the slot frees, and that nothing more reaches ``selector`` in four more steps of ``step_s``
    seconds (the pace the server's faults inject).
    """
    held = server.state()
    assert held["slots"]["busy"] == 1 and [r["state"] for r in held["requests"]] == ["running"]
    pg.click("#stop")
    assert pg.get_attribute("#demo", "data-state") == "stopped"
    assert pg.evaluate("window.greenserve.source.readyState") == 2
    tokens = int(pg.text_content("#tokens"))
    assert pg.text_content("#state") == f"Stopped after {tokens} tokens."
    text = pg.text_content(selector)
    server.wait_idle()
    pg.wait_for_timeout(4 * step_s * 1000)
    assert pg.text_content(selector) == text  # nothing arrived after Stop
    return text


def check_page(pg: Page, watch: Watch, origin: str) -> dict:
    """Assert what every page owes: loads from ``origin`` only, no errors, labels, contrast."""
    assert [u for u in watch.urls if not u.startswith(origin + "/")] == []
    assert watch.errors == []
    labels = pg.evaluate(LABELS)
    assert labels["lang"] == "en" and labels["unlabelled"] == [] and labels["overflow"] <= 0
    contrast = pg.evaluate(CONTRAST)
    assert contrast["failures"] == [] and contrast["checked"] > 20
    return labels
