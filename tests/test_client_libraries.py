"""Real clients against a real server: the official ``openai`` package, ``sseclient-py``, ``requests``
with ``iter_lines``, and the README's examples (curl, Python, browser JavaScript) run as written.

Each client's text and usage must equal what a raw HTTP client sees for the same request.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import openai
import pytest
import requests
import sseclient

from tests.readme import README, README_URL, readme_block, run_readme_python
from tests.sse import sse_json

SSE = {"Accept": "text/event-stream"}


def raw_text(server, body: dict) -> tuple[str, dict]:
    """The text and usage a plain HTTP POST gets for ``body`` (not streamed)."""
    status, _, raw = server.complete({**body, "stream": False})
    assert status == 200, raw
    doc = json.loads(raw)
    return doc["choices"][0]["text"], doc["usage"]


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


# -- openai ---------------------------------------------------------------------------------------


def test_openai_plain_equals_raw_http(default_server):
    body = {"model": "bigram", "prompt": "KING:", "max_tokens": 40, "seed": 3, "temperature": 0.8}
    done = client_for(default_server).completions.create(**body)
    text, usage = raw_text(default_server, body)
    assert len(text) > 0
    assert done.choices[0].text == text
    assert done.choices[0].finish_reason == "length"
    assert (
        (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens)
        == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
            usage["total_tokens"],
        )
        == (5, 40, 45)
    )
    assert (done.object, done.model) == ("text_completion", "bigram")


def test_openai_stream_equals_raw_http(default_server):
    body = {"model": "bigram", "prompt": "KING:", "max_tokens": 40, "seed": 3, "temperature": 0.8}
    stream = client_for(default_server).completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text, usage = raw_text(default_server, body)
    assert len(chunks) == 41  # one per token, then the usage chunk
    assert "".join(c.choices[0].text for c in chunks[:-1]) == text
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * 39 + ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump(include=set(usage)) == usage


def test_openai_bad_request_names_the_param(succ_server):
    client = client_for(succ_server)
    for kwargs, param in (
        ({"max_tokens": 5000}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"seed": -2}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model="m", prompt="a", stream=stream, **kwargs)
            err = info.value
            assert (err.status_code, err.param, err.type, err.code) == (
                400,
                param,
                "invalid_request_error",
                None,
            )
            assert len(err.request_id) == 32


def test_openai_models(succ_server, succ_dir):
    client = client_for(succ_server)
    models = client.models.list()
    assert [m.id for m in models.data] == [succ_dir.name]
    assert models.data[0].owned_by == "greenserve"
    assert client.models.retrieve(succ_dir.name).id == succ_dir.name
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.code == "model_not_found"


# -- SSE libraries ----------------------------------------------------------------------------------


def test_sseclient_reads_the_event_source_stream(succ_server):
    url = f"{succ_server.url}/v1/completions?model=m&prompt=a&max_tokens=3&temperature=0&seed=5"
    with requests.get(url, headers=SSE, stream=True, timeout=30) as resp:
        assert resp.headers["content-type"] == "text/event-stream"
        events = list(sseclient.SSEClient(resp).events())
    assert [(e.id, e.event) for e in events] == [
        ("5-0", "message"),
        ("5-1", "message"),
        ("5-2", "message"),
        ("5-done", "message"),
    ]
    assert [json.loads(e.data)["choices"][0]["text"] for e in events[:-1]] == ["b", "c", "d"]
    assert events[-1].data == "[DONE]"


def post_stream(server, body: dict) -> requests.Response:
    """POST ``body`` as a stream with requests; the response is read as it arrives."""
    url = f"{server.url}/v1/completions"
    return requests.post(url, json={**body, "stream": True}, stream=True, timeout=30)


def test_sseclient_reads_the_post_stream(default_server):
    body = {"model": "bigram", "prompt": "Is", "max_tokens": 25, "seed": 9}
    with post_stream(default_server, body) as resp:
        events = list(sseclient.SSEClient(resp).events())
    assert events[-1].data == "[DONE]" and {e.id for e in events} == {None}
    streamed = "".join(json.loads(e.data)["choices"][0]["text"] for e in events[:-1])
    assert streamed == raw_text(default_server, body)[0]


def test_requests_iter_lines(default_server):
    body = {"model": "bigram", "prompt": "Is", "max_tokens": 25, "seed": 9}
    with post_stream(default_server, body) as resp:
        lines = list(resp.iter_lines())
    data = [ln[len(b"data: ") :] for ln in lines if ln.startswith(b"data: ")]
    assert data[-1] == b"[DONE]" and len(data) == 26
    assert set(lines) - set(ln for ln in lines if ln.startswith(b"data: ")) <= {b"", b": ok"}
    streamed = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])
    assert streamed == raw_text(default_server, body)[0]


# -- the README, as written -------------------------------------------------------------------------


def test_readme_curl_line(default_server):
    command = readme_block("sh", f"curl -N {README_URL}/v1/completions")
    assert README_URL in command
    run = subprocess.run(
        ["bash", "-c", command.replace(README_URL, default_server.url)],
        capture_output=True,
        timeout=60,
        check=True,
    )
    body = json.loads(re.search(r"-d '(.*?)'", command, re.S).group(1))
    assert body["stream"] is True
    chunks = sse_json(run.stdout)
    assert len(chunks) == body["max_tokens"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == raw_text(default_server, body)[0]


def test_readme_inline_curl_event_source_line(default_server):
    (command,) = re.findall(r"`(curl -N -H 'Accept: text/event-stream' [^`]*)`", README.read_text())
    run = subprocess.run(
        ["bash", "-c", command.replace(README_URL, default_server.url)],
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert run.stdout.startswith(b"retry: 3000\n\nid: 1-0\ndata: {")
    assert run.stdout.endswith(b"id: 1-done\ndata: [DONE]\n\n")
    chunks = [json.loads(d) for d in re.findall(rb"data: ({.*})\n", run.stdout)]
    body = {"model": "bigram", "prompt": "ROMEO:", "seed": 1}
    assert "".join(c["choices"][0]["text"] for c in chunks) == raw_text(default_server, body)[0]


def test_readme_openai_example(default_server):
    run = run_readme_python("client.completions.create(", default_server.url)
    text, usage = raw_text(
        default_server, {"model": "bigram", "prompt": "ROMEO:", "max_tokens": 32, "seed": 1}
    )
    assert run.stdout == f"{text!r} {usage['completion_tokens']}\n{text!r}\n"


# A small EventSource for Node (which has none before 22): the WHATWG processing model for the parts the
# README uses (Accept and Last-Event-ID headers, data/id/retry fields, 204 ends, reconnect after `retry`).
EVENTSOURCE_SHIM = r"""
globalThis.document = { body: { append: (text) => process.stdout.write(text) } };
let connections = 0;
globalThis.EventSource = class {
  constructor(url) { this.url = url; this.lastEventId = ""; this.retry = 3000; this.closed = false;
                     this.run(); }
  close() { this.closed = true; if (this.ctrl) this.ctrl.abort(); }
  async run() {
    while (!this.closed) {
      connections++;
      this.ctrl = new AbortController();
      const headers = { Accept: "text/event-stream", "Cache-Control": "no-cache" };
      if (this.lastEventId) headers["Last-Event-ID"] = this.lastEventId;
      try {
        const res = await fetch(this.url, { headers, signal: this.ctrl.signal });
        if (res.status === 204) { this.closed = true; break; }
        if (res.status !== 200) throw new Error("status " + res.status);
        const decoder = new TextDecoder();
        let buf = "", data = [], idBuffer = this.lastEventId;
        for await (const bytes of res.body) {
          buf += decoder.decode(bytes, { stream: true });
          let nl;
          while ((nl = buf.indexOf("\n")) >= 0) {
            const line = buf.slice(0, nl); buf = buf.slice(nl + 1);
            if (line === "") {
              this.lastEventId = idBuffer;
              if (data.length && this.onmessage)
                this.onmessage({ data: data.join("\n"), lastEventId: this.lastEventId });
              data = [];
              if (this.closed) return;
            } else if (!line.startsWith(":")) {
              const colon = line.indexOf(":");
              const field = colon < 0 ? line : line.slice(0, colon);
              let value = colon < 0 ? "" : line.slice(colon + 1);
              if (value.startsWith(" ")) value = value.slice(1);
              if (field === "data") data.push(value);
              else if (field === "id") idBuffer = value;
              else if (field === "retry" && /^[0-9]+$/.test(value)) this.retry = Number(value);
            }
          }
        }
      } catch (err) { if (this.closed) return; throw err; }
      await new Promise((resolve) => setTimeout(resolve, this.retry));
    }
  }
};
process.on("exit", () => process.stderr.write(`connections=${connections}`));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_readme_event_source_example(default_server, tmp_path):
    code = readme_block("js", "new EventSource")
    script = tmp_path / "readme.mjs"
    script.write_text(EVENTSOURCE_SHIM + code.replace(README_URL, default_server.url))
    run = subprocess.run(
        ["node", str(script)], capture_output=True, text=True, timeout=60, check=True
    )
    body = {"model": "bigram", "prompt": "ROMEO:", "max_tokens": 64, "seed": 1}
    assert run.stdout == raw_text(default_server, body)[0]
    assert run.stderr == "connections=1"  # closed on [DONE]: no reconnect
