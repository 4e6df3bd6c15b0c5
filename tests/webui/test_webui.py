"""The web UI in a real browser on a real server: streaming, stop, edit as rollback, regenerate as a branch,
snapshots, reload, restart, API keys, layout, and model output that tries to run script.

Set STATELM_SCREENSHOTS to a directory to save screenshots of the main states there (docs/webui.md's come so).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.webui.conftest import KEY, Server, missing_requirement

pytestmark = pytest.mark.skipif(missing_requirement() is not None, reason=str(missing_requirement()))

COMPOSER = "textarea[aria-label=message]"
STREAMING_TEXT = ".message.assistant.streaming .markdown > *"  # a reply's first tokens, still coming
SCREENSHOTS = os.environ.get("STATELM_SCREENSHOTS")


def screenshot(page: Any, name: str) -> None:
    """Save a screenshot of the page when STATELM_SCREENSHOTS names a directory."""
    if SCREENSHOTS:
        page.screenshot(path=str(Path(SCREENSHOTS) / f"webui-{name}.png"))


def conversation(api: httpx.Client, title: str, messages: list[dict[str, str]], **settings: Any) -> str:
    """A conversation made through the API (as an import would make it); its session id."""
    metadata = {"title": title, "settings": json.dumps(settings)}
    answer = api.post("/v1/sessions", json={"messages": messages, "metadata": metadata})
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def show(page: Any, title: str) -> None:
    """Reload the page and open the conversation with that title."""
    page.reload()
    page.get_by_role("button", name=title, exact=True).click()
    page.locator(".message").first.wait_for()


def send(page: Any, text: str) -> None:
    """Type a message, send it with Enter, and wait for the whole reply (its figures)."""
    replies = page.locator(".figures").count()
    page.fill(COMPOSER, text)
    page.press(COMPOSER, "Enter")
    page.locator(".figures").nth(replies).wait_for()


def history(api: httpx.Client, session_id: str) -> list[dict[str, Any]]:
    """A session's transcript."""
    return api.get(f"/v1/sessions/{session_id}/history").json()["messages"]


def test_a_reply_streams_with_its_figures_and_nothing_leaves_the_server(
    page: Any, server: Server, api: httpx.Client
) -> None:
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.fill(COMPOSER, "What is the capital of France? Show it in a Python code block.")
    page.press(COMPOSER, "Enter")
    page.locator(STREAMING_TEXT).first.wait_for()
    figures = page.locator(".figures")
    figures.wait_for()
    assert page.locator(".message.assistant.streaming").count() == 0
    assert "tok/s" in figures.inner_text() and "cached" in figures.inner_text()
    screenshot(page, "chat")
    (session,) = api.get("/v1/sessions").json()["data"]
    assert session["metadata"]["title"].startswith("What is the capital of France?")
    messages = history(api, session["id"])
    assert [message["role"] for message in messages] == ["user", "assistant"]
    code = page.locator(".message.assistant .markdown .code")
    assert code.count() >= 1 and code.first.get_by_role("button", name="Copy").is_visible()
    assert code.first.locator("code").inner_text().strip() in messages[1]["content"]
    assert code.first.locator("[class^='hljs-']").count() > 0  # highlighted
    assert requests and all(url.startswith(server.url) for url in requests), requests


def test_a_reply_that_quotes_the_message_shows_its_drafted_tokens(page: Any, api: httpx.Client) -> None:
    conversation(api, "Quote", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    show(page, "Quote")
    sentence = "The paged KV cache keeps every block of a session resident between turns, so a follow-up is cheap."
    send(page, f"Repeat this sentence exactly: {sentence}")
    figures = page.locator(".figures").last.inner_text()
    assert " drafted)" in figures, figures  # "N generated (M drafted)": prompt lookup's verified drafts


def test_stop_cancels_the_generation_on_the_server(page: Any, api: httpx.Client) -> None:
    question = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    session_id = conversation(api, "Endless", question, ignore_eos=True, max_tokens=4000)
    show(page, "Endless")
    page.fill(COMPOSER, "Tell me a very long story.")
    page.press(COMPOSER, "Enter")
    page.locator(STREAMING_TEXT).first.wait_for()
    page.keyboard.press("Escape")
    page.get_by_text("Stopped: this turn was not kept").wait_for()
    assert page.input_value(COMPOSER) == "Tell me a very long story."  # given back to send again
    deadline = time.monotonic() + 30
    while "statelm_requests_running 0.0" not in api.get("/metrics").text:  # the generation was cancelled
        assert time.monotonic() < deadline, "the generation still runs after the stop"
        time.sleep(0.2)
    assert history(api, session_id) == question
    assert api.get(f"/v1/sessions/{session_id}").json()["state"] != "busy"


def test_editing_an_earlier_message_rolls_the_session_back(page: Any, api: httpx.Client) -> None:
    messages = [
        {"role": "user", "content": "What is the capital of Spain?"},
        {"role": "assistant", "content": "Madrid."},
        {"role": "user", "content": "And of Portugal?"},
        {"role": "assistant", "content": "Lisbon."},
    ]
    session_id = conversation(api, "Capitals", messages)
    show(page, "Capitals")
    page.locator(".message.user").first.get_by_role("button", name="Edit").click()
    page.fill("textarea[aria-label='edited message']", "What is the capital of Italy?")
    page.get_by_role("button", name="Send edit").click()
    page.locator(".figures").wait_for()
    transcript = history(api, session_id)
    assert [message.get("content") for message in transcript][:1] == ["What is the capital of Italy?"]
    assert [message["role"] for message in transcript] == ["user", "assistant"]  # Spain and Portugal are gone
    assert page.locator(".message").count() == 2


def test_regenerate_keeps_the_earlier_answer_in_a_branch(page: Any, api: httpx.Client) -> None:
    question = {"role": "user", "content": "What is the capital of Germany?"}
    first_id = conversation(api, "Germany", [question, {"role": "assistant", "content": "The earlier answer."}])
    show(page, "Germany")
    page.get_by_role("button", name="Regenerate").click()
    page.locator(".figures").wait_for()
    assert page.locator(".branch-count").inner_text() == "2/2"
    sessions = api.get("/v1/sessions").json()["data"]
    assert len(sessions) == 2
    (fork,) = [session for session in sessions if session["id"] != first_id]
    assert fork["metadata"]["conversation"] == first_id
    assert history(api, first_id)[1]["content"] == "The earlier answer."
    new_answer = history(api, fork["id"])[1]["content"]
    assert new_answer != "The earlier answer." and history(api, fork["id"])[0] == question
    screenshot(page, "branches")
    page.get_by_role("button", name="previous answer").click()
    assert page.locator(".message.assistant").inner_text().startswith("The earlier answer.")
    assert page.locator(".branch-count").inner_text() == "1/2"
    page.reload()  # the page remembers the branch shown, and the server has both
    assert page.locator(".branch-count").inner_text() == "1/2"
    assert page.locator(".message.assistant").inner_text().startswith("The earlier answer.")
    page.get_by_role("button", name="next answer").click()
    assert page.locator(".message.assistant .markdown").inner_text().strip() == new_answer.strip()


def test_a_snapshot_is_saved_and_loaded_into_a_new_conversation(page: Any, api: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Remember the number 42."}, {"role": "assistant", "content": "Noted: 42."}]
    session_id = conversation(api, "Numbers", messages)
    show(page, "Numbers")
    page.get_by_role("button", name="Save snapshot").click()
    page.get_by_label("Title").fill("forty-two")
    page.get_by_role("button", name="Save", exact=True).click()
    snapshot = page.locator(".snapshots li", has_text="forty-two")
    snapshot.wait_for()
    (saved,) = api.get("/v1/snapshots").json()["data"]
    assert saved["title"] == "forty-two" and saved["session_id"] == session_id
    page.reload()  # the listing comes from the server
    page.locator(".snapshots li", has_text="forty-two").get_by_role("button", name="Load").click()
    page.locator("h1", has_text="forty-two").wait_for()
    loaded = [session for session in api.get("/v1/sessions").json()["data"] if session["id"] != session_id]
    assert len(loaded) == 1 and loaded[0]["metadata"]["title"] == "forty-two"
    assert history(api, loaded[0]["id"]) == messages
    assert page.locator(".message.assistant").inner_text().startswith("Noted: 42.")
    screenshot(page, "snapshots")
    page.get_by_role("button", name="delete snapshot forty-two").click()
    page.locator(".snapshots li", has_text="forty-two").wait_for(state="detached")
    assert api.get("/v1/snapshots").json()["data"] == []


def test_a_conversation_is_exported_and_imported_as_json(page: Any, api: httpx.Client, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Pack this."}, {"role": "assistant", "content": "Packed **well**."}]
    conversation(api, "Luggage", messages, temperature=0.5)
    show(page, "Luggage")
    with page.expect_download() as download:
        page.get_by_role("button", name="Export").click()
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["format"] == "statelm-conversation" and exported["messages"] == messages
    assert exported["title"] == "Luggage" and exported["settings"] == {"temperature": 0.5}
    (tmp_path / "luggage.json").write_text(json.dumps({**exported, "title": "Unpacked"}))
    page.locator("input[type=file]").set_input_files(str(tmp_path / "luggage.json"))
    page.locator("h1", has_text="Unpacked").wait_for()
    (imported,) = [
        entry for entry in api.get("/v1/sessions").json()["data"] if entry["metadata"]["title"] == "Unpacked"
    ]
    assert history(api, imported["id"]) == messages
    assert page.locator(".message.assistant strong").inner_text() == "well"


def test_model_output_never_runs_script(page: Any, api: httpx.Client) -> None:
    reply = "\n".join(
        [
            "Inline <script>window.__xss = 'script'</script> and <img src=x onerror=\"window.__xss = 'img'\">.",
            "",
            "[a link](javascript:window.__xss='link') and <a href=\"javascript:window.__xss='raw'\">raw</a>",
            "",
            "<iframe src=\"javascript:window.__xss='iframe'\"></iframe>",
            "<svg onload=\"window.__xss='svg'\"><script>window.__xss='svg-script'</script></svg>",
            "<details open ontoggle=\"window.__xss='toggle'\">x</details>",
            "",
            "```html",
            "</code></pre><script>window.__xss='code'</script>",
            "```",
        ]
    )
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    conversation(api, "Hostile", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}])
    show(page, "Hostile")
    markdown = page.locator(".message.assistant .markdown")
    for link in markdown.locator("a").all():
        assert not (link.get_attribute("href") or "").lower().startswith("javascript:")
        link.click(modifiers=["Control"])  # whatever is left of the links, following them runs nothing
    hostile = "script, iframe, img, svg, object, embed, [onerror], [onload], [ontoggle], [href^='javascript:' i]"
    assert markdown.locator(hostile).count() == 0
    text = markdown.inner_text()
    assert "<script>window.__xss = 'script'</script>" in text and "<iframe" in text  # raw HTML is shown as text
    assert page.evaluate("window.__xss") is None and not dialogs


def test_the_page_asks_for_a_key_and_refuses_a_wrong_one(browser: Any, server: Server) -> None:
    context = browser.new_context()
    context.set_default_timeout(60_000)
    page = context.new_page()
    page.goto(server.url)
    dialog = page.get_by_role("dialog", name="API key")
    dialog.wait_for()
    page.get_by_label("This server needs an API key").fill("wrong-key")
    page.get_by_role("button", name="Use key").click()
    page.get_by_role("alert").get_by_text("The server refused this API key.").wait_for()
    screenshot(page, "api-key")
    assert page.evaluate("localStorage.getItem('statelm.key')") is None
    page.get_by_label("This server needs an API key").fill(KEY)
    page.get_by_role("button", name="Use key").click()
    dialog.wait_for(state="detached")
    page.reload()  # asked once: the browser keeps it
    page.locator(COMPOSER).wait_for()
    assert page.get_by_role("dialog").count() == 0
    context.close()


def test_phone_width_and_dark_scheme(browser: Any, server: Server, api: httpx.Client) -> None:
    conversation(api, "On the go", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "**Hello!**"}])
    phone = {"viewport": {"width": 390, "height": 760}, "color_scheme": "dark", "reduced_motion": "reduce"}
    context = browser.new_context(**phone)
    context.add_init_script(f"localStorage.setItem('statelm.key', JSON.stringify({KEY!r}))")
    page = context.new_page()
    page.goto(server.url)
    page.locator(COMPOSER).wait_for()
    assert page.evaluate("getComputedStyle(document.documentElement).backgroundColor") == "rgb(23, 25, 29)"
    sidebar = page.locator(".sidebar")
    assert not sidebar.is_visible() or sidebar.bounding_box()["x"] < 0  # folded away at phone width
    page.get_by_role("button", name="conversations").click()
    page.get_by_role("button", name="On the go", exact=True).click()
    page.locator(".message.assistant").wait_for()
    assert sidebar.bounding_box()["x"] < 0  # folded again once a conversation is chosen
    assert page.locator(".composer").bounding_box()["width"] <= 390
    screenshot(page, "phone-dark")
    context.close()


def test_a_restarted_server_resumes_the_conversations_and_the_page_keeps_its_state(
    page: Any, server: Server, api: httpx.Client
) -> None:
    send(page, "What is the capital of France?")
    server.stop()
    page.fill(COMPOSER, "And of Italy?")
    page.press(COMPOSER, "Enter")
    page.get_by_text("The server cannot be reached; reconnecting").wait_for()
    assert page.input_value(COMPOSER) == "And of Italy?"
    screenshot(page, "reconnecting")
    server.start()
    page.get_by_text("The server cannot be reached; reconnecting").wait_for(state="detached")
    assert page.locator(".message.user").first.inner_text().startswith("What is the capital of France?")
    assert page.input_value(COMPOSER) == "And of Italy?"
    page.press(COMPOSER, "Enter")
    page.locator(".figures").nth(1).wait_for()
    (session,) = api.get("/v1/sessions").json()["data"]
    assert [message["content"] for message in history(api, session["id"]) if message["role"] == "user"] == [
        "What is the capital of France?",
        "And of Italy?",
    ]
