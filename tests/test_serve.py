"""`shoal serve` as a real subprocess on 127.0.0.1: the OpenAI client and raw HTTP against
`LLM.generate`/`LLM.chat` on the real SmolLM2; errors, cancel on disconnect, concurrency,
the server's options, restart on a warm pool, SIGTERM, --dp 2."""

from __future__ import annotations

import asyncio
import json
import re
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from shoal import SamplingParams
from shoal.serving.process import READY_MESSAGE

pytestmark = pytest.mark.slow

MODEL = "smollm2"
READY_TIMEOUT = 240.0
DOC = ("The lighthouse keeper of Marrow Point kept a log of every ship that passed. " * 24)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m shoal serve ...` on a free port; ready once it printed READY_MESSAGE (its
    URL: http://HOST:PORT). A thread keeps its output (stdout and stderr): a full pipe would
    block it, and tests wait for lines in it."""

    def __init__(self, model_path: str, *args: str, own_group: bool = False,
                 verbose: bool = False):
        """`own_group`: the server leads a process group of its own (as under systemd);
        `verbose`: `shoal -v serve` (INFO lines)."""
        self.port = _free_port()
        env = {**os.environ, "SHOAL_SERVE_DEBUG": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shoal", *["-v"] * verbose, "serve", "--model", model_path,
             "--port", str(self.port), "--served-model-name", MODEL, *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=own_group)
        self.output: list[str] = []
        self._is_output_closed = False
        self._has_exited = False
        self._is_terminated = False
        self._output_changed = threading.Condition()
        threading.Thread(target=self._read_output, name="server-output", daemon=True).start()
        threading.Thread(target=self._notice_exit, name="server-exit", daemon=True).start()
        ready = self.wait_for_line(READY_MESSAGE, READY_TIMEOUT, or_exit=True)
        if ready is None:
            self.proc.kill()
            raise AssertionError(f"server not ready (exit status {self.proc.wait()}): "
                                 f"{''.join(self.output)}")
        self.url = ready.split()[len(READY_MESSAGE.split())]
        assert httpx.get(f"{self.url}/health", timeout=60).status_code == 200
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                    timeout=120)
        self.headers: dict[str, str] = {}  # sent with `post` (e.g. the API key)

    def _read_output(self) -> None:
        for line in self.proc.stdout:
            with self._output_changed:
                self.output.append(line)
                self._output_changed.notify_all()
        with self._output_changed:  # every process holding the pipe has ended
            self._is_output_closed = True
            self._output_changed.notify_all()

    def _notice_exit(self) -> None:
        """Wake `wait_for_line(..., or_exit=True)` once the server exited (its rank
        processes may hold the output open)."""
        fd = os.pidfd_open(self.proc.pid)
        select.select([fd], [], [])
        os.close(fd)
        with self._output_changed:
            self._has_exited = True
            self._output_changed.notify_all()

    def wait_for_line(self, text: str, timeout: float, or_exit: bool = False) -> str | None:
        """The first output line containing `text`, once printed; None if the output ended,
        `timeout` seconds passed or (`or_exit`) the server exited first."""
        def line():
            return next((x for x in self.output if text in x), None)
        def is_over() -> bool:
            return self._is_output_closed or (or_exit and self._has_exited)
        with self._output_changed:
            self._output_changed.wait_for(lambda: line() is not None or is_over(), timeout)
            return line()

    def children(self) -> list[int]:
        """Pids of the server's child processes (rank processes)."""
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == self.proc.pid:
                    out.append(int(d.name))
        return out

    def terminate(self, group: bool = False) -> None:
        """SIGTERM, once: a second one while the server shuts down would kill it (`group`:
        to the server's whole process group, which it leads with `own_group`)."""
        if not self._is_terminated:
            self._is_terminated = True
            if group:
                os.killpg(self.proc.pid, signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (unless sent already); the exit status."""
        if self.proc.poll() is None:
            self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return self.proc.returncode

    def post(self, path: str, body, timeout=120.0) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, timeout=timeout,
                          headers={"content-type": "application/json", **self.headers})

    def metrics(self) -> dict[str, float]:
        """Sample name -> value summed over labels."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=60).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
                out[name] = out.get(name, 0.0) + value
        return out


def _sse(response) -> list:
    """The `data:` payloads of an SSE response or of its remaining lines (the JSON objects,
    then "[DONE]")."""
    events = []
    for line in response.iter_lines() if isinstance(response, httpx.Response) else response:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _stream_text(events: list, chat: bool = True) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            part = c["delta"].get("content") if chat else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + (part or "")
    return texts


@pytest.fixture(scope="module")
def pool_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("serve-pool"))


@pytest.fixture(scope="module")
def server(smollm2_path, pool_dir):
    s = Server(smollm2_path, "--kv-pool", pool_dir, "--num-kv-blocks", "1024")
    yield s
    s.stop()


def _wait_idle(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """The metrics once the engine has no work (/debug/idle waits for the driver to find
    none): nothing running, every KV block free."""
    r = httpx.get(f"{server.url}/debug/idle", params={"timeout": timeout}, timeout=timeout + 60)
    assert r.json() == {"idle": True}, r.text
    m = server.metrics()
    assert m["shoal:num_requests_running"] == 0 and m["shoal:kv_cache_usage_perc"] == 0, m
    return m


# -- text equals the library's -----------------------------------------------------------


def test_chat_and_completions_equal_the_library(server, smollm2):
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    ref_chat = smollm2.chat(CHAT, sp)[0]
    r = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                              temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref_chat.text
    assert r.choices[0].finish_reason == ref_chat.finish_reason
    assert r.usage.prompt_tokens == len(ref_chat.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref_chat.token_ids)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # max_completion_tokens wins over max_tokens
    r = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                              max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"

    ref = smollm2.generate(["Once upon a time"], sp)[0]
    r = server.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                         temperature=0)
    assert r.id.startswith("cmpl-") and r.choices[0].text == ref.text
    ids = smollm2.tokenizer.encode("Once upon a time")
    r = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.prompt_tokens == len(ids)
    assert server.client.models.list().data[0].id == MODEL
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_streaming_equals_non_streaming_with_usage_chunk(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 20, "temperature": 0}
    server.post("/v1/chat/completions", body)  # both below then reuse the same cached prefix
    whole = server.post("/v1/chat/completions", body).json()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"]
               for e in events[:-1])
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert events[-3]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert _stream_text(events)[0] == whole["choices"][0]["message"]["content"]

    # the openai client's streaming; completions too
    chunks = list(server.client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True))
    whole = server.client.completions.create(model=MODEL, prompt="Once upon a time",
                                             max_tokens=16, temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_multibyte_text_is_never_split(server):
    msgs = [{"role": "user", "content": "Write three emoji and the word café in French."}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 40, "temperature": 0}
    whole = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        events = _sse(r)
    parts = [c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"]]
    assert "".join(parts) == whole
    assert not any("\ufffd" in p for p in parts)


def test_n_choices(server):
    r = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                              temperature=0.9, seed=7, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    # choice i of a seeded request draws as a single request seeded seed + i
    singles = [server.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0.9, seed=7 + i) for i in (0, 1)]
    by_index = {c.index: c.message.content for c in r.choices}
    assert by_index == {i: s.choices[0].message.content for i, s in enumerate(singles)}
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
            "prompt": "The sea", "max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 2,
            "stream": True}) as s:
        events = _sse(s)
    texts = _stream_text(events, chat=False)
    whole = server.post("/v1/completions", {"prompt": "The sea", "max_tokens": 8,
                                            "temperature": 0.9, "seed": 3, "n": 2}).json()
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    finals = [c for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1]


def test_stop_strings(server, smollm2):
    ref = smollm2.generate(["Once upon a time"], SamplingParams(max_tokens=24))[0].text
    words = ref.split()
    stop = " " + words[4]
    expected = ref[:ref.index(stop)]
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
            "stop": [stop, "zzzz-never"]}
    r = server.post("/v1/completions", body).json()
    assert r["choices"][0]["text"] == expected and r["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={**body, "stream": True}) as s:
        assert _stream_text(_sse(s), chat=False)[0] == expected
    assert r["usage"]["completion_tokens"] < 24


def test_logprobs(server):
    r = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                              temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert abs(item.logprob - item.top_logprobs[0].logprob) < 1e-5  # greedy: the argmax
    assert "".join(i.token for i in content) == r.choices[0].message.content
    r = server.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5,
                                        "temperature": 0, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(t) == 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "stream": True}) as s:
        events = _sse(s)
    items = [i for e in events[:-1] for c in e["choices"] if c["logprobs"]
             for i in c["logprobs"]["content"]]
    assert len(items) == 6 and all(i["top_logprobs"] == [] for i in items)


def test_min_tokens_and_stop_token_ids(server, smollm2):
    base = {"messages": CHAT, "max_tokens": 40, "temperature": 0}
    plain = server.post("/v1/chat/completions", base).json()
    n = plain["usage"]["completion_tokens"]
    assert n < 20 and plain["choices"][0]["finish_reason"] == "stop"  # ends at eos
    r = server.post("/v1/chat/completions", {**base, "min_tokens": 20}).json()
    assert r["usage"]["completion_tokens"] >= 20  # eos does not end it before 20 tokens
    # stop_token_ids: the third token of the greedy answer ends it (and counts)
    ref = smollm2.generate(["Once upon a time"], SamplingParams(max_tokens=8))[0].token_ids
    r = server.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8,
                                        "temperature": 0, "stop_token_ids": [ref[2]]}).json()
    assert r["usage"]["completion_tokens"] == ref.index(ref[2]) + 1
    assert r["choices"][0]["finish_reason"] == "stop"


def test_cached_tokens_on_a_repeated_long_prompt(server):
    body = {"prompt": DOC + "\nQuestion: who kept the log?", "max_tokens": 4, "temperature": 0}
    first = server.post("/v1/completions", body).json()["usage"]
    second = server.post("/v1/completions", body).json()["usage"]
    n = first["prompt_tokens"]
    assert n > 200
    details = second["prompt_tokens_details"]
    assert details["cached_tokens"] >= n - 32
    assert details["cached_tokens"] == details["local_prefix_tokens"] + details["pool_tokens"]


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 2}, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 2**70}, "seed"),
    ("/v1/chat/completions", {"max_tokens": 4}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2.5]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": list(range(1, 9000))}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    # a lone surrogate is valid JSON but not text: 400 naming where it is, never a 500
    ("/v1/completions", {"prompt": "x", "model": "a\ud800"}, "model"),
    ("/v1/completions", {"prompt": "x", "cache_salt": "\udfff"}, "cache_salt"),
    ("/v1/completions", {"prompt": ["ok", "x\ud800"]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["\ud800"]}, "stop"),
    # sampling settings outside OpenAI's (or vLLM's) ranges
    ("/v1/chat/completions", {"messages": CHAT, "frequency_penalty": 50}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": -2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"42": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"abc": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 5}}, "logit_bias"),
    # asked for, not built: refused, never ignored (issue 27 builds them)
    # structured output: malformed, invalid, or more than one constraint
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[a-"}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "start: nowhere"}, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "object"}, "guided_regex": "a"},
     "guided_regex"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "bad name", "parameters": {}}}]}, "tools.0.function.name"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tools"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
])
def test_bad_request_is_400_naming_the_field(server, path, body, param):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"]


def test_tokenize_and_detokenize(server, smollm2):
    """vLLM's /tokenize and /detokenize: the ids generation runs (the prompt_tokens of a
    completion of the same prompt), back to the text; bad input is a 400 naming the field."""
    text = "The harbor gate opens at dawn."
    r = server.post("/tokenize", {"prompt": text}).json()
    assert r["tokens"] == smollm2.tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 1000
    usage = server.post("/v1/completions", {"prompt": text, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == r["count"]
    chat = server.post("/tokenize", {"messages": CHAT}).json()
    assert chat["tokens"] == smollm2.tokenizer.apply_chat_template(CHAT)
    usage = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert usage["usage"]["prompt_tokens"] == chat["count"]
    back = server.post("/detokenize", {"tokens": r["tokens"]}).json()
    assert back == {"prompt": smollm2.tokenizer.decode(r["tokens"])} and text in back["prompt"]
    for path, body, param in (("/tokenize", {"prompt": text, "messages": CHAT}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": text, "add_special_tokens": False},
                               "add_special_tokens"),
                              ("/tokenize", {"prompt": text, "model": "other"}, "model"),
                              ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):
        err = server.post(path, body)
        assert err.status_code in (400, 404), err.text
        assert err.json()["error"]["param"] == param, err.text


def test_penalties_bias_and_min_p_equal_the_library(server, smollm2):
    """The sampling settings over HTTP run as the library's SamplingParams do (the same
    tokens), and they do change the answer."""
    prompt = "List the days of the week: Monday, Tuesday,"
    settings = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3,
                "logit_bias": {"28": 4.0}}
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                        **settings}).json()
    library = {**settings, "logit_bias": {28: 4.0}}
    want = smollm2.generate([prompt], SamplingParams(max_tokens=12, **library))[0]
    plain = smollm2.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert r["choices"][0]["text"] == want.text and want.token_ids != plain.token_ids
    seeded = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 3, "min_p": 0.3}
    r = server.post("/v1/completions", seeded).json()
    want = smollm2.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                                     min_p=0.3))[0]
    assert r["choices"][0]["text"] == want.text


def test_top_k_and_top_p_equal_the_library(server, smollm2):
    """Seeded sampling with top_k and top_p over HTTP draws the library's tokens, and each
    changes what is drawn."""
    prompt = "Once upon a time, in a small village,"
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 1.3, "seed": 11}
    texts = {}
    for name, cut in (("none", {}), ("top_k", {"top_k": 3}), ("top_p", {"top_p": 0.5}),
                      ("both", {"top_k": 5, "top_p": 0.8})):
        got = server.post("/v1/completions", {**body, **cut}).json()["choices"][0]["text"]
        want = smollm2.generate([prompt], SamplingParams(max_tokens=16, temperature=1.3,
                                                         seed=11, **cut))[0].text
        assert got == want, name
        texts[name] = got
    assert all(texts[k] != texts["none"] for k in ("top_k", "top_p", "both"))


def test_a_cache_salt_separates_cached_prefixes(server):
    """The same long prompt under one salt is cached from its second request on; under
    another salt nothing of it is (the salt is in every block's key)."""
    body = {"prompt": DOC + "\nQuestion: which ship came last?", "max_tokens": 2,
            "temperature": 0}

    def cached(salt: str):
        usage = server.post("/v1/completions", {**body, "cache_salt": salt}).json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    n, first = cached("tenant-a")
    assert first == 0 and n > 200
    assert cached("tenant-a")[1] >= n - 32
    assert cached("tenant-b")[1] == 0
    assert cached("tenant-a")[1] >= n - 32


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
          "properties": {"city": {"type": "string", "maxLength": 40},
                         "country": {"type": "string", "maxLength": 40}}}


def test_structured_output_with_the_official_client(server):
    """response_format json_schema / json_object through `openai`, streamed and not,
    greedy and sampled: every answer parses and validates; vLLM's guided_choice,
    guided_regex and structured_outputs hold too."""
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA,
                                                  "strict": True}}
    msgs = [{"role": "user", "content": "Name a large city and its country, as JSON."}]
    r = server.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                              temperature=0.8, seed=3, n=4, response_format=fmt)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    stream = server.client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=80, temperature=0, stream=True,
        response_format={"type": "json_object"})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert isinstance(json.loads(text), dict)
    extra = {"guided_choice": ["red", "green", "blue"]}
    r = server.client.completions.create(model=MODEL, prompt="My favourite colour is",
                                         max_tokens=10, temperature=1.0, seed=1, n=3,
                                         extra_body=extra)
    assert all(c.text in extra["guided_choice"] for c in r.choices)
    for extra, pattern in (({"guided_regex": "[0-9]{3}-[0-9]{4}"}, "[0-9]{3}-[0-9]{4}"),
                           ({"structured_outputs": {"regex": "(yes|no)!"}}, "(yes|no)!")):
        r = server.client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20,
                                             temperature=0, extra_body=extra)
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text


NUMBER = {"type": "object", "additionalProperties": False, "required": ["n"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def _number(text: str) -> bool:
    import jsonschema
    jsonschema.validate(json.loads(text), NUMBER)
    return True


def _object(text: str, finish_reason: str) -> bool:
    """Any JSON object: sampled, one may run to max_tokens (then it has begun as one)."""
    return isinstance(json.loads(text), dict) if finish_reason == "stop" else (
        finish_reason == "length" and text.lstrip().startswith("{"))


def _also(extra, holds, name):  # another spelling of a form the default run covers
    return pytest.param(extra, holds, id=name, marks=pytest.mark.extended)


@pytest.mark.parametrize("extra, holds", [
    pytest.param({"guided_json": NUMBER}, _number, id="guided_json"),
    _also({"guided_json": json.dumps(NUMBER)}, _number, "guided_json_text"),  # (vLLM's)
    _also({"guided_grammar": 'start: "yes" | "no"'}, lambda t: t in ("yes", "no"),
          "guided_grammar_lark"),
    pytest.param({"guided_grammar": 'root ::= "up" | "down"'}, lambda t: t in ("up", "down"),
                 id="guided_grammar_gbnf"),
    _also({"structured_outputs": {"json": NUMBER}}, _number, "structured_outputs_json"),
    pytest.param({"structured_outputs": {"json_object": True}}, _object,
                 id="structured_outputs_json_object"),
    _also({"structured_outputs": {"choice": ["north", "south"]}},
          lambda t: t in ("north", "south"), "structured_outputs_choice"),
    pytest.param({"structured_outputs": {"grammar": 'start: /[0-9]{1,3}/ "!"'}},
                 lambda t: re.fullmatch("[0-9]{1,3}!", t), id="structured_outputs_grammar"),
])
def test_each_form_of_vllm_s_structured_output_extras_holds(server, extra, holds):
    """vLLM's extras in each form, through the official client, greedy and sampled: the
    text matches (checked by jsonschema, json, re), and the request stops there."""
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        r = server.client.completions.create(model=MODEL, prompt="Answer: ", max_tokens=40,
                                             extra_body=extra, **sampling)
        c = r.choices[0]
        ok = holds(c.text, c.finish_reason) if holds is _object else (
            c.finish_reason == "stop" and holds(c.text))
        assert ok, (sampling, c.finish_reason, c.text)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"], "additionalProperties": False}}}


def test_tool_calls_with_the_official_client(server):
    """tool_choice named and "required" force calls (SmolLM2 was never taught tools: the
    grammar makes it call): parsed tool_calls whose arguments match their schema,
    finish_reason "tool_calls", the same calls streamed; the call and its result go back
    into the conversation."""
    import jsonschema
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [WEATHER_TOOL, TIME_TOOL]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = server.client.chat.completions.create(model=MODEL, messages=msgs, tools=tools,
                                              tool_choice=named, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])
    stream = server.client.chat.completions.create(
        model=MODEL, messages=msgs, tools=tools, tool_choice=named, max_tokens=60,
        temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == \
        [("get_weather", args)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    r = server.client.chat.completions.create(model=MODEL, messages=msgs, tools=tools,
                                              tool_choice="required", max_tokens=200,
                                              temperature=0.7, seed=2)
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0]
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments),
                            {t["function"]["name"]: t for t in tools}[c.function.name][
                                "function"]["parameters"])
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    r = server.client.chat.completions.create(model=MODEL, messages=follow, tools=tools,
                                              max_tokens=30, temperature=0)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 100


def test_echo_and_prompt_logprobs_score_a_text(server, smollm2):
    """Scoring as lm-eval does it (echo, logprobs, max_tokens 1): the prompt comes back
    with its tokens' logprobs (the first has none), then the answer's; vLLM's
    prompt_logprobs give the same numbers; streamed echo starts with the prompt."""
    text = "The capital of France is Paris"
    ids = smollm2.tokenizer.encode(text)
    ref = smollm2.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=2,
                                                  logprobs=2))[0]
    r = server.post("/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0,
                                        "echo": True, "logprobs": 2}).json()["choices"][0]
    assert r["text"] == text + ref.text
    lp = r["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    want = [x.logprob for x in ref.prompt_logprobs[1:]] + [ref.logprobs[0].logprob]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    r = server.post("/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0,
                                        "prompt_logprobs": 2}).json()["choices"][0]
    assert r["text"] == ref.text and r["prompt_logprobs"][0] is None
    for token_id, entry, lp_ in zip(ids[1:], r["prompt_logprobs"][1:], ref.prompt_logprobs[1:]):
        mine = entry[str(token_id)]
        assert mine["logprob"] == pytest.approx(lp_.logprob, abs=1e-4) and mine["rank"] == lp_.rank
        assert {int(k) for k in entry} == {token_id, *(t for t, _ in lp_.top)}
    chat = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
            "prompt": text, "max_tokens": 3, "echo": True, "stream": True, "temperature": 0}) as s:
        events = _sse(s)
    assert events[0]["choices"][0]["text"] == text
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text + smollm2.generate(
        [text], SamplingParams(max_tokens=3))[0].text


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    """What clients send by default (zero penalties, an empty logit_bias, text output,
    tool_choice "none") changes nothing and is served."""
    r = server.post("/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 2, "temperature": 0, "frequency_penalty": 0,
        "presence_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
        "tool_choice": "none", "min_p": 0, "repetition_penalty": 1, "user": "u1"})
    assert r.status_code == 200, r.text


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(server):
    """A text with more bytes than the token limit times the longest token's bytes is a 400
    before the tokenizer sees it (a just-under-body-limit prompt never holds the tokenizer
    for seconds); one that only tokenizes too long is refused after tokenizing, also 400."""
    huge = "word " * 400_000  # 2 MB: under --max-body-bytes, certainly too many tokens
    r = server.post("/v1/completions", {"prompt": huge, "max_tokens": 1})
    assert r.status_code == 400 and "bytes" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "prompt"
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    long = "word " * 9000  # 45 kB: tokenized, then refused for its 9000 tokens
    r = server.post("/v1/completions", {"prompt": long, "max_tokens": 1})
    assert r.status_code == 400 and "tokens, more than" in r.json()["error"]["message"]


def test_a_huge_body_is_refused_unread_while_others_run(server):
    """The default --max-body-bytes (8 MiB): a 20 MB body is answered 413 before it is
    parsed or tokenized, declared (Content-Length) or chunked, and a small request sent
    at the same time is served as usual."""
    import concurrent.futures

    huge = json.dumps({"prompt": "word " * 4_000_000, "max_tokens": 1})  # 20 MB
    chunks = [huge[i:i + (1 << 20)].encode() for i in range(0, len(huge), 1 << 20)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        declared = pool.submit(server.post, "/v1/completions", huge)
        chunked = pool.submit(lambda: httpx.post(
            f"{server.url}/v1/completions", content=iter(chunks), timeout=120,
            headers={"content-type": "application/json"}))
        small = pool.submit(server.post, "/v1/completions",
                            {"prompt": "The sea", "max_tokens": 2, "temperature": 0})
        for refused in (declared.result(), chunked.result()):
            assert refused.status_code == 413, refused.text
            assert refused.json()["error"]["type"] == "invalid_request_error"
        assert small.result().status_code == 200
    assert server.post("/v1/completions", {"prompt": "a", "max_tokens": 1}).status_code == 200


def test_other_errors(server):
    r = server.post("/v1/chat/completions", "{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = server.post("/v1/chat/completions", {"model": "gpt-9", "messages": CHAT})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/v1/nothing").status_code == 404
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=MODEL, messages=CHAT, top_p=3.0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="hi", max_tokens=2)
    # unknown fields are ignored; bad requests disturbed nothing
    r = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3,
                                             "temperature": 0, "frobnicate": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# -- cancel on disconnect, concurrency ---------------------------------------------------------


def test_abandoned_requests_are_cancelled(server):
    before = server.metrics()
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "n": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got >= 4:
                break
        _wait_metric(server, "shoal:num_requests_running", 2)
    # a non-streaming request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", {**body, "stream": False, "n": 1},
                    timeout=httpx.Timeout(120, read=2.0))
    m = _wait_idle(server)
    assert m["shoal:num_cancellations_total"] >= before.get("shoal:num_cancellations_total", 0) + 3
    assert m["shoal:num_requests_waiting"] == 0
    assert httpx.get(f"{server.url}/debug/integrity", timeout=60).json() == {"ok": True}


def test_32_concurrent_streams_each_get_their_own_tokens(server, smollm2):
    prompts = [f"List {i} things about the number {i * 7}:" for i in range(32)]
    expected = [o.text for o in smollm2.generate(prompts, SamplingParams(max_tokens=8))]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        text = ""
        async with client.stream("POST", f"{server.url}/v1/completions", json={
                "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == expected
    m = _wait_idle(server)
    assert m["shoal:request_success_total"] >= 32
    assert m["shoal:time_to_first_token_seconds_count"] >= 32
    assert m["shoal:inter_token_latency_seconds_count"] > 0
    assert m["shoal:generation_tokens_total"] > 0 and m["shoal:prompt_tokens_total"] > 0


def test_metrics_names(server):
    assert server.post("/v1/completions", {"prompt": "a", "max_tokens": 2}).status_code == 200
    _wait_idle(server)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("shoal:num_requests_running", "shoal:num_requests_waiting",
                 "shoal:request_success_total", "shoal:prompt_tokens_total",
                 "shoal:generation_tokens_total", "shoal:prefix_cache_queries_total",
                 "shoal:prefix_cache_hits_total", "shoal:pool_lookups_total",
                 "shoal:pool_hit_blocks_total", "shoal:pool_miss_blocks_total",
                 "shoal:pool_bytes_loaded_total", "shoal:pool_bytes_saved_total",
                 "shoal:pool_corrupt_blocks_total", "shoal:deadline_expiries_total",
                 "shoal:kv_cache_usage_perc", "shoal:time_to_first_token_seconds_bucket",
                 "shoal:inter_token_latency_seconds_bucket",
                 "shoal:e2e_request_latency_seconds_bucket",
                 "shoal:pool_hits_loaded_total", "shoal:pool_hits_split_total",
                 "shoal:pool_hits_computed_total", "shoal:pool_front_tokens_computed_total",
                 "shoal:prefill_tokens_per_second", "shoal:pool_load_tokens_per_second",
                 "shoal:pool_load_latency_seconds", "shoal:pool_hit_host_tokens_total",
                 "shoal:pool_host_load_tokens_per_second",
                 "shoal:pool_host_load_latency_seconds", "shoal:pool_front_slowdown",
                 "shoal:pool_load_slowdown"):
        assert name in text, name
    assert 'owner="0"' in text
    # the metrics vLLM has, also under its names (dashboards built for vLLM read them)
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "request_success_total", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "time_to_first_token_seconds_bucket",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_sum",
                 "e2e_request_latency_seconds_bucket"):
        ours = {k.replace("shoal:", ""): v for k, v in samples.items()
                if k.startswith(f"shoal:{name}")}
        theirs = {k.replace("vllm:", ""): v for k, v in samples.items()
                  if k.startswith(f"vllm:{name}")}
        assert ours and ours == theirs, name
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert re.search(r"# TYPE vllm:prompt_tokens(_total)? counter", text)
    assert "vllm:pool_" not in text  # shoal's own metrics keep only their name


# -- the server's own options -------------------------------------------------------------------


def test_host_access_log_engine_limits_and_shutdown_grace(smollm2_path, smollm2):
    s = Server(smollm2_path, "--host", "127.0.0.2", "--access-log", "--shutdown-grace", "1",
               "--no-overlap", "--max-batch-size", "4", "--max-num-tokens", "64",
               "--num-kv-blocks", "320", "--api-key", "k3y", "--max-body-bytes", "4000")
    s.headers = {"Authorization": "Bearer k3y"}
    try:
        # --api-key: /v1/* needs it (OpenAI's 401 body), /health and /metrics do not
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k3y"}):
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                           headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{s.url}/v1/models", timeout=30).status_code == 401
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{s.url}/metrics", timeout=30).status_code == 200
        from openai import AuthenticationError, OpenAI
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{s.url}/v1", api_key="wrong").models.list()
        assert OpenAI(base_url=f"{s.url}/v1", api_key="k3y").models.list().data
        # --max-body-bytes 4000: a 5000-byte body is refused unread, a 3000-byte one served
        big = s.post("/v1/completions", {"prompt": "x" * 5000, "max_tokens": 1})
        assert big.status_code == 413 and "--max-body-bytes" in big.json()["error"]["message"]
        assert s.post("/v1/completions", {"prompt": "y" * 3000, "max_tokens": 1}).status_code == 200
        # --host: it listens there, not on 127.0.0.1
        assert s.url == f"http://127.0.0.2:{s.port}"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=10)
        # --max-num-tokens 64: the prompt is prefilled in 64-token chunks, one per step (the
        # default prefills it in one)
        body = {"prompt": DOC, "max_tokens": 4, "temperature": 0}
        r = s.post("/v1/completions", body).json()
        ref = smollm2.generate([DOC], SamplingParams(max_tokens=4))[0].text
        assert r["choices"][0]["text"] == ref
        steps = _wait_idle(s)["shoal:iterations_total"]
        num_chunks = -(-r["usage"]["prompt_tokens"] // 64)
        assert steps >= num_chunks + 3, (steps, num_chunks)
        # --max-batch-size 4: 8 choices of 4 tokens take 8 steps or more (4 by default)
        r = s.post("/v1/completions", {"prompt": "The sea", "max_tokens": 4, "temperature": 0,
                                       "ignore_eos": True, "n": 8}).json()
        assert r["usage"]["completion_tokens"] == 32
        assert _wait_idle(s)["shoal:iterations_total"] - steps >= 8
        # --access-log: one line per request
        assert s.wait_for_line('"POST /v1/completions HTTP/1.1" 200', READY_TIMEOUT)
        # --shutdown-grace 1: a stream and a plain request far from done end a second
        # after SIGTERM, properly: an error event and [DONE]; a JSON 503. Meanwhile the
        # port stays open: /health and new requests are 503
        endless = {"prompt": "Count to ten thousand:", "max_tokens": 4000, "ignore_eos": True,
                   "temperature": 0}
        plain: list[httpx.Response] = []
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=120, headers=s.headers,
                          json={**endless, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            other = threading.Thread(target=lambda: plain.append(s.post("/v1/completions", endless)))
            other.start()
            _wait_metric(s, "shoal:server_requests_running", 2)
            s.terminate()
            start = time.monotonic()
            health = httpx.get(f"{s.url}/health", timeout=10)
            late = s.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
            events = _sse(lines)
            cut_after = time.monotonic() - start
        other.join(60)
        assert health.status_code == 503 and late.status_code == 503, (health.text, late.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutdown"
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "server_shutdown"
        assert cut_after < 15  # the default grace (30 s) would have let them run on
    finally:
        assert s.stop() == 0


def test_the_engine_flags_shape_the_server_s_engine(smollm2_path, smollm2):
    """`--block-size --kv-cache-gb --dtype --enforce-eager` reach the engine the server runs
    (its ready line: blocks of 32 tokens, as many as 0.05 GiB of float32 KV holds) and the
    answers are the library's."""
    s = Server(smollm2_path, "--block-size", "32", "--kv-cache-gb", "0.05", "--dtype",
               "float32", "--enforce-eager", verbose=True)
    try:
        line = s.wait_for_line("KV blocks of 32 tokens", READY_TIMEOUT)
        block_nbytes = 2 * smollm2.engine.info.block_nbytes  # (16-token float32 blocks there)
        assert smollm2.config.block_size == 16 and smollm2.config.torch_dtype == torch.float32
        assert line and f" {int(0.05 * 2**30) // block_nbytes} KV blocks" in line, line
        r = s.post("/v1/completions", {"prompt": DOC[:300], "max_tokens": 6, "temperature": 0})
        want = smollm2.generate([DOC[:300]], SamplingParams(max_tokens=6))[0].text
        assert r.json()["choices"][0]["text"] == want
    finally:
        assert s.stop() == 0


def _wait_metric(s: Server, name: str, value: float, timeout: float = 60.0) -> None:
    """Until /metrics shows `name` at `value` (the server's own state, read as it changes)."""
    deadline = time.monotonic() + timeout
    while (seen := s.metrics().get(name)) != value:
        assert time.monotonic() < deadline, (f"{name} stayed {seen}, expected {value}; "
                                             f"server output: {''.join(s.output[-20:])}")


def _raw(s: Server, data: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", s.port), timeout=60)
    conn.sendall(data)
    return conn


def _read_all(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    with conn:
        while chunk := conn.recv(65536):
            out += chunk
    return out


def test_places_queue_429_and_stalled_clients(smollm2_path, smollm2):
    """--max-concurrent-requests 1 --max-queue 1: one runs, one waits, the next gets 429
    with Retry-After while /health answers; the place goes to the waiter once the running
    request's client leaves, and a waiter that leaves gives its turn up. --read-timeout 2:
    a client that stalls mid-request is answered 408 and cut; one waiting for a long
    answer is not."""
    s = Server(smollm2_path, "--max-concurrent-requests", "1", "--max-queue", "1",
               "--read-timeout", "2", "--num-kv-blocks", "320")
    long = {"prompt": "Count to ten thousand:", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    short = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    try:
        with httpx.stream("POST", f"{s.url}/v1/completions", json=long, timeout=120) as r:
            # the iterator is kept: a dropped one closes the connection (a client gone)
            lines = r.iter_lines()
            first = next(lines)  # running: the one place is taken
            assert json.loads(first.removeprefix("data: "))["choices"], first
            results: list[httpx.Response] = []
            waiting = threading.Thread(target=lambda: results.append(
                s.post("/v1/completions", short)))
            waiting.start()
            _wait_metric(s, "shoal:server_requests_queued", 1)
            assert not results, results[0].text  # it waits (and did not fail)
            refused = s.post("/v1/completions", short)
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            err = refused.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "too_many_requests"
            assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
            assert s.metrics()["shoal:num_requests_rejected_total"] == 1
        waiting.join(120)  # the stream's client left: its place went to the waiter
        assert results[0].status_code == 200, results[0].text
        ref = smollm2.generate([short["prompt"]], SamplingParams(max_tokens=3))[0].text
        assert results[0].json()["choices"][0]["text"] == ref
        # a waiter whose client leaves gives its turn up: the next request runs at once
        with httpx.stream("POST", f"{s.url}/v1/completions", json=long, timeout=120) as r:
            lines = r.iter_lines()
            next(lines)
            body = json.dumps(short).encode()
            leaver = _raw(s, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            _wait_metric(s, "shoal:server_requests_queued", 1)
            leaver.close()
            _wait_metric(s, "shoal:server_requests_queued", 0)
        assert s.post("/v1/completions", short).status_code == 200
        _wait_metric(s, "shoal:server_requests_running", 0)
        # --read-timeout 2: stalled headers, a stalled body, a silent connection: 408, cut
        stalled = [_raw(s, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"),
                   _raw(s, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\""),
                   _raw(s, b"")]
        for conn in stalled:
            answer = _read_all(conn)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408
        # a stream that outlasts the timeout is not cut
        start = time.monotonic()
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=120,
                          json={**long, "max_tokens": 60}) as r:
            events = _sse(r)
        assert time.monotonic() - start > 2, "the stream must outlast --read-timeout"
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    finally:
        assert s.stop() == 0


# -- restart, SIGTERM, --dp 2 (last: they stop the shared server) ------------------------------


def test_restart_on_the_same_pool_loads_cached_tokens(server, smollm2_path, pool_dir):
    body = {"prompt": DOC + "\nQuestion: what did the keeper log?", "max_tokens": 6,
            "temperature": 0}
    before = server.post("/v1/completions", body).json()
    # SIGTERM during a running stream: it finishes or is cut within the grace; exit 0
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
            "prompt": "Count to one hundred:", "max_tokens": 30, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        server.terminate()
        events = _sse(lines)
    assert events and events[-1] == "[DONE]"
    assert server.stop() == 0
    again = Server(smollm2_path, "--kv-pool", pool_dir, "--num-kv-blocks", "1024")
    try:
        after = again.post("/v1/completions", body).json()
        details = after["usage"]["prompt_tokens_details"]
        m = again.metrics()
        # the pool's tokens were loaded, or computed where the engine found that faster
        front = m["shoal:pool_front_tokens_computed_total"]
        assert details["pool_tokens"] + front >= after["usage"]["prompt_tokens"] - 32, details
        assert details["cached_tokens"] == details["pool_tokens"] + details["local_prefix_tokens"]
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert m["shoal:pool_bytes_loaded_total"] > 0 and m["shoal:pool_hit_blocks_total"] > 0
    finally:
        assert again.stop() == 0


def test_dp2_serves_and_sigterm_leaves_no_rank(smollm2_path, smollm2):
    s = Server(smollm2_path, "--dp", "2", "--num-kv-blocks", "256")
    try:
        ranks = s.children()
        assert len(ranks) >= 2
        exits = _pidfds(ranks)  # these processes, whoever reuses their pids later
        ref = smollm2.chat(CHAT, SamplingParams(max_tokens=12))[0].text
        outs = [s.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                                 temperature=0) for _ in range(3)]
        assert all(o.choices[0].message.content == ref for o in outs)
        text = httpx.get(f"{s.url}/metrics").text
        assert 'owner="1"' in text
    finally:
        assert s.stop() == 0
    # the ranks are gone with the server (multiprocessing's resource tracker, also a
    # child, exits once it sees the server's end: within a bound)
    assert _still_running(exits, timeout=10) == []


def test_an_engine_process_drains_on_a_sigterm_to_the_server_s_whole_group(smollm2_path,
                                                                           smollm2):
    """`shoal serve --engine-process` (the default on a GPU) gives the same answers, and a
    SIGTERM to its whole process group (systemd's stop, `kill -- -PGID`) drains as one to
    the server does: the stream in flight finishes (the engine's process ignores it and
    stops when the server shuts it down); exit 0, no process left."""
    s = Server(smollm2_path, "--engine-process", "--num-kv-blocks", "256", own_group=True)
    try:
        ranks = s.children()
        exits = _pidfds(ranks)
        ref = smollm2.chat(CHAT, SamplingParams(max_tokens=12))[0].text
        out = s.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                               temperature=0)
        assert out.choices[0].message.content == ref
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=120, json={
                "prompt": "Count to one hundred:", "max_tokens": 30, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            s.terminate(group=True)
            events = _sse(lines)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) >= 2
    finally:
        assert s.stop() == 0
    assert ranks and _still_running(exits, timeout=10) == []


def _pidfds(pids: list[int]) -> dict[int, int]:
    """pid -> a pidfd of that process (readable once it exited); those gone already left out."""
    fds = {}
    for pid in pids:
        try:
            fds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            pass
    return fds


def _still_running(pidfds: dict[int, int], timeout: float) -> list[int]:
    """The pids whose process has not exited within `timeout` seconds (waits on each pidfd;
    closes them)."""
    deadline = time.monotonic() + timeout
    running = []
    for pid, fd in pidfds.items():
        readable, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
        if not readable:
            running.append(pid)
        os.close(fd)
    return running


# -- the driver (in process, tiny model) -------------------------------------------------------


def test_driver_wait_idle_and_a_request_added_around_it(tiny_model, caplog):
    from shoal import LLM
    from shoal.request import NewRequest
    with LLM(tiny_model, num_kv_blocks=64) as llm:
        driver = llm._driver
        assert driver.wait_idle(timeout=0)  # nothing submitted yet
        direct = llm.engine.add(NewRequest([1, 2, 3], SamplingParams(max_tokens=2)))
        h = llm.submit([4, 5, 6], SamplingParams(max_tokens=1000, ignore_eos=True))
        assert not driver.wait_idle(timeout=0)
        h.cancel()
        assert driver.wait_idle(timeout=60)
        assert h.result(timeout=0).finish_reason == "cancelled"
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0
    # the engine handed back a request the driver never had a handle for: said as it is
    assert f"request {direct} was added to the engine directly" in caplog.text


# -- a fatal engine failure (in-process app, tiny model, fault-injecting connector) ---------


def test_fatal_connector_failure_is_503(tiny_model, tmp_path):
    from fastapi.testclient import TestClient

    from shoal import LLM
    from shoal.connectors import ConnectorConfig
    from shoal.serving.app import build_app
    from shoal.serving.http import OpenAIServer

    cfg = ConnectorConfig(module="tests.fault_connector", scheduler_class="FaultScheduler",
                          worker_class="NoAbortFaultWorker",
                          options={"root": str(tmp_path), "fault": {"raise_in": "save_kv_layer"}},
                          transfer_timeout_sec=30, control_grace_sec=5)
    llm = LLM(tiny_model, kv_connector=cfg, num_kv_blocks=64)
    try:
        client = TestClient(build_app(OpenAIServer(llm, "tiny")))
        assert client.get("/health").status_code == 200
        body = {"prompt": list(range(1, 41)), "max_tokens": 4, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "service_unavailable" and "injected fault" in err["message"]
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503 and "injected fault" in r.json()["error"]["message"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 503
    finally:
        try:
            llm.shutdown()
        except RuntimeError as e:  # the connector's error, said again
            assert "injected fault" in str(e)


def test_tokens_queued_together_make_one_delta(smollm2):
    """Several steps' tokens waiting in a response's queue (the loop or the client fell
    behind) go out as one delta per choice, their text whole, before the choice's end."""
    import asyncio

    from shoal.serving.detokenizer import TextStream
    from shoal.serving.errors import ApiError
    from shoal.serving.generation import Choice, ChoiceQueue, Generation
    from shoal.serving.metrics import ServerMetrics

    prompt = smollm2.tokenizer.encode("The lighthouse keeper said")
    handle = smollm2.submit(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    out = handle.result(timeout=60)  # ended: the deltas' end finds its output

    async def deltas(steps: list[list[int]]):
        queue = ChoiceQueue()
        choice = Choice(0, 0, prompt, handle, TextStream(smollm2.tokenizer, prompt, []),
                        time.perf_counter())
        for ids in steps:  # all queued before the reader looks
            queue.put_nowait((0, ids, None, time.perf_counter()))
        queue.put_nowait((0, None, None, time.perf_counter()))
        return [d async for d in Generation([choice], queue, ServerMetrics("m")).deltas()]

    together = asyncio.run(deltas([[t] for t in out.token_ids]))
    assert [(d.text, d.finish_reason) for d in together] == [(out.text, None), ("", "length")]

    async def aborted():  # the server stops with tokens waiting: they go out before the error
        queue = ChoiceQueue()
        choice = Choice(0, 0, prompt, handle, TextStream(smollm2.tokenizer, prompt, []),
                        time.perf_counter())
        for t in out.token_ids:
            queue.put_nowait((0, [t], None, time.perf_counter()))
        queue.abort(ApiError(503, "stopping"))
        got = []
        with pytest.raises(ApiError):
            async for d in Generation([choice], queue, ServerMetrics("m")).deltas():
                got.append(d.text)
        return got

    assert asyncio.run(aborted()) == [out.text]


def test_every_connection_sends_small_writes_at_once():
    """Connections accepted from `shoal serve`'s listening socket have Nagle's algorithm off
    (with it on, each request of a kept-alive client waited ~40 ms for a delayed ACK)."""
    import uvicorn
    from uvicorn.server import ServerState

    from shoal.serving.process import listen
    from shoal.serving.read_timeout import ReadTimeoutProtocol

    seen = []

    class Probe(ReadTimeoutProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False)
    config.load()

    async def one_request() -> bytes:
        state, sock = ServerState(), listen("127.0.0.1", 0)
        assert sock.proto == socket.IPPROTO_TCP
        try:  # (as uvicorn serves the socket it is given: `sockets=[sock]`)
            listener = await asyncio.get_running_loop().create_server(
                lambda: Probe(config, state, {}), sock=sock)
        except BaseException:
            sock.close()
            raise
        try:
            port = listener.sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nhost: test\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            writer.close()
            await writer.wait_closed()
            return head
        finally:
            listener.close()
            await listener.wait_closed()

    assert asyncio.run(one_request()).startswith(b"HTTP/1.1 200")
    assert seen and all(seen)
