"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`).

No extra package and no port: Chromium reads commands on fd 3 and writes replies and events on
fd 4, each a JSON message ended by a NUL byte. The tests open a page from disk, collect console
messages, exceptions, log entries and network requests, and screenshot elements.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Flags that work on these machines (no display, root, closed network): without the
# background-networking ones Chromium keeps trying to reach Google's hosts.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageLoad:
    """What happened while a page loaded."""

    console: list[dict] = field(default_factory=list)  # Runtime.consoleAPICalled params
    exceptions: list[dict] = field(default_factory=list)  # Runtime.exceptionThrown params
    log_entries: list[dict] = field(default_factory=list)  # Log.entryAdded entries
    requests: list[str] = field(default_factory=list)  # every URL the page asked for

    def errors(self) -> list[str]:
        """Console errors/warnings, uncaught exceptions and error log entries, as readable lines."""
        out = [
            f"console.{c['type']}: "
            + " ".join(str(a.get("value", a.get("description", ""))) for a in c["args"])
            for c in self.console
            if c["type"] in ("error", "assert", "warning")
        ]
        out += [f"exception: {e['exceptionDetails'].get('text')}" for e in self.exceptions]
        out += [
            f"log {e['level']}: {e.get('text')} ({e.get('url', '')})"
            for e in self.log_entries
            if e["level"] in ("error", "warning")
        ]
        return out


class Browser:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, width: int = 1200, height: int = 900, timeout: float = 60):
        self.width, self.height, self.timeout = width, height, timeout
        self._id = 0
        self._buf = b""
        self._events: list[dict] = []

    def __enter__(self) -> Browser:
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("chromium is not installed")
        self._profile = tempfile.mkdtemp(prefix="llmft-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_fds():
            # Chromium expects its command pipe on fd 3 and its reply pipe on fd 4. Move both ends
            # out of the way first: either may itself be fd 3 or 4.
            high_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
            high_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self._proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=wire_fds,
            pass_fds=(3, 4),  # kept open across exec; close_fds runs after preexec_fn
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=True)
        self.send(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=self.width,
            height=self.height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.send("Browser.close")
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self._profile, ignore_errors=True)

    # ------------------------------------------------------------ protocol

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no reply from chromium")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                err = self._proc.stderr.read().decode(errors="replace")[-2000:] if self._proc.stderr else ""
                raise RuntimeError(f"chromium closed the protocol pipe: {err}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, session: bool = False, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def _wait_event(self, method: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not any(e["method"] == method for e in self._events):
            self._events.append(self._read_message(deadline))

    # ------------------------------------------------------------ what the tests use

    def open(self, path: Path, settle: float = 0.5) -> PageLoad:
        """Load a file and return what the page logged, threw and requested."""
        self._events.clear()
        self.send("Page.navigate", session=True, url=Path(path).resolve().as_uri())
        self._wait_event("Page.loadEventFired")
        time.sleep(settle)  # late console messages (e.g. CSP reports) arrive after load
        self.evaluate("1")  # drain the pipe into self._events
        load = PageLoad()
        for e in self._events:
            p = e.get("params", {})
            if e["method"] == "Runtime.consoleAPICalled":
                load.console.append(p)
            elif e["method"] == "Runtime.exceptionThrown":
                load.exceptions.append(p)
            elif e["method"] == "Log.entryAdded":
                load.log_entries.append(p["entry"])
            elif e["method"] == "Network.requestWillBeSent":
                load.requests.append(p["request"]["url"])
        return load

    def evaluate(self, expression: str):
        res = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def screenshot(self, x: float, y: float, width: float, height: float) -> bytes:
        """PNG of a page region in page coordinates (beyond the viewport too)."""
        clip = {"x": x, "y": y, "width": width, "height": height, "scale": 1}
        res = self.send(
            "Page.captureScreenshot", session=True, format="png", clip=clip, captureBeyondViewport=True
        )
        return base64.b64decode(res["data"])

    def elements(self, selector: str) -> list[dict]:
        """Page-coordinate boxes and a few attributes of every element matching `selector`."""
        js = (
            f"JSON.stringify([...document.querySelectorAll({json.dumps(selector)})].map(e => {{"
            "const r = e.getBoundingClientRect();"
            " return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height,"
            " label: e.getAttribute('aria-label'), cls: e.getAttribute('class') || ''}}))"
        )
        return json.loads(self.evaluate(js))
