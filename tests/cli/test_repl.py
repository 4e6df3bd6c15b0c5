"""The chat and docs REPLs in a real terminal (tmux): streaming, Ctrl-C, /save and /load, ingestion and sources."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.helpers import Terminal, has_tmux, run_cli

pytestmark = pytest.mark.skipif(not has_tmux(), reason="needs tmux")


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    """Terminals a test opens; closed after it."""
    opened: list[Terminal] = []
    yield opened
    for terminal in opened:
        terminal.close()


def test_chat_save_quit_load_continue(cli_env: dict[str, str], terminals: list[Terminal]) -> None:
    first = Terminal(["chat", "--temperature", "0", "--max-tokens", "300"], cli_env)
    terminals.append(first)
    first.wait_for(r"Ctrl-D to quit")
    first.send("What is the capital of France?")
    first.wait_for(r"Paris[\s\S]*prompt \(\d+ cached\) · \d+ generated · TTFT")
    first.send("/save capital")
    snapshot = first.wait_for(r"saved snapshot (\S+) \(").group(1)

    # Ctrl-C stops a long reply, and the turn leaves no trace in the session
    first.send("Write a very long story about a dragon who learns to cook.")
    first.wait_for(r"learns to cook\.\n.*\w+ \w+ \w+")  # the reply is streaming
    first.keys("C-c")
    first.wait_for(r"interrupted: the turn was discarded")
    first.send("/history")
    history = first.wait_for(r"/history\n(.*\n){2}.*›")
    assert "1 user: What is the capital of France?" in history.group(0) and "dragon" not in history.group(0)
    first.send("/exit")
    first.wait_for(r"\[exited 0\]")

    second = Terminal(["chat", "--temperature", "0", "--max-tokens", "20"], cli_env)
    terminals.append(second)
    second.wait_for(r"Ctrl-D to quit")
    second.send(f"/load {snapshot}")
    second.wait_for(rf"loaded {snapshot} into")
    second.send("And of Germany?")
    cached = second.wait_for(r"Berlin[\s\S]*prompt \((\d+) cached\)").group(1)
    assert int(cached) > 0  # the follow-up was served from the snapshot's KV cache
    second.send("/history")
    second.wait_for(r"1 user: What is the capital of France\?\n.*Paris.*\n.*3 user: And of Germany\?")
    second.keys("C-c")
    second.wait_for(r"Ctrl-C again, Ctrl-D or /exit to quit\)\n.*›")  # the first one reached the next prompt
    second.keys("C-c")
    second.wait_for(r"\[exited 0\]")


def test_docs_ingest_ask_cite_save_restore(tmp_path: Path, cli_env: dict[str, str], terminals: list[Terminal]) -> None:
    folder = tmp_path / "handbook"
    (folder / "office").mkdir(parents=True)
    (folder / "office" / "pets.md").write_text(
        "# Pets\n\nThe office cat is named Biscuit. She sleeps on the printer.\n"
    )
    (folder / "travel.txt").write_text("The train to Lyon leaves at 9:15 from platform 4.\n")
    (folder / "tools.py").write_text('def deploy() -> None:\n    """Deploy to staging, then production."""\n')
    args = ["docs", "handbook", "--temperature", "0", "--max-tokens", "30"]
    terminal = Terminal(args, cli_env, cwd=tmp_path)
    terminals.append(terminal)
    terminal.wait_for(r"session docs-handbook \(new\)")
    terminal.send("/add handbook")
    table = terminal.wait_for(r"FILE +TOKENS +WHERE *\n(.*\n){3}context: ([\d,]+) of").group(0)
    for name in ("handbook/office/pets.md", "handbook/travel.txt", "handbook/tools.py"):
        assert name in table
    terminal.send("What is the name of the office cat?")
    terminal.wait_for(r"Sources: handbook/office/pets\.md")
    terminal.send("/save")
    terminal.wait_for(r"saved snapshot \S+ \(3 documents\)")
    terminal.send("/exit")
    terminal.wait_for(r"\[exited 0\]")

    assert run_cli(["session", "rm", "docs-handbook"], cli_env).exit_code == 0
    restored = Terminal(args, cli_env, cwd=tmp_path)
    terminals.append(restored)
    restored.wait_for(r"3 documents .* session docs-handbook \(restored from snapshot \S+ in [\d.]+s\)")
    restored.send("/sources")
    restored.wait_for(r"3 +handbook/travel\.txt +\d+ +context")
    restored.send("When does the train to Lyon leave?")
    restored.wait_for(r"Sources: handbook/travel\.txt")
