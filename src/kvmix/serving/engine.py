"""What kvmix adds to transformers' ``ContinuousBatchingManager``, for its own cache and for
the anchor alike (``Served``, a mixin): requests carry their sampling and their number of
choices; the step's figures are recorded; and a fault stays with its request.

A step that raises is contained: the cache is rolled back where it can be (kvmix's cache undoes
the step in every layer), the requests the error names fail (every request of the step when it
names none), and the others are put back as they were before the step — requests that were
decoding retry it, requests that were joining wait again at the front of the queue — so the
loop goes on and every other request gives the text it gives alone. A fault outside the step
(scheduling, admission, forks, the update after it) fails the requests it names, or every
running one, and the loop goes on with those waiting.
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
from transformers.generation.continuous_batching.requests import RequestStatus

from kvmix.serving.sampling import (
    RequestFault,
    SamplerMark,
    Sampling,
    ServedRequest,
    ServedRunner,
    sampling_processors,
)
from kvmix.serving.stats import Stats

OUTSIDE_FAULTS = 3  # faults outside the step in a row that end the loop: it cannot go on


class StepSkipped(Exception):
    """A step was contained (its faulty requests failed, the others put back): no update."""


def greedy(model: Any, max_new_tokens: int) -> GenerationConfig:
    """The manager's defaults: greedy, ``max_new_tokens`` unless a request asks otherwise."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=-1 if eos is None else eos)


def child_ids(request_id: str, n: int) -> list[str]:
    """The ids transformers gives the other ``n - 1`` choices of a request (its forks)."""
    return [f"{request_id}__child#{i}" for i in range(n - 1)]


class Served:
    """A ``ContinuousBatchingManager`` mixin: per-request sampling and choices, the step's
    figures in ``stats``, fault containment."""

    stats: Stats

    def _serve(self, model: Any) -> None:
        """Called once transformers' manager is built: its processors become the per-request
        sampling ones."""
        self.stats = Stats()
        self._outside_faults = 0  # faults outside the step in a row
        self.logit_processor = sampling_processors(model.config.get_text_config().vocab_size)

    def _runner(self, processor: ContinuousBatchProcessor) -> ContinuousBatchProcessor:
        """A new batch processor, picking tokens by each request's sampling."""
        old = processor.model_runner
        processor.model_runner = ServedRunner(
            logit_processor=self.logit_processor, cb_config=old.cb_config,
            inputs_and_outputs=old.inputs_and_outputs, cache=old.cache, do_sample=True,
            return_logprobs=old.return_logprobs)
        return processor

    def add_request(self, input_ids: list[int], request_id: str | None = None,
                    max_new_tokens: int | None = None, streaming: bool = False,
                    record_timestamps: bool = False, eos_token_id: int | list[int] | None = None,
                    sampling: Sampling | None = None, n: int = 1) -> str | None:
        """transformers' ``add_request`` with the request's ``sampling`` and ``n`` choices
        (the others get ``child_ids``); None when the loop takes no more requests."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r} is invalid; expected an integer >= 1")
        sampling = sampling or Sampling()
        sampling.check_vocabulary(self.model.config.get_text_config().vocab_size)
        if self.background_thread_status.can_accept_new_requests() is not None:
            return None
        if request_id is None:
            with self._request_lock:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
        config = self.generation_config
        state = ServedRequest(
            request_id=request_id, initial_tokens=list(input_ids), num_children=n - 1,
            record_timestamps=record_timestamps, streaming=streaming,
            max_new_tokens=config.max_new_tokens if max_new_tokens is None else max_new_tokens,
            eos_token_id=config.eos_token_id if eos_token_id is None else eos_token_id,
            logit_processor_kwargs=sampling.processor_kwargs(), sampling=sampling,
            generator=None if sampling.greedy else sampling.generator(self.model.device))
        self.input_queue.put(state, block=True, timeout=10)
        self._wake_up_loop.set()
        return request_id

    def complete(self, prompts: list[list[int]], max_new_tokens: int) -> list[Any]:
        """Start the loop, serve ``prompts`` (greedy) to the end, stop it -> each prompt's
        finished result, in order; an error if the loop stopped or a request failed."""
        self.start()
        try:
            ids = [self.add_request(list(prompt), max_new_tokens=max_new_tokens)
                   for prompt in prompts]
            results = {}
            while len(results) < len(ids):
                result = self.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not self.is_running():
                    raise RuntimeError(f"the generation loop stopped: "
                                       f"{self.background_thread_status.fatal_error}")
        finally:
            self.stop(block=True)
        failed = {rid: r.error for rid, r in results.items() if r.error is not None}
        if failed:
            raise RuntimeError(f"requests failed: {failed}")
        return [results[rid] for rid in ids]

    # -- the loop ------------------------------------------------------------------------------

    def _generation_step(self) -> None:
        """One forward and its sampling, then the cache keeps the step; a fault is contained
        and the step skipped (no update of the requests; their samplers as before it)."""
        marks = [SamplerMark.mark(future.state)
                 for future in self.batch_processor.inputs_and_outputs.requests_in_batch]
        try:
            super()._generation_step()
            commit = getattr(self.batch_processor.cache, "commit", None)
            if commit is not None:
                commit()
        except Exception as error:
            for mark in filter(None, marks):
                mark.restore()
            self._contain(error)
            raise StepSkipped from error
        self.stats.record(self.batch_processor)

    def _generation_loop_body(self, batch_processor: Any, bootstrapping: bool) -> bool:
        """transformers' loop body; a skipped step goes on to the next; a fault in scheduling
        or in the update after a step fails its requests, and the loop goes on, unless it
        recurs ``OUTSIDE_FAULTS`` turns in a row (a broken loop then dies, as before); the
        figures after."""
        try:
            going = super()._generation_loop_body(batch_processor, bootstrapping)
            self._outside_faults = 0
            return going
        except StepSkipped:
            return True
        except Exception as error:  # outside the step: scheduling, admission, forks, update
            self._outside_faults += 1
            if self._outside_faults >= OUTSIDE_FAULTS:
                raise
            self._contain_outside(error)
            return True
        finally:
            self.stats.refresh(batch_processor)

    def _contain(self, error: Exception) -> None:
        """A step raised: undo it, fail the requests at fault, put the others back."""
        processor = self.batch_processor
        batch = list(processor.inputs_and_outputs.requests_in_batch)
        rollback = getattr(processor.cache, "rollback", None)
        if rollback is not None:
            rollback()
        causes = error.causes if isinstance(error, RequestFault) else {
            f.state.request_id: f"{type(error).__name__}: {error}" for f in batch}
        waiting = []
        for future in batch:
            state = future.state
            state.position_offset -= future.query_length
            if state.request_id in causes:
                self._fail(processor, state, causes[state.request_id])
            elif state.position_offset == 0:  # it was joining: it waits again
                waiting.append(state)
            else:  # it retries the step: the tokens it was given again
                start = state.position_offset
                state.tokens_to_process = (state.initial_tokens + state.generated_tokens)[
                    start : start + future.query_length]
        for state in reversed(waiting):
            _requeue(processor, state)
        self.stats.count_faults(len(causes))

    def _contain_outside(self, error: Exception) -> None:
        """The loop body raised outside the step. kvmix's own checks name the requests at
        fault (``RequestFault``, raised before anything changes): those fail, running or
        waiting. Anything else may have left any scheduled request half-prepared (its position
        moved on, its tokens swapped): every running request fails with the error. The other
        waiting requests and the loop go on."""
        processor = self.batch_processor
        scheduler = processor.scheduler
        states = {**scheduler.waiting_requests, **scheduler.active_requests}
        causes = error.causes if isinstance(error, RequestFault) else dict.fromkeys(
            scheduler.active_requests, f"{type(error).__name__}: {error}")
        failed = [rid for rid in causes if rid in states]
        for request_id in failed:
            self._fail(processor, states[request_id], causes[request_id])
        self.stats.count_faults(len(failed))

    @staticmethod
    def _fail(processor: ContinuousBatchProcessor, state: Any, cause: str) -> None:
        """The request fails with ``cause``; it is left nowhere (a round that raised while
        admitting it may not have taken it off the waiting queue)."""
        scheduler = processor.scheduler
        _drop_fork(processor, state)
        processor._handle_request_error(RuntimeError(cause), state)
        scheduler.finish_request(state.request_id)
        scheduler.waiting_requests.pop(state.request_id, None)
        if state.request_id in scheduler.waiting_requests_order:
            scheduler.waiting_requests_order.remove(state.request_id)


def _requeue(processor: ContinuousBatchProcessor, state: Any) -> None:
    """A request whose prompt was in a contained step waits again, first in line, holding
    nothing."""
    scheduler = processor.scheduler
    _drop_fork(processor, state)
    scheduler.active_requests.pop(state.request_id, None)
    processor.cache.free_blocks(state.request_id)
    state.status = RequestStatus.PENDING
    state.remaining_prefill_tokens = list(state.initial_tokens)
    state.tokens_to_process, state.allocated_blocks = [], 0
    scheduler.waiting_requests[state.request_id] = state
    scheduler.waiting_requests_order.appendleft(state.request_id)


def _drop_fork(processor: ContinuousBatchProcessor, state: Any) -> None:
    forks = processor.scheduler._requests_to_fork
    if state in forks:
        forks.remove(state)
