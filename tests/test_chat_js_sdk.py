"""The official openai JavaScript SDK streams a chat answer from a page on another origin, in Chromium.

The SDK comes from the npm registry (``tests/js/package.json`` and its lock file pin it; ``.ci/run``
runs ``npm ci`` there) and is bundled by esbuild into one browser file at test time. A second loopback
server (another port, so another origin) serves that file and an empty page; greenserve runs with
``CORS_ORIGINS`` naming that origin and an API key, so the SDK's ``fetch`` needs a CORS preflight for
its ``Authorization``, ``Content-Type`` and ``x-stainless-*`` headers. The streamed text must equal, byte
for byte, the same request made from Python with the official ``openai`` client. The same page on a
third origin (``localhost`` instead of ``127.0.0.1``) is refused by the browser.

Source: WHATWG Fetch Standard §3.2 (CORS protocol); OpenAI API reference, "Chat Completions" (streaming).
"""

from __future__ import annotations

import functools
import http.server
import json
import subprocess
import threading
from collections.abc import Iterator

import openai
import pytest

from tests.browser import needs_chromium
from tests.server import ROOT, GunicornServer

JS_DIR = ROOT / "tests" / "js"
ESBUILD = JS_DIR / "node_modules" / ".bin" / "esbuild"
KEY = "sdk-key-1"
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Name a colour."},
]
REQUEST = {"model": "bigram", "messages": MESSAGES, "max_tokens": 40, "temperature": 0.9, "seed": 7}

pytestmark = [
    pytest.mark.browser,
    needs_chromium,
    pytest.mark.skipif(
        not ESBUILD.exists(), reason="tests/js has no node_modules: run `npm ci --prefix tests/js`"
    ),
]

# Stream one chat completion with the SDK from the page; return the text and what came with it.
STREAM = """async ({ baseURL, apiKey, request }) => {
  const { OpenAI } = await import("/openai.js");
  const client = new OpenAI({ baseURL, apiKey, dangerouslyAllowBrowser: true, maxRetries: 0 });
  try {
    const stream = await client.chat.completions.create(
      { ...request, stream: true },
      { timeout: 60_000 },
    );
    let text = "";
    const ids = new Set();
    let finish = null;
    let chunks = 0;
    for await (const chunk of stream) {
      chunks += 1;
      ids.add(chunk.id);
      const choice = chunk.choices[0];
      text += choice.delta.content ?? "";
      finish = choice.finish_reason ?? finish;
    }
    return { text, ids: [...ids], finish, chunks };
  } catch (err) {
    return { error: err.constructor.name, message: err.message };
  }
}"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the stdlib's name)
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Serve the bundled SDK and an empty page from a static server on a loopback port; yield it."""
    root = tmp_path_factory.mktemp("sdk-site")
    subprocess.run(
        [
            str(ESBUILD),
            "sdk.js",
            "--bundle",
            "--format=esm",
            "--platform=browser",
            f"--outfile={root / 'openai.js'}",
            "--log-level=warning",
        ],
        cwd=JS_DIR,
        check=True,
        timeout=120,
    )
    # An empty page; its icon is inline, so the browser asks this server for nothing else.
    (root / "index.html").write_text(
        '<!doctype html><html lang="en"><title>sdk</title><link rel="icon" href="data:,"></html>\n'
    )
    handler = functools.partial(_QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def server(site: int, serve_module) -> GunicornServer:
    return serve_module(CORS_ORIGINS=f"http://127.0.0.1:{site}", API_KEYS=KEY)


def python_answer(server: GunicornServer) -> tuple[str, str | None, int]:
    """Stream the same request with the official Python client; return (text, finish reason, chunks)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    text, finish, chunks = "", None, 0
    for chunk in client.chat.completions.create(**REQUEST, stream=True):
        chunks += 1
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, finish, chunks


def test_the_js_sdk_streams_a_chat_answer_cross_origin(server, site, page):
    pg, watch = page
    posts: list[dict[str, str]] = []
    pg.on("request", lambda r: posts.append(r.headers) if r.method == "POST" else None)
    pg.goto(f"http://127.0.0.1:{site}/index.html")
    args = {"baseURL": server.url + "/v1", "apiKey": KEY, "request": REQUEST}
    got = pg.evaluate(STREAM, args)

    text, finish, chunks = python_answer(server)
    assert "error" not in got, got
    assert got["text"].encode() == text.encode() and len(text) > 0
    assert (got["finish"], got["chunks"]) == (finish, chunks)
    assert len(got["ids"]) == 1 and got["ids"][0].startswith("chatcmpl-")
    # The browser sent the POST with the SDK's headers: the preflight let them through.
    assert len(posts) == 1
    assert posts[0]["authorization"] == f"Bearer {KEY}"
    assert sorted(h for h in posts[0] if h.startswith("x-")) == [
        "x-stainless-arch",
        "x-stainless-lang",
        "x-stainless-os",
        "x-stainless-package-version",
        "x-stainless-retry-count",
        "x-stainless-runtime",
        "x-stainless-runtime-version",
        "x-stainless-timeout",  # sent when a request carries its own timeout
    ]
    assert watch.errors == []


def test_a_page_from_another_origin_is_refused(server, site, page):
    pg, watch = page
    chats_before = chat_requests(server)
    pg.goto(f"http://localhost:{site}/index.html")  # same files, another origin
    args = {"baseURL": server.url + "/v1", "apiKey": KEY, "request": REQUEST}
    got = pg.evaluate(STREAM, args)
    assert got["error"] == "APIConnectionError", got
    assert any("blocked by CORS policy" in e for e in watch.errors), watch.errors
    # The preflight got no CORS headers, so the POST was never sent.
    assert chat_requests(server) == chats_before


def chat_requests(server: GunicornServer) -> int:
    """Return how many chat completion requests the server has answered (``/stats``)."""
    status, _, body = server.get("/stats")
    assert status == 200, body
    return json.loads(body)["totals"]["by_endpoint"].get("chat", 0)
