"""`rlcore serve` under a bounded load of good and abusive requests, on loopback only: the real command in a process
of its own (so its memory is its own), tight limits, 12 concurrent clients, two rounds of the same ~300 requests.

Every answer must be the one its request calls for (200, or 503 with Retry-After when the queue is full, for good
requests; the exact 4xx for each bad one, with OpenAI's error body); no request may reach a 500; the server's
memory must not grow from the first round to the second (what a leak per request would do); and afterwards it
answers a greedy request with the text an engine of our own gives.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import psutil
import pytest

from .test_serve import complete_ref, reference  # noqa: F401  (the fixture)

MAX_QUEUE, MAX_BODY = 4, 16384
GOOD = {200, 503}
JSON = {"content-type": "application/json"}

# name -> (raw body or JSON, statuses allowed). Bodies as bytes go out exactly as written.
REQUESTS: dict[str, tuple[object, set[int]]] = {
    "greedy": ({"prompt": "12+3=", "max_tokens": 8, "temperature": 0}, GOOD),
    "chat": ({"messages": [{"role": "user", "content": "5+5"}], "max_tokens": 6}, GOOD),
    "seeded n=2": ({"prompt": "4+4=", "n": 2, "seed": 7, "temperature": 0.8, "max_tokens": 6, "logprobs": 1}, GOOD),
    "temperature 1e-40": ({"prompt": "9+1=", "temperature": 1e-40, "max_tokens": 6}, GOOD),
    "temperature 1e300": ({"prompt": "9+1=", "temperature": 1e300, "max_tokens": 6}, GOOD),
    "max_tokens 1e12": ({"prompt": "1+1=", "max_tokens": 10**12}, {400}),
    "100 prompts": ({"prompt": ["1+1="] * 100}, {400}),
    "n 1000": ({"prompt": "1+1=", "n": 1000}, {400}),
    "NaN temperature": (b'{"prompt": "1+1=", "temperature": NaN}', {400}),
    "Infinity top_p": (b'{"prompt": "1+1=", "top_p": Infinity}', {400}),
    "malformed": (b'{"prompt": "x",', {400}),
    "not an object": (b"[1, 2, 3]", {400}),
    "nested 4000 deep": (b"[" * 4000 + b"]" * 4000, {400}),
    "garbage bytes": (bytes(range(256)) * 8, {400}),
    "lone surrogate": (b'{"prompt": "\\ud800 hi"}', {400}),
    "token id 1e9": ({"prompt": [1, 10**9]}, {400}),
    "17 stop strings": ({"prompt": "1+1=", "stop": [str(i) for i in range(17)]}, {400}),
    "stream": ({"prompt": "1+1=", "stream": True}, {400}),
    "unknown model": ({"prompt": "1+1=", "model": "gpt-9"}, {404}),
    "body over the limit": ({"prompt": "x" * (MAX_BODY + 100)}, {413}),
    "gigabyte Content-Length": (None, {413}),
}


def send(url: str, port: int, name: str) -> tuple[str, int, dict, dict]:
    body, _ = REQUESTS[name]
    if body is None:  # a Content-Length of a gigabyte and no body: answered from the header
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000000\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        head, raw = data.split(b"\r\n\r\n", 1)
        return name, int(head.split()[1]), {}, json.loads(raw)
    path = "/v1/chat/completions" if name == "chat" else "/v1/completions"
    with httpx2.Client(base_url=url, timeout=30) as client:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers=JSON)
        else:
            r = client.post(path, json=body)
    return name, r.status_code, dict(r.headers), r.json()


def check(name: str, status: int, headers: dict, body: dict) -> None:
    allowed = REQUESTS[name][1]
    assert status in allowed, (name, status, body)
    if status == 200:
        assert body["choices"] and all(c.get("text", c.get("message")) is not None for c in body["choices"])
        return
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], (name, body)
    assert "Traceback" not in err["message"] and "File \"" not in err["message"]
    if status == 503:
        assert err["code"] == "server_busy" and int(headers["retry-after"]) >= 1, (name, headers)


def run_round(url: str, port: int, names: list[str]) -> dict[int, int]:
    statuses: dict[int, int] = {}
    with ThreadPoolExecutor(12) as pool:
        for name, status, headers, body in pool.map(lambda n: send(url, port, n), names):
            check(name, status, headers, body)
            statuses[status] = statuses.get(status, 0) + 1
    return statuses


@pytest.fixture
def server_process(tiny_model_dir, tmp_path):
    out, err = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlcore", "serve", "--model", str(tiny_model_dir), "--served-model-name", "m",
         "--host", "127.0.0.1", "--port", "0", "--max-queue", str(MAX_QUEUE), "--max-batch-size", "8",
         "--max-n", "4", "--max-tokens", "16", "--request-timeout", "20", "--max-body-bytes", str(MAX_BODY),
         "--threads", "1", "--log-level", "critical"],
        cwd=tmp_path, stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"at http://127\.0\.0\.1:(\d+)/v1", (tmp_path / "stdout.txt").read_text())):
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        port = int(m.group(1))
        url = f"http://127.0.0.1:{port}"
        while True:  # the socket listens before uvicorn serves: wait for /health
            try:
                if httpx2.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not answer /health"
            time.sleep(0.1)
        yield proc, url, port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
        stderr = (tmp_path / "stderr.txt").read_text()
        assert "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.integration
def test_good_and_abusive_requests_together_keep_the_server_answering_in_bounded_memory(
        server_process, reference, tiny_tokenizer):  # noqa: F811
    proc, url, port = server_process
    rss = lambda: psutil.Process(proc.pid).memory_info().rss  # noqa: E731
    start = time.monotonic()
    run_round(url, port, list(REQUESTS))  # each kind once: what the server allocates the first time
    names = [name for _ in range(7) for name in REQUESTS]  # 147 requests a round
    first = run_round(url, port, names)
    after_first = rss()
    second = run_round(url, port, names)
    after_second = rss()
    assert time.monotonic() - start < 240
    health = httpx2.get(f"{url}/health", timeout=30).json()
    assert health["internal_errors"] == 0 and health["waiting"] == 0 and health["engine_errors"] == 0
    assert first.get(200, 0) > 0 and second.get(200, 0) > 0
    growth = (after_second - after_first) / 2**20
    print(f"rss after round 1: {after_first / 2**20:.1f} MiB, after round 2: {after_second / 2**20:.1f} MiB "
          f"(+{growth:.1f}); statuses {first} / {second}; {health['refused_busy']} refused as busy")
    assert growth < 16, f"the server's memory grew by {growth:.1f} MiB over the second round of the same requests"
    # still serving, and right: the greedy answer is an engine's of our own
    r = httpx2.post(f"{url}/v1/completions", json={"prompt": "3+4=", "temperature": 0, "max_tokens": 12}, timeout=30)
    [ref] = complete_ref(reference, tiny_tokenizer, "3+4=", 12)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref["text"]
    assert proc.poll() is None
