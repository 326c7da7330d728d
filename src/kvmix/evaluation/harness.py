"""lm-evaluation-harness adapter (the ``eval`` extra): ``KVMixLM``, registered as ``kvmix``.

Every request gets a fresh cache of the method. A single prefill never reads the quantized
cache, so log-likelihood requests prefill the context up to the token that predicts the
continuation's first token and run the rest of the continuation through the cache in chunks
of ``chunk`` tokens (1 = exact decode semantics). Generation requests pass the cache to
``generate``. The cache object never reaches lm-eval's results; only its peak bytes are kept.

    import lm_eval
    from kvmix.evaluation.harness import KVMixLM
    lm_eval.simple_evaluate(model=KVMixLM(method="pnmix1"), tasks=["kvmix_passkey"],
                            task_manager=task_manager(), limit=4)

From lm-eval's own command line — released lm-eval (0.4.13 and before) finds models only in
its own source tree, so ``kvmix-lm-eval`` is lm-eval's CLI with ``kvmix`` registered and
kvmix's tasks on the include path; every argument is lm-eval's:

    kvmix-lm-eval --model kvmix --model_args method=pnmix1,dtype=float32 --device cpu \
        --tasks kvmix_passkey --limit 2
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from tqdm import tqdm

from kvmix.jobs.report import versions
from kvmix.methods import parse_method
from kvmix.models.loading import DEFAULT_MODEL, LoadedModel, load_model, max_positions
from kvmix.runtime.attention import make_cache
from kvmix.runtime.folding import prepare_model
from kvmix.runtime.kernels import resolve

TASKS = Path(__file__).with_name("tasks")
LOCAL_TASKS = ("kvmix_passkey", "niah_single_1", "ruler_vt")


@register_model("kvmix")
class KVMixLM(HFLM):
    """HFLM whose every request runs over a fresh kvmix cache of ``method``."""

    def __init__(self, pretrained: str | LoadedModel = DEFAULT_MODEL, method: str = "full",
                 backend: str = "auto", chunk: int = 16, dtype: str = "auto",
                 device: str | None = None, **kwargs):
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r} is invalid; expected an integer >= 1")
        parse_method(method)
        # lm-eval passes its --device here: the model loads there (a loaded one moves there)
        if isinstance(pretrained, LoadedModel):
            loaded = pretrained
            if device is not None:
                loaded.model.to(device)
        else:
            loaded = load_model(pretrained, dtype, device or "cpu")
        runner = prepare_model(loaded.model, method)
        make_cache(runner, method, backend)  # the method binds to the model before any work
        kwargs = {"batch_size": 1, "max_length": max_positions(runner), **kwargs}
        super().__init__(pretrained=runner, tokenizer=loaded.tokenizer,
                         device=str(runner.device), **kwargs)
        # HFLM's own ``backend`` attribute is "causal"/"seq2seq": kvmix's is ``kv_backend``
        self.method, self.kv_backend, self.chunk = method, backend, chunk
        self.source = loaded.source
        self.peak_nbytes = 0

    def get_model_info(self) -> dict:
        """What lm-eval records in its results' config: the model as loaded and the cache (no
        hub lookup: HFLM's asks the hub for a commit hash)."""
        return {"model_num_parameters": self.model.num_parameters(),
                "model_dtype": str(self.model.dtype), "model_device": str(self.model.device),
                "model_source": self.source, "kvmix_versions": versions(),
                "kvmix_method": str(parse_method(self.method)),
                "kvmix_backend": resolve(self.kv_backend, self.model.device),
                "kvmix_chunk": self.chunk}

    def _fresh_cache(self):
        return make_cache(self.model, self.method, self.kv_backend)

    def _record(self, cache) -> None:
        self.peak_nbytes = max(self.peak_nbytes, cache.nbytes())

    @torch.no_grad()
    def continuation_logprobs(self, tokens: list[int], count: int) -> torch.Tensor:
        """Log-probabilities [count, V] of the distributions that predict the last ``count``
        of ``tokens``: prefill up to the first of them, then chunks through the cache."""
        inputs = torch.tensor([tokens[:-1]], device=self.device)  # [1, T]
        split = inputs.shape[1] - count + 1
        cache = self._fresh_cache()
        logits = [self.model(inputs[:, :split], cache=cache, use_cache=True,
                             logits_to_keep=1).logits]
        for start in range(split, inputs.shape[1], self.chunk):
            chunk = inputs[:, start : start + self.chunk]
            logits.append(self.model(chunk, cache=cache, use_cache=True).logits)
        self._record(cache)
        return torch.log_softmax(torch.cat(logits, 1)[0].float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        results = []
        for request, context, continuation in tqdm(requests, disable=disable_tqdm):
            whole = (context + continuation)[-(self.max_length + 1):]
            count = min(len(continuation), len(whole) - 1)
            logprobs = self.continuation_logprobs(whole, count)  # [count, V]
            target = torch.tensor(whole[-count:], device=logprobs.device)
            answer = (float(logprobs.gather(1, target[:, None]).sum()),
                      bool((logprobs.argmax(-1) == target).all()))
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
            results.append(answer)
        return results

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        cache = self._fresh_cache()
        out = super()._model_generate(context, max_length, stop, cache=cache,
                                      **generation_kwargs)
        self._record(cache)
        return out


def cli(argv: list[str] | None = None) -> None:
    """``kvmix-lm-eval``: lm-eval's own command line, with the ``kvmix`` model registered (this
    module) and kvmix's tasks on ``--include_path`` (unless one is given)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        argv += ["--include_path", str(TASKS)]
    sys.argv = ["lm-eval", *argv]
    cli_evaluate()


def task_manager(tokenizer_folder: str | None = None, lengths: list[int] | None = None,
                 **metadata: Any) -> TaskManager:
    """lm-eval's tasks plus kvmix's local ones; ``tokenizer_folder``, ``lengths`` and other
    ``metadata`` (``samples``) feed the synthetic tasks (passkey, RULER) that size their prompts
    in tokens."""
    if tokenizer_folder:
        metadata["tokenizer"] = tokenizer_folder
    if lengths:
        metadata["max_seq_lengths"] = lengths
    return TaskManager(include_path=str(TASKS), metadata=metadata or None)
