"""``Processor``: a call's prompts and params checked and tokenized before
anything is queued (vLLM V1's ``Processor``).

Every check that can run before scheduling runs here, so one bad prompt refuses
the whole call (the error names its index: "prompt 3: ...") and the engine's
state never changes for it. What needs the device (the logits processors' own
rules, the vocabulary size) is asked of the worker through public calls.
"""
from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Callable
from collections.abc import Sequence as Seq  # encdec.sequence.Sequence is the other one
from typing import Any

from encdec.block_manager.capacity import kv_blocks_needed
from encdec.block_manager.manager import watermark_blocks
from encdec.config import CacheConfig, ModelConfig, SchedulerConfig
from encdec.inputs import InputPreprocessor, PromptType, prompt_errors
from encdec.models.registry import get_model_hooks
from encdec.param_checks import check_priority
from encdec.sampling_params import BeamRowParams, BeamSearchParams, SamplingParams
from encdec.structured_output.manager import StructuredOutputManager

# Generation-config tokens a request inherits from the checkpoint unless it sets them.
FORCED_TOKENS = ("forced_bos_token_id", "forced_eos_token_id")


def load_tokenizer(hooks: Any, path: str) -> Any:
    """The model module's tokenizer loader if it has one, else ``AutoTokenizer``."""
    if hooks.load_tokenizer is not None:
        return hooks.load_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class Processor:
    """``validate_params``: the worker's check of a request's params against its
    logits processors; ``vocab_size``: the model's logits width; ``feature_device``:
    where audio features are computed (the worker's device: a GPU's STFT is far
    cheaper than the host's)."""

    def __init__(self, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, *, vocab_size: int,
                 validate_params: Callable[[SamplingParams], None], feature_device: str = "cpu"):
        self.model_config = model_config
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.vocab_size = vocab_size
        self._validate_params = validate_params
        self.hooks = get_model_hooks(model_config.architecture)
        hf_config, gen_config = model_config.hf_config, model_config.generation_config
        self.tokenizer = load_tokenizer(self.hooks, model_config.tokenizer or model_config.checkpoint_path)
        default_prompt = self.hooks.default_decoder_prompt(hf_config, gen_config, self.tokenizer)
        audio, prepare = self.hooks.make_audio_processor, self.hooks.prepare_decoder_prompt
        self.input_preprocessor = InputPreprocessor(
            self.tokenizer, hf_config.decoder_start_token_id, lambda: list(default_prompt),
            audio(hf_config, feature_device) if audio else None,
            (lambda ids: prepare(ids, gen_config)) if prepare else None,
            # audio models' encoders read (n_mels, 2 * positions) features (Whisper's conv2 halves them)
            audio_features_shape=((hf_config.num_mel_bins, 2 * hf_config.max_source_positions),
                                  hf_config.max_source_positions) if audio else None)
        eos = gen_config.eos_token_id if gen_config.eos_token_id is not None else hf_config.eos_token_id
        self.eos_token_id: int | None = eos[0] if isinstance(eos, list) else eos
        # Whisper's grammar covers its text tokens: every id after end-of-text passes
        whisper = hf_config.model_type == "whisper" and self.eos_token_id is not None
        passthrough = self.eos_token_id + 1 if whisper else None
        self.structured_outputs = StructuredOutputManager(self.tokenizer, vocab_size=vocab_size,
                                                          eos_token_id=self.eos_token_id,
                                                          passthrough_from=passthrough)

    def process_requests(self, prompts: Seq[PromptType],
                         params_list: Seq[SamplingParams | None]) -> list[tuple[dict, SamplingParams]]:
        """Validate and tokenize a whole call. The audio of all prompts becomes
        features in one batched call. Each request's options travel on its params
        (``truncate_prompt_tokens``: its encoder prompt cut instead of refused).
        ``BeamSearchParams`` become the params of the beams' rows."""
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        return self._process(prompts, params_list, indexed=True)

    def process_request(self, prompt: PromptType, params: SamplingParams | None) -> tuple[dict, SamplingParams]:
        """``process_requests`` for one prompt (errors carry no index)."""
        return self._process([prompt], [params], indexed=False)[0]

    def _process(self, prompts: Seq[PromptType], params_list: Seq[SamplingParams | None], *,
                 indexed: bool) -> list[tuple[dict, SamplingParams]]:
        checked: dict[int, SamplingParams] = {}  # id(user params) -> checked; a shared one is checked once
        for i, params in enumerate(params_list):
            with prompt_errors(i if indexed else None):
                if id(params) not in checked:
                    checked[id(params)] = self._check_params(params)
        # The tokenizer's defaults, except for Whisper, whose special tokens the
        # user gives (vLLM's rule; an added eos would end generation).
        kwargs = {"add_special_tokens": False} if self.model_config.hf_config.model_type == "whisper" else None
        preprocessor = self.input_preprocessor
        all_inputs = preprocessor.process_batch(prompts, tokenization_kwargs=kwargs) if indexed \
            else [preprocessor.process(prompts[0], tokenization_kwargs=kwargs)]
        out = []
        for i, (inputs, params) in enumerate(zip(all_inputs, params_list)):
            with prompt_errors(i if indexed else None):
                out.append(self._check_request(inputs, checked[id(params)]))
        return out

    def check_priority(self, priority: Any) -> None:
        """A request's priority under this engine's scheduling policy (``param_checks.check_priority``)."""
        check_priority(priority, self.scheduler_config.policy)

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        """The checks that need the model: token ids against the vocabulary,
        logits processors' own rules. Returns a private copy with the model's
        eos ids folded in."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, BeamSearchParams):  # beam search: its rows run greedy params
            params = BeamRowParams.from_beam_params(self._forced_tokens(params))
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        else:
            params = self._forced_tokens(params.clone())
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        params.verify_against(self.vocab_size)
        self._validate_params(params)
        if params.structured_outputs is not None:  # compiled (or found cached) now: a bad one is refused here
            self.structured_outputs.compile(params.structured_outputs)
            if params.extra_args:  # its grammar decides where it ends, not the checkpoint's forced eos
                params.extra_args.pop("forced_eos_token_id", None)
        params.update_from_generation_config({"eos_token_id": self.model_config.generation_config.eos_token_id},
                                             self.eos_token_id)
        return params

    def _forced_tokens(self, params: SamplingParams | BeamSearchParams) -> SamplingParams | BeamSearchParams:
        """HF's merge rule for the checkpoint's forced BOS/EOS (bart-large-cnn's
        generation config forces both): a request that leaves one unset (None;
        for ``SamplingParams`` a key absent from ``extra_args``) inherits it;
        ``False`` turns it off for that request. Resolved here, so every path
        (greedy, sampling, beams) sees ints or nothing. ``SamplingParams`` is
        changed in place: pass a private copy."""
        gen = self.model_config.generation_config
        given = {k: (getattr(params, k) if isinstance(params, BeamSearchParams)
                     else (params.extra_args or {}).get(k)) for k in FORCED_TOKENS}
        resolved = {}
        for key, value in given.items():
            if value is None:
                value = getattr(gen, key, None)
                if isinstance(value, list) and len(value) == 1:
                    value = value[0]
            if value is not None and value is not False:
                if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
                        or not 0 <= value < self.vocab_size:
                    raise ValueError(f"{key} must be a token id in [0, {self.vocab_size}) or False, "
                                     f"got {value!r}")
            resolved[key] = None if value is False else value
        if isinstance(params, BeamSearchParams):
            return dataclasses.replace(params, **resolved)
        extra = {k: v for k, v in (params.extra_args or {}).items() if k not in FORCED_TOKENS}
        extra.update({k: int(v) for k, v in resolved.items() if v is not None})
        params.extra_args = extra or None
        return params

    def _truncate(self, inputs: dict, params: SamplingParams) -> dict:
        """``inputs`` with the encoder prompt cut as ``params.truncate_prompt_tokens``
        asks (vLLM's: k tokens, -1 the model's encoder positions): "left" keeps the
        last k, "right" the first k with a final eos kept (HF's
        ``tokenizer(truncation=True)``). Audio features are never cut."""
        k = params.truncate_prompt_tokens
        limit = self.model_config.max_encoder_len
        if k is None or "encoder_features" in inputs:
            return inputs
        if k > limit:
            raise ValueError(f"truncate_prompt_tokens={k} is more than the model's {limit} encoder positions; "
                             f"give at most {limit}, or -1 for the model's limit")
        ids = inputs["encoder_prompt_token_ids"]
        keep = limit if k == -1 else k
        if len(ids) <= keep:
            return inputs
        if params.truncation_side == "left":
            ids = ids[-keep:]
        else:
            ids = ids[:keep - 1] + ids[-1:] if ids[-1] == self.eos_token_id and keep > 1 else ids[:keep]
        return {**inputs, "encoder_prompt_token_ids": ids}

    def _check_request(self, inputs: dict, params: SamplingParams) -> tuple[dict, SamplingParams]:
        """Lengths, token ids and KV capacity of one processed prompt; returns the
        inputs (truncated if its params ask) and their own params with
        ``max_tokens`` fitted to the decoder's positions."""
        inputs = self._truncate(inputs, params)
        dec_len, enc_len = len(inputs["prompt_token_ids"]), len(inputs["encoder_prompt_token_ids"])
        cfg = self.model_config
        if enc_len > cfg.max_encoder_len:
            raise ValueError(f"encoder prompt is {enc_len} tokens, longer than the model's "
                             f"{cfg.max_encoder_len} encoder positions; to cut it, set truncate_prompt_tokens "
                             "(SamplingParams, BeamSearchParams; encdec generate --truncate-prompt-tokens) or "
                             "pass truncation=True (LLM.generate, LLM.translate; encdec generate --truncation)")
        if dec_len >= cfg.max_model_len:
            raise ValueError(f"decoder prompt is {dec_len} tokens; the model has {cfg.max_model_len} "
                             "decoder positions and needs room for at least one output token")
        far = [p for p in params.prompt_token_logprobs or () if not -dec_len <= p < dec_len]
        if far:
            raise ValueError(f"prompt_token_logprobs positions {far} are outside the {dec_len}-token decoder prompt")
        # Audio requests carry placeholder encoder ids; the decoder's are real. Each
        # list is named as the API names it, so a server can say which field is wrong.
        encoder = () if "encoder_features" in inputs else inputs["encoder_prompt_token_ids"]
        for name, ids in (("prompt", encoder), ("decoder_prompt", inputs["prompt_token_ids"])):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
        # Shallow: the checked params are a private copy already (_check_params) and
        # only max_tokens differs per request; a deep copy per request was a third of
        # processing 512 BART prompts.
        params = copy.copy(params)
        if params.max_tokens is None or dec_len + params.max_tokens > cfg.max_model_len:
            params.max_tokens = cfg.max_model_len - dec_len
        self._check_fits(dec_len, enc_len, params)
        return inputs, params

    def _check_fits(self, dec_len: int, enc_len: int, params: SamplingParams) -> None:
        """Refuse a request that could never finish in this KV cache, which the
        scheduler would otherwise end mid-run with an error and an empty or cut
        output (arithmetic in ``encdec.block_manager.capacity``)."""
        bs, b, total = self.cache_config.block_size, params.best_of, self.cache_config.num_gpu_blocks
        if b > self.scheduler_config.max_num_seqs:
            raise ValueError(f"best_of (or n) is {b}, more sequences than max_num_seqs="
                             f"{self.scheduler_config.max_num_seqs} can run at once; raise max_num_seqs")
        need = kv_blocks_needed(dec_len, enc_len, max_tokens=params.max_tokens, best_of=b,
                                block_size=bs, watermark_blocks=watermark_blocks(total))
        if need.total > total:
            raise ValueError(
                f"the request can never fit the KV cache: it needs up to {need.total} blocks of {bs} "
                f"tokens ({need.self_attention} for decoder self-attention: a {dec_len}-token prompt + "
                f"max_tokens={params.max_tokens}, best_of={b}; {need.cross_attention} for cross-attention "
                f"over {enc_len} encoder positions; {need.reserve} the scheduler keeps in reserve) but "
                f"the cache has {total} blocks; lower max_tokens or raise kv_cache_memory")
