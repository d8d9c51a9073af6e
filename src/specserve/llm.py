"""Offline batched generation: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from specserve.config import (
    DEFAULT_DRAFT_P_MIN,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    Quantization,
    SchedulerConfig,
    SpecConfig,
    spec_kwargs_from_vllm,
)
from specserve.engine.engine import LLMEngine
from specserve.errors import ConfigError, InvalidRequestError
from specserve.models.chat import ChatError, render_chat
from specserve.models.tools import check_tools
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Load a model once, then generate for lists of prompts with continuous batching."""

    def __init__(
        self,
        model: str,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        kv_cache_gib: float = 1.0,
        max_model_len: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_host_gib: float = 0.0,
        kv_disk_dir: str | None = None,
        kv_disk_gib: float = 16.0,
        kv_tier_load: str = "auto",
        kv_remote_store: str | None = None,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        enable_chunked_prefill: bool = True,
        num_threads: int | None = None,
        seed: int = 0,
        linear_backend: str = "auto",
        quantization: Quantization | str | None = None,
        enforce_eager: bool = False,
        logprobs_mode: str = "raw_logprobs",
        num_kv_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        draft_model: str | None = None,
        spec_method: str | None = None,
        num_spec_tokens: int = 8,
        spec_policy: str = "adaptive",
        spec_tree: str = "auto",
        max_draft_nodes: int = 16,
        draft_num_layers: int | None = None,
        draft_kv_cache_gib: float | None = None,
        draft_quantization: Quantization | str | None = None,
        draft_vocab_size: int | None = None,
        draft_p_min: float = DEFAULT_DRAFT_P_MIN,
        ngram_min: int = 1,
        ngram_max: int = 4,
        lookahead_window: int = 6,
        lookahead_corpus: str = "auto",
        suffix_cache_requests: int = 10_000,
        spec_copy: str = "auto",
        spec_copy_min_match: int = 3,
        spec_join: str = "none",
        spec_on_batch: int = 8,
        spec_off_batch: int = 32,
        spec_release_after_s: float | None = 300.0,
        profile_spec_costs: bool = True,
        checkpoint: Any = None,
        draft_checkpoint: Any = None,
        speculative_config: dict[str, Any] | str | None = None,
    ) -> None:
        if speculative_config is not None:  # vLLM's form (config.spec_kwargs_from_vllm)
            if spec_method is not None or draft_model is not None:
                raise ConfigError("give speculation as speculative_config or as spec_method / draft_model, not both.")
            spec = spec_kwargs_from_vllm(speculative_config)
            spec_method, draft_model = spec.pop("spec_method"), spec.pop("draft_model", None)
            num_spec_tokens = spec.pop("num_spec_tokens", num_spec_tokens)
            draft_quantization = spec.pop("draft_quantization", draft_quantization)
            ngram_min, ngram_max = spec.pop("ngram_min", ngram_min), spec.pop("ngram_max", ngram_max)
            spec_on_batch, spec_off_batch = spec.pop("spec_on_batch", spec_on_batch), spec.pop("spec_off_batch", spec_off_batch)
            suffix_cache_requests = spec.pop("suffix_cache_requests", suffix_cache_requests)
            if spec:  # a key spec_kwargs_from_vllm maps that this constructor does not take yet
                raise ConfigError(f"speculative_config keys {sorted(spec)} are not taken by LLM(); pass them by name.")
        if spec_method is None:
            spec_method = "draft" if (draft_model or draft_checkpoint is not None) else "none"
        config = EngineConfig(
            model=ModelConfig(
                model=model, device=device, dtype=dtype, max_model_len=max_model_len, seed=seed,
                linear_backend=linear_backend, quantization=quantization, enforce_eager=enforce_eager,
                logprobs_mode=logprobs_mode,
            ),
            cache=CacheConfig(
                block_size=block_size, kv_cache_gib=kv_cache_gib,
                enable_prefix_caching=enable_prefix_caching, num_gpu_blocks_override=num_kv_blocks,
                kv_cache_dtype=kv_cache_dtype, kv_host_gib=kv_host_gib,
                kv_disk_dir=None if kv_disk_dir is None else str(kv_disk_dir), kv_disk_gib=kv_disk_gib,
                kv_tier_load=kv_tier_load, kv_remote_store=kv_remote_store,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
            spec=SpecConfig(
                method=spec_method, num_spec_tokens=num_spec_tokens, policy=spec_policy, tree=spec_tree, max_draft_nodes=max_draft_nodes,
                draft_model=draft_model or ("<checkpoint>" if draft_checkpoint is not None else None),
                draft_num_layers=draft_num_layers, draft_kv_cache_gib=draft_kv_cache_gib,
                draft_quantization=draft_quantization, draft_vocab_size=draft_vocab_size,
                draft_p_min=draft_p_min, ngram_min=ngram_min, ngram_max=ngram_max,
                lookahead_window=lookahead_window, lookahead_corpus=lookahead_corpus,
                suffix_cache_requests=suffix_cache_requests, copy=spec_copy, copy_min_match=spec_copy_min_match, join=spec_join, on_batch=spec_on_batch, off_batch=spec_off_batch,
                profile_on_start=profile_spec_costs, release_after_s=spec_release_after_s,
            ),
            num_threads=num_threads,
        )
        self.engine = LLMEngine(config, checkpoint=checkpoint, draft_checkpoint=draft_checkpoint)

    @property
    def tokenizer(self):
        """The model's tokenizer (None for token-id-only test models)."""
        return self.engine.tokenizer

    def get_tokenizer(self):  # noqa: ANN201
        """vLLM's accessor: the model's tokenizer (encode, decode, apply_chat_template)."""
        return self.engine.tokenizer

    def reset_suffix_cache(self) -> None:
        """Forget the earlier requests' outputs that ngram and lookahead draft from (benchmarks that
        run one prompt several times call it between runs, as they reset the prefix cache)."""
        self.engine.reset_suffix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (one SamplingParams for all, or one each); outputs in order.
        Arguments as vLLM's: `priority` one per prompt (lower is served first). `params=` and
        `priorities=` are this API's earlier names for the same two arguments.

        With params.n > 1 a prompt's output holds n completions in `.outputs`.
        """
        if sampling_params is not None and params is not None:
            raise TypeError("generate() got both sampling_params= and its older name params=")
        if priority is not None and priorities is not None:
            raise TypeError("generate() got both priority= and its older name priorities=")
        params = sampling_params if sampling_params is not None else params
        priority = priority if priority is not None else priorities
        plist = self._as_prompt_list(prompts)
        if priority is not None and len(priority) != len(plist):
            raise InvalidRequestError(f"got {len(plist)} prompts but {len(priority)} priorities")
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params_list = [params] * len(plist)
        elif isinstance(params, Sequence) and all(isinstance(p, SamplingParams) for p in params):
            params_list = list(params)
        else:
            raise InvalidRequestError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                                      f"got {type(params).__name__}.")
        if len(params_list) != len(plist):
            raise InvalidRequestError(f"got {len(plist)} prompts but {len(params_list)} SamplingParams")
        engine = self.engine
        groups: list[list[str]] = []
        submitted: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(plist, params_list)):
                ids = []
                for j in range(p.n):
                    sub = p if p.n == 1 else _nth_sample_params(p, j)
                    rid = engine.add_request(
                        prompt, sub, priority=priority[i] if priority else 0, index=j
                    )
                    ids.append(rid)
                    submitted.append(rid)
                groups.append(ids)
        except BaseException:  # Ctrl-C among thousands of submissions too: none may run in a later call
            engine.abort_request(submitted)
            raise
        final: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(submitted) > 1
        bar = tqdm(total=len(submitted), desc="generate", unit="req", disable=not show)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in submitted if r not in final])
            raise
        finally:
            bar.close()
        results = []
        for ids in groups:
            first = final[ids[0]]
            if len(ids) > 1:
                first.outputs = [final[r].outputs[0] for r in ids]
            results.append(first)
        return results

    @staticmethod
    def _as_prompt_list(prompts: Prompt | Sequence[Prompt] | dict | Sequence[dict]) -> list[Prompt]:
        """Prompts as a list: a string, token ids, vLLM's {"prompt": text} / {"prompt_token_ids":
        ids} dicts, or a list of any of these."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
            raise TypeError(f"prompts must be a string, token ids, a {{'prompt_token_ids': ids}} dict or a list of "
                            f"these, got {type(prompts).__name__}.")
        seq = list(prompts)
        if seq and all(isinstance(t, int) for t in seq):
            return [seq]  # a single prompt given as token ids (a bool among them is refused as one)
        out: list[Prompt] = []
        for i, p in enumerate(seq):
            if isinstance(p, dict):
                keys = set(p) & {"prompt", "prompt_token_ids"}
                if len(keys) != 1:
                    raise TypeError(f"prompt {i}: a dict prompt holds 'prompt' (text) or 'prompt_token_ids', got keys {sorted(p)}.")
                p = p[keys.pop()]
            if not isinstance(p, Sequence) or isinstance(p, (bytes, bytearray)):  # text or token ids
                raise TypeError(f"prompt {i} must be a string or token ids, got {type(p).__name__}.")
            out.append(p)
        return out

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Render one conversation or a list of them with the model's chat template (or
        `chat_template`), then generate; arguments as vLLM's `LLM.chat`. Messages are checked as
        the server checks them (models.chat): a bad role or content raises ChatError, a ValueError.
        `tools` (OpenAI's form) go to the template as transformers passes them (written into the
        messages for a template that takes none); models.tools.parse_calls reads calls back."""
        if self.tokenizer is None:
            raise ChatError("this model has no tokenizer, so it has no chat template; use generate() with token ids.")
        many = (isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Sequence)
                and not isinstance(messages[0], (str, bytes)))  # a list of conversations
        convs = list(messages) if many else [messages]
        checked = check_tools(tools, "auto") if tools else None
        prompts = [render_chat(self.tokenizer, c, add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                               continue_final_message=continue_final_message,
                               chat_template_kwargs=chat_template_kwargs, chat_template=chat_template, tools=checked)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, params=params)  # (params=: the earlier name)


def _nth_sample_params(p: SamplingParams, j: int) -> SamplingParams:
    """Params of the j-th of n samples: distinct but reproducible seeds when a seed is set."""
    from dataclasses import replace

    seed = p.seed
    if seed is not None and j > 0:
        seed = hash((seed, j)) & 0x7FFFFFFF
    return replace(p, n=1, seed=seed)
