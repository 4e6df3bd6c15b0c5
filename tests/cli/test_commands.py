"""The non-interactive commands against a real server: chat -p, session, snapshot, docs -p, help and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.helpers import run_cli
from tests.e2e.conftest import free_port

QUESTION = "What is the capital of France?"


def ok(args: list[str], env: dict[str, str], stdin: str | None = None) -> str:
    """stdout of a command that must succeed."""
    result = run_cli(args, env, stdin)
    assert result.exit_code == 0, f"{args}: exit {result.exit_code}\n{result.output}"
    return result.stdout


def fails(args: list[str], env: dict[str, str]) -> str:
    """The one error line of a command that must fail with exit code 1."""
    result = run_cli(args, env)
    assert result.exit_code == 1, f"{args}: exit {result.exit_code}\n{result.output}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("statelm: error: "), result.stderr
    return lines[0]


def test_chat_prompt_answers_once(cli_env: dict[str, str]) -> None:
    assert "Paris" in ok(["chat", "-p", QUESTION, "--temperature", "0"], cli_env)


def test_chat_prompt_answers_sanely_at_the_default_settings(cli_env: dict[str, str]) -> None:
    """No sampling flags: the defaults statelm ships for the bundled model keep it on topic."""
    answers = [ok(["chat", "-p", QUESTION], cli_env) for _ in range(10)]
    assert all("Paris" in answer for answer in answers), answers


def test_chat_prompt_reads_stdin(cli_env: dict[str, str]) -> None:
    assert "Paris" in ok(["chat", "--temperature", "0", "--max-tokens", "20"], cli_env, stdin=QUESTION + "\n")


def test_session_commands(cli_env: dict[str, str]) -> None:
    created = json.loads(ok(["session", "new", "cli-s1", "--system", "You are terse.", "--json"], cli_env))
    assert created["id"] == "cli-s1"
    args = ["--temperature", "0", "--max-tokens", "20"]
    assert "Paris" in ok(["chat", "--session", "cli-s1", "-p", QUESTION, *args], cli_env)
    assert "cli-s1" in ok(["session", "ls"], cli_env)
    assert "cli-s1" in [s["id"] for s in json.loads(ok(["session", "ls", "--json"], cli_env))]
    shown = json.loads(ok(["session", "show", "cli-s1", "--json"], cli_env))
    assert shown["num_messages"] == 3 and shown["system"] == "You are terse."
    messages = json.loads(ok(["session", "history", "cli-s1", "--json"], cli_env))
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert "2 user: What is the capital of France?" in ok(["session", "history", "cli-s1"], cli_env)
    forked = json.loads(ok(["session", "fork", "cli-s1", "cli-s2", "--json"], cli_env))
    assert forked["id"] == "cli-s2" and forked["num_messages"] == 3
    assert json.loads(ok(["session", "rollback", "cli-s1", "1", "--json"], cli_env))["num_messages"] == 1
    assert len(json.loads(ok(["session", "history", "cli-s2", "--json"], cli_env))) == 3
    ok(["session", "rm", "cli-s1", "cli-s2"], cli_env)
    assert "does not exist" in fails(["session", "show", "cli-s1"], cli_env)


def test_snapshot_commands(cli_env: dict[str, str]) -> None:
    ok(["session", "new", "cli-snap"], cli_env)
    ok(["chat", "-s", "cli-snap", "-p", QUESTION, "--temperature", "0", "--max-tokens", "20"], cli_env)
    save = ["snapshot", "save", "cli-snap", "--title", "capital", "--tag", "geo", "--json"]
    snap = json.loads(ok(save, cli_env))
    assert snap["num_messages"] == 2 and snap["title"] == "capital"
    assert snap["id"] in [s["id"] for s in json.loads(ok(["snapshot", "ls", "--json", "--tag", "geo"], cli_env))]
    assert json.loads(ok(["snapshot", "ls", "--json", "--tag", "nope"], cli_env)) == []
    assert "capital" in ok(["snapshot", "show", snap["id"]], cli_env)
    edited = json.loads(
        ok(["snapshot", "edit", snap["id"], "--title", "", "--tag", "a", "--tag", "b", "--json"], cli_env)
    )
    assert edited["title"] is None and edited["tags"] == ["a", "b"]
    loaded = json.loads(ok(["snapshot", "load", snap["id"], "--as", "cli-loaded", "--json"], cli_env))
    assert loaded["id"] == "cli-loaded" and loaded["num_messages"] == 2
    assert "exists" in fails(["snapshot", "load", snap["id"], "--as", "cli-loaded"], cli_env)
    ok(["snapshot", "load", snap["id"], "--as", "cli-loaded", "--overwrite"], cli_env)
    follow_up = ["chat", "-s", "cli-loaded", "-p", "And of Germany?", "--temperature", "0", "--max-tokens", "20"]
    assert "Berlin" in ok(follow_up, cli_env)
    ok(["snapshot", "rm", snap["id"]], cli_env)
    assert "does not exist" in fails(["snapshot", "show", snap["id"]], cli_env)
    ok(["session", "rm", "cli-snap", "cli-loaded"], cli_env)


def test_errors_are_one_line(cli_env: dict[str, str]) -> None:
    down = {**cli_env, "STATELM_URL": f"http://127.0.0.1:{free_port()}"}
    assert "cannot reach the statelm server" in fails(["session", "ls"], down)
    assert "cannot reach the statelm server" in fails(["chat", "-p", "hi"], down)
    assert "does not exist" in fails(["chat", "--session", "missing", "-p", "hi"], cli_env)
    assert "does not exist" in fails(["session", "history", "missing"], cli_env)
    assert "does not exist" in fails(["snapshot", "load", "missing"], cli_env)
    assert "invalid" in fails(["session", "show", "bad id!"], cli_env).lower()


@pytest.mark.parametrize(
    "command",
    [
        [], ["serve"], ["chat"], ["docs"], ["server", "start"], ["server", "status"], ["server", "stop"],
        *[["session", c] for c in ("new", "ls", "show", "rm", "history", "rollback", "fork")],
        *[["snapshot", c] for c in ("save", "ls", "show", "load", "rm", "edit")],
    ],
)  # fmt: skip
def test_help_has_an_example(command: list[str], cli_env: dict[str, str]) -> None:
    assert "Example" in ok([*command, "--help"], cli_env)


def test_docs_prompt_cites_its_source(tmp_path: Path, cli_env: dict[str, str]) -> None:
    folder = tmp_path / "notes"
    (folder / "pets").mkdir(parents=True)
    (folder / "pets" / "cat.md").write_text(
        "# Office pets\n\nThe office cat is named Biscuit. She sleeps on the printer.\n"
    )
    (folder / "travel.txt").write_text("The train to Lyon leaves at 9:15 from platform 4.\n")
    (folder / "deploy.py").write_text('def deploy() -> None:\n    """Deploy to staging, then production."""\n')
    (folder / ".hidden.md").write_text("never ingested")
    args = ["docs", "cli-notes", "--add", str(folder), "--temperature", "0", "--max-tokens", "30"]
    out = ok([*args, "-p", "What is the name of the office cat?"], cli_env)
    assert all(name in out for name in ("cat.md", "travel.txt", "deploy.py")) and ".hidden.md" not in out
    sources = next(line for line in out.splitlines() if line.startswith("Sources:"))
    assert sources.split(":", 1)[1].split(",")[0].strip().endswith("pets/cat.md")


def test_docs_beyond_the_context_answers_from_excerpts(tmp_path: Path, cli_env: dict[str, str]) -> None:
    filler = "The river market opens in summer and the winter school teaches music to the people of the city."
    paragraphs = [f"{filler} Paragraph {i}." for i in range(500)]
    paragraphs[321] = "The launch code of the Zephyr project is amber-falcon-42; it is kept in the vault."
    (tmp_path / "archive.txt").write_text("\n\n".join(paragraphs))
    args = ["docs", "cli-archive", "--add", str(tmp_path / "archive.txt"), "--temperature", "0", "--max-tokens", "30"]
    out = ok([*args, "-p", "What is the launch code of the Zephyr project?"], cli_env)
    assert "would overflow the context" in out and "excerpts" in out
    assert "Sources: " in out and "archive.txt" in out.split("Sources: ", 1)[1]


def test_the_client_embeds_with_the_served_model_and_finds_no_embedding_model_beside_it(server_url: str) -> None:
    from statelm.cli.client import StatelmClient

    client = StatelmClient(server_url)
    assert client.embedding_model() is None  # `statelm docs` then retrieves with BM25 alone
    answer = client.embed(client.model()["id"], ["The capital of France is Paris.", "Cats sleep."])
    vectors = answer.vectors
    assert answer.fingerprint.startswith("fp_")
    assert len(vectors) == 2 and len(vectors[0]) == 576  # SmolLM2-135M's hidden size, last-token pooled
    assert abs(sum(value * value for value in vectors[0]) - 1) < 1e-4
