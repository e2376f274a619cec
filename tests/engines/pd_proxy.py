"""A P/D proxy in the shape of vLLM's toy one (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`): a
completion goes to the prefill server with max_tokens=1 and kv_transfer_params asking for a hand-off, then to the
decode server with the kv_transfer_params the prefill server answered. Runs in a thread of the test on a free
loopback port; it times each leg of every request it forwards."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional


def post_json(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


@dataclass(frozen=True)
class Leg:
    """One forwarded request: the prefill leg's and the decode leg's wall seconds, and what each was sent/answered."""

    prefill_s: float
    decode_s: float
    handoff: Optional[dict[str, Any]]  # the kv_transfer_params the prefill server answered
    decode_response: dict[str, Any]


@dataclass
class PDProxy:
    """`ask` is what the prefill leg's kv_transfer_params hold; `decode_url` may be changed between requests."""

    prefill_url: str
    decode_url: str
    ask: dict[str, Any]
    legs: list[Leg] = field(default_factory=list)
    _server: Optional[ThreadingHTTPServer] = None

    def __enter__(self) -> str:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    answer = proxy.forward(body)
                    status = 200
                except Exception as exc:  # the test reads the status and the text
                    answer, status = {"error": f"{type(exc).__name__}: {exc}"}, 502
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the test reports what matters."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __exit__(self, *exc: Any) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def forward(self, body: dict[str, Any]) -> dict[str, Any]:
        """The toy proxy's two legs: prefill (max_tokens 1, the ask), then decode with the prefill's answer."""
        started = time.monotonic()
        prefill = post_json(f"{self.prefill_url}/v1/completions",
                            {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": self.ask})
        prefilled = time.monotonic()
        handoff = prefill.get("kv_transfer_params")
        decode = post_json(f"{self.decode_url}/v1/completions", {**body, "kv_transfer_params": handoff})
        self.legs.append(Leg(prefilled - started, time.monotonic() - prefilled, handoff, decode))
        return decode
