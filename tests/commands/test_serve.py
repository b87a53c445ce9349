"""`rlcore serve`: a real uvicorn server on 127.0.0.1 (in a thread), driven by the official `openai`
client and by raw HTTP (httpx2, the client `openai` itself uses).

Reference values come from a second, independently loaded engine over the same model folder: greedy
texts, seeded samples and their log-probs must equal what ``engine.generate`` gives for the same
prompt. The scheduler's grouping is checked on its own (:func:`rlcore.serve.batcher.plan`).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx2
import openai
import pytest
import torch

from rlcore.commands import main
from rlcore.serve.schema import ChatRequest
from rlcore.serve.batcher import Job, Sampling, plan

MODEL = "tiny-test"
MAX_N = 4
CONTEXT = 64  # tests/conftest.py TINY_SHAPE max_position_embeddings


@contextmanager
def serving(model_dir, **options):
    """A server over ``model_dir`` on a free loopback port, in a thread; stopped (and its thread joined) on exit."""
    import uvicorn

    from rlcore.commands.serve import listen
    from rlcore.config import parse_config
    from rlcore.serve.app import create_app
    from rlcore.serve.server import ServeOptions, load_server

    cfg = parse_config({"rollout": {"engine": "static"}}, "test")
    server = load_server(model_dir, cfg, ServeOptions(served_model_name=MODEL, **options), torch.device("cpu"))
    sock = listen("127.0.0.1", 0)
    uv = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        yield SimpleNamespace(url=url, port=sock.getsockname()[1], server=server, client=client,
                              http=httpx2.Client(base_url=url, timeout=30))
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()
    assert not thread.is_alive(), "the server thread did not stop"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """The server over the session's tiny model, with room for every test of the API."""
    with serving(tiny_model_dir, max_batch_size=16, batch_wait_ms=50, max_n=MAX_N) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_tokenizer):
    """An engine of its own over the same model folder: what the server's answers must equal."""
    from rlcore.engine.model import ModelSpec, load_rollout_model
    from rlcore.rollout import EngineSpec, make_engine

    model = load_rollout_model(ModelSpec(path=str(tiny_model_dir)), torch.device("cpu"))
    engine = make_engine(model, EngineSpec("static"), eos_token_id=tiny_tokenizer.eos_token_id,
                         pad_token_id=tiny_tokenizer.pad_token_id)
    return engine


def generate(engine, tok, ids: torch.Tensor, mask: torch.Tensor, max_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None) -> list[dict]:
    """Per row: the text, the finish reason, the token count (EOS included) and the log-probs."""
    from rlcore.data.collate import decode_responses
    from rlcore.rollout import SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature or 1.0, top_p=top_p,
                            greedy=temperature == 0)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out = engine.generate(ids, mask, params, generator=gen)
    texts = decode_responses(tok, out["responses"], out["response_mask"])
    rows = []
    for i, text in enumerate(texts):
        m = out["response_mask"][i].bool()
        toks = out["responses"][i][m].tolist()
        rows.append({"text": text, "finish": "stop" if tok.eos_token_id in toks else "length", "n_tokens": len(toks),
                     "log_probs": out["log_probs"][i][m].tolist()})
    return rows


def complete_ref(engine, tok, prompt: str, max_tokens: int, n: int = 1, **kw) -> list[dict]:
    ids = torch.tensor([tok(prompt)["input_ids"]] * n)
    return generate(engine, tok, ids, torch.ones_like(ids), max_tokens, **kw)


def health(served) -> dict:
    r = served.http.get("/health")
    assert r.status_code == 200
    return r.json()


def test_health_and_models(served):
    assert health(served)["status"] == "ok"
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    assert served.client.models.retrieve(MODEL).id == MODEL


def test_greedy_completion_and_chat_equal_the_engine(served, reference, tiny_tokenizer):
    from rlcore.data.collate import encode_prompts

    res = served.client.completions.create(model=MODEL, prompt="12+34=", n=2, temperature=0, max_tokens=12)
    [ref] = complete_ref(reference, tiny_tokenizer, "12+34=", 12)
    assert [c.text for c in res.choices] == [ref["text"]] * 2
    assert [c.finish_reason for c in res.choices] == [ref["finish"]] * 2
    assert [c.index for c in res.choices] == [0, 1]
    assert res.usage.prompt_tokens == len("12+34=")  # one token per character
    assert res.usage.completion_tokens == 2 * ref["n_tokens"]
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
    assert res.model == MODEL and res.object == "text_completion"

    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = served.client.chat.completions.create(model=MODEL, messages=messages, n=2, temperature=0, max_tokens=10)
    ids, mask = encode_prompts(tiny_tokenizer, [messages], 40, "test")
    [ref] = generate(reference, tiny_tokenizer, ids, mask, 10)
    assert [c.message.content for c in chat.choices] == [ref["text"]] * 2
    assert [c.message.role for c in chat.choices] == ["assistant"] * 2
    assert [c.finish_reason for c in chat.choices] == [ref["finish"]] * 2
    assert chat.usage.prompt_tokens == int(mask.sum())


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(served, reference, tiny_tokenizer):
    kw = dict(model=MODEL, prompt="7+8=", temperature=0.9, top_p=0.95, max_tokens=24, n=2, logprobs=1)
    results: dict[str, object] = {}

    def send(key: str, **extra) -> None:
        results[key] = served.client.completions.create(**{**kw, **extra})

    # the seeded request goes in with unseeded ones of the same settings, which it must not share a call with
    threads = [threading.Thread(target=send, args=(f"other{i}",)) for i in range(4)]
    threads.append(threading.Thread(target=send, args=("seeded",), kwargs={"seed": 1234}))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seeded = results["seeded"]
    ref = complete_ref(reference, tiny_tokenizer, "7+8=", 24, n=2, temperature=0.9, top_p=0.95, seed=1234)
    assert [c.text for c in seeded.choices] == [r["text"] for r in ref]
    for choice, r in zip(seeded.choices, ref):
        lp = choice.logprobs
        assert lp.token_logprobs == pytest.approx(r["log_probs"], rel=1e-5, abs=1e-6)
        assert sum(lp.token_logprobs) == pytest.approx(sum(r["log_probs"]), rel=1e-5)
        assert len(lp.tokens) == len(lp.text_offset) == r["n_tokens"]
        # character tokens: offsets are the lengths of the text before each token (special tokens add none)
        visible = [t if not (t.startswith("<") and t.endswith(">")) else "" for t in lp.tokens]
        assert lp.text_offset == [len("".join(visible[:i])) for i in range(len(visible))]
        assert "".join(visible) == choice.text

    again = served.client.completions.create(**kw, seed=1234)
    assert [c.text for c in again.choices] == [c.text for c in seeded.choices]
    other = served.client.completions.create(**kw, seed=1235)
    assert [c.text for c in other.choices] != [c.text for c in seeded.choices]  # 2 x 24 tokens at ~1/90 each


def test_stop_strings_cut_the_text_and_finish_with_stop(served, reference, tiny_tokenizer):
    [ref] = complete_ref(reference, tiny_tokenizer, "3+4=", 20)
    text = ref["text"]
    assert len(text) >= 8, f"the tiny model's greedy text is too short for this test: {text!r}"
    stop = text[4:6]
    res = served.client.completions.create(model=MODEL, prompt="3+4=", temperature=0, max_tokens=20,
                                           stop=["never-generated", stop])
    assert res.choices[0].text == text[:text.find(stop)]
    assert res.choices[0].finish_reason == "stop"
    assert res.usage.completion_tokens < ref["n_tokens"]  # tokens after the stop string are not counted
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 temperature=0, max_tokens=20, stop="\x00")
    assert chat.choices[0].finish_reason in ("stop", "length") and "\x00" not in chat.choices[0].message.content


def test_concurrent_requests_are_answered_and_batched(served, reference, tiny_tokenizer):
    prompts = [f"{'9' * (i % 3 + 1)}+{i}=" for i in range(8)]  # different lengths: left padding in the batch
    before = health(served)
    barrier = threading.Barrier(len(prompts))
    texts: dict[int, str] = {}

    def send(i: int) -> None:
        barrier.wait()
        res = served.client.completions.create(model=MODEL, prompt=prompts[i], temperature=0, max_tokens=8)
        texts[i] = res.choices[0].text

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [texts[i] for i in range(len(prompts))] == [complete_ref(reference, tiny_tokenizer, p, 8)[0]["text"]
                                                       for p in prompts]
    after = health(served)
    assert after["requests"] - before["requests"] == len(prompts)
    assert after["engine_calls"] - before["engine_calls"] < len(prompts)


BAD = [  # (endpoint, body, status, param, code)
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model",
     "model_not_found"),
    ("completions", {"model": MODEL, "prompt": "x" * 60, "max_tokens": 10}, 400, "max_tokens",
     "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, 400,
     "top_p", None),
    ("completions", {"model": MODEL, "prompt": "x", "n": MAX_N + 1}, 400, "n", None),
    ("completions", {"model": MODEL}, 400, "prompt", None),
    ("chat/completions", {"model": MODEL}, 400, "messages", None),
    ("completions", {"model": MODEL, "prompt": 123}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": "x", "n": "2"}, 400, "n", None),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("completions", {"model": MODEL, "prompt": "x", "stream": True}, 400, "stream", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role",
     None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "user"}]}, 400,
     "messages.1.content", None),
]


@pytest.mark.parametrize("endpoint, body, status, param, code", BAD, ids=[f"{b[0]}-{b[3]}-{b[2]}" for b in BAD])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(served, endpoint, body, status, param, code):
    r = served.http.post(f"/v1/{endpoint}", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    assert err["message"].startswith(param) or code is not None
    if code == "context_length_exceeded":
        assert all(str(v) in err["message"] for v in (60, 10, 70, CONTEXT))
    expected = openai.NotFoundError if status == 404 else openai.BadRequestError
    create = served.client.completions.create if endpoint == "completions" else served.client.chat.completions.create
    args = {"prompt": openai.omit} if endpoint == "completions" else {"messages": openai.omit}
    with pytest.raises(expected) as raised:
        create(**{**args, **body})
    assert raised.value.status_code == status and raised.value.body["param"] == param
    assert len(served.client.completions.create(model=MODEL, prompt="1", max_tokens=2).choices) == 1


def test_malformed_json_is_a_400(served):
    r = served.http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in r.json()["error"]["message"]
    assert health(served)["status"] == "ok"


def test_engine_failure_is_a_500_without_internals_and_the_scheduler_goes_on(served, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("engine on fire at /secret/path/model.py")

    errors = health(served)["engine_errors"]
    monkeypatch.setattr(served.server.batcher.engine, "generate", broken)
    with caplog.at_level(logging.ERROR, logger="rlcore.serve"):
        r = served.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error"
    assert not any(word in err["message"] for word in ("fire", "secret", "RuntimeError", "Traceback"))
    error_id = err["message"].split("error id ")[1].split(";")[0]
    # the traceback is in the server's log, under the id the client was given
    [record] = [r for r in caplog.records if error_id in r.getMessage()]
    assert "engine on fire" in str(record.exc_info[1])
    assert health(served)["engine_errors"] == errors + 1
    monkeypatch.undo()
    assert served.client.completions.create(model=MODEL, prompt="1", max_tokens=2).usage.completion_tokens >= 1


def _job(rows: int, max_tokens: int = 8, temperature: float = 1.0, seed: int | None = None) -> Job:
    return Job([[1]] * rows, Sampling(max_tokens=max_tokens, temperature=temperature), seed,
               future=None)  # type: ignore[arg-type]  # plan() never touches it


def test_plan_groups_same_settings_within_the_row_limit_and_runs_seeded_jobs_alone():
    a, b, c = _job(3), _job(2), _job(3)  # same settings: a+b fit 6 rows, c does not
    other_len, greedy, seeded = _job(1, max_tokens=4), _job(1, temperature=0), _job(1, seed=7)
    big = _job(9)
    calls = list(plan([a, other_len, b, seeded, greedy, c, big], max_rows=6))
    assert calls == [[a, b], [other_len], [seeded], [greedy], [c], [big]]
    assert list(plan([a, b, c], max_rows=6, batching=False)) == [[a], [b], [c]]


def test_command_refuses_a_missing_model_folder_and_a_port_in_use(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(tmp_path / "nope")])
    assert exit_.value.code == 2
    assert "--model" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(tiny_model_dir), "--max-n", "32", "--max-batch-size", "8"])
    assert exit_.value.code == 2 and "--max-n 32" in capsys.readouterr().err

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--model", str(tiny_model_dir), "--port", str(port)])
    assert exit_.value.code == 2 and f"--port {port}" in capsys.readouterr().err


# --- limits ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(tiny_model_dir):
    """A server with tight limits: 5 tokens a completion, 8 rows a request, 2 requests waiting, 4 KiB bodies,
    every request its own engine call."""
    with serving(tiny_model_dir, max_batch_size=8, max_n=4, max_tokens=5, max_queue=2, request_timeout_s=30,
                 max_body_bytes=4096, batching=False) as s:
        yield s


@contextmanager
def engine_held(server):
    """Engine calls wait (in the engine thread) until the block ends; yields an event set once a call is inside."""
    gate, inside = threading.Event(), threading.Event()
    engine = server.batcher.engine
    real = engine.generate

    def held(*args, **kwargs):
        inside.set()
        gate.wait(60)
        return real(*args, **kwargs)

    engine.generate = held
    try:
        yield inside
    finally:
        gate.set()
        del engine.generate


def send_in_thread(client, results: dict, key: str, **kw) -> threading.Thread:
    def send() -> None:
        try:
            results[key] = client.completions.create(model=MODEL, **{"prompt": "1+1=", "max_tokens": 2, **kw})
        except openai.APIStatusError as err:
            results[key] = err

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_full_queue_is_a_503_with_retry_after_and_the_waiting_requests_are_answered(limited):
    results: dict = {}
    with engine_held(limited.server) as inside:
        threads = [send_in_thread(limited.client, results, "running")]
        assert inside.wait(20)  # its engine call started: it no longer waits
        threads += [send_in_thread(limited.client, results, k) for k in ("waiting1", "waiting2")]
        wait_for(lambda: health(limited)["waiting"] == 2, "two requests waiting")
        refused_before = health(limited)["refused_busy"]
        with pytest.raises(openai.InternalServerError) as busy:
            limited.client.completions.create(model=MODEL, prompt="2+2=", max_tokens=2)
        assert busy.value.status_code == 503
        assert int(busy.value.response.headers["retry-after"]) >= 1
        assert busy.value.body["code"] == "server_busy" and "--max-queue 2" in busy.value.body["message"]
        assert health(limited)["refused_busy"] == refused_before + 1
    for t in threads:
        t.join(30)
    assert all(len(results[k].choices) == 1 for k in ("running", "waiting1", "waiting2")), results


def test_a_request_past_the_timeout_is_a_504_and_leaves_the_queue(limited, monkeypatch):
    import dataclasses

    monkeypatch.setattr(limited.server, "options", dataclasses.replace(limited.server.options, request_timeout_s=1.0))
    results: dict = {}
    with engine_held(limited.server) as inside:
        running = send_in_thread(limited.client, results, "running")
        assert inside.wait(20)
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as late:  # it waits behind the held call
            limited.client.completions.create(model=MODEL, prompt="3+3=", max_tokens=2)
        elapsed = time.monotonic() - start
        assert late.value.status_code == 504 and late.value.body["code"] == "timeout"
        assert 0.9 <= elapsed < 10, elapsed
        assert health(limited)["waiting"] == 0  # it left the queue while the engine is still held
        running.join(30)  # the running request's own timeout: 504 as well, its rows dropped when the call ends
        assert results["running"].status_code == 504
    monkeypatch.undo()
    wait_for(lambda: health(limited)["abandoned"] >= 2, "both requests abandoned")
    assert len(limited.client.completions.create(model=MODEL, prompt="1", max_tokens=2).choices) == 1


def test_max_tokens_is_capped_at_the_servers_limit_after_the_context_check(limited, reference, tiny_tokenizer):
    [long] = complete_ref(reference, tiny_tokenizer, "3+4=", 20)
    assert long["n_tokens"] > 5, "the tiny model's greedy answer should run past the cap"
    res = limited.client.completions.create(model=MODEL, prompt="3+4=", temperature=0, max_tokens=20)
    [capped] = complete_ref(reference, tiny_tokenizer, "3+4=", 5)
    assert res.choices[0].text == capped["text"] and res.usage.completion_tokens == capped["n_tokens"] <= 5
    assert res.choices[0].finish_reason == capped["finish"]
    # the request's own max_tokens still has to fit the context with the prompt (40 + 30 > 64)
    r = limited.http.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 30})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def raw_http(port: int, request: bytes, timeout: float = 20.0, then: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as is on a new connection (and ``then``, half a second later); (status, headers, body) of the
    answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        if then:
            time.sleep(0.5)
            sock.sendall(then)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before an answer: {data!r}"
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        while len(body) < int(headers.get("content-length", 0)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return int(lines[0].split()[1]), headers, body


def test_a_body_over_the_limit_is_a_413_before_it_is_read(limited):
    # a Content-Length of a gigabyte, and no body sent at all: answered from the header alone
    start = time.monotonic()
    status, _, body = raw_http(limited.port, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                               b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
    assert status == 413 and time.monotonic() - start < 10
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and "1000000000 bytes" in err["message"]
    # chunked, with no length: refused once the bytes received pass the limit
    r = limited.http.post("/v1/completions", content=iter([b'{"prompt": "' + b"x" * 5000 + b'"}']),
                          headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # 200 KiB in 100 chunks: the client is still sending when the limit passes, and reads the 413 (not a reset)
    r = limited.http.post("/v1/completions", content=iter([b'{"prompt": "'] + [b"x" * 2048] * 100 + [b'"}']),
                          headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a body with its Content-Length that arrives just after the headers (as a client under load sends it): refused
    # by the length, but the body is read first, so the client reads the 413; a close with the body unread, or
    # before it arrives, resets the connection ("connection reset" in the client, seen with the official client)
    payload = b'{"prompt": "' + b"x" * 5000 + b'"}'
    status, _, body = raw_http(limited.port, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                               b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload), then=payload)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as raised:  # the official client, a prompt of 5000 characters
        limited.client.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=2)
    assert raised.value.status_code == 413
    assert len(limited.client.completions.create(model=MODEL, prompt="1", max_tokens=2).choices) == 1


def test_the_number_of_completions_is_checked_before_any_prompt_is_tokenized(limited, monkeypatch):
    tokenized = []
    monkeypatch.setattr(limited.server, "completion_prompts", lambda req: tokenized.append(req))
    for body, count in [({"prompt": ["1+1="] * 9}, "9 prompt(s) x n=1 = 9"),
                        ({"prompt": ["1+1="] * 3, "n": 3}, "3 prompt(s) x n=3 = 9"),
                        ({"prompt": [[5, 6]] * 9}, "9 prompt(s)")]:
        r = limited.http.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and count in r.json()["error"]["message"]
    assert not tokenized


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "7+8=", "temperature": NaN}', "temperature"),
    (b'{"prompt": "7+8=", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "7+8=", "top_p": NaN}', "top_p"),
    (b'{"prompt": "7+8=", "temperature": -1e-9}', "temperature"),
    (b'{"prompt": "\\ud800"}', "prompt"),  # a lone surrogate: JSON can spell it, no tokenizer can encode it
    (b'{"prompt": "7+8=", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", '
     b'"q"]}', "stop"),
])
def test_settings_that_could_make_nan_or_break_the_tokenizer_are_400s(served, raw, param):
    r = served.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_a_temperature_near_zero_is_greedy_or_raised_as_vllm_does(served, reference, tiny_tokenizer):
    greedy = complete_ref(reference, tiny_tokenizer, "7+8=", 12)
    for t in (5e-324, 1e-40, 5e-6):  # under 1e-5: greedy (logits / 1e-40 overflows to inf, the softmax to NaN)
        res = served.client.completions.create(model=MODEL, prompt="7+8=", temperature=t, max_tokens=12, seed=3,
                                               logprobs=1)
        assert res.choices[0].text == greedy[0]["text"]
        assert all(lp == lp and abs(lp) < 1e4 for lp in res.choices[0].logprobs.token_logprobs)  # finite
    raised = health(served)["temperatures_raised"]
    res = served.client.completions.create(model=MODEL, prompt="7+8=", temperature=1e-3, max_tokens=12, seed=4, n=2)
    ref = complete_ref(reference, tiny_tokenizer, "7+8=", 12, n=2, temperature=1e-2, seed=4)
    assert [c.text for c in res.choices] == [r["text"] for r in ref]
    assert health(served)["temperatures_raised"] == raised + 1
    hot = served.client.completions.create(model=MODEL, prompt="7+8=", temperature=1e300, max_tokens=12, seed=5,
                                           logprobs=1)
    assert all(lp == lp and lp > -1e4 for lp in hot.choices[0].logprobs.token_logprobs)  # uniform, finite


def test_a_body_that_stops_arriving_is_a_408_at_the_timeout(tiny_model_dir):
    """A client that sends its headers and part of the body, then nothing (one connection held open on purpose),
    gets 408 once --request-timeout has passed, and the server goes on answering."""
    with serving(tiny_model_dir, request_timeout_s=1.0) as s:
        start = time.monotonic()
        status, _, body = raw_http(s.port, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                                           b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        assert status == 408 and json.loads(body)["error"]["code"] == "timeout"
        assert 0.9 <= time.monotonic() - start < 10
        assert len(s.client.completions.create(model=MODEL, prompt="1", max_tokens=2).choices) == 1


def test_tools_come_back_as_openai_tool_calls_and_earlier_calls_reach_the_prompt(served, tiny_tokenizer, monkeypatch):
    """The model's text (scripted here) holds a hermes call: the answer is message.tool_calls with finish_reason
    tool_calls; a next request's assistant tool_calls and tool message are rendered into its prompt (the tiny
    template does not render tool_calls itself: they appear as the model wrote them)."""
    tok = tiny_tokenizer
    reply = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

    def scripted(input_ids, attention_mask, params, generator=None):
        ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows = input_ids.shape[0]
        return {"responses": torch.tensor([ids] * rows), "response_mask": torch.ones((rows, len(ids)), dtype=torch.long),
                "log_probs": torch.zeros((rows, len(ids)))}

    monkeypatch.setattr(served.server.batcher.engine, "generate", scripted)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    out = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+3?"}],
                                                tools=tools, max_tokens=50)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and json.loads(call.function.arguments) == {
        "a": 2, "b": 3} and call.id.startswith("call_")
    follow = [{"role": "user", "content": "2+3?"}, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    # (too long for the tiny model's context to send: the prompt it would get)
    prompt = served.server.chat_prompt(ChatRequest(messages=follow, tools=tools))
    assert tok.decode(prompt) == '<s><|user|>2+3?<|assistant|><tool_call>{"name": "add", "arguments": {"a": 2, ' \
                                 '"b": 3}}</tool_call></s><|tool|>5<|assistant|>'
    plain = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                  tools=tools, tool_choice="none", max_tokens=50)
    assert plain.choices[0].message.content == reply and plain.choices[0].finish_reason == "stop"
    r = served.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                        "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
