"""An OpenAI-compatible chat-completions endpoint in front of the engines, one per rollout worker.

Agents written against the OpenAI API (the ``openai`` SDK, the OpenAI Agents SDK, LangGraph, a
hand-written loop) talk to it over real HTTP (FastAPI on uvicorn). Every episode gets its own API
key; each request of that episode is turned into token ids by its
:class:`~agentrl.rollout.agent.recorder.EpisodeRecorder` (a rendered delta when it continues the episode, a
new segment when it rewrites history), the engine samples, and the sampled tokens, logprobs and
weight versions are recorded as sampled before the response goes back. The response carries
``tool_calls`` parsed by vLLM's parser of the model's family (``rollout.tool_parser``),
``usage`` and ``finish_reason``; ``stream=true`` answers in server-sent events.

Bad requests get a 4xx with an OpenAI-style error body (``{"error": {"message", "type",
"param", "code"}}``) and write nothing. This module knows nothing of Ray: it takes an engine
client (:class:`agentrl.rollout.episode.EngineClient`), the rollout actor hosts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.rollout.chat import ChatRenderer
from agentrl.config import AgentConfig, RolloutConfig
from agentrl.rollout.agent.recorder import EpisodeRecorder, MessageError
from agentrl.rollout.episode import EngineClient
from agentrl.rollout.tool_calls import ToolCallParser

__all__ = ["AgentEndpoint", "ApiError", "ChatCompletionRequest", "EndpointEpisode", "cut_at_stop"]

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat-completions request the endpoint serves. Unknown fields are
    refused by name; fields that would change the sampling distribution the learner assumes are
    accepted only at their neutral value."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[Any]
    tools: list[Any] | None = None
    tool_choice: Any = None
    temperature: float | None = Field(None, ge=0, le=2)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    # Accepted and ignored: they do not change what is sampled.
    parallel_tool_calls: bool | None = None
    seed: int | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def check(self) -> None:
        """Refuse what the endpoint cannot do without training on something else than was sampled.

        Raises:
            ApiError: naming the parameter.
        """
        if self.n not in (None, 1):
            raise ApiError(400, f"n={self.n} is not supported: one choice per request (make several "
                           "requests for several samples)", param="n")
        neutral = {"top_p": (self.top_p, (None, 1.0)), "frequency_penalty": (self.frequency_penalty, (None, 0.0)),
                   "presence_penalty": (self.presence_penalty, (None, 0.0)), "logprobs": (self.logprobs, (None, False)),
                   "top_logprobs": (self.top_logprobs, (None, 0))}
        for name, (value, ok) in neutral.items():
            if value not in ok:
                raise ApiError(400, f"{name}={value!r} is not supported: the policy samples from its full "
                               "distribution (rollout.top_p), which is what the learner trains on", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported: it changes the distribution the learner trains on",
                           param="logit_bias")
        if self.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "response_format other than text is not supported (constrained decoding "
                           "changes the distribution the learner trains on)", param="response_format")
        if self.tool_choice not in (None, "auto", "none"):
            raise ApiError(400, f"tool_choice={self.tool_choice!r} is not supported; use 'auto' or 'none' "
                           "(forcing a call needs constrained decoding, which changes the distribution the "
                           "learner trains on)", param="tool_choice")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop: at most 4 non-empty strings", param="stop")


def cut_at_stop(tokenizer_decode: Any, token_ids: list[int], stops: list[str]) -> tuple[int, str] | None:
    """Where the first stop string appears in the decoded tokens: ``(number of tokens kept (up to
    the one that completes it), text before it)``; None when none appears."""
    if not stops:
        return None
    def hit(k: int) -> bool:
        text = tokenizer_decode(token_ids[:k])
        return any(s in text for s in stops)

    if not hit(len(token_ids)):
        return None
    lo, hi = 1, len(token_ids)  # the shortest prefix whose text holds a stop string (a longer one still does)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hit(mid) else (mid + 1, hi)
    text = tokenizer_decode(token_ids[:lo])
    return lo, text[:min(text.find(s) for s in stops if s in text)]


@dataclass
class EndpointEpisode:
    """One episode's key and record. ``base_url`` and ``api_key`` are what its agent's client uses."""

    episode_id: str
    api_key: str
    base_url: str
    temperature: float
    recorder: EpisodeRecorder
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    slot: str = ""
    closed: bool = False
    truncated_by: str | None = None
    error: str | None = None
    num_requests: int = 0
    num_tool_calls: int = 0  # tool calls returned to the agent
    num_sampled: int = 0  # tokens sampled for this episode (rollout.max_episode_tokens)


@dataclass
class _Turn:
    """A checked request, ready for the engine."""

    prep: Any  # recorder.Prepared
    room: int  # tokens left in the episode's budget
    left: int | None  # tokens left in its sampled-token budget (rollout.max_episode_tokens)
    stops: list[str]
    kwargs: dict[str, Any]  # engine.generate's keyword arguments
    tools: bool  # tool calls are parsed from the reply


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the process hosting the endpoint (a Ray worker) keeps
    its own handling of SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class AgentEndpoint:
    """The HTTP endpoint of one rollout worker.

    Args:
        renderer: the policy's chat renderer.
        tool_parser: vLLM's parser of the model's tool-call format.
        engine: where prompts are sampled (the rollout actor's router).
        rollout: the ``rollout`` config (turn and token caps, top_p, overlong).
        agent: the ``agent`` config (model name, temperature policy, host).
        max_model_len: the engine's context; the token budget is the smaller of it and
            ``rollout.max_total_tokens``.
    """

    def __init__(self, renderer: ChatRenderer, tool_parser: ToolCallParser, engine: EngineClient, *,
                 rollout: RolloutConfig, agent: AgentConfig, max_model_len: int | None = None) -> None:
        self.renderer = renderer
        self.tool_parser = tool_parser
        self.engine = engine
        self.rollout = rollout
        self.agent = agent
        self.limit = min(rollout.max_total_tokens, max_model_len or rollout.max_total_tokens)
        self.episodes: dict[str, EndpointEpisode] = {}
        self.num_refused = 0  # requests refused before reaching an episode (bad key, ended episode)
        self.num_requests = 0  # completions served (plain and streamed)
        self.num_streamed = 0  # of which streamed
        self.base_url = ""
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._start_lock: asyncio.Lock | None = None
        self._app = self._build_app()

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> str:
        """Serve on ``agent.host`` at a free port in the running event loop; returns the base URL.
        Concurrent calls (a rollout worker's first groups all ask for the endpoint at once) wait
        for the one server and get its URL."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._task is not None:
                return self.base_url
            # proto=IPPROTO_TCP: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections
            # accepted from a socket that says it is TCP. With proto 0, a response's header and body
            # writes wait on the client's delayed ACK: +40 ms on every request of a kept-alive
            # connection after its first (bench/agent_endpoint.py). Set on the listening socket too,
            # which accepted sockets inherit.
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.agent.host, self.agent.port))
            port = sock.getsockname()[1]
            # proxy_headers off: no proxy stands in front (and a client may not pose as another address).
            config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_keep_alive=30, limit_concurrency=None, proxy_headers=False)
            server = _QuietServer(config)
            task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
            while not server.started:
                if task.done():
                    task.result()  # re-raises why it stopped
                    raise RuntimeError("the agent endpoint stopped before it started")
                await asyncio.sleep(0.01)
            self._server, self._task = server, task
            self.base_url = f"http://{self.agent.host}:{port}/v1"
            return self.base_url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._task = self._server = None
        self.base_url = ""

    # -- episodes ---------------------------------------------------------------------------------
    def open_episode(self, episode_id: str, *, temperature: float) -> EndpointEpisode:
        """A new episode with its own API key (requests with it go to this episode only)."""
        if not self.base_url:  # its base URL would be a relative path no client can reach
            raise RuntimeError("the agent endpoint is not serving: await start() before opening episodes")
        key = "agentrl-" + secrets.token_urlsafe(24)
        slot = secrets.token_hex(6)  # the episode's own base URL: a key sent to another episode's URL is refused
        root = self.base_url.removesuffix("/v1")
        ep = EndpointEpisode(episode_id, key, f"{root}/e/{slot}/v1", temperature, EpisodeRecorder(self.renderer))
        ep.slot = slot
        self.episodes[key] = ep
        return ep

    def close_episode(self, ep: EndpointEpisode) -> EndpointEpisode:
        """End an episode: its key is refused from now on and its record is final."""
        ep.closed = True
        self.episodes.pop(ep.api_key, None)
        return ep

    # -- HTTP -------------------------------------------------------------------------------------
    def _build_app(self) -> Any:
        app = FastAPI(title="agentrl agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(404)
        async def _not_found(request: Request, _exc: Exception) -> JSONResponse:
            err = ApiError(404, f"unknown path {request.url.path} (served: GET /v1/models, "
                           "POST /v1/chat/completions)", code="unknown_url")
            return JSONResponse(err.body(), status_code=404)

        @app.exception_handler(405)
        async def _bad_method(request: Request, _exc: Exception) -> JSONResponse:
            err = ApiError(405, f"method {request.method} is not allowed on {request.url.path}", code="method_not_allowed")
            return JSONResponse(err.body(), status_code=405)

        # Plain Starlette routes (request in, response out): FastAPI's dependency solving and
        # response validation would cost ~0.1 ms of CPU per request and serve nothing here.
        async def models(request: Request) -> Response:
            self._episode(request, request.path_params.get("slot"))
            return Response(json.dumps({"object": "list", "data": [{"id": self.agent.model_name, "object": "model",
                                                                     "created": 0, "owned_by": "agentrl"}]}),
                            media_type="application/json")

        async def chat(request: Request) -> Response:
            ep = self._episode(request, request.path_params.get("slot"))
            req = await self._parse(request)
            if req.stream:
                return await self._stream(ep, req)
            return Response(json.dumps(await self._complete(ep, req)).encode(), media_type="application/json")

        for root in ("", "/e/{slot}"):
            app.add_route(root + "/v1/models", models, methods=["GET"])
            app.add_route(root + "/v1/chat/completions", chat, methods=["POST"])
        return app

    def _episode(self, request: Any, slot: str | None = None) -> EndpointEpisode:
        """The episode a request belongs to: by its key, which must match the episode's base URL
        when the request came through one (``/e/<slot>/v1``)."""
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        ep = self.episodes.get(key)
        detail = None
        if ep is None or ep.closed:
            detail = "no API key given" if not key else "this API key belongs to no running episode (it is " \
                "unknown, or its episode has ended)"
        elif slot is not None and slot != ep.slot:
            detail = "this API key belongs to another episode than this base URL's"
        if detail is not None:
            self.num_refused += 1
            raise ApiError(401, f"{detail}; each episode's agent must use the base URL and key it was given",
                           type="authentication_error", code="invalid_api_key")
        return ep

    async def _parse(self, request: Any) -> ChatCompletionRequest:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                           code="invalid_json")
        try:
            req = ChatCompletionRequest.model_validate(data)
        except ValidationError as err:
            e = err.errors()[0]
            param = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                raise ApiError(400, f"unsupported parameter: '{param}'", param=param,
                               code="unsupported_parameter") from None
            raise ApiError(400, f"{param}: {e['msg']}", param=param) from None
        req.check()
        if req.model != self.agent.model_name:
            raise ApiError(404, f"the model '{req.model}' does not exist; this endpoint serves "
                           f"'{self.agent.model_name}' (agent.model_name)", param="model", code="model_not_found")
        return req

    def _begin(self, ep: EndpointEpisode, req: ChatCompletionRequest) -> _Turn:
        """Check and render a request of ``ep`` (whose lock the caller holds): the prompt, the token
        budget and the sampling arguments. Raises :class:`ApiError`; writes nothing."""
        if ep.closed:
            raise ApiError(401, "the episode has ended", type="authentication_error", code="invalid_api_key")
        ep.num_requests += 1
        rec = ep.recorder
        if rec.num_completions >= self.rollout.max_turns:
            ep.truncated_by = ep.truncated_by or "turns"
            raise ApiError(400, f"this episode already made {rec.num_completions} completions "
                           f"(rollout.max_turns = {self.rollout.max_turns})", code="turn_limit_exceeded")
        calls = self.rollout.max_model_calls
        if calls is not None and rec.num_completions >= calls:
            ep.truncated_by = ep.truncated_by or "model_calls"
            raise ApiError(400, f"this episode already made {rec.num_completions} model calls "
                           f"(rollout.max_model_calls = {calls})", code="model_call_budget_exceeded")
        left = None if self.rollout.max_episode_tokens is None else self.rollout.max_episode_tokens - ep.num_sampled
        if left is not None and left <= 0:
            ep.truncated_by = ep.truncated_by or "sampled_tokens"
            raise ApiError(400, f"this episode already sampled {ep.num_sampled} tokens "
                           f"(rollout.max_episode_tokens = {self.rollout.max_episode_tokens})",
                           code="token_budget_exceeded")
        try:
            prep = rec.prepare(req.messages, req.tools)
        except MessageError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        room = self.limit - len(prep.prompt_ids)
        if room <= 0:
            ep.truncated_by = "tokens"
            raise ApiError(400, f"the prompt is {len(prep.prompt_ids)} tokens; this episode's limit is "
                           f"{self.limit} (rollout.max_total_tokens, engine.max_model_len)", param="messages",
                           code="context_length_exceeded")
        asked = min(x for x in (req.max_completion_tokens, req.max_tokens, self.rollout.max_new_tokens) if x)
        temperature = ep.temperature
        if self.agent.temperature == "request" and req.temperature is not None:
            temperature = req.temperature
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        budget = min(asked, room) if left is None else min(asked, room, left)
        kwargs: dict[str, Any] = {"max_tokens": budget, "temperature": temperature,
                                  "top_p": self.rollout.top_p, "episode_id": ep.episode_id}
        if stops:  # the engine stops sampling at them (engine clients without stop strings are not passed any)
            kwargs["stop"] = stops
        return _Turn(prep, room, left, stops, kwargs, req.tools is not None and req.tool_choice != "none" and bool(req.tools))

    def _engine_failed(self, ep: EndpointEpisode, exc: Exception) -> ApiError:
        ep.error = f"engine error: {type(exc).__name__}: {str(exc)[:200]}"  # the episode is not trained on
        return ApiError(500, "the engine failed on this request; the episode is dropped", type="server_error",
                        code="engine_error")

    def _finish(self, ep: EndpointEpisode, turn: _Turn, tokens: list[int], logprobs: list[float],
                versions: list[int]) -> dict[str, Any]:
        """Record what the engine sampled for ``turn`` and build the chat.completion response."""
        if ep.closed:  # the agent was cancelled (timeout) while the engine sampled
            raise ApiError(401, "the episode has ended", type="authentication_error", code="invalid_api_key")
        budget = turn.kwargs["max_tokens"]
        cut = cut_at_stop(self.renderer.decode, tokens, turn.stops)
        closed = bool(tokens) and tokens[-1] in self.renderer.stop_token_ids
        if cut is not None:
            n, text = cut
            tokens, logprobs, versions = tokens[:n], logprobs[:n], versions[:n]
            closed = bool(tokens) and tokens[-1] in self.renderer.stop_token_ids
            finish = "stop"
        else:
            text = self.renderer.decode(tokens)
            finish = "stop" if closed else "length"
            if not closed and len(tokens) >= budget and budget == turn.room:
                ep.truncated_by = "tokens"  # cut by the episode's token limit, not by max_tokens
            elif not closed and len(tokens) >= budget and budget == turn.left:
                ep.truncated_by = "sampled_tokens"  # cut by the episode's sampled-token budget
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if turn.tools and cut is None:
            parsed = self.tool_parser.parse(text)
            if parsed.calls and not parsed.errors:
                message["content"] = parsed.content or None
                message["tool_calls"] = [
                    {"id": f"call_{secrets.token_hex(8)}", "type": "function",
                     "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
                finish = "tool_calls" if closed else finish
                ep.num_tool_calls += len(parsed.calls)
        ep.recorder.record(turn.prep, tokens, logprobs, versions, message, closed=closed)
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.agent.model_name,
            "choices": [{"index": 0, "message": {**message, "refusal": None}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": len(turn.prep.prompt_ids), "completion_tokens": len(tokens),
                      "total_tokens": len(turn.prep.prompt_ids) + len(tokens)},
        }

    async def _complete(self, ep: EndpointEpisode, req: ChatCompletionRequest) -> dict[str, Any]:
        async with ep.lock:  # one request of an episode at a time: each extends the last
            turn = self._begin(ep, req)
            try:
                out = await self.engine.generate(turn.prep.prompt_ids, **turn.kwargs)
            except Exception as exc:  # noqa: BLE001 (the engine died or refused)
                raise self._engine_failed(ep, exc) from None
            ep.num_sampled += len(out.token_ids)
            self.num_requests += 1
            return self._finish(ep, turn, list(out.token_ids), list(out.logprobs), list(out.versions))

    async def _stream(self, ep: EndpointEpisode, req: ChatCompletionRequest) -> StreamingResponse:
        """``stream=true``: checks answer with a status code as for a plain request; then the turn
        runs in a task of its own (holding the episode's lock) that sends text as the engine
        samples it, when the engine client streams (``engine.stream``), else the whole turn at
        once. Text that may still turn out to be a tool call or a stop string is held back
        until it is known; tool calls go out whole at the end (parsed as a plain request's).
        A client that goes away mid-turn cancels it: the engine's request is aborted and nothing
        is recorded."""
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        await ep.lock.acquire()
        try:
            turn = self._begin(ep, req)
        except BaseException:
            ep.lock.release()
            raise
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        base = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.agent.model_name}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                         **({"usage": None} if include_usage else {})})

        async def run() -> None:
            sent = ""  # content already sent
            try:
                queue.put_nowait(chunk({"role": "assistant", "content": ""}))
                tokens: list[int] = []
                logprobs: list[float] = []
                versions: list[int] = []
                try:
                    if hasattr(self.engine, "stream"):
                        async for delta in self.engine.stream(turn.prep.prompt_ids, **turn.kwargs):
                            tokens += delta.token_ids
                            ep.num_sampled += len(delta.token_ids)  # counted even if the client goes away
                            logprobs += delta.logprobs
                            versions += delta.versions
                            safe = self._safe_text(self.renderer.decode(tokens), turn)
                            if len(safe) > len(sent):
                                queue.put_nowait(chunk({"content": safe[len(sent):]}))
                                sent = safe
                    else:
                        out = await self.engine.generate(turn.prep.prompt_ids, **turn.kwargs)
                        tokens, logprobs, versions = list(out.token_ids), list(out.logprobs), list(out.versions)
                        ep.num_sampled += len(tokens)
                except Exception as exc:  # noqa: BLE001 (the engine died or refused)
                    raise self._engine_failed(ep, exc) from None
                self.num_requests += 1
                self.num_streamed += 1
                result = self._finish(ep, turn, tokens, logprobs, versions)
                choice = result["choices"][0]
                msg = choice["message"]
                content = msg.get("content") or ""
                if content.startswith(sent) and len(content) > len(sent):
                    queue.put_nowait(chunk({"content": content[len(sent):]}))
                for i, call in enumerate(msg.get("tool_calls") or []):
                    queue.put_nowait(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function", "function": {
                        "name": call["function"]["name"], "arguments": ""}}]}))
                    queue.put_nowait(chunk({"tool_calls": [{"index": i, "function": {
                        "arguments": call["function"]["arguments"]}}]}))
                queue.put_nowait(chunk({}, choice["finish_reason"]))
                if include_usage:
                    queue.put_nowait(_sse({**base, "choices": [], "usage": result["usage"]}))
                queue.put_nowait("data: [DONE]\n\n")
            except ApiError as err:  # the status line is gone: OpenAI sends the error as an event
                queue.put_nowait(_sse(err.body()))
            finally:
                ep.lock.release()
                queue.put_nowait(None)

        task = asyncio.get_running_loop().create_task(run())

        async def events() -> AsyncIterator[str]:
            try:
                while (item := await queue.get()) is not None:
                    yield item
            finally:
                if not task.done():
                    task.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    def _safe_text(self, text: str, turn: _Turn) -> str:
        """The part of a turn's text so far that will be sent as content whatever comes next: not
        a partial character, nothing from a tool-call marker on (or any text, for parsers
        without a marker), no suffix that may begin a stop string or a marker, and no trailing
        whitespace (a call's content is stripped)."""
        text = text.rstrip("\ufffd")
        if turn.tools:
            marker = self.tool_parser.marker
            if marker is None:
                return ""
            at = text.find(marker)
            if at >= 0:
                text = text[:at]
        for s in turn.stops + ([self.tool_parser.marker] if turn.tools and self.tool_parser.marker else []):
            at = text.find(s)
            if at >= 0:
                text = text[:at]
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    text = text[:-k]
                    break
        return text.rstrip() if turn.tools else text

    def stats(self) -> dict[str, float]:
        return {"rollout/endpoint_refused": float(self.num_refused),
                "rollout/endpoint_requests": float(self.num_requests),
                "rollout/endpoint_streamed": float(self.num_streamed)}

