"""Open a page in real headless chromium over the DevTools protocol (``--remote-debugging-pipe``,
standard library only) and report what a person would see: the page's visible text, its console
errors and uncaught exceptions, and every request it made.

The pipe protocol: the browser reads NUL-terminated JSON commands on its fd 3 and writes
NUL-terminated JSON replies and events on its fd 4.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The first chromium-like binary on PATH, or None."""
    return next((found for name in CANDIDATES if (found := shutil.which(name))), None)


@dataclasses.dataclass(frozen=True)
class Page:
    text: str  # document.body.innerText: what is rendered visibly
    errors: list[str]  # console errors, log entries of level error, uncaught exceptions
    requests: list[str]  # every URL the page requested (the page itself included)
    svg_count: int


class _Pipe:
    def __init__(self, binary: str, profile: str) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def _fds() -> None:  # in the child: fd 3 reads our commands, fd 4 writes its replies (kept by pass_fds)
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "about:blank",
            ],
            pass_fds=(3, 4),
            preexec_fn=_fds,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30.0) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event.get("method") == method:
                    return event
            self.events.append(self._read(deadline))

    def _read(self, deadline: float) -> dict:
        import select

        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


def open_page(path: Path, binary: str, timeout: float = 60.0) -> Page:
    """Load ``path`` (a local file) in headless chromium and read what it shows."""
    with tempfile.TemporaryDirectory(prefix="sdc-chromium-") as profile:
        pipe = _Pipe(binary, profile)
        try:
            target = pipe.send("Target.createTarget", {"url": "about:blank"}, timeout=timeout)["targetId"]
            session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page", "Network"):
                pipe.send(f"{domain}.enable", session=session)
            pipe.events.clear()
            pipe.send("Page.navigate", {"url": Path(path).resolve().as_uri()}, session=session)
            pipe.wait_event("Page.loadEventFired", timeout=timeout)
            text = pipe.send(
                "Runtime.evaluate", {"expression": "document.body.innerText", "returnByValue": True}, session=session
            )
            svgs = pipe.send(
                "Runtime.evaluate",
                {"expression": "document.querySelectorAll('svg').length", "returnByValue": True},
                session=session,
            )
            errors, requests = [], []
            for event in pipe.events:
                method, params = event.get("method"), event.get("params", {})
                if method == "Runtime.exceptionThrown":
                    errors.append(json.dumps(params.get("exceptionDetails", {}))[:500])
                elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                    errors.append(json.dumps(params.get("args", []))[:500])
                elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                    errors.append(params["entry"].get("text", "")[:500])
                elif method == "Network.requestWillBeSent":
                    requests.append(params.get("request", {}).get("url", ""))
            return Page(
                text=text["result"].get("value", ""),
                errors=errors,
                requests=requests,
                svg_count=svgs["result"].get("value", 0),
            )
        finally:
            pipe.close()
