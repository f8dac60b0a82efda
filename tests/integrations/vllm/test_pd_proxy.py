"""The P/D router (kvgroups.integrations.vllm.pd_proxy) between two stand-in servers: what each is sent,
that a stream stays a stream, and that a failing prefill server or a refusing decode server still answers
the client. With two `vllm serve` it runs in tests/integrations/vllm/test_pd_serve.py."""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvgroups.integrations.vllm.pd_proxy import PDProxy, main, prefill_body

HANDOVER = {"do_remote_prefill": True, "do_remote_decode": False, "kvgroups_handover": {"tokens": 64}}


class StandIn(http.server.ThreadingHTTPServer):
    """Records each request's (path, body); answers as the test says."""

    daemon_threads = True

    def __init__(self, answer: Any) -> None:
        self.seen: list[tuple[str, Any]] = []
        self.answer = answer
        super().__init__(("127.0.0.1", 0), _StandInHandler)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _StandInHandler(http.server.BaseHTTPRequestHandler):
    server: StandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.seen.append((self.path, None))
        self._send(200, b'{"data": []}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, body))
        self.server.answer(self, body)

    def _send(self, status: int, data: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def prefill_answer(handler: _StandInHandler, body: dict[str, Any]) -> None:
    handler._send(200, json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": HANDOVER}).encode())


def decode_answer(handler: _StandInHandler, body: dict[str, Any]) -> None:
    if not body.get("stream"):
        handler._send(200, json.dumps({"choices": [{"text": "answer"}], "echo": body}).encode())
        return
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Connection", "close")
    handler.end_headers()
    for index in range(3):  # events apart in time: the client must see the first before the last is sent
        handler.wfile.write(f"data: {json.dumps({'index': index, 'at': time.monotonic()})}\n\n".encode())
        handler.wfile.flush()
        time.sleep(0.3)
    handler.wfile.write(b"data: [DONE]\n\n")
    handler.close_connection = True


@contextmanager
def running(server: http.server.HTTPServer) -> Iterator[None]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def routed(prefill: Any = prefill_answer, decode: Any = decode_answer) -> Iterator[tuple[str, StandIn, StandIn]]:
    prefill_server, decode_server = StandIn(prefill), StandIn(decode)
    proxy = PDProxy(("127.0.0.1", 0), prefill_server.base, decode_server.base)
    with running(prefill_server), running(decode_server), running(proxy):
        yield f"http://127.0.0.1:{proxy.server_address[1]}", prefill_server, decode_server


def post(base: str, path: str, body: Any) -> urllib.request.Request:
    return urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})


def test_the_prompt_goes_to_the_prefill_server_for_one_token_then_with_its_hand_over_to_the_decode_server() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
    with routed() as (base, prefill, decode), urllib.request.urlopen(post(base, "/v1/completions", body)) as answer:
        echoed = json.loads(answer.read())["echo"]
    assert prefill.seen == [("/v1/completions", {**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False}})]
    assert decode.seen == [("/v1/completions", {**body, "kv_transfer_params": HANDOVER})]
    assert echoed == decode.seen[0][1]


def test_a_stream_is_relayed_as_it_arrives_and_the_prefill_is_never_streamed() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 5}
    with routed() as (base, prefill, _), urllib.request.urlopen(post(base, "/v1/chat/completions", body)) as answer:
        events = []
        for line in answer:
            if line.startswith(b"data: {"):
                events.append((json.loads(line[6:]), time.monotonic()))
    assert [event["index"] for event, _ in events] == [0, 1, 2]
    first_sent, first_seen = events[0][0]["at"], events[0][1]
    assert first_seen - first_sent < events[2][0]["at"] - first_sent  # seen before the last was sent
    assert prefill.seen[0][1] == {"model": "m", "messages": body["messages"], "max_completion_tokens": 1,
                                  "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True,
                                                                          "do_remote_prefill": False}}


def test_a_failing_prefill_server_leaves_the_prompt_to_the_decode_server() -> None:
    def broken(handler: _StandInHandler, body: dict[str, Any]) -> None:
        handler._send(500, b"{}")

    body = {"model": "m", "prompt": "hello", "max_tokens": 2}
    with routed(prefill=broken) as (base, _, decode), urllib.request.urlopen(post(base, "/v1/completions",
                                                                                   body)) as answer:
        assert json.loads(answer.read())["choices"][0]["text"] == "answer"
    assert decode.seen == [("/v1/completions", body)]  # no hand-over: an ordinary request


def test_the_decode_server_s_refusal_and_other_paths_are_passed_on() -> None:
    def refusing(handler: _StandInHandler, body: dict[str, Any]) -> None:
        handler._send(400, b'{"error": {"message": "max_tokens too large"}}')

    with routed(decode=refusing) as (base, prefill, decode):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post(base, "/v1/completions", {"prompt": "x", "max_tokens": 10**9}))
        assert refused.value.code == 400 and b"max_tokens too large" in refused.value.read()
        with urllib.request.urlopen(base + "/v1/models") as models:
            assert json.loads(models.read()) == {"data": []}
        with pytest.raises(urllib.error.HTTPError) as malformed:
            urllib.request.urlopen(urllib.request.Request(base + "/v1/completions", data=b"[1, 2]"))
        assert malformed.value.code == 400
    assert decode.seen[-1] == ("/v1/models", None) and len(prefill.seen) == 1


def test_prefill_body_keeps_the_prompt_and_asks_one_token() -> None:
    assert prefill_body({"prompt": "a", "stream": True, "max_tokens": 9, "kv_transfer_params": {"x": 1}}) == {
        "prompt": "a", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}


def test_a_bad_server_url_is_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == ("pd_proxy: --prefill must be a server's base URL such as "
                                       "http://127.0.0.1:8100, got 'localhost:8100'\n")
