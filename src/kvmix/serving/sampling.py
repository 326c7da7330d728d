"""Per-request sampling on transformers' continuous batching (docs/guide/serving.md).

Each request carries its ``Sampling``: temperature, top-k and top-p are applied through
transformers' per-request logits processors (``cb_logits_processors``: one set built with
neutral defaults, each request's values in its ``logit_processor_kwargs``), only to the rows
that sample; a greedy row (temperature 0) takes the arg-max of the model's own logits. Every
request draws from its own random generator, so a seeded request picks the same tokens whatever
runs beside it. The log-probability of each chosen token, and the most likely alternatives when
a request asks, come from the same logits that chose it (the model's distribution, before
temperature and filtering, as vLLM reports them by default).

The seam is ``ModelRunner._sample`` (``ServedRunner``), which transformers calls with the
logits of every row that gets a token, in batch order; before it picks anything it validates the
step (``RequestFault`` names the requests at fault).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import (
    FutureRequestState,
    GenerationOutput,
    RequestState,
)
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

MAX_LOGPROBS = 20  # alternatives per token (chat's top_logprobs; completions take 5)


class RequestFault(Exception):
    """A step failed because of some of its requests: ``causes`` maps each request id at
    fault to why (the step's other requests are not in question)."""

    def __init__(self, causes: dict[str, str]):
        super().__init__("; ".join(f"{rid}: {why}" for rid, why in causes.items()))
        self.causes = causes


MIN_TEMPERATURE = 1e-5  # below it a request is greedy (vLLM's rule: 1/T would overflow)
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)

# name -> (low, high) of each number a request may set: ranges the sampler computes in float32
# without overflow, inf or NaN (the vocabulary bounds top_k and the biased ids further)
RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "top_k": (0, (1 << 31) - 1),
    "min_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.01, 10.0), "min_tokens": (0, (1 << 31) - 1),
    "logprobs": (0, MAX_LOGPROBS), "seed": (-(1 << 63), (1 << 64) - 1)}


@dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens (the meaning of vLLM's ``SamplingParams``).

    Every row's logits are first adjusted, in vLLM's order: ``min_tokens`` masks the tokens
    that would end the text, ``logit_bias`` is added, then the repetition penalty (prompt and
    output tokens: a positive logit divided, a negative one multiplied) and OpenAI's presence
    and frequency penalties (output tokens: minus ``presence`` once, ``frequency`` per
    occurrence). A greedy row takes the arg-max of the adjusted logits; a sampled one divides
    by the temperature, keeps the tokens at least ``min_p`` times as likely as the most likely
    one, then the top-k and top-p sets, and draws."""

    temperature: float = 0.0  # 0: greedy (the arg-max), as ``generate`` without sampling
    top_p: float = 1.0  # the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # the k most likely tokens; 0: every token
    seed: int | None = None  # the request's own generator; None: a random seed
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    min_p: float = 0.0  # tokens less likely than min_p x the most likely one are dropped
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # tokens generated before an end token (EOS, stop ids) may be picked

    def __post_init__(self):
        for name, (low, high) in RANGES.items():
            value = getattr(self, name)
            value = 0 if value is None else value
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not low <= value <= high or (name == "top_p" and value == 0):
                bounds = "(0, 1]" if name == "top_p" else f"[{low}, {high}]"
                raise ValueError(f"{name}={value!r} is invalid; expected a number in {bounds}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds {len(self.logit_bias)} tokens; expected at "
                             f"most {MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 \
                    or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias {token!r}: {bias!r} is invalid; expected a "
                                 "token id >= 0 and a bias in [-100, 100]")

    def check_vocabulary(self, vocab: int) -> None:
        """``ValueError`` naming a token id or a top_k the vocabulary of ``vocab`` lacks."""
        if self.top_k > vocab:
            raise ValueError(f"top_k={self.top_k} is invalid; expected -1, 0 (every token) "
                             f"or at most the vocabulary's {vocab}")
        outside = [token for token, _ in self.logit_bias if token >= vocab]
        if outside:
            raise ValueError(f"logit_bias names token {outside[0]}, outside the vocabulary "
                             f"[0, {vocab})")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def adjusts(self) -> bool:
        """Whether the row's logits change before it picks (penalties, bias, min_tokens)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1)

    def processor_kwargs(self) -> dict[str, Any]:
        """The request's values for transformers' per-request processors (none when greedy;
        a filter left at its neutral value is not applied)."""
        if self.greedy:
            return {}
        kwargs: dict[str, Any] = {"temperature": float(self.temperature)}
        if self.top_k:
            kwargs["top_k"] = int(self.top_k)
        if self.top_p < 1:
            kwargs["top_p"] = float(self.top_p)
        return kwargs

    def generator(self, device: torch.device, sample: int = 0) -> torch.Generator:
        """The generator of the request's ``sample``-th choice: seeded from (seed, sample) when
        the request has a seed, else from the system's entropy."""
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(random.Random(f"{self.seed}:{sample}").getrandbits(63))
        return generator


@dataclass
class ServedOutput(GenerationOutput):
    """transformers' output of a request, with the alternatives of each token it chose."""

    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class ServedRequest(RequestState):
    """transformers' request state, with how it samples: its ``Sampling``, its generator
    (a fork, one of ``n`` choices, gets its own) and, when it asked for logprobs, the most
    likely alternatives of each token it chose."""

    sampling: Sampling = field(default_factory=Sampling)
    generator: torch.Generator | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    forks: int = 0

    def to_generation_output(self) -> ServedOutput:
        output = super().to_generation_output()
        return ServedOutput(**vars(output), top_logprobs=list(self.top_logprobs))

    def fork(self, new_request_id: str) -> ServedRequest:
        """A choice of the same prompt (transformers forks after the prompt's prefill): the
        same state, its own generator."""
        generator, self.generator = self.generator, None
        try:
            child = super().fork(new_request_id)
        finally:
            self.generator = generator
        self.forks += 1
        if generator is not None:
            child.generator = self.sampling.generator(generator.device, self.forks)
        return child


@dataclass
class SamplerMark:
    """What a step's sampling changes in one request, as it was before the step: its
    generator's state and how many top-logprob entries it had (``mark``, ``restore``)."""

    state: ServedRequest
    generator: torch.Tensor | None
    entries: int

    @classmethod
    def mark(cls, state: Any) -> SamplerMark | None:
        if not isinstance(state, ServedRequest):
            return None
        generator = None if state.generator is None else state.generator.get_state()
        return cls(state, generator, len(state.top_logprobs))

    def restore(self) -> None:
        """The step is undone: a retried step draws and records what it drew the first time."""
        if self.generator is not None:
            self.state.generator.set_state(self.generator)
        del self.state.top_logprobs[self.entries :]


def sampling_processors(vocab: int) -> ContinuousBatchingLogitsProcessorList:
    """transformers' per-request temperature, top-k and top-p processors with neutral
    defaults. transformers does not apply them itself (``do_processing`` off): ``ServedRunner``
    applies them to the rows that sample, keeping every row's own logits for its logprobs."""
    processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList(
        [TemperatureLogitsWarper(1.0), TopKLogitsWarper(vocab), TopPLogitsWarper(1.0)]),
        per_request_processors=True)
    processors.do_processing = False
    return processors


class ServedRunner(ModelRunner):
    """transformers' model runner, picking each row's token by its request's ``Sampling``."""

    def _sample(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        """scores: [1, N, V] float32 logits of the N rows with a new token, in batch order ->
        output_ids[0, :N] the tokens, output_ids[1, :N] their log-probabilities."""
        futures = [f for f in self.inputs_and_outputs.requests_in_batch if f.has_new_token]
        logits = scores[0, : len(futures)]  # [N, V] (rows beyond are no request's)
        self._validate(logits, futures)
        states: list[ServedRequest] = [f.state for f in futures]
        adjusted = _adjusted(logits, states)  # [N, V]
        tokens = adjusted.argmax(-1)  # [N]
        sampled = [i for i, s in enumerate(states) if not _sampling(s).greedy]
        if sampled:
            tokens[sampled] = self._draw(adjusted[sampled], [futures[i] for i in sampled])
        output_ids[0, : len(states)].copy_(tokens)
        if self.return_logprobs:
            chosen = _logprobs(logits, tokens, states)  # [N]
            output_ids[1, : len(states)].copy_(chosen.view(dtype=torch.int32))

    def _validate(self, logits: torch.Tensor, futures: list[FutureRequestState]) -> None:
        """Raise a ``RequestFault`` naming the requests whose logits are not finite, or whose
        new keys or values the cache refuses (one host read for both)."""
        finite = torch.isfinite(logits).all(-1)  # [N]
        ids = [f.state.request_id for f in futures]
        step = getattr(self.cache, "step_faults", None)
        cached, verdicts = ([], None) if step is None else step()
        flags = finite.tolist() if verdicts is None else \
            torch.cat([finite.float(), verdicts]).tolist()
        causes = {rid: "non-finite logits" for rid, ok in zip(ids, flags[: len(ids)],
                                                                strict=True) if not ok}
        for (rid, why), layer in zip(cached, flags[len(ids):], strict=True):
            if layer >= 0:
                causes[rid] = why.format(layer=int(layer))
        if causes:
            raise RequestFault(causes)

    def _draw(self, logits: torch.Tensor, futures: list[FutureRequestState]) -> torch.Tensor:
        """Sampled rows' tokens: [S, V] logits through the per-request processors some row
        sets (top-k and top-p sort the vocabulary: not for nothing), min-p after the
        temperature, one uniform draw per row from its own generator, inverted through the
        row's distribution -> [S]."""
        for processor in self.logit_processor.logits_processor:
            if any(key in f.state.logit_processor_kwargs for f in futures
                   for key in processor.supported_kwargs):
                args = processor.prepare_tensor_args(futures).to(logits.device)
                logits = processor(logits, args)
            if "temperature" in processor.supported_kwargs:
                logits = _min_p(logits, [_sampling(f.state).min_p for f in futures])
        cdf = torch.softmax(logits, dim=-1).cumsum(-1)  # [S, V]
        draws = torch.stack([torch.rand((), generator=f.state.generator, device=logits.device)
                             for f in futures])  # [S]
        picked = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)[:, 0]
        return picked.clamp(max=logits.shape[-1] - 1)


def _sampling(state: RequestState) -> Sampling:
    return getattr(state, "sampling", None) or Sampling()


def _adjusted(logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
    """[N, V] logits -> the same with each asking row's min_tokens mask, logit bias and
    penalties applied (a copy; ``logits`` itself when no row asks)."""
    rows = [i for i, state in enumerate(states) if _sampling(state).adjusts]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        logits[i] = _adjust(logits[i], states[i])
    return logits


def _adjust(row: torch.Tensor, state: RequestState) -> torch.Tensor:
    """One row's [V] logits adjusted by its request's ``Sampling`` (see there)."""
    sampling = _sampling(state)
    prompt, output = _history(state)
    vocab = row.shape[-1]
    if len(output) < sampling.min_tokens:
        ends = [t for t in getattr(state, "_eos_token_ids", ()) if 0 <= t < vocab]
        row[ends] = -math.inf
    if sampling.logit_bias:
        ids, biases = zip(*sampling.logit_bias, strict=True)
        row[list(ids)] += torch.tensor(biases, dtype=row.dtype, device=row.device)
    if sampling.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[torch.tensor(prompt + output, dtype=torch.long, device=row.device)] = True
        penalty = sampling.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row)
    if (sampling.presence_penalty or sampling.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=row.device),
                                minlength=vocab)[:vocab].to(row.dtype)  # [V]
        row = row - sampling.frequency_penalty * counts \
            - sampling.presence_penalty * (counts > 0).to(row.dtype)
    return row


def _history(state: RequestState) -> tuple[list[int], list[int]]:
    """(prompt, output) token ids of a request, whether or not transformers soft-reset it
    (which moves the output so far into its ``initial_tokens``)."""
    true_prompt = getattr(state, "_true_initial_tokens", 0)
    if true_prompt:
        return (state.initial_tokens[:true_prompt],
                state.initial_tokens[true_prompt:] + state.generated_tokens)
    return state.initial_tokens, state.generated_tokens


def _min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """[S, V] logits with each row's tokens below its min_p x its most likely token's
    probability masked (rows with min_p 0 unchanged)."""
    if not any(min_ps):
        return logits
    probs = torch.softmax(logits, dim=-1)  # [S, V]
    floor = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)[:, None] \
        * probs.amax(-1, keepdim=True)  # [S, 1]
    return logits.masked_fill(probs < floor, -math.inf)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor,
              states: list[RequestState]) -> torch.Tensor:
    """Log-probabilities of the chosen ``tokens`` [N] under the rows' own logits [N, V] (0 for
    rows that did not ask), and each asking row's top alternatives, kept on its state."""
    chosen = torch.zeros(len(states), dtype=torch.float32, device=logits.device)
    asking = [i for i, s in enumerate(states) if _sampling(s).logprobs is not None]
    if not asking:
        return chosen
    logp = torch.log_softmax(logits[asking], dim=-1)  # [A, V]
    chosen[asking] = logp.gather(1, tokens[asking][:, None])[:, 0]
    most = max(_sampling(states[i]).logprobs for i in asking)
    if most:
        values, ids = logp.topk(most, dim=-1)
        for row, i in enumerate(asking):
            k = _sampling(states[i]).logprobs
            states[i].top_logprobs.append(list(zip(ids[row, :k].tolist(),
                                                   values[row, :k].tolist(), strict=True)))
    return chosen
