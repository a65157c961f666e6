"""The pages (``/``, ``/status``) and their assets as HTTP answers: types, the same-origin policy, API keys,
``PAGES=0``, and package data that ships every file. The browser side is ``test_pages_browser.py``."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import tomllib
from pathlib import Path

import pytest

from tests.modelfiles import BIGRAM_CONFIG, succ_weight, write_model_dir
from wsgi_app import create_app
from wsgi_app.http.routes import pages
from wsgi_app.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "wsgi_app"
PAGE_FILES = sorted(
    p.relative_to(PACKAGE).as_posix()
    for d in ("templates", "assets")
    for p in (PACKAGE / d).rglob("*")
    if p.is_file()
)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


def client(succ_dir: Path, tmp_path: Path, **env: str):
    settings = Settings.from_env(
        {"MODEL_DIR": str(succ_dir), "STATS_DB": str(tmp_path / "s"), **env}
    )
    return create_app(settings).test_client()


def test_settings_pages_switch():
    assert Settings.from_env({}).pages is True
    assert Settings.from_env({"PAGES": "1"}).pages is True
    assert Settings.from_env({"PAGES": "0"}).pages is False
    for bad in ("2", "yes", "off"):
        with pytest.raises(ValueError, match="PAGES"):
            Settings.from_env({"PAGES": bad})


def test_pages_are_html_under_a_same_origin_policy(succ_dir, tmp_path):
    c = client(succ_dir, tmp_path)
    for path, marker in (("/", '<label for="prompt">Prompt</label>'), ("/status", "Server status")):
        r = c.get(path)
        assert r.status_code == 200
        assert r.headers["Content-Type"] == "text/html; charset=utf-8"
        assert r.headers["Content-Security-Policy"] == CSP
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["Cache-Control"] == "no-cache"
        html = r.get_data(as_text=True)
        assert html.startswith('<!doctype html>\n<html lang="en">')
        assert marker in html
        assert f"version <code>{r.headers['X-Model-Version']}</code>" in html


def test_demo_page_carries_the_model_and_the_limits(succ_dir, tmp_path):
    html = client(succ_dir, tmp_path).get("/").get_data(as_text=True)
    assert f'data-model="{succ_dir.name}"' in html
    assert 'maxlength="2000"' in html and 'max="4096"' in html
    assert '<script type="module" src="/assets/demo.js"></script>' in html
    assert "(optional)" in html and " required>" not in html.split('id="api_key"')[1][:200]


def test_demo_page_asks_for_a_key_when_the_server_requires_one(succ_dir, tmp_path):
    c = client(succ_dir, tmp_path, API_KEYS="k1,k2")
    # Pages and assets stay open; only /v1/ needs the key.
    assert [c.get(p).status_code for p in ("/", "/status", "/assets/demo.js")] == [200, 200, 200]
    assert c.get("/v1/models").status_code == 401
    html = c.get("/").get_data(as_text=True)
    field = html.split('id="api_key"')[1].split(">")[0]
    assert "(this server requires one)" in html and field.endswith(" required")


def test_status_page_states_the_objective(succ_dir, tmp_path):
    html = client(succ_dir, tmp_path, SLO_TTFT_S="0.25", SLO_TARGET="0.995").get("/status")
    text = re.sub(r"\s+", " ", html.get_data(as_text=True))
    assert (
        "Objective: 99.5% of requests answered without a server error and with a first token "
        "within 0.25 s (<code>SLO_TTFT_S</code>), over 7 days." in text
    )
    assert 'data-refresh-s="5"' in text
    # The per-model table status.js fills from /stats' "models".
    assert (
        '<thead><tr><th scope="col">Model</th><th scope="col">Variant</th>'
        '<th scope="col">Requests</th><th scope="col">Failed</th>' in text
    )
    assert '<tbody id="models"><tr><td colspan="7">—</td></tr></tbody>' in text
    # The shadows' table, hidden until /stats has a shadow (tests/test_pages_browser.py fills it).
    assert (
        '<section class="card chart" aria-labelledby="h-shadows" id="shadows-card" hidden>' in text
    )
    assert (
        '<th scope="col">Model</th><th scope="col">Shadow</th><th scope="col">Mirrored</th>'
        '<th scope="col" class="wide-only">Exact</th><th scope="col" class="wide-only">Diverged</th>'
        '<th scope="col" class="wide-only">Dropped</th><th scope="col">Exact %</th></tr></thead> '
        '<tbody id="shadows"></tbody>' in text
    )


def test_model_names_are_escaped(tmp_path):
    model = write_model_dir(
        tmp_path / "m", succ_weight(), {**BIGRAM_CONFIG, "name": '<b x="1">&</b>'}
    )
    settings = Settings.from_env({"MODEL_DIR": str(model), "STATS_DB": str(tmp_path / "s")})
    html = create_app(settings).test_client().get("/").get_data(as_text=True)
    assert 'data-model="&lt;b x=&#34;1&#34;&gt;&amp;&lt;/b&gt;"' in html
    assert "<b x=" not in html


@pytest.mark.parametrize("name", sorted(pages.ASSETS))
def test_assets_are_served_with_their_type_and_revalidated(succ_dir, tmp_path, name):
    c = client(succ_dir, tmp_path)
    r = c.get(f"/assets/{name}")
    body = (PACKAGE / "assets" / name).read_bytes()
    assert r.status_code == 200 and r.data == body
    assert r.headers["Content-Type"] == pages.ASSETS[name]
    assert r.headers["Cache-Control"] == "no-cache"
    etag = f'"{hashlib.sha256(body).hexdigest()[:32]}"'
    assert r.headers["ETag"] == etag
    again = c.get(f"/assets/{name}", headers={"If-None-Match": etag})
    assert (again.status_code, again.data) == (304, b"")


def test_unknown_assets_are_404_envelopes(succ_dir, tmp_path):
    c = client(succ_dir, tmp_path)
    for path in ("/assets/nope.js", "/assets/..%2Fopenapi.json", "/assets/", "/assets/layout.html"):
        r = c.get(path)
        assert r.status_code == 404, path
        assert r.json["error"]["type"] == "not_found_error"


def test_pages_off_is_404_everywhere(succ_dir, tmp_path):
    c = client(succ_dir, tmp_path, PAGES="0")
    for path in ("/", "/status", "/assets/pages.css"):
        r = c.get(path)
        assert r.status_code == 404
        assert r.json == {
            "error": {
                "message": "Not found: no such route.",
                "type": "not_found_error",
                "param": None,
                "code": None,
            }
        }
    assert c.get("/stats/history").status_code == 200  # the data the status page reads stays


def test_every_asset_file_is_listed_and_loaded_from_this_server_only():
    on_disk = {p.removeprefix("assets/") for p in PAGE_FILES if p.startswith("assets/")}
    assert on_disk == set(pages.ASSETS)
    for rel in PAGE_FILES:
        text = (PACKAGE / rel).read_text("utf-8")
        # The only absolute URL is the SVG namespace name, which is never fetched.
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"'`)]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (rel, urls)
        assert "@import" not in text and "url(" not in text, rel


def test_package_data_ships_every_page_file():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["wsgi_app"]
    missing = [f for f in PAGE_FILES if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert PAGE_FILES and missing == []


def test_routes_are_in_the_openapi_document():
    doc = json.loads((PACKAGE / "openapi.json").read_text())
    assert {p: sorted(doc["paths"][p]) for p in ("/", "/status", "/assets/{name}")} == {
        "/": ["get"],
        "/status": ["get"],
        "/assets/{name}": ["get"],
    }
    (param,) = doc["paths"]["/assets/{name}"]["get"]["parameters"]
    assert param["schema"]["enum"] == list(pages.ASSETS)
