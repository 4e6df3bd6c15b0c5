"""The web UI's routes in-process on the tiny model: its files are public and carry a strict CSP, the API keeps its
keys, `--no-webui` turns the page off, and a server whose UI is not built says how to build it.

The page itself is driven in a browser by tests/webui.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from statelm.server import launch, webui
from tests.http.conftest import serve_in_process, tiny_args


@pytest.fixture
def dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A built UI of two files, served in place of the package's."""
    (tmp_path / "dist" / "assets").mkdir(parents=True)
    (tmp_path / "dist" / "index.html").write_text('<script type="module" src="/webui/assets/app-1.js"></script>')
    (tmp_path / "dist" / "assets" / "app-1.js").write_text("console.log('statelm');\n" * 100)
    monkeypatch.setattr(launch, "DIST", tmp_path / "dist")
    return tmp_path / "dist"


def test_page_and_assets_are_public_with_security_headers(tiny_model: Path, tmp_path: Path, dist: Path) -> None:
    with serve_in_process(tiny_args(tiny_model, tmp_path / "state", "--api-key", "k")) as server, server.http() as http:
        page = http.get("/")
        assert page.status_code == 200 and page.text == (dist / "index.html").read_text()
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "unsafe-inline" not in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-cache"
        asset = http.get("/webui/assets/app-1.js", headers={"Accept-Encoding": "gzip"})
        assert asset.status_code == 200 and asset.headers["content-encoding"] == "gzip"
        assert asset.headers["content-security-policy"] == webui.CONTENT_SECURITY_POLICY
        assert "immutable" in asset.headers["cache-control"]
        assert http.get("/webui/assets/missing.js").status_code == 404
        assert http.get("/v1/sessions").status_code == 401  # the API still needs the key
        assert "/" not in http.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()["paths"]


def test_no_webui_leaves_the_root_unrouted(tiny_model: Path, tmp_path: Path, dist: Path) -> None:
    with serve_in_process(tiny_args(tiny_model, tmp_path / "state", "--no-webui")) as server, server.http() as http:
        assert http.get("/").status_code == 404
        assert http.get("/webui/assets/app-1.js").status_code == 404
    keyed = tiny_args(tiny_model, tmp_path / "state", "--no-webui", "--api-key", "k")
    with serve_in_process(keyed) as server, server.http() as http:
        assert http.get("/").status_code == 401


def test_an_unbuilt_ui_says_how_to_build_it(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "DIST", tmp_path / "absent")
    with serve_in_process(tiny_args(tiny_model, tmp_path / "state")) as server, server.http() as http:
        page = http.get("/")
        assert page.status_code == 404 and page.text == webui.NOT_BUILT and "make webui" in page.text
        assert http.get("/health").status_code == 200
