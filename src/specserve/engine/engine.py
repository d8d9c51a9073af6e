"""The engine loop: schedule -> run the model -> update requests -> detokenize and stop.

One `step()` is three calls (scheduler.schedule, runner.execute, scheduler.update_from_output)
plus output processing (incremental detokenization, stop strings, metrics).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import math
import numbers
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import torch

from specserve.config import CacheConfig, EngineConfig, KVCacheDtype, Quantization, usable_cpus
from specserve.defaults import resolve_defaults
from specserve.engine.runner import ModelRunner, StepConnector, kv_bytes_per_token
from specserve.engine.scheduler import SampledTokens, Scheduler, SchedulerOutput
from specserve.errors import (
    ConfigError,
    InvalidRequestError,
    PromptTooLongError,
    RequestTooLongError,
    SpecServeError,
)
from specserve.kv_cache.manager import KVCacheManager
from specserve.kv_cache.pages import KVPrefaulter
from specserve.kv_cache.tiers import TieredKVStore
from specserve.models.tokenizer import IncrementalDetokenizer, Tokenizer
from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.progress import bar
from specserve.request import Request, RequestStatus, ending_token_ids
from specserve.sampling.grammar import GrammarCompiler
from specserve.sampling.penalties import prune_banned
from specserve.sampling_params import SamplingParams, is_unicode
from specserve.spec.factory import (
    ProposerContext,
    build_proposer,
    drafter_kv_bytes_per_token,
    reserved_kv_blocks,
)
from specserve.spec.policy import RecentMedian, SpecPolicy
from specserve.spec.proposer import Proposer
from specserve.spec.tree import DraftTree

if TYPE_CHECKING:
    from specserve.startup_cache import StartupCache

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Structured output drafts the text its grammar forces, up to max(K, this many) tokens.
MIN_FORCED_DRAFT = 8
# Without measured step times, forced text is drafted only up to this many decoding requests.
FORCED_DRAFT_MAX_BATCH = 4
# Host-time estimates (a step's host work beyond its forward, a proposal's time) are the median
# of the last HOST_WINDOW measurements: a first-use cost or a collector pause in one step must
# not set them. (An EWMA started at its first measurement: a warm-up verify's 60 ms of first-use
# work read as 3.1 ms of overhead per verify for the next ~20 drafting steps, Qwen 1.5B +
# lookahead on a Xeon, against 0.5-0.8 ms steady; the policy drafted less on that start.)
HOST_WINDOW = 31
PROFILE_ROUNDS = 3  # rounds of profile_costs (the median ratio of each point is kept)
PROFILE_WARM_STEPS = 4  # one-token steps before each round's small points (the caches as decoding leaves them)
# One-token steps timed to read saved step costs at the machine's speed now: their lower quartile.
# (A shared VM's steps come with bursts of a few slow ones, 42-45 ms among 36 on the 2-vCPU Xeon;
# the median of three caught two of them, read the Qwen 1.5B's curve 24% slow, and the lookahead
# trees sized on it verified 6-7 nodes a step where 2-4 pay: 1.11x plain against 1.28-1.31x in
# the runs around it. The phase only comes back through one-token steps, rare under speculation,
# and the points below the knee learn against it meanwhile.)
RESTORE_ROUNDS = 5
RESTORE_SPEED = (0.5, 2.0)  # that speed against the saved one's, outside which the costs are measured afresh
# A step's time as T(n) learns it keeps at least this share when its attention beyond T(n)'s
# context is taken off (pair_s is timed on the kernel alone, and may run ahead of a busy step).
MIN_SHARE_AFTER_ATTENTION = 0.25
CATCHUP_PROFILE_TOKENS = 64  # one request's tokens in the pass that times a proposer's catch-up
# When the model declares a longer context than this, default to it (KV memory stays modest).
DEFAULT_MAX_MODEL_LEN_CAP = 8192
# KV bytes (over every layer) an idle server keeps faulted in past the pool's highest block handed
# out (Engine.prefault_kv): a few long prompts' worth, resident memory otherwise following the KV used.
PREFAULT_AHEAD_BYTES = 128 << 20


class EngineConnector(StepConnector, Protocol):
    """A StepConnector that also runs between steps and hears about finished requests."""

    def pump(self) -> None:
        """Between steps, after the scheduler has placed the blocks of new arrivals: move whatever
        KV has arrived into them (engine thread)."""

    def after_update(self) -> None:
        """After a step's outputs are in and its hidden states observed, before its finished
        requests are released (a prefill worker sends its drafter's prompt KV here)."""

    def request_finished(self, request: Request) -> None:
        """The request finished or was aborted; drop its transfer state."""


class PreparedRequest(NamedTuple):
    """A tokenized, validated request ready to be queued."""

    request: Request
    prompt: str | None
    index: int
    emitted_chars: int = 0  # a resumed request: characters of its text already streamed


@dataclass
class _OutputState:
    """Engine-side text state of one request."""

    prompt: str | None
    detok: IncrementalDetokenizer | None
    stop: list[str]
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    index: int = 0
    # Length of the text of the first min_tokens tokens: a stop string must end after it (None
    # until the output is that long).
    stop_after: int | None = 0


class RequestPreparer:
    """Tokenizes and validates requests for one model; needs no weights (routers use it too)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 capacity_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens
        self.eos_token_ids = tokenizer.stop_token_ids if tokenizer is not None else frozenset()
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler of this vocabulary (built on first use: ~0.1 s)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs a tokenizer; this model has none.")
            self._grammars = GrammarCompiler.shared(self.tokenizer, self.vocab_size)
        return self._grammars

    def prepare(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        *,
        request_id: str,
        priority: int = 0,
        arrival_time: float | None = None,
        index: int = 0,
        check_max_tokens: bool = True,
    ) -> PreparedRequest:
        """A validated Request; raises InvalidRequestError / PromptTooLongError otherwise.

        The whole request, prompt plus max_tokens, must fit in one request's room
        (max_request_tokens): one that cannot is refused here (RequestTooLongError) instead of
        being preempted over and over and cut short with finish_reason 'length'. max_tokens None
        (vLLM's convention) gives the request that whole room. Callers that size max_tokens
        themselves afterwards (the server, when a client leaves it out) pass check_max_tokens=False."""
        params = params or SamplingParams()
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise InvalidRequestError(f"priority must be an integer (lower is served first), got {priority!r}.",
                                      param="priority")
        priority = int(priority)
        prompt_text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        if params.max_tokens is None:  # as many as fit: the request's whole room
            room = self.max_request_tokens - len(token_ids)
            if params.min_tokens > room:
                raise self.too_long(len(token_ids), params.min_tokens)
            params = replace(params, max_tokens=room)
        if check_max_tokens and len(token_ids) + params.max_tokens > self.max_request_tokens:
            raise self.too_long(len(token_ids), params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none, use stop_token_ids.",
                                      param="stop")
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)  # refuse a bad schema before queueing
        if params.reference_text and params.reference_token_ids is None and self.tokenizer is not None:
            # Tokenized here, on the caller's thread (the server's tokenizer pool), not on the
            # engine thread when the reference proposer first sees the request.
            params = replace(params, reference_token_ids=self.tokenizer.encode(params.reference_text,
                                                                               add_special_tokens=False))
        ref = params.reference_token_ids
        if ref is not None and any(t >= self.vocab_size for t in ref):
            raise InvalidRequestError(
                f"reference_token_ids holds ids outside the vocabulary [0, {self.vocab_size}); check the tokenizer.",
                param="reference_token_ids")
        outside = sorted(t for t in params.logit_bias or () if t >= self.vocab_size)
        if outside:
            raise InvalidRequestError(
                f"logit_bias names token ids {outside[:5]} outside the vocabulary [0, {self.vocab_size}); check the tokenizer.",
                param="logit_bias")
        outside = sorted(t for t in params.stop_token_ids if t >= self.vocab_size)
        if outside:  # never sampled: a stop that could never happen is a mistake worth saying
            raise InvalidRequestError(
                f"stop_token_ids names token ids {outside[:5]} outside the vocabulary [0, {self.vocab_size}); "
                "check the tokenizer.", param="stop_token_ids")
        if params.min_tokens:
            ending = ending_token_ids(params, self.eos_token_ids)
            if sum(t < self.vocab_size for t in ending) == self.vocab_size:
                raise InvalidRequestError("min_tokens cannot hold: stop_token_ids and EOS cover the whole vocabulary.",
                                          param="min_tokens")
        req = Request(
            request_id, token_ids, params, eos_token_ids=self.eos_token_ids,
            priority=priority, arrival_time=arrival_time,
        )
        return PreparedRequest(req, prompt_text, index)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may reach, prompt and output: the context window, or the
        whole KV cache when that is smaller (a longer request could only be cut short)."""
        return min(self.max_model_len, self.capacity_tokens)

    def too_long(self, num_prompt: int, max_tokens: int) -> RequestTooLongError:
        """The error for a request of num_prompt + max_tokens tokens that cannot fit."""
        if self.max_model_len <= self.capacity_tokens:
            why = f"the context window (--max-model-len / max_model_len=) is {self.max_model_len:,} tokens"
        else:
            why = (f"the whole KV cache holds {self.capacity_tokens:,} tokens (--kv-cache-gib / kv_cache_gib=), "
                   f"fewer than the context window of {self.max_model_len:,}")
        most = self.max_request_tokens
        return RequestTooLongError(
            f"This request needs {num_prompt:,} prompt + {max_tokens:,} max_tokens = {num_prompt + max_tokens:,} "
            f"tokens, but one request holds at most {most:,}: {why}. Lower max_tokens to at most "
            f"{max(most - num_prompt, 0):,}, shorten the prompt, or give the engine a larger KV cache / context window."
        )

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "This model has no tokenizer; pass the prompt as a list of token ids."
                )
            if not is_unicode(prompt):
                raise InvalidRequestError("The prompt is not valid Unicode text: it holds a lone surrogate "
                                          "(bytes that were not UTF-8, or a \\ud800-style escape).")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, bytearray)):  # not token ids: list(b"hi") would read as [104, 105]
            raise InvalidRequestError("The prompt is bytes; decode it to text or pass token ids.")
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt token ids must be integers.")
        return None, ids

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("The prompt is empty; send at least one token.")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"Prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}); check the tokenizer."
            )
        n = len(token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"The prompt has {n} tokens but max_model_len is {self.max_model_len} and at least one "
                "token must be generated; shorten the prompt or raise --max-model-len."
            )
        if n + 1 > self.capacity_tokens:
            raise PromptTooLongError(
                f"The prompt has {n} tokens but the whole KV cache holds only "
                f"{self.capacity_tokens}; shorten the prompt or raise --kv-cache-gib."
            )


def _trim_heap() -> None:
    """Hand memory freed into the C allocator's arenas back to the OS. glibc serves allocations
    below its (adaptive, up to 32 MiB) mmap threshold from arenas and keeps them after free: in a
    process that has freed large buffers before, a released drafter's tensors would stay resident
    (measured: 3 MB of 200 MB returned). No-op without glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _target_kv_share(config: EngineConfig, arch: object, draft_checkpoint: object | None) -> CacheConfig:
    """The target's share of --kv-cache-gib: a drafter with KV of its own (a draft model, an
    EAGLE head) holds as many tokens as the target, out of the same budget."""
    cache = config.cache
    if cache.num_gpu_blocks_override is not None or not config.spec.enabled:
        return cache
    dtype = config.model.torch_dtype
    drafter = drafter_kv_bytes_per_token(config.spec, arch, cache, dtype, getattr(draft_checkpoint, "arch", None))
    if not drafter:
        return cache
    target = kv_bytes_per_token(arch, cache, dtype)  # type: ignore[arg-type]
    return replace(cache, kv_cache_gib=cache.kv_cache_gib * target / (target + drafter))


def build_off_thread(factory: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """factory(*args, **kwargs) run on a thread that exits once it returns: the torch (OpenMP)
    team its loading starts goes with it, so the thread that later steps the engine holds the
    process's only one (see LLMEngine._check_stepping_thread for why a second one costs)."""
    with ThreadPoolExecutor(1, thread_name_prefix="specserve-load") as loader:
        return loader.submit(factory, *args, **kwargs).result()


class LLMEngine:
    """Continuous-batching engine over one model; not thread-safe (drive it from one loop)."""

    def __init__(
        self, config: EngineConfig, checkpoint: object | None = None, draft_checkpoint: object | None = None
    ) -> None:
        from specserve.models.bundled import resolve_model
        from specserve.models.loader import LoadedCheckpoint, load_model_files

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model(config.model.model) if checkpoint is None else None
        has_blocks = bool(getattr(checkpoint, "packed", None)) if checkpoint is not None else None
        config = resolve_defaults(config, path, has_blocks)
        self.config = config
        if checkpoint is None:
            assert path is not None
            checkpoint = load_model_files(path, keep_blocks=config.model.quantization.blocks)
        elif config.model.quantization is Quantization.AUTO and not has_blocks:
            logger.warning("quantization 'auto' on a checkpoint that kept no quantized blocks: its layers run in "
                           "float. Load it with load_model_files(path, keep_blocks=True), pass the model path "
                           "instead, or ask for int4.")
        assert isinstance(checkpoint, LoadedCheckpoint)
        self.arch = checkpoint.arch
        self.tokenizer: Tokenizer | None = checkpoint.tokenizer
        self.model_name = config.model.model
        self._loader: threading.Thread | None = threading.current_thread()  # see _check_stepping_thread
        self._stepping_thread: int | None = None
        self.max_model_len = self._resolve_max_model_len(config)
        target_cache = _target_kv_share(config, checkpoint.arch, draft_checkpoint)
        self.drafter_kv_gib = config.cache.kv_cache_gib - target_cache.kv_cache_gib  # the drafter's share
        self.runner = ModelRunner(
            checkpoint.arch, checkpoint.weights, config.model, target_cache, self.max_model_len,
            packed=checkpoint.packed,
            reserved_blocks=reserved_kv_blocks(config.spec, config.scheduler.max_num_seqs, config.cache.block_size),
            source=path,  # (None for a checkpoint handed in: its tensors may not be the file's)
        )
        source = path if path is not None else checkpoint.source
        self._source = source
        self._ships_mtp = checkpoint.mtp_layers > 0  # a model trained with multi-token prediction
        del checkpoint  # the runner holds converted copies; let the float32 originals go
        self.kv_manager = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            tiers=self._build_tiers(config, source),
        )
        self.runner.tiers = self.kv_manager.tiers
        self._kv_prefaulter = KVPrefaulter(self.runner.kv_caches) if self.runner.device.type == "cpu" else None
        self.num_failed_load_requeues = 0  # requests sent back because a block failed while loading
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise InvalidRequestError(
                f"Without chunked prefill max_num_batched_tokens ({sched.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}); enable chunked prefill or raise the budget."
            )
        self.scheduler = Scheduler(sched, self.kv_manager, self.max_model_len)
        self.preparer = RequestPreparer(
            self.tokenizer, self.arch.vocab_size, self.max_model_len, self.kv_manager.capacity_tokens
        )
        self.eos_token_ids = self.preparer.eos_token_ids
        self.connector: EngineConnector | None = None
        self._pending_outputs: list[RequestOutput] = []
        self._forced_drafts: set[str] = set()  # requests whose coming draft is text their grammar forces
        self._copied: set[str] = set()  # requests whose coming draft a hybrid proposer copied (no draft pass)
        self._states: dict[str, _OutputState] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self._init_speculation(draft_checkpoint)

    # ------------------------------------------------------------------ speculation set-up
    def _init_speculation(self, draft_checkpoint: object | None) -> None:
        spec = self.config.spec
        # A checkpoint handed in by the caller stays alive in the caller anyway; kept to reload from.
        self._draft_checkpoint = draft_checkpoint
        self._spec_off_since: float | None = None  # monotonic time speculation was switched off
        self.drafter_released = False  # the proposer was freed while off; switching on rebuilds it
        self.proposer: Proposer | None = self._build_proposer()
        traits = self.proposer.traits if self.proposer is not None else None
        self.policy = SpecPolicy(
            spec,
            draft_cost_is_per_token=traits is not None and traits.cost == "per_pass",
            prior_acceptance=traits.prior_acceptance if traits is not None else 0.5,
            enabled=self.proposer is not None,
            trees=traits is not None and traits.trees and spec.use_trees(traits.tree_by_default),
            scored=traits is not None and traits.scores_predict_acceptance,
        )
        self._host_s = {False: RecentMedian(HOST_WINDOW), True: RecentMedian(HOST_WINDOW)}  # see _account_host_time
        self._propose_s = RecentMedian(HOST_WINDOW)  # a scored proposer's host time per request drafted for
        self._cycle_draft_s = 0.0  # the drafting done at the start of the last step, for it (_account_cycle)
        self._cycle_catchup_s = 0.0  # the part of it the cost model charges as a catch-up (estimated)
        self.spec_counters = {"draft_time_s": 0.0, "verify_time_s": 0.0, "decode_time_s": 0.0,
                              "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                              "num_forced_tokens": 0}
        depth = max(spec.num_spec_tokens, spec.max_draft_nodes)
        self.accepted_per_position = [0] * depth  # by depth: steps that accepted a node there
        self.drafted_per_position = [0] * depth  # steps whose draft reached that depth
        self.accepted_length_counts = [0] * (depth + 1)  # verify steps by accepted drafts
        if self.proposer is not None and spec.policy == "adaptive" and spec.profile_on_start:
            self._seed_cost_model()

    def _seed_cost_model(self) -> None:
        """The policy's step costs: what an earlier start measured for this machine, model and
        settings (specserve.startup_cache), read at the machine's speed now, or profile_costs.

        Saved points are the curve at the memory speed of the start that measured them. One
        fresh one-token step gives today's speed against it, which is the StepTimer's phase;
        the policy reads every point through it (and refines them from the steps it sees) just
        as after a fresh profile. A speed more than twice or half the saved one says the
        machine is not the one measured (another VM of the same CPU type): profile afresh.
        The attention a draft row adds per key of context beyond T(n)'s is timed at every start
        (a few milliseconds over the native kernel: ModelRunner.time_attention_pairs)."""
        self.policy.pair_s = self.runner.time_attention_pairs()
        cache = self._cost_cache()
        saved = cache.load() if cache is not None else None
        if saved is not None and self._restore_costs(saved):
            logger.info("speculation step costs from %s (SPECSERVE_PROFILE_CACHE=0 measures them at every start)",
                        cache.path)  # type: ignore[union-attr]
            return
        measured = self.profile_costs()
        if cache is not None:
            cache.save({**measured, "catchup_s_per_token": self.policy.catchup_s_per_token})

    def _cost_cache(self) -> StartupCache | None:
        """Where profile_costs' figures for this engine are kept; None for a model that is no file."""
        from dataclasses import asdict

        from specserve.models.bundled import resolve_model
        from specserve.startup_cache import StartupCache, file_identity

        target = file_identity(self._source)
        if target is None or self.proposer is None:
            return None
        config = self.config
        draft = None
        if config.spec.draft_model and self._draft_checkpoint is None:
            with contextlib.suppress(SpecServeError, OSError):
                draft = file_identity(resolve_model(config.spec.draft_model))
        return StartupCache("step-costs", {
            "target": target, "draft": draft, "model": asdict(config.model), "spec": asdict(config.spec),
            "max_num_seqs": config.scheduler.max_num_seqs, "budget": config.scheduler.max_num_batched_tokens,
            "kv": [str(config.cache.kv_cache_dtype), config.cache.block_size],
            "proposer": [type(self.proposer).__name__, self.proposer.memory_bytes(), str(self.proposer.traits)],
            "trees": self.policy.trees,
        })

    def _restore_costs(self, saved: dict[str, object]) -> bool:
        """Seed the policy from a saved profile_costs (see _seed_cost_model); False when it does
        not parse or the machine's speed says it is another machine."""
        try:
            target = {int(n): float(t) for n, t in saved["target"].items()}  # type: ignore[attr-defined]
            draft = {int(n): float(t) for n, t in saved["draft"].items()}  # type: ignore[attr-defined]
            catchup = float(saved.get("catchup_s_per_token", 0.0))  # type: ignore[arg-type]
        except (KeyError, AttributeError, TypeError, ValueError):
            return False
        values = [*target.values(), *draft.values()]
        if 1 not in target or not draft or not all(math.isfinite(v) and v > 0 for v in values) or not catchup >= 0:
            return False
        self.runner.time_decode_step(1)  # warm-up
        now = sorted(self.runner.time_decode_step(1, repeats=1) for _ in range(RESTORE_ROUNDS))[RESTORE_ROUNDS // 4]
        speed = now / target[1]
        if not RESTORE_SPEED[0] <= speed <= RESTORE_SPEED[1]:
            logger.info("saved step costs measured T(1) = %.1f ms, now %.1f ms: profiling afresh",
                        target[1] * 1e3, now * 1e3)
            return False
        timer = self.policy.target_time
        timer.calibrate(target)
        timer.phase = speed
        # The draft timer learns in seconds (StepTimer.observe, no phase): its points scale.
        per_pass = self.proposer is not None and self.proposer.traits.cost == "per_pass"
        self.policy.draft_time.calibrate({b: t * speed for b, t in draft.items()} if per_pass else draft)
        if per_pass:
            self.policy.catchup_s_per_token = catchup * speed
        return True

    def profile_costs(self, max_batch: int | None = None) -> dict[str, dict[int, float]]:
        """Time target forwards of n tokens and draft passes of b requests to seed the cost model.

        Small steps are timed as one request verifying n tokens (the shape a batch-1 draft has),
        larger ones as n requests of one token; two interleaved rounds, the faster of each, so a
        burst of noise on a shared machine does not bend the curve the policy prunes trees on.
        """
        spec = self.config.spec
        kmax = max(spec.num_spec_tokens, spec.max_draft_nodes if self.policy.trees else 0)
        limit = max_batch or min(spec.off_batch, self.config.scheduler.max_num_seqs)
        budget = self.config.scheduler.max_num_batched_tokens
        verify = [n for n in range(1, kmax + 2) if n <= budget]
        sizes = sorted({16, 32, 64, 2 * (kmax + 1), 4 * (kmax + 1), 8 * (kmax + 1)} - set(verify))
        sizes = [n for n in sizes if n <= max(limit * (kmax + 1), 1) and n <= budget]
        self.runner.time_decode_step(1)  # warm-up
        small = [n for n in verify if n > 1]  # one request verifying n tokens; sizes: n requests of one
        # Each round times one token before and after its points and keeps each point's ratio to
        # it: a shared machine's memory speed moves between phases (10-25% within minutes here),
        # which bent a curve of absolute minima (T(2) 15% above T(1) where the medians say 4%).
        # The curve is the median one-token time times the median ratios.
        # The small steps are timed as decoding meets them: after a few one-token steps, and
        # before the large ones. A large step leaves the caches cold for the next few: SmolLM2's
        # one-token step took 5.9, 5.5, 3.9, 3.5 ms after a 136-token one, then 3.1 (its 98 MB of
        # weights partly stay in the L3 while decoding; 2-vCPU Xeon). Timed right after the large
        # steps of the round before, T(1) read 5.3-6.0 ms and T(2) below it, and the policy,
        # seeing verify steps as nearly free, drafted where they cost 1.5-2x a one-token step.
        ones: list[float] = []
        ratios: dict[int, list[float]] = {n: [] for n in (*small, *sizes)}
        for _ in bar(range(PROFILE_ROUNDS), desc="profiling step costs for the speculation policy", unit="round"):
            for _ in range(PROFILE_WARM_STEPS):
                self.runner.time_decode_step(1, repeats=1)
            before = self.runner.time_decode_step(1, repeats=1)
            times = {n: self.runner.time_decode_step(1, tokens_per_req=n, repeats=1) for n in small}
            one = (before + self.runner.time_decode_step(1, repeats=1)) / 2
            times.update({n: self.runner.time_decode_step(n, repeats=1) for n in sizes})
            ones.append(one)
            for n, t in times.items():
                ratios[n].append(t / one)
        t1 = statistics.median(ones)
        self.policy.target_time.calibrate({1: t1, **{n: t1 * statistics.median(r) for n, r in ratios.items()}})
        if self.proposer is not None and self.proposer.traits.cost == "per_pass":
            self.proposer.time_pass(1)  # warm-up
            self.policy.draft_time.calibrate({b: self.proposer.time_pass(b) for b in (1, 2, 4, 8, 16, 32) if b <= limit})
            # What catching a request up costs per token (a prompt, a backlog): one pass over many.
            self.policy.catchup_s_per_token = self.proposer.time_catchup(CATCHUP_PROFILE_TOKENS) / CATCHUP_PROFILE_TOKENS
        else:
            self.policy.draft_time.calibrate({1: 1e-4})  # a table lookup: negligible next to a forward
        return {"target": dict(self.policy.target_time.points), "draft": dict(self.policy.draft_time.points)}

    def attach_connector(self, connector: EngineConnector | None) -> None:
        """Install a disaggregation connector (see specserve.disagg.kv_transfer)."""
        self.connector = connector
        self.runner.attach_connector(connector)

    def _build_proposer(self) -> Proposer | None:
        proposer = build_proposer(ProposerContext(
            spec=self.config.spec, model=self.config.model, cache=self.config.cache,
            max_model_len=self.max_model_len, tokenizer=self.tokenizer, target_vocab_size=self.arch.vocab_size,
            target_num_blocks=self.runner.num_blocks, draft_checkpoint=self._draft_checkpoint, target_runner=self.runner,
            target_block_ids=self.kv_manager.block_ids, target_source=self._source if self._ships_mtp else None,
        ))
        # Feature-level drafters read the target's hidden states of every verified token.
        self.runner.capture_hidden = proposer is not None and proposer.traits.needs_hidden_states
        self.runner.feature_layers = proposer.feature_layers() if self.runner.capture_hidden else ()
        return proposer

    def reset_suffix_cache(self) -> None:
        """Forget the finished requests' outputs the proposer drafts from (specserve.spec.served)."""
        if self.proposer is not None:
            self.proposer.reset_served()

    def set_speculation(self, enabled: bool) -> None:
        """Turn speculation off or on at run time (takes effect from the next step). Switching on
        reloads a drafter released while off (`release_idle_drafter`)."""
        if enabled and self.drafter_released:
            self._reload_drafter()
        self.policy.enabled = bool(enabled) and self.proposer is not None
        if self.policy.enabled:
            self._spec_off_since = None
        else:
            if self._spec_off_since is None:
                self._spec_off_since = time.monotonic()
            for req in self.scheduler.running:
                req.draft = None

    @property
    def speculation_enabled(self) -> bool:
        """Whether the policy may currently speculate."""
        return self.policy.enabled

    @property
    def can_speculate(self) -> bool:
        """A proposer is configured (loaded, or released while speculation is off)."""
        return self.proposer is not None or self.drafter_released

    @property
    def suffix_cache_tokens(self) -> int:
        """Tokens of finished requests' outputs (each after its prompt's last tokens) the proposer
        keeps to draft later ones from."""
        return self.proposer.served_tokens() if self.proposer is not None else 0

    @property
    def drafter_memory_bytes(self) -> int:
        """Bytes the proposer holds now (a draft model's weights and KV cache; 0 when released)."""
        return self.proposer.memory_bytes() if self.proposer is not None else 0

    def idle_work(self) -> bool:
        """What the engine thread of a server or a worker does in a turn with no request running:
        release a drafter switched off long enough, and fault in the KV pages the next requests
        will write (prefault_kv). True while some of that work remains (look for commands, do not
        sleep)."""
        self.release_idle_drafter()  # step() checks while busy
        return self.prefault_kv()

    def prefault_kv(self, budget_s: float = 0.002) -> bool:
        """Idle work for the server's engine thread: fault in, for about `budget_s`, the KV pages
        the next allocations will write, up to PREFAULT_AHEAD_BYTES past the highest block the pool
        has handed out (specserve.kv_cache.pages); True while some remain."""
        pf = self._kv_prefaulter
        if pf is None or not pf.available:
            return False
        ahead = -(-PREFAULT_AHEAD_BYTES // max(self.runner.block_payload_bytes(), 1))
        return pf.advance(len(self.kv_manager.pool.blocks) + ahead, time.monotonic() + budget_s)

    def release_idle_drafter(self, now: float | None = None) -> int:
        """Free the proposer's weights and KV cache once speculation has been switched off for
        `spec.release_after_s` seconds; returns the bytes freed (0: nothing to do yet).

        Called by the engine loop every step and, when idle, by the server's engine thread.
        Only proposers that hold memory are freed (a draft model; n-gram tables are small and
        hold per-request state worth keeping)."""
        after = self.config.spec.release_after_s
        if self.proposer is None or self.policy.enabled or after is None or self._spec_off_since is None:
            return 0
        held = self.proposer.memory_bytes()
        if held == 0 or (time.monotonic() if now is None else now) - self._spec_off_since < after:
            return 0
        self.proposer = None
        self.runner.capture_hidden = False
        self.runner.feature_layers = ()
        self.drafter_released = True
        gc.collect()
        _trim_heap()
        logger.info("speculation off for %.0f s: released the drafter (%.1f MiB of weights and KV cache)",
                    after, held / (1 << 20))
        return held

    def _reload_drafter(self) -> None:
        t0 = time.perf_counter()
        self.proposer = self._build_proposer()
        self.drafter_released = False
        if self.proposer is not None:
            for req in [*self.scheduler.running, *self.scheduler.waiting]:
                self.proposer.add_request(req)
        logger.info("speculation on: reloaded the drafter in %.1f s", time.perf_counter() - t0)

    def _build_tiers(self, config: EngineConfig, path: object | None) -> TieredKVStore | None:
        """The prefix cache's host and disk tiers, when configured. Their blocks are keyed by a
        fingerprint of everything that decides a block's bytes (model file, precision, the linear
        kernels, KV dtype and layout, specserve's version), so a directory never serves another
        model's KV, nor KV the same model computed with other kernels."""
        cache = config.cache
        if not cache.has_tiers:
            return None
        import hashlib
        import json
        import sys

        from specserve import __version__
        from specserve.startup_cache import file_identity

        runner, arch = self.runner, self.arch
        ident: dict[str, object] = {
            "model": config.model.model, "quantization": config.model.quantization, "dtype": str(runner.dtype),
            # the products' kernels (dense and oneDNN float32 matmuls round differently: another KV)
            "linear_backend": str(runner.linear_backend), "float_backend": str(runner.float_linear_backend),
            "native_ops": runner.native_ops, "device": str(runner.device),
            "kv_cache_dtype": cache.kv_cache_dtype, "block_size": cache.block_size, "layers": arch.num_layers,
            "kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "vocab": arch.vocab_size,
            "specserve": __version__, "python": list(sys.version_info[:2]),  # block hashes are Python's hash()
        }
        if path is not None and (where := file_identity(path)) is not None:
            ident |= where
        fingerprint = hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=16).hexdigest()
        gib = 1 << 30
        remote = None
        if cache.kv_remote_store is not None:
            from specserve.kv_cache.remote import find_kv_store

            remote = find_kv_store(cache.kv_remote_store)
        store = TieredKVStore(fingerprint, runner.block_payload_bytes(), host_bytes=int(cache.kv_host_gib * gib),
                              disk_dir=cache.kv_disk_dir, disk_bytes=int(cache.kv_disk_gib * gib), remote_store=remote,
                              layer_bytes=runner.layer_payload_bytes())
        if store.disk is not None:
            logger.info("KV disk tier %s: %d blocks from earlier runs", store.disk.dir, len(store.disk))
        return store

    def _save_to_tiers(self) -> None:
        """Copy the blocks the prefix cache registered this step into its lower tiers (their
        content is final and nothing has reused them since the step's forward)."""
        kv = self.kv_manager
        if kv.tiers is None:
            return
        for block_id, block_hash in kv.take_pending_saves():
            kv.tiers.save(block_hash, self.runner.read_block(block_id))

    def close(self) -> None:
        """Finish background work (the disk tier's writes). The engine is not used afterwards."""
        if self.kv_manager.tiers is not None:
            self.kv_manager.tiers.close()

    def _resolve_max_model_len(self, config: EngineConfig) -> int:
        native = self.arch.max_position_embeddings
        want = config.model.max_model_len
        if want is None:
            return min(native, DEFAULT_MAX_MODEL_LEN_CAP)
        if want > native:  # the engine's configuration, not a request: a ConfigError as the others
            raise ConfigError(
                f"max_model_len={want} exceeds the model's context length {native}; "
                f"use --max-model-len {native} or less."
            )
        return want

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        index: int = 0,
    ) -> str:
        """Validate and queue one request; raises InvalidRequestError without side effects."""
        prepared = self.prepare_request(
            prompt, params, request_id=request_id, priority=priority, arrival_time=arrival_time, index=index
        )
        return self.add_prepared(prepared)

    def prepare_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        index: int = 0,
        check_max_tokens: bool = True,
    ) -> PreparedRequest:
        """Tokenize and validate without touching engine state (safe from any thread)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return self.preparer.prepare(prompt, params, request_id=rid, priority=priority,
                                     arrival_time=arrival_time, index=index, check_max_tokens=check_max_tokens)

    def add_prepared(self, prepared: PreparedRequest) -> str:
        """Queue a request made by prepare_request (engine thread only)."""
        req = prepared.request
        rid = req.request_id
        if rid in self._states:
            raise InvalidRequestError(f"request id {rid!r} is already in use; pick a unique id.")
        params = req.sampling_params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens)
        state = _OutputState(prepared.prompt, detok, list(params.stop or []), index=prepared.index,
                             stop_after=None if params.min_tokens else 0)
        if req.num_output_tokens:
            # A request resumed elsewhere after a worker failure: its earlier output is known and
            # was already streamed, so text and emission continue exactly where they stopped.
            if detok is not None:
                detok.append(req.output_token_ids)
                state.text = detok.text
            state.num_emitted_tokens = req.num_output_tokens
            state.num_emitted_chars = min(prepared.emitted_chars, len(state.text))
        if params.structured_output is not None:
            req.grammar = self.preparer.grammars.new_state(params.structured_output, req.output_token_ids)
        self._states[rid] = state
        self.scheduler.add_request(req)
        if self.proposer is not None:
            self.proposer.add_request(req)
            self.policy.guard.new_request()
        self.num_prompt_tokens += req.num_prompt_tokens
        return rid

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests now; their KV blocks are freed before this returns."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        done = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self._release_finished(self.scheduler.take_finished())
        return [self._make_output(req, []) for req in done]

    def fail_requests(self, request_ids: Iterable[str], error: str) -> None:
        """End requests with an error outside a step; their outputs come with the next step."""
        done = self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ERROR)
        for req in done:
            req.error = error
        self._release_finished(self.scheduler.take_finished())
        self._pending_outputs.extend(self._make_output(req, []) for req in done)

    def has_request(self, request_id: str) -> bool:
        """True while the request is queued or running."""
        return request_id in self._states

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running."""
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        """Queued plus running requests."""
        return self.scheduler.num_waiting + self.scheduler.num_running

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return outputs of requests that progressed or finished.

        The drafts a step verifies are proposed at its start, not at the end of the step before:
        that step's tokens are returned (and streamed) first. A request's first token then waits
        for its prefill only, not also for its first drafts (a draft model catching up over the
        whole prompt, a copier indexing it); every later token is sooner by a proposal's time too,
        and the steps' total time is unchanged."""
        if threading.get_ident() != self._stepping_thread:
            self._check_stepping_thread()
        self._prepare_drafts()
        pending: list[RequestOutput] = []
        if self.connector is not None:
            self.scheduler.reserve_incoming()  # blocks for KV arriving from a prefill worker
            self.connector.pump()
            pending, self._pending_outputs = self._pending_outputs, []
        if self._spec_off_since is not None:
            self.release_idle_drafter()
        t_step = time.perf_counter()
        sched_out = self.scheduler.schedule()
        for rid in sched_out.preempted_ids:
            if self.proposer is not None:
                self.proposer.remove_request(rid, finished=False)
        if sched_out.is_empty:
            return pending
        t_exec = time.perf_counter()
        try:
            sampled = self.runner.execute(sched_out)
        except Exception as exc:  # a model failure must not take every other request down
            self._drop_failed_loads()
            logger.exception("model step failed; failing the %d scheduled requests", len(sched_out.scheduled))
            ids = [sr.request_id for sr in sched_out.scheduled]
            failed = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            self._release_finished(self.scheduler.take_finished())
            outs = []
            for req in failed:
                req.error = f"{type(exc).__name__}: {exc}"
                outs.append(self._make_output(req, []))
            return pending + outs
        self.num_steps += 1
        self._drop_failed_loads()
        for rid, (first, lps, tops) in self.runner.take_prompt_logprobs().items():
            if (req := self.scheduler.requests.get(rid)) is not None:
                req.add_prompt_logprobs(first, lps, tops)
        self._account_step(sched_out, sampled)
        self._account_host_time(sched_out, time.perf_counter() - t_exec - self.runner.last_forward_time_s)
        results = self.scheduler.update_from_output(sched_out, sampled)
        self._save_to_tiers()
        if self.runner.capture_hidden and self.proposer is not None:
            self.proposer.observe_hidden(self.runner.take_hidden())
        if self.connector is not None:
            self.connector.after_update()
        if self.proposer is not None and self.proposer.traits.needs_verify_outputs:
            by_id = {req.request_id: req for req, _ in results}
            for sr in sched_out.scheduled:
                if (sr.draft is not None and sr.request_id in by_id and sr.request_id in sampled
                        and sr.request_id not in self._forced_drafts):
                    self.proposer.observe(by_id[sr.request_id], sr.draft, sampled[sr.request_id])
        outputs = pending
        for req, new_tokens in results:
            if req.grammar is not None:
                req.grammar.accept(new_tokens)
            self.num_generated_tokens += len(new_tokens)
            outputs.append(self._make_output(req, new_tokens))
        self._release_finished(self.scheduler.take_finished())
        self._account_cycle(sched_out, sum(len(new) for _, new in results), time.perf_counter() - t_step)
        return outputs

    def _prepare_drafts(self) -> None:
        """The coming step's drafts: the proposer's for the requests the policy lets draft, then
        the text a grammar forces. Run first in `step`, in the order the end of the step before
        ran them until the proposal moved there (before the connector takes in new requests)."""
        self._cycle_catchup_s = 0.0
        if self.proposer is not None and self.policy.enabled:
            t_propose = time.perf_counter()
            self._propose_next()
            self._cycle_draft_s = time.perf_counter() - t_propose
        else:
            self._cycle_draft_s = 0.0
        self._draft_forced()

    def _account_cycle(self, sched_out: SchedulerOutput, tokens: int, seconds: float) -> None:
        """Tell the policy's rate guard what a decode step yielded: its tokens, and its seconds
        with the drafting done for it at its start (a step with a prompt chunk tells nothing about
        decoding). A catch-up in that drafting (the drafter feeding a request's prompt, or the
        tokens it fell behind while drafts were held back) is left out at the rate the cost model
        charges it: it is paid once per request or resumption, and the cost model already weighed
        it, spread over the steps the request has left, when it chose to draft. Counted whole, it
        was judged as the rate of drafting: Qwen 1.5B + 0.5B draft on coding prompts, 2-vCPU
        Zen 4, each answer's first steps carry a 27-50-token catch-up of the prompt (0.06-0.1 s
        against ~0.06 s a step), and a trial after a hold carries the held steps' backlog (64
        tokens, ~0.1 s) within its 4 steps, so in the VM's fast-memory spells trials failed and
        holds doubled: one run of the 8 prompts held 312 of its ~470 chain steps (1.23x plain)
        where the next held none (1.36x)."""
        if self.proposer is None and not self.drafter_released:
            return
        if any(sr.num_new_tokens > 1 and sr.draft is None for sr in sched_out.scheduled):
            return
        speculated = any(sr.draft is not None and sr.request_id not in self._forced_drafts for sr in sched_out.scheduled)
        if speculated and self.policy.config.policy != "adaptive":
            return  # drafts of another policy's K: not the rate the adaptive policy gets
        draft_s = max(0.0, self._cycle_draft_s - self._cycle_catchup_s)
        self.policy.guard.observe(len(sched_out.scheduled), tokens, seconds + draft_s, speculated)

    def _drop_failed_loads(self) -> None:
        """Lower-tier blocks that failed verification while this step loaded them: their cached
        content is forgotten and every request that read one goes back to the queue (the runner
        dropped its results); it recomputes from its last good block."""
        if not self.runner.failed_loads:
            return
        failed, holders = self.runner.take_failed_loads()
        requeued = self.scheduler.requeue_failed_loads(failed, holders)
        self.num_failed_load_requeues += len(requeued)
        logger.warning("%d KV block(s) failed verification while loading; %d request(s) recompute them",
                       len(failed), len(requeued))
        if self.proposer is not None:
            for rid in requeued:
                self.proposer.remove_request(rid, finished=False)

    def _check_stepping_thread(self) -> None:
        """Warn (once) when steps run on another thread than the one that loaded the model while
        that one lives on. torch's CPU kernels run on OpenMP: each thread that starts a parallel
        region keeps a team of its own, and with more team threads than CPUs idle workers sleep
        instead of spinning, so every parallel region of a step wakes them (a SmolLM2 decode
        step 9.5 against 7.6 ms on a 2-vCPU Zen 4). `specserve serve` steps on its loading thread;
        a thread that loads and then exits (`build_off_thread`) leaves no team behind."""
        self._stepping_thread = threading.get_ident()
        loader = self._loader
        if loader is None or loader is threading.current_thread() or not loader.is_alive():
            return
        threads = torch.get_num_threads()
        cpus = usable_cpus()
        if threads < 2 or 2 * threads <= cpus:
            return
        self._loader = None  # once
        logger.warning(
            "this engine steps on thread %r, but its model was loaded on %r, which is still running: torch's "
            "OpenMP keeps a team of %d threads for each on %d CPUs, and every parallel region then wakes sleeping "
            "workers (steps 1.2-1.6x slower measured on 2 vCPUs). Load the model on the thread that steps it, or "
            "on a thread that exits once it is loaded.", threading.current_thread().name, loader.name, threads, cpus)

    def _account_step(self, sched_out: SchedulerOutput, sampled: dict[str, SampledTokens]) -> None:
        t = self.runner.last_forward_time_s
        if self._teaches_step_cost(sched_out):
            # T(n) is the curve at a short context: the attention beyond it (charged per request by
            # the policy, pair_s) is taken off first, or a long context's steps would read as a
            # slow memory phase and make every verify look as cheap as a decode step.
            attn = self.policy.attention_s((len(sr.token_ids), sr.start_pos) for sr in sched_out.scheduled)
            self.policy.target_time.observe_scaled(sched_out.num_batched_tokens, max(t - attn, t * MIN_SHARE_AFTER_ATTENTION))
        spec = False
        for sr in sched_out.scheduled:
            st = sampled.get(sr.request_id)
            if st is None or sr.draft is None:
                continue
            if sr.request_id in self._forced_drafts:  # not the proposer's: keep its statistics clean
                self.spec_counters["num_forced_tokens"] += st.num_accepted_tokens
                continue
            spec = True
            self.policy.observe(sr.request_id, sr.draft.max_depth, st.num_accepted_tokens,
                                free=sr.request_id in self._copied,
                                predicted=sum(sr.draft.scores) if sr.draft.scores else None, nodes=len(sr.draft))
            c = self.spec_counters
            c["num_drafts"] += 1
            c["num_draft_tokens"] += st.num_draft_tokens
            c["num_accepted_tokens"] += st.num_accepted_tokens
            self.accepted_length_counts[min(st.num_accepted_tokens, len(self.accepted_length_counts) - 1)] += 1
            depth = sr.draft.max_depth
            for j in range(min(depth, st.num_accepted_tokens + 1, len(self.drafted_per_position))):
                self.drafted_per_position[j] += 1
                self.accepted_per_position[j] += int(j < st.num_accepted_tokens)
        self.spec_counters["verify_time_s" if spec else "decode_time_s"] += t

    def _account_host_time(self, sched_out: SchedulerOutput, host_s: float) -> None:
        """Learn what a step with drafts costs on the host beyond one without: the execute time
        the forward does not account for, decode steps only, one EWMA for each kind."""
        if any(sr.num_new_tokens > 1 and sr.draft is None for sr in sched_out.scheduled):
            return  # a prompt chunk's host work is not a draft's
        with_drafts = any(sr.draft is not None for sr in sched_out.scheduled)
        self._host_s[with_drafts].add(host_s)
        plain, spec = self._host_s[False].value, self._host_s[True].value
        if plain is not None and spec is not None:
            self.policy.verify_overhead_s = max(0.0, spec - plain)

    def _teaches_step_cost(self, sched_out: SchedulerOutput) -> bool:
        """Whether the step's forward time is what the policy's T(n) should learn for n tokens.

        Not a step that captured a CUDA graph: it took 30-40x a replay (SmolLM2-shaped model on an
        H200: 126-150 ms against 4.4 for the first step of a 23-token prompt), and the point
        stayed in the curve trees are pruned on. Nor, with graphs on, a step that carried a prompt
        chunk and ran eagerly: SmolLM2's 113-154-token prompts took 22-23 ms where 136 decode rows
        replayed take 5, so batched verifies looked 4-5x dearer than they are. Decode and verify
        steps, the shapes the policy prices, are always learned."""
        runner = self.runner
        if runner.last_forward_built_graph:
            return False
        return not runner.last_forward_eager or all(sr.num_new_tokens <= 1 for sr in sched_out.scheduled)

    def _propose_next(self) -> None:
        """Ask the policy for K per decoding request and the proposer for that many drafts."""
        decoding = [r for r in self.scheduler.running if r.is_decoding]
        self._copied = set()
        if not any(r.sampling_params.speculative is not False for r in decoding):
            # Every decoding request opted out (or none decodes): the copier and the cost model
            # would be asked for nothing. SmolLM2 + EAGLE, 8 prose asks sent with speculative=False:
            # asking them cost ~0.2 ms of a 3.4 ms step (0.91x the plain engine's tokens/s).
            return
        prefill_tokens = sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.running if not r.is_decoding)
        other = min(prefill_tokens, self.config.scheduler.max_num_batched_tokens)
        if self.policy.drafts_held(len(decoding), other) and not self.policy.guard.copy_resumes(
                len(decoding), self.proposer.copy_resumes(decoding)):  # type: ignore[union-attr]
            # Whatever the copier and the cost model chose would be dropped: neither is asked, only
            # whether the text has turned to one a copy carries on (one search of each tail),
            # which ends the hold. SmolLM2 with its EAGLE head on coding and prose prompts, 2-vCPU
            # Xeon: the guard held 480 of 1,001 steps' drafts off, each of which had spent ~0.25
            # ms of a 5.5 ms step on a copy match and the policy's choice.
            return
        spec = self.policy.config
        # How far a stateful drafter is behind each request: asked only where catching up costs.
        catchup = ([self.proposer.catchup_tokens(r) for r in decoding]  # type: ignore[union-attr]
                   if self.policy.catchup_s_per_token > 0 and self.policy.config.policy == "adaptive" else None)
        # Which drafts a hybrid will copy (no draft pass), unless no request may draft at this batch size.
        none_may = spec.policy == "adaptive" and len(decoding) >= spec.off_batch
        free = None if none_may else self.proposer.free_drafts(decoding)  # type: ignore[union-attr]
        if free is not None:  # a copy where it promises as much as the model's draft, else the model
            chosen = self.policy.prefer_copy(decoding, free)
            self.proposer.decline_free({r.request_id for r, f, c in zip(decoding, free, chosen) if f and not c})  # type: ignore[union-attr]
            free = chosen
        ks = self.policy.choose(decoding, other, catchup, free)
        for i, req in enumerate(decoding):
            if ks[i]:
                # Never draft past the context window or past the last token max_tokens allows.
                room = min(self.max_model_len - req.num_tokens,
                           req.sampling_params.max_tokens - req.num_output_tokens) - 1
                ks[i] = max(0, min(ks[i], room))
        if any(ks) and (other or self.scheduler.waiting):  # a prompt in the step (one admitted now too) waits for its drafts' rows
            ks = self.policy.cap_for_prompts(ks, self.scheduler.prompt_tokens_next_step(len(decoding)))
        for i, req in enumerate(decoding):
            if ks[i] and not self.proposer.may_draft(req):  # type: ignore[union-attr]
                # Its search would find nothing: what the empty proposal teaches the policy, without
                # the search. (SmolLM2's coding answers, batch 1: 207 of 464 steps had a last token
                # new to the text; each search and its bookkeeping ~0.05 ms of a ~4.5 ms step. The
                # step's choice is still made: skipping it too, where no request may draft, left
                # the policy's yields without those steps' zeros and its probes later, and edit
                # answers took 2.7 tokens a step where they had taken 3.1.)
                ks[i] = 0
                self.policy.observe_nothing_drafted(req.request_id, free=bool(free and free[i]))
        if not any(ks):
            return
        t0 = time.perf_counter()
        if self.proposer.traits.cost == "per_pass":  # type: ignore[union-attr]
            # What one draft pass costs next to a target step: where growing a tree stops paying.
            self.proposer.pass_cost_ratio = (self.policy.draft_time(len(decoding))  # type: ignore[union-attr]
                                             / max(self.policy.target_time(len(decoding) + other), 1e-9))
        copied = self._copied = {r.request_id for i, r in enumerate(decoding) if free and free[i] and ks[i]}
        proposals = self.proposer.propose(decoding, ks)  # type: ignore[union-attr]
        if catchup is not None:  # what the cost model charged as catch-ups (see _account_cycle)
            self._cycle_catchup_s = sum(self.policy.catchup_seconds(c) for r, c, k in zip(decoding, catchup, ks)
                                        if k and r.request_id not in copied)
        delivered = {rid: tree.max_depth for rid, tree in proposals.items()}
        proposals = self.policy.prune(decoding, proposals, other, free)
        dt = time.perf_counter() - t0
        if self.policy.scored:  # the host's time per request for a proposal and its pruning (choose() weighs it)
            self.policy.propose_s = self._propose_s.add(dt / max(1, sum(1 for k in ks if k)))
        self.spec_counters["draft_time_s"] += dt
        if not self._cycle_catchup_s:  # (a catch-up's cost is its own estimate's: left out)
            self.policy.observe_drafting(dt)
        if self.policy.draft_cost_is_per_token:  # the draft model
            # Steady cost of a draft position, without the catch-up pass; None when every
            # request stopped after that pass (K = 1, or an unsure first draft).
            per_pass = getattr(self.proposer, "last_pass_time_s", None)
            if per_pass is not None:
                # over the requests the drafter drafted for (not those a hybrid copied for)
                self.policy.draft_time.observe(sum(1 for r, k in zip(decoding, ks) if k and r.request_id not in copied), per_pass)
        for req, k in zip(decoding, ks):
            prop = proposals.get(req.request_id)
            if k and req.request_id in delivered:  # before the grammar's cut: what it cuts would be rejected, a miss
                self.policy.observe_proposal(req.request_id, k, delivered[req.request_id],
                                             prop.max_depth if prop is not None else 0, free=req.request_id in copied)
            if prop is not None:
                prop = prune_banned(prop, req)  # a copied token the request bans (logit_bias, min_tokens)
            if prop is not None and req.grammar is not None:
                prop = req.grammar.prune(prop)  # cut what the grammar could never accept
            if prop is not None and len(prop):
                req.draft = prop
            elif k:
                self.policy.observe_nothing_drafted(req.request_id, free=req.request_id in copied)

    def _draft_forced(self) -> None:
        """Structured output: where the grammar forces the next text (`{"name":"`), draft its usual
        tokenization. It is verified like any deterministic draft, so the output stays exact, and
        is nearly always accepted: jump-forward decoding folded into the verify pass, with or
        without a proposer. A proposer's draft that already begins with it is kept."""
        self._forced_drafts.clear()
        if self.tokenizer is None:
            return
        running = self.scheduler.running
        forced_reqs = [r for r in running if r.grammar is not None and r.is_decoding
                       and r.sampling_params.speculative is not False]
        if not forced_reqs:  # the common step: no constrained request, nothing more to look at
            return
        cap = max(self.config.spec.num_spec_tokens, MIN_FORCED_DRAFT)
        num_decoding = sum(1 for r in running if r.is_decoding)
        picks: list[tuple[Request, DraftTree]] = []
        for req in forced_reqs:
            assert req.grammar is not None
            text = req.grammar.forced_text()
            room = min(self.max_model_len - req.num_tokens,
                       req.sampling_params.max_tokens - req.num_output_tokens) - 1
            if not text or room <= 0:
                continue
            tokens = self.tokenizer.encode(text, add_special_tokens=False)[: min(room, cap)]
            forced = req.grammar.prune(DraftTree.chain(tokens)) if tokens else None
            if forced is None:
                continue
            if req.draft is not None and req.draft.main_path_tokens()[: len(forced)] == forced.token_ids:
                continue
            picks.append((req, forced))
        extra = sum(len(f) - (len(r.draft) if r.draft is not None else 0) for r, f in picks)
        if not picks or not self._forced_drafts_pay(num_decoding, max(extra, 1)):
            return
        for req, forced in picks:
            req.draft = forced
            self._forced_drafts.add(req.request_id)

    def _forced_drafts_pay(self, num_decoding: int, extra_tokens: int) -> bool:
        """Whether verifying about `extra_tokens` more tokens (nearly all accepted) beats decoding
        them one step at a time, on the step times measured so far (T(n) by tokens per step).
        Without measurements up to that size: only at small batches (measured on SmolLM2, two
        EPYC cores: +11% at batch 1, -34% at batch 8 where the step is already compute-bound)."""
        t = self.policy.target_time
        n = num_decoding + extra_tokens
        if len(t.points) >= 2 and max(t.points) >= n:
            return (num_decoding + 0.9 * extra_tokens) / t(n) > num_decoding / t(num_decoding)
        return num_decoding <= FORCED_DRAFT_MAX_BATCH

    def _release_finished(self, finished: list[Request]) -> None:
        for req in finished:
            if self.connector is not None:
                self.connector.request_finished(req)
            # (an answer's length where it ended by itself or at its limit, not an abort's)
            ended = req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            self.policy.forget(req.request_id, req.num_output_tokens if ended else None)
            if self.proposer is not None:
                self.proposer.request_finished(req)
                self.proposer.remove_request(req.request_id, finished=True)

    def _make_output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        state = self._states[req.request_id]
        if state.detok is not None and new_tokens:
            old_len = len(state.text)
            # The id that ended the output (EOS, a stop_token_ids id) stays in token_ids; its text
            # only with include_stop_str_in_output (vLLM's convention, as for a stop string).
            hidden = int(req.status == RequestStatus.FINISHED_STOPPED and isinstance(req.stop_reason, (int, type(None)))
                         and not req.sampling_params.include_stop_str_in_output)
            text_tokens = new_tokens[: len(new_tokens) - hidden]
            rest = text_tokens
            if state.stop_after is None:
                head = req.sampling_params.min_tokens - (req.num_output_tokens - len(new_tokens))
                if head <= len(new_tokens):  # this step reaches min_tokens
                    state.detok.append(text_tokens[: max(head, 0)])
                    state.stop_after = len(state.detok.text)
                    rest = text_tokens[max(head, 0) :]
            checking = bool(state.stop) and state.stop_after is not None
            # Several tokens in one (speculative) step under stop strings: one at a time, so that a
            # stop string ends the output at the token that completes it, as plain decoding's would.
            pieces = [[t] for t in rest] if checking and len(rest) > 1 else [rest]
            for j, piece in enumerate(pieces):
                if piece:
                    state.detok.append(piece)
                state.text = state.detok.text
                if checking and self._check_stop_strings(req, state, old_len, already_finished=req.is_finished):
                    if dropped := len(pieces) - 1 - j + hidden:  # the step's tokens after the one that completed it
                        req.drop_last_output_tokens(dropped)
                        self.num_generated_tokens -= dropped
                    break
        finished = req.is_finished
        # At the end, emit bytes still held back (an incomplete character at the very end).
        if (finished and state.detok is not None and not isinstance(req.stop_reason, str)
                and state.detok.flush()):
            state.text = state.detok.text
        holdback = 0
        if not finished and state.stop:
            # Hold back text that could still turn out to be the start of a stop string, so the
            # streamed text always equals the final text.
            holdback = max(len(s) for s in state.stop) - 1
        emit_upto = max(state.num_emitted_chars, len(state.text) - holdback)
        delta_text = state.text[state.num_emitted_chars : emit_upto]
        state.num_emitted_chars = emit_upto
        all_out = req.output_token_ids
        delta_ids = all_out[state.num_emitted_tokens :]
        state.num_emitted_tokens = len(all_out)
        completion = CompletionOutput(
            index=state.index,
            text=state.text,
            token_ids=all_out,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.output_logprobs) if req.sampling_params.logprobs else None,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            top_logprobs=list(req.output_top_logprobs) if req.sampling_params.top_logprobs else None,
        )
        if finished:
            del self._states[req.request_id]
        want_prompt = req.sampling_params.prompt_logprobs is not None
        return RequestOutput(
            request_id=req.request_id,
            prompt=state.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=[None, *req.prompt_logprobs] if want_prompt else None,
            prompt_top_logprobs=[None, *req.prompt_top_logprobs] if want_prompt else None,
            outputs=[completion],
            finished=finished,
            metrics=RequestMetrics.from_request(req),
            error=req.error,
        )

    def _check_stop_strings(
        self, req: Request, state: _OutputState, old_len: int, already_finished: bool = False
    ) -> bool:
        """Whether the text past `old_len` (less a stop string's length) holds a stop string
        beyond the first min_tokens tokens' text; if so the text is cut there and the request
        finished."""
        longest = max(len(s) for s in state.stop)
        start = max(0, old_len - longest + 1)
        best: tuple[int, str] | None = None
        for s in state.stop:
            idx = state.text.find(s, start)
            while idx >= 0 and idx + len(s) <= (state.stop_after or 0):  # inside the first min_tokens tokens
                idx = state.text.find(s, idx + 1)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        cut = idx + len(s) if req.sampling_params.include_stop_str_in_output else idx
        state.text = state.text[:cut]
        req.stop_reason = s
        if not already_finished:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        else:
            req.status = RequestStatus.FINISHED_STOPPED
        return True

    # ------------------------------------------------------------------ introspection
    @property
    def precision(self) -> dict[str, str]:
        """The numbers this engine computes in, as settings that rebuild them elsewhere (the
        resolved --quantization, --dtype and --kv-cache-dtype): what `audit --url` reads from
        /v1/models to compute its reference the way the server computes."""
        cfg = self.config
        return {"quantization": str(cfg.model.quantization), "dtype": str(self.runner.dtype).removeprefix("torch."),
                "kv_cache_dtype": str(cfg.cache.kv_cache_dtype)}

    def describe(self) -> dict[str, str]:
        """What is running, one line per aspect (the start-up summary of `specserve serve`)."""
        cfg, arch = self.config, self.arch
        q = cfg.model.quantization
        runner = self.runner
        if runner.native_ops:
            from specserve.kernels import kernels

            k = kernels()
            isa = "AVX512-VNNI" if k.has_vnni() else "AVX2" if k.has_avx2() else "portable"
            wide = ""
            if k.has_avx512():
                rows = k.wide_min_rows()
                wide = f", 512 bits wide from {rows} rows per pass" if rows <= 32 else ", 256 bits wide (512 did not pay here)"
            if (amx := k.amx_min_rows()) > 0:
                wide += f", Q4_K passes of {amx}+ rows on AMX tiles"
            precision = (f"{q}: the GGUF's own blocks through native {isa} kernels{wide}" if q == "auto"
                         else f"{q}: 4-bit blocks, native {isa} kernels{wide}")
        else:
            precision = f"{q} ({str(runner.dtype).removeprefix('torch.')})"
            if runner.device.type == "cuda":
                precision += (", decode and verify steps as CUDA graphs" if runner.step_graphs is not None
                              else ", every step eager (--enforce-eager)")
        kv_gib = runner.kv_cache_bytes / (1 << 30)
        out = {
            "model": f"{self.model_name} ({arch.architecture}, {arch.num_layers} layers, vocabulary {arch.vocab_size})",
            "precision": precision,
            "KV cache": f"{kv_gib:.2f} GiB = {self.kv_manager.capacity_tokens:,} tokens ({cfg.cache.kv_cache_dtype}), "
                        + (f"the drafter's {self.drafter_kv_gib:.2f} GiB beside it in the same budget, " if self.drafter_kv_gib else "")
                        + f"context up to {self.max_model_len:,}",
        }
        if (tiers := self.kv_manager.tiers) is not None:
            out["KV tiers"] = self._describe_tiers(tiers)
        spec = cfg.spec
        if self.drafter_released:
            out["speculation"] = f"{spec.method}: switched off, drafter released (switching on reloads it)"
        elif self.proposer is None:
            out["speculation"] = "off (--spec-method draft | ngram | reference | lookahead, or --draft-model auto)" + (
                "; this model ships a multi-token-prediction layer: --spec-method mtp drafts with it" if self._ships_mtp else "")
        else:
            what = f"{spec.method} {spec.draft_model}" if spec.draft_model else spec.method
            if detail := self.proposer.describe():
                what += f" ({detail})"
            shape = "trees" if self.policy.trees else "chains"
            out["speculation"] = f"{what}, {shape}, K <= {spec.num_spec_tokens}, policy {spec.policy}"
            if not self._shape_invariant():
                out["speculation"] += ("; at this precision greedy output can differ from plain decoding where two "
                                       "tokens tie within its rounding (token for token: float32 with --quantization "
                                       "auto / int4 on the CPU, or float32 weights and float KV)")
        out["threads"] = str(torch.get_num_threads())
        return out

    def _shape_invariant(self) -> bool:
        """Whether a token's logits come out the same whatever else shares its step (a verify
        pass's rows, other requests): the native CPU kernels (built for it) and float32 weights
        with a float KV cache. bf16 rounds other matrix shapes differently; int8 weights (bf16
        activations) and an int8 KV cache beside torch's kernels round ~1e-7 differences between
        shapes to whole steps (SmolLM2, n-gram, 64 tokens, 6 prompts: int8 weights left plain decoding
        at 5, an int8 KV cache at 3, where plain batched against alone already differed at 1)."""
        runner = self.runner
        if runner.native_ops:
            return True
        return (runner.dtype == torch.float32 and self.config.model.quantization is Quantization.NONE
                and self.config.cache.kv_cache_dtype is not KVCacheDtype.INT8)

    def _describe_tiers(self, tiers: TieredKVStore) -> str:
        """The prefix cache's lower tiers and how a disk hit reaches the KV cache."""
        gib = 1 << 30
        parts = []
        if tiers.host is not None:
            parts.append(f"host {tiers.host.capacity_bytes / gib:.2f} GiB")
        if tiers.disk is not None:
            parts.append(f"disk {tiers.disk.dir} ({tiers.disk.capacity_bytes / gib:.1f} GiB, {len(tiers.disk)} blocks)")
        if tiers.remote is not None:
            parts.append(f"store {self.config.cache.kv_remote_store}")
        if tiers.disk is not None:
            mode = self.runner.tier_load
            if self.runner.device.type != "cpu":
                how = "disk hits load before the forward (layer by layer beside it: CPU only)"
            elif self.runner.loads_layer_wise():
                how = "disk hits load layer by layer beside the forward" + (" (a CPU is spare)" if mode == "auto" else "")
            else:
                how = "disk hits load before the forward" + (
                    " (every CPU computes; --kv-tier-load layer overlaps them anyway)" if mode == "auto" else "")
            parts.append(how)
        return "; ".join(parts)

    def check_integrity(self) -> bool:
        """KV bookkeeping holds: every block is free, cached, or held by a live request."""
        live = [r.request_id for r in self.scheduler.running]
        # Requests whose KV is still arriving from a prefill worker hold blocks while waiting.
        live += [r.request_id for r in self.scheduler.waiting if r.kv_source is not None]
        ok = self.kv_manager.check_integrity(live)
        if self.proposer is not None:
            stale = set(self.proposer.live_request_ids()) - set(live) - {r.request_id for r in self.scheduler.waiting}
            if stale:
                from specserve.kv_cache.manager import KVCacheIntegrityError

                raise KVCacheIntegrityError(f"proposer still holds finished requests: {sorted(stale)[:5]}")
            ok = ok and self.proposer.check_integrity()
        return ok

    def stats(self) -> dict[str, float]:
        """Counters for metrics endpoints and benchmarks."""
        usage = self.kv_manager.usage()
        return {
            "num_steps": self.num_steps,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": usage.num_blocks,
            "kv_blocks_free": usage.num_free_blocks,
            "kv_blocks_used": usage.num_used_blocks,
            "prefix_cache_hit_rate": usage.prefix_hit_rate,
            **({"kv_tier_layer_wise_steps": self.runner.num_layer_wise_loads,
                "kv_tier_requeued_requests": self.num_failed_load_requeues,
                **{f"kv_tier_{k}": v for k, v in self.kv_manager.tiers.stats().items()}}
               if self.kv_manager.tiers is not None else {}),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "time": time.time(),
        }
