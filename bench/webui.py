"""The web UI's weight and load time: bytes transferred (compressed, as the server sends them) and the time until
the page is usable, in Debian's chromium on the machine the server runs on.

Usage: .venv/bin/python -m bench.webui [--url http://127.0.0.1:8000] [--port 8790] [--loads 20]

Each load is a fresh browser profile (nothing cached): navigation start to the message box shown (the page usable)
and to the `load` event; transferred bytes are the sum over every response of the
page's own files (encoded bodies plus headers, from the Resource Timing API), and the bodies alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from bench.common import machine_report, server_for
from tests.webui.conftest import CHROMIUM, CHROMIUM_ARGS

READY = "textarea[aria-label=message]"
RESOURCES = """() => performance.getEntriesByType('resource').concat(performance.getEntriesByType('navigation'))
    .filter((entry) => !entry.name.includes('/v1/'))
    .map((entry) => ({name: entry.name, transfer: entry.transferSize, body: entry.encodedBodySize,
                      decoded: entry.decodedBodySize}))"""
TIMES = """() => { const nav = performance.getEntriesByType('navigation')[0];
    return {load: nav.loadEventEnd, dom: nav.domContentLoadedEventEnd}; }"""


def main() -> None:
    """Load the page --loads times and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="measure a running server instead of starting one")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--loads", type=int, default=20)
    args = parser.parse_args()
    print(machine_report())
    from playwright.sync_api import sync_playwright

    with (
        tempfile.TemporaryDirectory() as state,
        server_for(args.url, args.port, f"--state-dir {state} --no-persist-sessions") as target,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        print(f"browser: {browser.version}")
        ready, loaded, files = [], [], []
        for _ in range(args.loads):
            context = browser.new_context()
            page = context.new_page()
            page.goto(target.url)
            page.locator(READY).wait_for()
            ready.append(page.evaluate("() => performance.now()"))
            page.wait_for_load_state("networkidle")
            loaded.append(page.evaluate(TIMES)["load"])
            files = page.evaluate(RESOURCES)
            context.close()
        browser.close()
    for entry in files:
        print(f"  {entry['name']}: {entry['transfer']} B transferred, {entry['decoded']} B uncompressed")
    transferred = sum(entry["transfer"] for entry in files)
    bodies = sum(entry["body"] for entry in files)
    uncompressed = sum(entry["decoded"] for entry in files)
    sizes = f"{transferred / 1000:.1f} kB transferred ({bodies / 1000:.1f} kB of bodies)"
    print(f"page: {sizes}, {uncompressed / 1000:.1f} kB uncompressed")
    print(
        f"load event: median {statistics.median(loaded):.0f} ms, max {max(loaded):.0f} ms over {args.loads} cold loads"
    )
    usable = f"median {statistics.median(ready):.0f} ms, max {max(ready):.0f} ms"
    print(f"usable (the message box shown, from navigation start): {usable}")


if __name__ == "__main__":
    main()
