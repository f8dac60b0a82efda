"""A small P/D router: each completion goes to a prefill server, then with its hand-over to a decode server.

What vLLM's P/D proxies and llm-d's sidecar do, for servers running KVGroupsConnector on one store
(docs/vllm.md, "Disaggregated prefill through the store"): a ``POST /v1/completions`` or
``/v1/chat/completions`` is sent to the prefill server with ``max_tokens`` 1, no streaming, and
``kv_transfer_params`` ``{"do_remote_decode": true, "do_remote_prefill": false}``; the request as the
client sent it then goes to the decode server with the ``kv_transfer_params`` of the prefill's
response, and the decode server's answer (streamed as it arrives, when the client asked to stream)
is the client's. Any other request goes to the decode server. A prefill server that fails or says no
hand-over leaves the decode server to compute the prompt: the client is answered either way.

For tests, benchmarks and trying P/D out, on one machine or a few; Python's threaded HTTP server, no
TLS. Run: ``python -m kvgroups.integrations.vllm.pd_proxy --prefill http://HOST:8100 --decode
http://HOST:8200 --port 8000``.
"""

from __future__ import annotations

import argparse
import http.server
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES = 64 << 20  # a request larger than this is refused (413)
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
TIMEOUT_SECONDS = 600.0
COPIED_HEADERS = ("Content-Type", "Authorization")


def _base(url: str, name: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"--{name} must be a server's base URL such as http://127.0.0.1:8100, got {url!r}")
    return url.rstrip("/")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill server is asked: the same prompt, one token, no stream, the hand-over requested."""
    asked = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    asked.update(max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    if "max_completion_tokens" in asked:
        asked["max_completion_tokens"] = 1
    return asked


class PDProxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], prefill: str, decode: str) -> None:
        self.prefill, self.decode = _base(prefill, "prefill"), _base(decode, "decode")
        super().__init__(address, _Handler)

    def __repr__(self) -> str:
        return f"PDProxy(prefill={self.prefill!r}, decode={self.decode!r}, port={self.server_address[1]})"

    def hand_over(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
        """The prefill server's ``kv_transfer_params`` for ``body``, or None (it failed: logged)."""
        request = urllib.request.Request(self.prefill + path, data=json.dumps(prefill_body(body)).encode(),
                                         headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as answer:
                params = json.loads(answer.read(MAX_BODY_BYTES)).get("kv_transfer_params")
        except (OSError, ValueError, AttributeError) as error:
            logger.warning("pd_proxy: the prefill server failed (%s: %s); the decode server computes the prompt",
                           type(error).__name__, error)
            return None
        return params if isinstance(params, dict) else None


class _Handler(http.server.BaseHTTPRequestHandler):
    server: PDProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("pd_proxy: " + format, *args)

    def do_GET(self) -> None:
        self._forward(self.server.decode + self.path, None, self._headers())

    def do_POST(self) -> None:
        declared = self.headers.get("Content-Length") or "0"
        length = int(declared) if declared.isdigit() else -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self._fail(413, f"a request body needs a Content-Length of at most {MAX_BODY_BYTES} bytes")
            self.close_connection = True
            return
        raw = self.rfile.read(length)
        headers = self._headers()
        if self.path.split("?")[0] not in GENERATION_PATHS:
            self._forward(self.server.decode + self.path, raw, headers)
            return
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._fail(400, "the request body must be a JSON object")
            return
        params = self.server.hand_over(self.path, body, headers)
        if params is not None:
            body = {**body, "kv_transfer_params": params}
        self._forward(self.server.decode + self.path, json.dumps(body).encode(), headers)

    def _headers(self) -> dict[str, str]:
        return {name: value for name in COPIED_HEADERS if (value := self.headers.get(name)) is not None}

    def _forward(self, url: str, data: bytes | None, headers: dict[str, str]) -> None:
        """Answer with the decode server's response, its body copied as it arrives (a stream stays one)."""
        request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
        try:
            answer = urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS)
        except urllib.error.HTTPError as error:  # the decode server's own refusal, passed on as it said it
            with error:
                self._reply(error.code, error.headers.get("Content-Type") or "application/json",
                            error.read(MAX_BODY_BYTES))
            return
        except OSError as error:
            self._fail(502, f"the decode server did not answer: {type(error).__name__}")
            return
        with answer:
            self.send_response(answer.status)
            for name in ("Content-Type", "Cache-Control"):
                if (value := answer.headers.get(name)) is not None:
                    self.send_header(name, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while piece := answer.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    def _fail(self, status: int, message: str) -> None:
        self._reply(status, "application/json", json.dumps({"error": {"message": message, "code": status}}).encode())

    def _reply(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prefill", required=True, help="the prefill server's base URL")
    parser.add_argument("--decode", required=True, help="the decode server's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    arguments = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        proxy = PDProxy((arguments.host, arguments.port), arguments.prefill, arguments.decode)
    except (ValueError, OSError) as error:
        parser.exit(2, f"pd_proxy: {error}\n")
    logger.info("pd_proxy: %r", proxy)
    with proxy:
        proxy.serve_forever()


if __name__ == "__main__":
    main()
