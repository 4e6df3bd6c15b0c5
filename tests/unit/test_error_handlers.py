"""The app's error handlers: an engine failure raised anywhere in a route is a 500 in the route's error shape."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from statelm.engine.client import EngineError
from statelm.server.errors import install_error_handlers


def failing_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    async def fail() -> None:
        raise EngineError("the engine stopped")

    app.add_api_route("/v1/embeddings", fail, methods=["POST"])
    app.add_api_route("/v1/messages", fail, methods=["POST"])
    return app


def test_an_engine_failure_is_a_500_in_openai_s_shape() -> None:
    response = TestClient(failing_app()).post("/v1/embeddings")
    assert response.status_code == 500
    assert response.json() == {
        "error": {"message": "the engine stopped", "type": "server_error", "param": None, "code": None}
    }


def test_an_engine_failure_on_an_anthropic_route_is_in_anthropic_s_shape() -> None:
    response = TestClient(failing_app()).post("/v1/messages")
    assert response.status_code == 500
    body = response.json()
    assert body["type"] == "error" and body["error"]["message"] == "the engine stopped"
