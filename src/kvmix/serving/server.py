"""``kvmix serve``'s OpenAI-compatible app (docs/guide/serving.md): ``/v1/completions`` and
``/v1/chat/completions`` (streamed or not), ``/v1/models``, ``/health`` and ``/metrics``, over a
started continuous-batching manager (``KVMixManager``, or ``TransformersManager``, the anchor).

* **Parameters** are parsed once where they enter (``protocol``): each honoured or refused with
  a 400 naming it. Sampling, seeds and logprobs are the loop's (``sampling``); stop strings and
  the text the client sees are each choice's ``ChoiceText``; ``n`` choices and several prompts
  are the manager's requests, one per prompt, forked per choice.
* **Ids** are the server's own (``cmpl-...``/``chatcmpl-...``); a client's ``X-Request-ID`` is
  echoed and logged, never used as a key.
* **Faults** stay with their request: the loop contains a failed step (``engine``), the request
  at fault gets a 500 with the cause (a streamed one a last chunk with the error).
* **Limits and access**: headers beyond ``MAX_HEADERS`` get 431, bodies beyond ``max_body``
  413 before they are parsed (the rest read and dropped: ``DRAIN_BYTES``); every field is
  bounded by ``protocol`` (400); parsing, tokenization and chat templates run in a worker
  thread; beyond ``max_waiting`` waiting prompts a request gets 429; a request past
  ``request_timeout`` (both on by default), or whose client went away, is cancelled and its
  pages return; with ``api_key``, ``/v1/*``
  needs ``Authorization: Bearer KEY`` (compared in constant time), ``/health`` and
  ``/metrics`` stay open.
* **Drain and death**: ``drain()`` (SIGTERM, SIGINT) answers 503 to new requests and lets
  running ones finish for up to ``drain_timeout`` seconds, then the server stops (exit 0); if
  the generation loop dies, the server stops with ``exit_code`` 1 for a supervisor to restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmix.serving.engine import child_ids
from kvmix.serving.metrics import CONTENT_TYPE, Metrics
from kvmix.serving.protocol import Ask, ParseError, parse
from kvmix.serving.text import ChoiceText, Delta, Token

LOG = logging.getLogger("kvmix.serve")
X_REQUEST_ID = "x-request-id"
MAX_HEADERS = 32 << 10  # bytes of a request's headers (431 beyond)
# A body refused for its size is still read, and dropped, up to this many bytes and seconds, so
# the client reads the 413 rather than a connection closed under its unsent body.
DRAIN_BYTES, DRAIN_SECONDS = 64 << 20, 30.0
POLL = 0.25  # seconds between checks of a waiting request's client, deadline and the server


@dataclass
class Limits:
    """What the server allows and requires."""

    max_tokens: int = 128  # a request's max_tokens when it sends none
    max_waiting: int = 256  # 429 beyond this many waiting requests (0: none refused)
    max_body: int = 4 << 20  # bytes of a request body (413 beyond)
    request_timeout: float | None = 600.0  # seconds a request may take, waiting included
    api_key: str | None = None  # /v1/* require "Authorization: Bearer <api_key>"
    drain_timeout: float = 30.0  # seconds running requests may take after drain()

    def __post_init__(self):
        for name in ("max_tokens", "max_body"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; expected an integer >= 1")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) \
                or self.max_waiting < 0:
            raise ValueError(f"max_waiting={self.max_waiting!r} is invalid; expected >= 0")
        for name in ("request_timeout", "drain_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r} is invalid; expected seconds > 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key is empty; give a key or none")


class Refused(Exception):
    """A request answered with an error status, before or while it runs."""

    def __init__(self, status: int, message: str, cause: str, kind: str = "server_error"):
        super().__init__(message)
        self.status, self.message, self.cause, self.kind = status, message, cause, kind

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": None, "code": self.status}},
                            self.status, headers=headers)


def bad_request(message: str) -> Refused:
    return Refused(400, message, "bad_request", "invalid_request_error")


# -- the service: what the routes share ----------------------------------------------------------

class Service:
    """The manager, tokenizer, limits and metrics of one server, the requests running, and
    whether it drains or its loop died."""

    def __init__(self, manager: Any, tokenizer: Any, name: str, limits: Limits):
        self.manager, self.tokenizer, self.name, self.limits = manager, tokenizer, name, limits
        self.metrics = Metrics(self.figures, name)
        self.runs: set[Run] = set()
        self.arrived = 0  # /v1 requests admitted by the gate and not yet answered in full
        self.draining_since: float | None = None
        self.exit_code: int | None = None  # set when the server should stop
        self.stop: Callable[[], None] = lambda: None  # set by ``Server``
        self.created = int(time.time())
        self.vocab = len(tokenizer)
        eos = getattr(manager.generation_config, "eos_token_id", None)
        self.eos = {e for e in (eos if isinstance(eos, list) else [eos]) if e is not None
                    and e >= 0}

    def figures(self) -> dict[str, float]:
        return self.manager.stats.snapshot()

    def drain(self) -> None:
        """Stop admitting (503); running requests go on until ``drain_timeout``."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            LOG.warning("draining: %d requests running, new ones refused (up to %.0f s)",
                        len(self.runs), self.limits.drain_timeout)

    def loop_died(self) -> bool:
        status = self.manager.background_thread_status
        return status.fatal_error is not None or not self.manager.is_running()

    async def watch(self) -> None:
        """Stop the server once a drain is over, or with exit code 1 if the loop died."""
        while self.exit_code is None:
            await asyncio.sleep(POLL / 5)
            if self.loop_died():
                LOG.error("the generation loop died (%s): stopping with exit code 1",
                          self.manager.background_thread_status.fatal_error)
                self._end(1, "the generation loop died", "loop_died")
            elif self.draining_since is not None and (
                    not self.arrived or time.monotonic() - self.draining_since
                    > self.limits.drain_timeout):
                self._end(0, "the server shut down before the request finished",
                          "draining")

    def _end(self, code: int, why: str, cause: str) -> None:
        for run in list(self.runs):
            run.abort(Refused(503, why, cause))
        self.exit_code = code
        self.stop()

    def encode(self, ask: Ask) -> list[list[int]]:
        """Each prompt's token ids (in a worker thread: a long prompt stalls no one)."""
        if ask.chat:
            ids = self.tokenizer.apply_chat_template(ask.prompts[0], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
            return [list(ids.get("input_ids", ids) if isinstance(ids, dict) else ids)]
        prompts = []
        for prompt in ask.prompts:
            ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
            outside = [t for t in ids if t >= self.vocab]
            if outside:
                raise bad_request(f"prompt token id {outside[0]} is outside the vocabulary "
                                  f"[0, {self.vocab})")
            prompts.append(list(ids))
        return prompts

    def admit(self, ask: Ask, prompts: list[list[int]], max_tokens: int) -> None:
        """Refuse what can never be served (400) or, beyond ``max_waiting``, 429."""
        if ask.model is not None and ask.model != self.name:
            raise bad_request(f"model={ask.model!r}: the server is pinned to {self.name!r}")
        if any(t >= self.vocab for t in ask.stop_token_ids):
            raise bad_request(f"stop_token_ids holds an id outside the vocabulary "
                              f"[0, {self.vocab})")
        try:
            ask.sampling.check_vocabulary(self.vocab)
        except ValueError as error:
            raise bad_request(str(error)) from None
        if ask.sampling.min_tokens > max_tokens:
            raise bad_request(f"min_tokens={ask.sampling.min_tokens} is invalid; expected at "
                              f"most max_tokens ({max_tokens})")
        for prompt in prompts:
            why = self.manager.refusal(len(prompt), max_tokens, ask.n)
            if why:
                raise bad_request(why)
        waiting = self.figures()["waiting"] + self.manager.input_queue.qsize()
        limit = self.limits.max_waiting
        if limit and waiting + len(prompts) > limit:
            raise Refused(429, f"{waiting:.0f} requests are waiting (max_waiting={limit}): "
                          "retry later", "overloaded", "rate_limit_error")


# -- one request --------------------------------------------------------------------------------

@dataclass
class Choice:
    """One choice of a request: the manager's request id, its text, how it ended."""

    index: int
    request_id: str
    text: ChoiceText
    stops: set[int]  # token ids that end it (EOS, stop_token_ids)
    seen: int = 0  # tokens of the manager's output taken
    finish: str | None = None
    error: str | None = None
    sent_role: bool = False

    def take(self, output: Any) -> Delta:
        """The tokens ``output`` (the manager's ``ServedOutput``) adds -> the text released."""
        tokens = output.generated_tokens
        new = slice(self.seen, len(tokens))
        delta = self.text.feed(tokens[new], output.logprobs[new],
                               getattr(output, "top_logprobs", [])[new])
        self.seen = len(tokens)
        if self.text.stopped:
            self.finish = "stop"
        elif output.error is not None:
            self.error = output.error
        elif output.is_finished():
            rest = self.text.finish()
            delta = Delta(delta.text + rest.text, delta.tokens + rest.tokens)
            self.finish = "stop" if tokens and tokens[-1] in self.stops else "length"
        return delta

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None


class Run:
    """One HTTP request on the manager: its choices (``n`` per prompt) submitted together,
    read as their outputs arrive, cancelled together when it ends early."""

    def __init__(self, service: Service, ask: Ask, prompts: list[list[int]], max_tokens: int,
                 client_id: str | None):
        self.service, self.ask, self.prompts = service, ask, prompts
        self.id = f"{'chatcmpl' if ask.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.client_id = client_id
        self.start = time.monotonic()
        self.first: float | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        stops = set() if ask.ignore_eos else set(service.eos)
        stops |= set(ask.stop_token_ids)
        self.stops = stops
        logprobs = ask.sampling.logprobs is not None
        self.choices = [
            Choice(i * ask.n + j, rid, ChoiceText(service.tokenizer, ask.stop, logprobs,
                                                  ask.sampling.min_tokens), stops)
            for i in range(len(prompts))
            for j, rid in enumerate(self._ids(i))]
        self.max_tokens = max_tokens

    def _ids(self, prompt: int) -> list[str]:
        parent = f"{self.id}-{prompt}"
        return [parent, *child_ids(parent, self.ask.n)]

    def submit(self) -> None:
        """Every prompt to the manager (its n choices fork from it), each choice's outputs
        routed to this run."""
        manager = self.service.manager
        for choice in self.choices:
            manager.register_result_handler(
                choice.request_id, lambda output, c=choice: self.queue.put_nowait((c, output)))
        self.service.runs.add(self)
        for i, prompt in enumerate(self.prompts):
            added = manager.add_request(
                prompt, request_id=self._ids(i)[0], max_new_tokens=self.max_tokens,
                streaming=True, eos_token_id=sorted(self.stops) or -1,
                sampling=self.ask.sampling, n=self.ask.n)
            if added is None:
                raise Refused(503, "the server is not taking requests",
                              "loop_died" if self.service.loop_died() else "draining")

    def abort(self, refusal: Refused) -> None:
        self.queue.put_nowait((None, refusal))

    async def events(self, request: Request | None) -> AsyncIterator[tuple[Choice, Delta]]:
        """(choice, what it adds) as outputs arrive, until every choice is done; ``Refused``
        for a fault (500), the deadline (504), a drain or a gone client (checked every
        ``POLL`` seconds, outputs arriving or not)."""
        check = time.monotonic() + POLL
        while not all(c.done for c in self.choices):
            now = time.monotonic()
            if now >= check:
                await self._check(request)
                check = now + POLL
            try:
                choice, output = self.queue.get_nowait()  # no task per output when they queue
            except asyncio.QueueEmpty:
                try:
                    choice, output = await asyncio.wait_for(self.queue.get(), check - now)
                except asyncio.TimeoutError:
                    continue
            if choice is None:
                raise output
            if choice.done:
                continue
            delta = choice.take(output)
            if choice.error is not None:
                raise Refused(500, f"generation failed: {choice.error}", "fault")
            if delta.text and self.first is None:
                self.first = time.monotonic() - self.start
            if choice.done:
                self._release(choice, cancel=choice.text.stopped)
            yield choice, delta

    async def _check(self, request: Request | None) -> None:
        timeout = self.service.limits.request_timeout
        if timeout is not None and time.monotonic() - self.start > timeout:
            raise Refused(504, f"the request passed its deadline of {timeout:g} s "
                          "(request_timeout)", "timeout")
        if request is not None and await request.is_disconnected():
            raise Refused(499, "the client went away", "disconnected")

    def _release(self, choice: Choice, cancel: bool) -> None:
        """A choice ended here (a stop string) or in the manager: its handler goes, and the
        manager's request is cancelled when it still runs (its pages return)."""
        manager = self.service.manager
        with manager.output_router._lock:
            manager.output_router.result_handlers.pop(choice.request_id, None)
        if cancel:
            manager.cancel_request(choice.request_id)

    def close(self) -> None:
        """Whatever still runs (or was submitted before a refusal) is cancelled."""
        for choice in self.choices:
            if not choice.done:
                choice.error = choice.error or "cancelled"
                self._release(choice, cancel=True)
        self.service.runs.discard(self)

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        output = sum(c.text.count for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": output,
                "total_tokens": prompt + output}

    def record(self) -> None:
        usage = self.usage()
        self.service.metrics.succeeded([c.finish for c in self.choices],
                                       usage["prompt_tokens"], usage["completion_tokens"],
                                       time.monotonic() - self.start, self.first)
        LOG.info("%s (x-request-id %s): %d choices, %d + %d tokens, %.2f s", self.id,
                 self.client_id, len(self.choices), usage["prompt_tokens"],
                 usage["completion_tokens"], time.monotonic() - self.start)

    # -- the answer, whole or streamed --------------------------------------------------------

    def envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.ask.chat else "text_completion") + \
            (".chunk" if chunk and self.ask.chat else "")
        return {"id": self.id, "object": kind, "created": self.service.created,
                "model": self.service.name}

    async def whole(self, request: Request) -> JSONResponse:
        texts: dict[int, list[Delta]] = {c.index: [] for c in self.choices}
        async for choice, delta in self.events(request):
            texts[choice.index].append(delta)
        choices = []
        for choice in self.choices:
            deltas = texts[choice.index]
            text = "".join(d.text for d in deltas)
            tokens = [t for d in deltas for t in d.tokens]
            body = {"index": choice.index, "logprobs": self._logprobs(tokens),
                    "finish_reason": choice.finish}
            if self.ask.chat:
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["text"] = text
            choices.append(body)
        self.record()
        return JSONResponse({**self.envelope(False), "choices": choices, "usage": self.usage()})

    async def stream(self) -> AsyncIterator[str]:
        async for choice, delta in self.events(None):
            if self.ask.chat and not choice.sent_role:
                choice.sent_role = True
                yield _sse(self._chunk(choice, {"role": "assistant", "content": ""}, None))
            if delta.text or delta.tokens:
                part = {"content": delta.text} if self.ask.chat else delta.text
                yield _sse(self._chunk(choice, part, self._logprobs(delta.tokens)))
            if choice.done:
                yield _sse(self._chunk(choice, {} if self.ask.chat else "", None, choice.finish))
        if self.ask.include_usage:
            yield _sse({**self.envelope(True), "choices": [], "usage": self.usage()})
        self.record()
        yield "data: [DONE]\n\n"

    def _chunk(self, choice: Choice, part: Any, logprobs: Any,
               finish: str | None = None) -> dict[str, Any]:
        body = {"index": choice.index, "logprobs": logprobs, "finish_reason": finish}
        body["delta" if self.ask.chat else "text"] = part
        return {**self.envelope(True), "choices": [body]}

    def _logprobs(self, tokens: list[Token]) -> dict[str, Any] | None:
        """The tokens' log-probabilities in the endpoint's format, or None when not asked."""
        if self.ask.sampling.logprobs is None:
            return None
        if self.ask.chat:
            return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.raw),
                                 "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(b)}
                                                  for s, lp, b in t.top]} for t in tokens]}
        return {"tokens": [t.text for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [_most_likely_first(t.top) for t in tokens],
                "text_offset": [t.start for t in tokens]}


def _most_likely_first(top: list[tuple[str, float, bytes]]) -> dict[str, float]:
    """Completions' alternatives as OpenAI's text -> logprob map: where two tokens decode to
    the same text, the more likely one's entry (``top`` comes most likely first)."""
    entries: dict[str, float] = {}
    for text, logprob, _ in top:
        entries.setdefault(text, logprob)
    return entries


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


# -- the app ------------------------------------------------------------------------------------

def build_app(manager: Any, tokenizer: Any, name: str, limits: Limits | None = None
              ) -> FastAPI:
    """The app over ``manager`` (a started ``KVMixManager`` or ``TransformersManager``)."""
    service = Service(manager, tokenizer, name, limits or Limits())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        watcher = asyncio.create_task(service.watch())
        yield
        watcher.cancel()

    # no /docs, /redoc or /openapi.json: the API is OpenAI's, and they would be open
    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(service, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answer(service, request, chat=True)

    @app.get("/v1/models")
    def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": service.created, "owned_by": "kvmix"}]})

    @app.get("/health")
    def health() -> JSONResponse:
        if service.loop_died():
            return JSONResponse({"status": "unhealthy", "reason": "the loop died"}, 503)
        if service.draining_since is not None:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    return Gate(app, service)


async def _answer(service: Service, request: Request, chat: bool) -> Response:
    """A completion or chat request from its body to its answer."""
    client_id = request.headers.get(X_REQUEST_ID)
    run, streaming = None, False
    try:
        ask, prompts = await asyncio.to_thread(_read, service, await request.body(), chat)
        max_tokens = ask.max_tokens or service.limits.max_tokens
        service.admit(ask, prompts, max_tokens)
        run = Run(service, ask, prompts, max_tokens, client_id)
        run.submit()
        if ask.stream:
            streaming = True  # the stream closes the run
            return StreamingResponse(_streamed(run), media_type="text/event-stream",
                                     headers={X_REQUEST_ID: client_id or run.id})
        response = await run.whole(request)
        response.headers[X_REQUEST_ID] = client_id or run.id
        return response
    except Refused as refusal:
        service.metrics.failure(refusal.cause)
        LOG.info("%s (x-request-id %s): %d %s", run.id if run else "-", client_id,
                 refusal.status, refusal.message)
        return refusal.response({X_REQUEST_ID: client_id or (run.id if run else "")})
    finally:
        if run is not None and not streaming:
            run.close()


def _read(service: Service, body: bytes, chat: bool) -> tuple[Ask, list[list[int]]]:
    """A request body -> what it asks and its prompts' token ids (in a worker thread: parsing
    and tokenizing a large body stall no one), or a 400 naming what is wrong."""
    try:
        ask = parse(json.loads(body), chat)
    except RecursionError:
        raise bad_request("the request body nests too deep to parse") from None
    except ParseError as error:
        raise bad_request(str(error)) from None
    except ValueError:  # json's errors, invalid UTF-8 among them
        raise bad_request("the request body is not valid JSON (UTF-8)") from None
    try:
        return ask, service.encode(ask)
    except Refused:
        raise
    except Exception as error:  # a chat template or tokenizer that refuses the input
        raise bad_request(f"the prompt cannot be tokenized: {type(error).__name__}: "
                          f"{error}") from None


async def _streamed(run: Run) -> AsyncIterator[str]:
    """A run's chunks; a refusal while it runs is its last chunk (then [DONE]); a client that
    closes the stream (the response is cancelled) is counted as gone."""
    try:
        async for chunk in run.stream():
            yield chunk
    except (asyncio.CancelledError, GeneratorExit):  # cancelled in a read or at a chunk
        run.service.metrics.failure("disconnected")
        LOG.info("%s (x-request-id %s): the client closed the stream", run.id, run.client_id)
        raise
    except Refused as refusal:
        run.service.metrics.failure(refusal.cause)
        LOG.info("%s (x-request-id %s): %s", run.id, run.client_id, refusal.message)
        yield _sse({"error": {"message": refusal.message, "type": refusal.kind,
                              "param": None, "code": refusal.status}})
        yield "data: [DONE]\n\n"
    finally:
        run.close()


class Gate:
    """ASGI middleware in front of the app: headers beyond ``MAX_HEADERS`` bytes refused
    (431); ``/v1/*`` refused while draining (503) or without the API key (401); bodies beyond
    ``max_body`` refused (413) before they are parsed, the rest of them read and dropped."""

    def __init__(self, app: FastAPI, service: Service):
        self.app, self.service = app, service

    @property
    def state(self) -> Any:
        return self.app.state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Refuse what the gate refuses; count each /v1 request it lets in from its first
        byte to its answer's last (a drain waits for it: read, tokenized, queued or running)."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADERS:
            refusal = Refused(431, f"the request's headers exceed {MAX_HEADERS} bytes",
                              "too_large", "invalid_request_error")
        elif not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        else:
            refusal = self._refusal(headers)
        if refusal is None:
            self.service.arrived += 1
            try:
                if scope["method"] == "POST":
                    body, refusal = await self._body(receive, headers)
                    receive = _replay(body, receive)
                if refusal is None:
                    return await self.app(scope, receive, send)
            finally:
                self.service.arrived -= 1
        self.service.metrics.failure(refusal.cause)
        return await refusal.response()(scope, receive, send)

    def _refusal(self, headers: dict[bytes, bytes]) -> Refused | None:
        key = self.service.limits.api_key
        if key is not None:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                return Refused(401, "a valid API key is required: Authorization: Bearer <key>",
                               "unauthorized", "authentication_error")
        if self.service.draining_since is not None:
            return Refused(503, "the server is shutting down: retry on another replica",
                           "draining")
        return None

    async def _body(self, receive: Callable, headers: dict[bytes, bytes]
                    ) -> tuple[bytes, Refused | None]:
        limit = self.service.limits.max_body
        too_large = Refused(413, f"the request body exceeds max_body={limit} bytes",
                            "too_large", "invalid_request_error")
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            if int(declared) <= DRAIN_BYTES and headers.get(b"expect", b"").lower() \
                    != b"100-continue":  # else more than a drop takes, or nothing is sent
                await _drop(receive)
            return b"", too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", Refused(499, "the client went away", "disconnected")
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                if message.get("more_body"):
                    await _drop(receive)
                return b"", too_large
            if not message.get("more_body"):
                return b"".join(chunks), None


async def _drop(receive: Callable) -> None:
    """Read the rest of a refused body and drop it (``DRAIN_BYTES``, ``DRAIN_SECONDS`` at most)."""
    async def drain() -> None:
        dropped = 0
        while dropped < DRAIN_BYTES:
            message = await receive()
            dropped += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                return

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(drain(), DRAIN_SECONDS)


def _replay(body: bytes, receive: Callable) -> Callable[[], Awaitable[dict]]:
    """A ``receive`` that gives the body read already, then the client's own messages."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


# -- the process --------------------------------------------------------------------------------

class Server:
    """The app on ``host:port``, in the foreground (``run``: SIGTERM/SIGINT drain, then exit
    with the service's exit code) or in a thread of this process (``start``/``stop``);
    ``port=0`` takes a free port, readable as ``port`` once bound."""

    def __init__(self, app: Gate, host: str = "127.0.0.1", port: int = 8000):
        self.service: Service = app.state.service
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY on the connections only then (without
        # it, a response's two writes wait for the client's delayed ACK, about 40 ms)
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))  # the port is taken (or refused) before any serving
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = _Draining(config, self.service)
        self.service.stop = self._exit
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _exit(self) -> None:
        self.server.should_exit = True

    def run(self) -> int:
        """Serve until drained or the loop dies -> the exit code (0 after a drain)."""
        self.server.run(sockets=[self.socket])
        return self.service.exit_code or 0

    def start(self, timeout: float = 30.0) -> None:
        self.thread = threading.Thread(target=lambda: asyncio.run(
            self.server.serve(sockets=[self.socket])), name="kvmix-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.socket.close()


class _Draining(uvicorn.Server):
    """uvicorn's server whose exit signals drain the service first (a second one exits)."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.service.draining_since is None:
            self.service.drain()
        else:
            super().handle_exit(sig, frame)
