"""A small headless-Chromium driver over the DevTools protocol, for tests of our web pages.

One browser process per `Browser`, in its own process group and its own temporary profile; one
WebSocket to the browser target, pages attached to it as flat sessions. Commands are answered
in order on that one socket, and every event read along the way is kept: a page's uncaught
exceptions and console errors are what tests assert on.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

if TYPE_CHECKING:
    from typing import Self  # 3.11+, annotations only

BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The browser binary: $OMNIRAY_CHROMIUM, else the first of BINARIES on PATH."""
    explicit = os.environ.get("OMNIRAY_CHROMIUM")
    if explicit:
        return explicit
    return next((p for p in map(shutil.which, BINARIES) if p), None)


class DevToolsError(RuntimeError):
    pass


class Browser:
    def __init__(
        self, binary: str, flags: Sequence[str] = (), start_timeout_s: float = 30.0
    ) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="omniray-chromium-"))
        self.log = open(self.profile / "chromium.log", "wb")  # noqa: SIM115 (closed in close())
        args = [
            binary,
            "--headless=new",
            "--remote-debugging-port=0",
            f"--user-data-dir={self.profile}",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
            *(["--no-sandbox"] if os.geteuid() == 0 else []),  # the sandbox refuses root
            *flags,
            "about:blank",
        ]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log, start_new_session=True)
        self.ws: ClientConnection | None = None
        self.stack = contextlib.ExitStack()  # the socket, closed on close()
        self.ids = itertools.count(1)
        self.pages: dict[str, Page] = {}
        try:
            self.ws = self.stack.enter_context(
                connect(self._endpoint(start_timeout_s), max_size=None, open_timeout=10)
            )
        except BaseException:
            self.close()
            raise

    def _endpoint(self, timeout_s: float) -> str:
        # Chromium writes the chosen port and the browser target's path once it listens.
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DevToolsError(
                    f"chromium exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            lines = port_file.read_text().split("\n") if port_file.exists() else []
            if len(lines) >= 2 and lines[1]:
                return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
            time.sleep(0.05)
        raise DevToolsError(f"chromium did not open its DevTools port:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        return (self.profile / "chromium.log").read_bytes()[-chars:].decode(errors="replace")

    def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        session: str | None = None,
        timeout_s: float = 30.0,
    ) -> dict[str, Any]:
        """One command; reads (and dispatches) events until its answer arrives."""
        assert self.ws is not None
        msg_id = next(self.ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read(deadline, method)
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise DevToolsError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self, deadline: float, what: str) -> dict[str, Any]:
        """The next message; an event is handed to its page first."""
        assert self.ws is not None
        left = deadline - time.monotonic()
        if left <= 0:
            raise DevToolsError(f"{what}: nothing in time")
        msg = json.loads(self.ws.recv(timeout=left))
        page = self.pages.get(msg.get("sessionId", ""))
        if page is not None and "method" in msg:
            page.on_event(msg["method"], msg.get("params", {}))
        return msg

    def new_page(self, url: str) -> Page:
        """A new tab with Runtime and Log reporting on before `url` starts loading, so nothing
        the page throws or logs from its first line on is missed."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        page = Page(self, session["sessionId"], target)
        self.pages[page.session] = page
        for domain in ("Runtime", "Log", "Page"):
            page.send(f"{domain}.enable")
        page.send("Page.navigate", {"url": url})
        deadline = time.monotonic() + 15
        while not page.loaded:
            self._read(deadline, f"loading {url}")
        return page

    def close(self) -> None:
        try:
            if self.ws is not None:
                # The process group is killed below either way.
                with contextlib.suppress(DevToolsError, TimeoutError, ConnectionClosed):
                    self.send("Browser.close", timeout_s=5)
            self.stack.close()
        finally:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.log.close()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str, target: str) -> None:
        self.browser, self.session, self.target = browser, session, target
        self.exceptions: list[str] = []  # uncaught exceptions and unhandled rejections
        self.console_errors: list[str] = []  # console.error and browser-logged errors
        self.loaded = False  # the navigated document's load event fired

    def send(
        self, method: str, params: dict[str, Any] | None = None, timeout_s: float = 30.0
    ) -> dict[str, Any]:
        return self.browser.send(method, params, self.session, timeout_s)

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})
        self.browser.pages.pop(self.session, None)

    def on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Page.loadEventFired":
            self.loaded = True
        elif method == "Runtime.exceptionThrown":
            d = params["exceptionDetails"]
            self.exceptions.append(d.get("exception", {}).get("description") or d.get("text", ""))
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = params.get("args", [])
            self.console_errors.append(
                " ".join(str(a.get("value", a.get("description", ""))) for a in args)
            )
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            e = params["entry"]
            self.console_errors.append(f"{e.get('text', '')} {e.get('url', '')}".strip())

    def evaluate(self, expression: str, user_gesture: bool = False, timeout_s: float = 30.0) -> Any:
        """The expression's value (awaited when it is a promise), as JSON data."""
        result = self.send(
            "Runtime.evaluate",
            {
                "expression": expression,
                "awaitPromise": True,
                "returnByValue": True,
                "userGesture": user_gesture,
            },
            timeout_s,
        )
        if "exceptionDetails" in result:
            d = result["exceptionDetails"]
            raise DevToolsError(d.get("exception", {}).get("description") or d.get("text"))
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 10.0, poll_s: float = 0.05) -> Any:
        """Polls until the expression is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true after {timeout_s} s: {expression}")
            time.sleep(poll_s)
