"""`shoal serve`'s endpoint logic (`OpenAIServer`) over one `LLM`; the routes are in app.py,
the process (socket, uvicorn, signals) in process.py.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    POST /tokenize              POST /detokenize
    GET /health                 GET /version           GET /metrics

The engine runs on the LLM's driver thread. A request takes a place (admission.py: past
`--max-concurrent-requests` running and `--max-queue` waiting, a 429), is tokenized,
checked and submitted on a worker thread (submit waits for the driver between two steps);
its tokens come back to the event loop through the handle's callback (`generation.py`),
so the loop never waits for the engine. Errors use OpenAI's body; bad input is a 400
naming the field. SIGTERM/SIGINT: `drain` (new requests and /health get 503, running ones
get the grace; past it every stream ends with an error event and [DONE], every other
response is a JSON 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from shoal.llm import LLM
from shoal.sampling import SamplingParams
from shoal.serving.admission import Admission, Place, QueueFull
from shoal.serving.detokenizer import TextStream
from shoal.serving.generation import Choice, ChoiceQueue, EngineStopped, Generation, TokenInbox
from shoal.serving.limits import ServerLimits
from shoal.serving.metrics import ServerMetrics
from shoal.serving.errors import ApiError, bad_request, field_of
from shoal.serving.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                           DetokenizeRequest, TokenizeRequest, for_prompt)
from shoal.serving.respond import disconnected, engine_stopped, error_response, respond
from shoal.serving.responses import ChatFormat, CompletionFormat
from shoal.serving.tools import ChatPrompt, ToolUse

log = logging.getLogger(__name__)

SUBMIT_THREADS = 64  # requests being tokenized and added at once
METRICS_WAIT_S = 0.05  # /metrics waits this long for fresh engine stats, then uses the last
FIRST_STATS_WAIT_S = 10.0  # ... unless there are none yet
ABORT_WAIT_S = 5.0  # past the shutdown grace: how long the cut responses may take to end
# the line on stderr once listening: "shoal serve: ready on http://HOST:PORT (model NAME)"
READY_MESSAGE = "shoal serve: ready on"


class OpenAIServer:
    """The endpoints' logic over one LLM (which it does not own: the caller shuts it down)."""

    def __init__(self, llm: LLM, served_model_name: str, limits: ServerLimits = ServerLimits()):
        self.llm = llm
        self.limits = limits
        self.admission = Admission(*limits.places(llm.config.max_batch_size * llm.config.dp_size))
        self.model_name = served_model_name
        info = llm.engine.info
        # what a request may grow to (the scheduler's limit: context, or the whole cache)
        self.max_request_len = min(info.max_model_len, info.num_kv_blocks * llm.config.block_size)
        self.max_model_len = info.max_model_len
        self.metrics = ServerMetrics(served_model_name)
        self.created = int(time.time())
        self._submitter = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="shoal-submit")
        # engine stats for /metrics: never queued behind tokenizing requests
        self._control = ThreadPoolExecutor(4, thread_name_prefix="shoal-stats")
        self._stats: dict | None = None  # the last stats read
        # loaded now, not by concurrent requests; the template tells the tool call format
        self._chat_template = (getattr(llm.tokenizer.hf, "chat_template", None)
                               if llm.tokenizer.is_available else None)
        # the most bytes one token stands for (each id decoded alone: a piece of a character
        # decodes to U+FFFD, more bytes than it holds), to refuse a text too long untokenized
        self._max_token_bytes = None
        if llm.tokenizer.is_available:
            hf = llm.tokenizer.hf
            self._max_token_bytes = max(len(t.encode("utf-8")) for t in hf.batch_decode(
                [[i] for i in range(len(hf))]))
        self.is_stopping = False
        self._inbox: TokenInbox | None = None  # made on the loop's first request
        self._queues: weakref.WeakSet[ChoiceQueue] = weakref.WeakSet()  # live requests'

    @property
    def engine_error(self) -> BaseException | None:
        """Why the engine stopped for good (the driver's record; LLM has no public one)."""
        return self.llm._driver.error

    def wait_idle(self, timeout: float) -> bool:
        """(worker thread) True once the engine has no work (every request ended, its KV
        blocks freed); False after `timeout` seconds (the driver's wait, as for engine_error)."""
        return self.llm._driver.wait_idle(timeout)

    def close(self) -> None:
        self._submitter.shutdown(wait=False, cancel_futures=True)
        self._control.shutdown(wait=False, cancel_futures=True)

    # -- endpoints -----------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        tools = ToolUse.from_request(body.tools, body.tool_choice, self._chat_template)
        forced = tools is not None and tools.mode != "auto"
        sampling = await self._sampling_of(
            body, lambda: body.sampling(tools.constraint() if forced else None), forced)
        conversation = body.conversation()
        prompt = tools.render(conversation) if tools else ChatPrompt(conversation)
        rid, gen = await self._start([prompt], sampling, body, "chatcmpl", request)
        fmt = ChatFormat(self.model_name, self.llm.tokenizer, rid, body.logprobs, tools,
                         body.prompt_logprobs)
        return await respond(gen, fmt, body.stream, body.include_usage, request)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        sampling = await self._sampling_of(body, body.sampling)
        prompts = body.prompts()
        rid, gen = await self._start(prompts, sampling, body, "cmpl", request)
        echo = None
        if body.echo:  # the prompts as text: as given, or token ids decoded (off the loop)
            echo = await asyncio.get_running_loop().run_in_executor(
                self._submitter, self._texts_of, prompts)
        fmt = CompletionFormat(self.model_name, self.llm.tokenizer, rid,
                               body.logprobs is not None, body.logprobs, echo,
                               body.prompt_logprobs)
        return await respond(gen, fmt, body.stream, body.include_usage, request)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """The ids a completion (prompt) or chat (messages) would run: the count clients
        budget with. Tokenized on a worker thread, as requests are."""
        self._check_model(body.model)
        prompt = body.text_or_conversation()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = ChatPrompt(prompt)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._submitter, self._prompt_ids, prompt)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": None}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self._check_model(body.model)
        vocab = self.llm.engine.info.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})",
                              "tokens")

        def decode() -> str:
            return self.llm.tokenizer.decode(list(body.tokens))
        loop = asyncio.get_running_loop()
        try:
            return {"prompt": await loop.run_in_executor(self._submitter, decode)}
        except ValueError as e:  # no tokenizer
            raise bad_request(str(e), "tokens") from e

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "shoal", "root": self.llm.config.model,
            "max_model_len": self.max_model_len}]}

    def health(self) -> Response:
        error = self.engine_error
        if error is not None:
            return error_response(engine_stopped(error))
        if self.is_stopping:
            return error_response(ApiError(503, "the server is shutting down",
                                            type_="service_unavailable"))
        return JSONResponse({"status": "ok"})

    async def render_metrics(self) -> Response:
        """The metrics with the engine's stats as fresh as METRICS_WAIT_S allows: a read
        waits for the engine between two steps, and a long prefill step must not hold the
        answer (the last stats read are used meanwhile)."""
        read = asyncio.get_running_loop().run_in_executor(self._control, self.llm.stats)
        read.add_done_callback(self._stats_read)
        # the first scrape has no earlier stats to show: it waits for these
        await asyncio.wait({read}, timeout=METRICS_WAIT_S if self._stats is not None
                           else FIRST_STATS_WAIT_S)
        stats = self._stats if not read.done() else self._stats_of(read)
        return Response(self.metrics.render(stats, self.admission),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def _stats_read(self, read: asyncio.Future) -> None:
        self._stats = self._stats_of(read)

    @staticmethod
    def _stats_of(read: asyncio.Future) -> dict | None:
        if read.cancelled() or read.exception() is not None:
            # the engine is gone: the server's own metrics still count
            log.debug("stats: %s", None if read.cancelled() else read.exception())
            return None
        return read.result()

    async def drain(self, grace_s: float) -> None:
        """(SIGTERM) New requests get 503 and /health says 503, while the port stays open;
        running and waiting requests get `grace_s` seconds to finish. Then every stream
        gets an error event and [DONE], every other response a JSON 503, waiters too, and
        their choices are cancelled in the engine."""
        self.is_stopping = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.admission.wait_idle(), grace_s)
            return
        error = ApiError(503, f"the server is shutting down: the request did not finish "
                         f"within the shutdown grace ({grace_s:g} s)",
                         type_="service_unavailable", code="server_shutdown")
        log.warning("shutdown grace (%g s) over: ending %d request(s)", grace_s,
                    self.admission.num_running + self.admission.num_waiting)
        self.admission.fail_waiters(error)
        for queue in list(self._queues):
            queue.abort(error)
        with contextlib.suppress(TimeoutError):  # their cancels take an engine step
            await asyncio.wait_for(self.admission.wait_idle(), ABORT_WAIT_S)

    # -- requests --------------------------------------------------------------------------

    async def _sampling_of(self, body, make, has_grammar: bool = False) -> SamplingParams:
        """`make()`: the body's sampling; with structured output (or a forced tool call) on
        a worker thread (checking a grammar can take a while: never on the loop)."""
        if not (has_grammar or body.asks_structured_output):
            return make()
        return await asyncio.get_running_loop().run_in_executor(self._submitter, make)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist (this server serves "
                           f"`{self.model_name}`)", "model", code="model_not_found")
        if self.engine_error is not None:
            raise engine_stopped(self.engine_error)
        if self.is_stopping:
            raise ApiError(503, "the server is shutting down", type_="service_unavailable")

    async def _start(self, prompts: list, sampling: SamplingParams, body, kind: str,
                     request: Request) -> tuple[str, Generation]:
        """Take a place (admission.py), then tokenize, check and submit every choice on a
        worker thread; the choices' tokens reach their queue on this loop, and the place
        is given back once every choice has ended in the engine. If this task is
        cancelled meanwhile, whatever was submitted is cancelled once the worker returns."""
        loop = asyncio.get_running_loop()
        if self._inbox is None:
            self._inbox = TokenInbox(loop)
        arrival = time.perf_counter()
        rid = f"{kind}-{uuid.uuid4().hex}"
        stop = body.stop_strings()
        has_limit = (getattr(body, "max_completion_tokens", None) is not None
                     or body.max_tokens is not None)
        place = await self._admit(request)
        queue = ChoiceQueue()
        self._queues.add(queue)
        future = loop.run_in_executor(
            self._submitter, self._submit_all, queue, rid, prompts, sampling, has_limit,
            body.n, stop, body.cache_salt, arrival)
        future.add_done_callback(lambda f: _hold_until_ended(f, queue, place))
        try:
            choices = await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_cancel_submitted)
            raise
        return rid, Generation(choices, queue, self.metrics)

    async def _admit(self, request: Request) -> Place:
        """A place for a generation request (QueueFull: 429), given up if the client
        leaves while it waits."""
        try:
            place = self.admission.take_now()
        except QueueFull:
            self.metrics.observe_rejected()
            raise
        if place is not None:
            return place
        enter = asyncio.ensure_future(self.admission.wait())
        watch = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({enter, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not enter.done():
                enter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await enter
        if enter.cancelled():
            raise asyncio.CancelledError  # the client left while waiting
        return enter.result()

    def _submit_all(self, queue, rid, prompts, sampling, has_limit, n, stop,
                    cache_salt, arrival) -> list[Choice]:
        """(worker thread) Every prompt checked before any is submitted; all or nothing."""
        prompt_ids = [self._prompt_ids(p) for p in prompts]
        choices: list[Choice] = []
        try:
            for p, ids in enumerate(prompt_ids):
                for j in range(n):
                    index = p * n + j
                    sp = for_prompt(sampling, len(ids), self.max_request_len, has_limit, j)
                    handle = self.llm.submit(ids, sp, request_id=f"{rid}-{index}",
                                             cache_salt=cache_salt)
                    choices.append(Choice(index, p, ids, handle,
                                          TextStream(self.llm.tokenizer, ids, stop), arrival))
                    handle.subscribe(self._inbox.callback(queue, index))
        except BaseException as e:
            for c in choices:
                c.cancel()
            if isinstance(e, (TypeError, ValueError)):
                param = field_of(str(e)) or ("cache_salt" if "cache_salt" in str(e)
                                              else "prompt")
                raise bad_request(str(e), param)
            if isinstance(e, RuntimeError) and not isinstance(e, ApiError):
                raise EngineStopped(str(e)) from e
            raise
        return choices

    def _texts_of(self, prompts: list) -> list[str]:
        """(worker thread) Each prompt as text: as given, or its token ids decoded."""
        if not self.llm.tokenizer.is_available:
            return [p if isinstance(p, str) else "" for p in prompts]
        return [p if isinstance(p, str) else self.llm.tokenizer.decode(list(p))
                for p in prompts]

    def _refuse_certainly_too_long(self, prompt, param: str) -> None:
        """A text with more UTF-8 bytes than max_request_len tokens of the longest token
        could hold is refused before it is tokenized (a huge prompt would hold the
        tokenizer, and every other request's tokenizing, for seconds)."""
        if self._max_token_bytes is None or not isinstance(prompt, (str, ChatPrompt)):
            return
        texts = [prompt] if isinstance(prompt, str) else [
            m.get("content") or "" for m in prompt.messages]
        num_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if num_bytes > self.max_request_len * self._max_token_bytes:
            raise bad_request(
                f"{param} is {num_bytes} bytes: more tokens than this server's limit of "
                f"{self.max_request_len} (the context, or what the KV cache holds)", param)

    def _prompt_ids(self, prompt) -> list[int]:
        """Token ids of a prompt: text, token ids, or a conversation (chat template)."""
        param = "messages" if isinstance(prompt, ChatPrompt) else "prompt"
        self._refuse_certainly_too_long(prompt, param)
        try:
            # (threads tokenize at once: shoal.model.tokenizer takes its own lock where needed)
            if param == "messages":
                ids = self.llm.tokenizer.apply_chat_template(prompt.messages, prompt.tools)
            elif isinstance(prompt, str):
                ids = self.llm.tokenizer.encode(prompt)
            else:
                ids = list(prompt)
        except (TypeError, ValueError) as e:
            raise bad_request(str(e), param) from e
        except Exception as e:  # a chat template may raise its own errors (e.g. roles)
            raise bad_request(f"{param}: {type(e).__name__}: {e}", param) from e
        if not ids:
            raise bad_request(f"{param} is empty once tokenized", param)
        if len(ids) > self.max_request_len:
            raise bad_request(
                f"{param} has {len(ids)} tokens, more than this server's limit of "
                f"{self.max_request_len} (the context, or what the KV cache holds)", param)
        return ids



def _hold_until_ended(future, queue: ChoiceQueue, place: Place) -> None:
    """The place goes back once every submitted choice has ended (at once if none was)."""
    if future.cancelled() or future.exception() is not None:
        place.release()  # nothing was submitted (a bad request): all or nothing
    else:
        queue.on_all_ended(len(future.result()), place.release)


def _cancel_submitted(future) -> None:
    """A submit whose HTTP request was abandoned meanwhile: cancel what it started."""
    if not future.cancelled() and future.exception() is None:
        for choice in future.result():
            choice.cancel()
