"""The demo (``/``) and status (``/status``) pages in a real browser (``tests.browser``: Debian's headless
Chromium driven by Playwright).

A second server serves a bigram with a shadow variant of the same weights (``shadow = 100``), for the
status page's shadows' table.

The first server streams slowly (``GREENSERVE_FAULTS=slow_step_s=0.05``) so that every token is its own update
on the page, and requires an API key, which the demo passes as ``api_key``. Screenshots of both pages,
wide and narrow, are saved under ``test-artifacts/`` at the repository root.
"""

from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import Page

from tests.browser import NARROW, WIDE, Watch, needs_chromium, screenshot, stop_running
from tests.browser import check_page as check_page_from
from tests.modelfiles import write_trained
from tests.server import GunicornServer, wait_until

KEY = "demo-key-1"
SLOW_STEP_S = 0.05

pytestmark = [pytest.mark.browser, needs_chromium]

# Record every change of the continuation's text (its length and the page's state at that moment).
RECORD = """() => {
  window.samples = [];
  const completion = document.getElementById("completion");
  new MutationObserver(() => window.samples.push({
    length: completion.textContent.length,
    state: document.getElementById("demo").dataset.state,
  })).observe(completion, { childList: true, characterData: true, subtree: true });
}"""


@pytest.fixture(scope="module")
def server(serve_module) -> GunicornServer:
    return serve_module(
        GREENSERVE_FAULTS=f"slow_step_s={SLOW_STEP_S}",
        API_KEYS=KEY,
        STATS_FLUSH_S="0.2",
        SLO_TTFT_S="0.5",
    )


SHADOWED = (
    '[models.twin]\nsource = "xyz"\n\n[models.twin.variants.copy]\nsource = "xyz"\nshadow = 100\n'
)


@pytest.fixture(scope="module")
def shadowed(serve_module, tmp_path_factory) -> GunicornServer:
    """A server of model ``twin`` (a bigram trained on ``xyz``) whose variant ``copy`` shadows it
    with the same weights: every request mirrored, every comparison exact."""
    root = tmp_path_factory.mktemp("shadowed")
    write_trained(root / "xyz", b"xyz")
    (root / "models.toml").write_text(SHADOWED)
    return serve_module(MODELS_FILE=str(root / "models.toml"), STATS_FLUSH_S="0.2")


def bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def check_page(pg: Page, watch: Watch, server: GunicornServer) -> dict:
    return check_page_from(pg, watch, server.url)


def fill_request(pg: Page, max_tokens: int, seed: int, key: str = KEY) -> None:
    pg.fill("#prompt", "ROMEO:")
    pg.fill("#temperature", "0.8")
    pg.fill("#max_tokens", str(max_tokens))
    pg.fill("#seed", str(seed))
    pg.fill("#api_key", key)


def test_demo_streams_the_continuation_token_by_token(server, page):
    pg, watch = page
    params = {
        "model": "bigram",
        "prompt": "ROMEO:",
        "max_tokens": 30,
        "temperature": 0.8,
        "seed": 11,
    }
    status, _, body = server.complete(params, headers=bearer())
    assert status == 200
    expected = json.loads(body)["choices"][0]["text"]

    pg.goto(server.url + "/")
    assert pg.get_attribute("#demo", "data-state") == "idle"
    fill_request(pg, 30, 11)
    pg.evaluate(RECORD)
    pg.click("#generate")
    pg.wait_for_selector('#demo[data-state="done"]')

    assert pg.text_content("#completion") == expected
    assert pg.text_content("#prompt-echo") == "ROMEO:"
    samples = pg.evaluate("window.samples")
    lengths = [s["length"] for s in samples]
    # The text grew in many separate updates, all while the page said it was streaming.
    assert len(lengths) >= 10 and lengths == sorted(set(lengths)) and lengths[-1] == len(expected)
    assert {s["state"] for s in samples} == {"streaming"}
    assert pg.text_content("#tokens") == "30"
    assert pg.text_content("#seed-used") == "11"
    assert re.fullmatch(r"\d+ ms|\d+\.\d\d s", pg.text_content("#ttft"))
    assert re.fullmatch(r"\d+\.\d", pg.text_content("#tps"))
    assert pg.text_content("#state") == "Done: 30 tokens, finish reason “length”."
    # The page closed the stream on [DONE]: no reconnect, one request for the stream.
    assert pg.evaluate("window.greenserve.source.readyState") == 2
    assert [u for u in watch.urls if "/v1/completions" in u] == [
        server.url + "/v1/completions?model=bigram&prompt=ROMEO%3A&max_tokens=30&temperature=0.8"
        f"&seed=11&api_key={KEY}"
    ]
    check_page(pg, watch, server)
    screenshot(pg, "demo.png")
    pg.set_viewport_size(NARROW)
    check_page(pg, watch, server)
    screenshot(pg, "demo-narrow.png")
    pg.emulate_media(color_scheme="dark")
    check_page(pg, watch, server)  # the dark theme is legible too


# The number of lines each meter's value takes: its height over its line height (rounded, as a
# fractional line height such as 1.9rem renders in whole device pixels).
METER_LINES = """() => Object.fromEntries([...document.querySelectorAll(".meters dd")].map((dd) => [
  dd.id, Math.round(dd.getBoundingClientRect().height / parseFloat(getComputedStyle(dd).lineHeight)),
]))"""


@pytest.mark.parametrize("width", [1200, 1280, 900, 390])
def test_every_meter_stays_on_one_line(server, page, width):
    pg, _ = page
    pg.set_viewport_size({"width": width, "height": 900})
    pg.goto(server.url + "/")
    fill_request(pg, 12, 4)
    pg.click("#generate")
    pg.wait_for_selector('#demo[data-state="done"]')
    assert re.fullmatch(r"\d+\.\d", pg.text_content("#tps"))
    assert pg.evaluate(METER_LINES) == {"ttft": 1, "tps": 1, "tokens": 1, "seed-used": 1}
    # The widest values the meters show: a fast server's speed, a slow first token, a long run.
    pg.evaluate("""() => {
      document.getElementById("tps").textContent = "99999.9";
      document.getElementById("ttft").textContent = "999.99 s";
      document.getElementById("tokens").textContent = "4096";
    }""")
    assert pg.evaluate(METER_LINES) == {"ttft": 1, "tps": 1, "tokens": 1, "seed-used": 1}
    assert pg.text_content(".meters div:has(#tps) dt") == "Tokens/s"


def test_stop_closes_the_stream_and_frees_the_slot(server, page):
    pg, watch = page
    pg.goto(server.url + "/")
    fill_request(pg, 4096, 3)  # about 200 s of tokens at the injected pace
    pg.click("#generate")
    pg.wait_for_function("() => document.getElementById('completion').textContent.length >= 5")
    stop_running(pg, server, "#completion", SLOW_STEP_S)
    assert pg.is_enabled("#generate") and not pg.is_enabled("#stop")
    assert watch.errors == []


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("wrong", "401: Invalid API key."),
        (
            "",
            "401: Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
        ),
    ],
)
def test_a_refused_stream_shows_the_servers_message(server, page, key, message):
    pg, _ = page
    pg.goto(server.url + "/")
    assert pg.get_attribute("#api_key", "required") is not None  # this server requires a key
    fill_request(pg, 5, 1, key)
    pg.evaluate("document.getElementById('api_key').required = false")  # submit it anyway
    pg.click("#generate")
    pg.wait_for_selector('#demo[data-state="error"]')
    pg.wait_for_selector("#error:not([hidden])")
    assert pg.text_content("#error") == message
    assert pg.text_content("#state") == "The server refused the request."
    assert pg.evaluate("window.greenserve.source.readyState") == 2


def test_status_page_draws_the_charts(server, page):
    pg, watch = page
    for seed in range(4):
        body = {"model": "bigram", "prompt": "KING:", "max_tokens": 4, "seed": seed}
        assert server.complete(body, headers=bearer())[0] == 200
    assert server.complete({"model": "bigram"}, headers=bearer())[0] == 400
    assert server.complete({"model": "bigram", "prompt": "x"})[0] == 401

    pg.goto(server.url + "/status")
    pg.wait_for_function("() => Number(document.getElementById('status').dataset.updates) >= 1")
    history = json.loads(server.get("/stats/history")[2])
    stats = json.loads(server.get("/stats")[2])
    minutes = history["minutes"]
    requests = sum(m["requests"] for m in minutes)
    failed = sum(m["failed"] for m in minutes)
    generated = sum(m["completion_tokens"] for m in minutes)
    prompt = sum(m["prompt_tokens"] for m in minutes)

    def marks(chart: str) -> int:
        return pg.locator(f"#chart-{chart} .mark").count()

    assert 1 <= marks("requests") <= 2 * len([m for m in minutes if m["requests"]])
    assert 1 <= marks("tokens") <= 2 * len([m for m in minutes if m["completion_tokens"]])
    ttft_points = sum(
        (m["ttft_p50_s"] is not None) + (m["ttft_p95_s"] is not None) for m in minutes
    )
    assert marks("ttft") == ttft_points >= 1
    assert marks("latency") == 12  # p50, p90 and p99 of TTFT, inter-token, end-to-end, queue wait
    assert marks("statuses") == len(stats["totals"]["by_status"])
    assert {"200", "400", "401"} <= set(stats["totals"]["by_status"])
    labels = check_page(pg, watch, server)
    assert labels["charts"][:2] == [
        f"Requests per minute over the last 60 minutes: {requests} requests, {failed} failed.",
        f"Tokens per minute over the last 60 minutes: {generated} generated, {prompt} prompt tokens.",
    ]
    assert "objective 500 ms" in pg.text_content("#chart-ttft")
    assert pg.text_content("#tile-budget .value") == "100%"
    assert "within 0.5 s (SLO_TTFT_S)" in pg.text_content("#objective")
    # One model, one variant: its row shows /stats' "models" (the 401 picked no model: not in it).
    row = stats["models"]["bigram"]["primary"]
    assert list(stats["models"]) == ["bigram"] and list(stats["models"]["bigram"]) == ["primary"]
    assert pg.locator("#models tr").count() == 1
    cells = pg.locator("#models tr td").all_text_contents()
    assert cells[:4] == ["bigram", "primary", str(row["requests"]), "0"]
    assert cells[4] == str(row["generation_tokens"]) and cells[5].endswith("s")
    assert row["requests"] == stats["totals"]["requests"] - stats["totals"]["by_status"]["401"]
    # No shadow variant on this server: its table stays hidden and empty.
    assert stats["shadows"] == {}
    assert pg.is_hidden("#shadows-card") and pg.locator("#shadows tr").count() == 0
    assert pg.locator("#workers tr").count() == 1
    assert pg.text_content("#workers tr td:nth-child(2)") == "ready"
    screenshot(pg, "status.png")
    pg.set_viewport_size(NARROW)
    pg.wait_for_timeout(200)  # the charts are redrawn at the new width
    check_page(pg, watch, server)
    screenshot(pg, "status-narrow.png")
    pg.set_viewport_size(WIDE)
    pg.emulate_media(color_scheme="dark")
    pg.wait_for_timeout(200)
    check_page(pg, watch, server)
    screenshot(pg, "status-dark.png")


def mirrored(srv: GunicornServer) -> int:
    """The requests ``srv`` mirrored to ``twin``'s shadow ``copy`` whose outcome is counted."""
    shadows = json.loads(srv.get("/stats")[2])["shadows"]
    return shadows.get("twin", {}).get("copy", {}).get("mirrored", 0)


def test_status_page_shows_the_shadows(shadowed, page):
    pg, watch = page
    for n in (1, 2):
        body = {"model": "twin", "prompt": "x", "max_tokens": 6, "seed": n}
        assert shadowed.complete(body)[0] == 200
        # Each mirrored request's outcome is counted before the next request (which would
        # otherwise preempt a shadow still running).
        wait_until(lambda n=n: mirrored(shadowed) == n, what=f"{n} mirrored requests counted")
    pg.goto(shadowed.url + "/status")
    pg.wait_for_function("() => Number(document.getElementById('status').dataset.updates) >= 1")
    assert pg.is_visible("#shadows-card")
    assert pg.locator("#shadows tr td").all_text_contents() == [
        "twin",
        "copy",
        "2",
        "2",
        "0",
        "0",
        "100%",
    ]
    pg.set_viewport_size(NARROW)
    check_page(pg, watch, shadowed)
    # At phone width the table fits without scrolling: the exact, diverged and dropped counts are
    # hidden, the mirrored ones and their exact share stay.
    assert pg.locator("#shadows tr td:visible").all_text_contents() == ["twin", "copy", "2", "100%"]
    wrap = "document.querySelector('#shadows-card .table-wrap')"
    assert pg.evaluate(f"{wrap}.scrollWidth <= {wrap}.clientWidth")
    screenshot(pg, "status-shadows-narrow.png")
