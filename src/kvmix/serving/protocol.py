"""The OpenAI request bodies ``kvmix serve`` takes, parsed once where they enter
(docs/guide/serving.md): pydantic models in strict mode (a number for a number, a string for a
string), every field honoured or refused. A field the OpenAI API defines that kvmix serve does not
apply is refused with a message naming it unless it holds its neutral value; an unknown field is
refused too. ``ParseError`` carries the message of the first problem, naming the field (HTTP 400).

Every field is bounded before any work: numbers to ranges the sampler computes without
overflow, strings and lists to the ``MAX_*`` caps below (stop strings as OpenAI's: 4, here of
at most 256 characters each), the body's JSON nesting to ``MAX_DEPTH``. The vocabulary bounds
token ids, ``top_k`` and ``logit_bias`` where the server knows it (``Service.admit``).

vLLM's meaning of each parameter is the reference; ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos`` and ``stop_token_ids`` are vLLM's
extensions, honoured too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from kvmix.serving.sampling import MAX_LOGIT_BIAS, RANGES, Sampling

MAX_CHOICES = 8  # n
MAX_STOPS = 4  # stop strings (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_STOP_IDS = 64  # stop_token_ids
MAX_PROMPTS = 64  # prompts of one completions request
MAX_SEQUENCES = 64  # prompts x n of one request
MAX_MESSAGES = 512  # messages of one chat request
MAX_DEPTH = 16  # JSON nesting of a body (the deepest valid one nests 4 levels)
MAX_ID = (1 << 31) - 1  # token ids and counts beyond any vocabulary or int32 sampler


class ParseError(ValueError):
    """A request body kvmix serve cannot take, naming the field (HTTP 400)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the usage and no choice


# fields of the OpenAI API kvmix serve does not apply: refused unless neutral
NEUTRAL: dict[str, tuple] = {
    "echo": (None, False), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
    "service_tier": (None, "auto", "default"), "store": (None, False), "metadata": (None, {}),
}

Positive = Annotated[int, Field(ge=1, le=MAX_ID)]
TokenId = Annotated[int, Field(ge=0, le=MAX_ID)]
Ids = Annotated[list[TokenId], Field(min_length=1)]
Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]

# A field that takes several forms is validated as the form its JSON value has (a list by its
# first item), so a refusal names what is wrong with that form, and a long list of the wrong
# form is not tried against every other. (Each form's name has a space: no field's name does.)
FORMS = ("a string", "token ids", "a list of strings", "token id lists", "a list of parts")


def _form(value: Any, empty: str) -> str | None:
    """The form ``value`` has (``empty``: an empty list's), None for none of ``FORMS``."""
    if isinstance(value, str):
        return "a string"
    if not isinstance(value, list):
        return None
    if not value:
        return empty
    if isinstance(value[0], int) and not isinstance(value[0], bool):
        return "token ids"
    return {str: "a list of strings", list: "token id lists", dict: "a list of parts"}.get(
        type(value[0]))


def OneOf(expected: str, forms: dict[str, Any]) -> Any:
    """A union of ``forms`` (by their names in ``FORMS``), the one validated chosen by the
    value's shape (an empty list: the first list form); another shape is refused as
    ``expected``."""
    tagged = [Annotated[kind, Tag(name)] for name, kind in forms.items()]
    empty = next(name for name in forms if "list" in name)
    return Annotated[Union[tuple(tagged)], Discriminator(  # noqa: UP007 (a runtime tuple)
        lambda value: _form(value, empty), custom_error_type="form",
        custom_error_message=f"expected {expected}")]


def Bounded(name: str) -> Any:
    """A float field in the sampler's range for ``name`` (``RANGES``), or None (neutral)."""
    low, high = RANGES[name]
    return Annotated[float, Field(ge=low, le=high)] | None


class _Request(_Body):
    """What completions and chat requests share."""

    model: str | None = None
    max_tokens: Positive | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_ID)] | None = None  # -1 or 0: every token
    min_p: Bounded("min_p") = None
    presence_penalty: Bounded("presence_penalty") = None  # OpenAI's range
    frequency_penalty: Bounded("frequency_penalty") = None
    repetition_penalty: Bounded("repetition_penalty") = None  # vLLM's meaning
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_ID)] = 0
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: OneOf(f"a string or a list of at most {MAX_STOPS} strings", {
        "a string": Annotated[str, Field(max_length=MAX_STOP_CHARS)],
        "a list of strings": Annotated[list[Stop], Field(max_length=MAX_STOPS)]}) | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_IDS)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=256)] | None = None  # logged, not used

    @model_validator(mode="after")
    def _neutral(self) -> _Request:
        for name in sorted(self.model_fields_set & NEUTRAL.keys()):
            value = getattr(self, name)
            if value not in NEUTRAL[name]:
                raise ValueError(f"{name}={value!r} is not served by kvmix serve (it would be "
                                 "ignored); leave it out")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only valid with stream=true")
        if any(not key.isdigit() for key in self.logit_bias or {}):
            raise ValueError("logit_bias keys are token ids (strings of digits); got "
                             f"{next(k for k in self.logit_bias if not k.isdigit())!r}")
        if self.n > 1 and not self.temperature:
            raise ValueError(f"n={self.n} asks for choices that would all be the same greedy "
                             "text (temperature 0, the default): set temperature > 0")
        return self

    def sampling(self, logprobs: int | None) -> Sampling:
        return Sampling(
            temperature=self.temperature or 0.0, top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0), seed=self.seed, logprobs=logprobs,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            logit_bias=tuple((int(k), v) for k, v in sorted((self.logit_bias or {}).items())),
            min_tokens=self.min_tokens)

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Request):
    """``/v1/completions``: one prompt or several (text or token ids), ``n`` choices each."""

    prompt: OneOf(f"a string, a list of token ids, or a list of at most {MAX_PROMPTS} of either", {
        "a string": str, "token ids": Ids,
        "a list of strings": Annotated[list[str], Field(max_length=MAX_PROMPTS)],
        "token id lists": Annotated[list[Ids], Field(max_length=MAX_PROMPTS)]})
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    best_of: Positive | None = None
    echo: Any = None
    suffix: Any = None

    @model_validator(mode="after")
    def _prompt(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not served (it would rank best_of "
                             f"choices and return n={self.n}); leave it out or equal to n")
        if not self.prompt or any(not p for p in self.prompts):
            raise ValueError("prompt is empty; expected a string, a list of token ids, or a "
                             "list of either, none empty")
        if len(self.prompts) * self.n > MAX_SEQUENCES:
            raise ValueError(f"{len(self.prompts)} prompts x n={self.n} ask for more than "
                             f"{MAX_SEQUENCES} sequences; send fewer prompts per request")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: OneOf("a string or a list of text parts", {
        "a string": str, "a list of parts": list[TextPart]}) | None = None
    name: str | None = None

    def plain(self) -> dict[str, str]:
        """The message as a chat template reads it (text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role,
                "content": content}


class ChatRequest(_Request):
    """``/v1/chat/completions``: a conversation through the model's chat template."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            raise ValueError("give max_completion_tokens or max_tokens, not both")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


@dataclass
class Ask:
    """What one request asks, parsed: its prompts (texts, token ids or a conversation),
    ``n`` choices each, how they sample and end, and how the answer is sent."""

    chat: bool
    prompts: list[Any]  # completions: texts or token ids; chat: one list of messages
    max_tokens: int | None
    sampling: Sampling
    n: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    model: str | None


def parse(body: Any, chat: bool) -> Ask:
    """A request body -> ``Ask``, or ``ParseError`` naming the first field at fault."""
    if not isinstance(body, dict):
        raise ParseError("the request body must be a JSON object")
    if depth(body) > MAX_DEPTH:
        raise ParseError(f"the request body nests deeper than {MAX_DEPTH} levels")
    try:
        request = (ChatRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as error:
        raise ParseError(_message(error)) from None
    try:
        sampling = request.sampling(request.top if chat else request.top_logprobs)
    except ValueError as error:
        raise ParseError(str(error)) from None
    prompts = [[m.plain() for m in request.messages]] if chat else request.prompts
    options = request.stream_options
    return Ask(chat, prompts, request.limit if chat else request.max_tokens, sampling,
               request.n, request.stops, tuple(request.stop_token_ids or ()),
               request.ignore_eos, request.stream, bool(options and options.include_usage),
               request.model)


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deep JSON ``value`` nests (counted up to ``limit`` + 1: no deeper walk)."""
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((depth(child, limit - 1) for child in children
                    if isinstance(child, (dict, list))), default=0)


def _message(error: ValidationError) -> str:
    """The first problem of a validation error, naming its field."""
    problem = min(error.errors(), key=lambda e: len(e["loc"]))  # the shallowest first
    where = ".".join(str(part) for part in problem["loc"] if not _union_branch(part))
    text = problem["msg"].removeprefix("Value error, ")
    if problem["type"] == "extra_forbidden":
        return f"{where} is not a field kvmix serve knows; leave it out"
    if problem["type"] == "missing":
        return f"{where} is required"
    return f"{where}: {text} (got {problem.get('input')!r})"[:500] if where else text


def _union_branch(part: Any) -> bool:
    """Pydantic names the union member it tried (``list[int]``, ``str``, a form's tag) in a
    location."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool"}
                                      or part in FORMS)
