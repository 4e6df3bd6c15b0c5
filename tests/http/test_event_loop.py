"""The event loop stays free while requests with huge prompts are read, rendered, tokenized and refused.

A prompt longer than any tokenization of the context could cover is refused before it is tokenized; a
shorter one is rendered and tokenized in a worker thread that lets go of the GIL. The start-up heap is out of the
garbage collector's scans, whose full collections would otherwise pause the loop.
"""

from __future__ import annotations

import gc
import json
import random
import string
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.http.test_chat import assert_openai_error

HUGE_TEXT_BYTES = 6 * 2**20  # refused from its length alone
LONG_PROMPT_CHARS = 100_000  # few enough characters to fit some tokenization of the context: tokenized
HEALTH_LIMIT_S = 0.1


def test_health_answers_quickly_while_huge_prompts_are_refused(api: httpx.Client, model_name: str) -> None:
    text = "All work and no play makes Jack a dull boy. " * (HUGE_TEXT_BYTES // 44)
    chat = {"model": model_name, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    words = random.Random(0).choices(string.ascii_lowercase, k=LONG_PROMPT_CHARS)
    completion = {"model": model_name, "prompt": "".join(words), "max_tokens": 1}  # tokenized, then refused
    bodies = {"/v1/chat/completions": json.dumps(chat), "/v1/completions": json.dumps(completion)}
    headers = {"content-type": "application/json"}
    # the test process's own heap (pytest's, the other modules'), which a server does not carry, is collected now
    # rather than in a full collection during the measurement (one paused this process for 0.8 s under CI's load)
    gc.collect()
    with ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(api.post, path, content=body, headers=headers) for path, body in bodies.items()]
        latencies = []
        while not all(future.done() for future in pending):
            asked = time.perf_counter()
            assert api.get("/health").status_code == 200
            latencies.append(time.perf_counter() - asked)
            time.sleep(0.01)
    chat_error = assert_openai_error(pending[0].result(), 400, "messages")
    completion_error = assert_openai_error(pending[1].result(), 400, "prompt")
    assert chat_error["code"] == completion_error["code"] == "context_length_exceeded"
    assert "at least" in chat_error["message"] and "at least" not in completion_error["message"]
    assert latencies and max(latencies) < HEALTH_LIMIT_S, latencies


def test_the_start_up_heap_is_out_of_the_collectors_scans(api: httpx.Client) -> None:
    assert api.get("/health").status_code == 200  # the app has started
    assert gc.get_freeze_count() > 0
