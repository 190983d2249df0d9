"""Prompts -> ``EncoderDecoderLLMInputs``.

A request names an encoder input (text, tokens or audio) and optionally a
decoder prompt. Singleton prompts go to the encoder and the decoder gets the
model's default prompt (BART: ``[<DEC>, <BOS>]``); an explicit decoder prompt
gets ``<DEC>`` prepended unless it already starts with it.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable, TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[dict[str, Any] | None]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict[str, Any] | None]


SingletonPrompt = Union[str, TextPrompt, TokensPrompt]


class ExplicitEncoderDecoderPrompt(TypedDict):
    encoder_prompt: SingletonPrompt
    decoder_prompt: SingletonPrompt | None


PromptType = Union[SingletonPrompt, ExplicitEncoderDecoderPrompt]


class EncoderDecoderLLMInputs(TypedDict):
    prompt_token_ids: list[int]  # decoder prompt
    prompt: NotRequired[str | None]
    encoder_prompt_token_ids: list[int]
    encoder_prompt: NotRequired[str | None]
    encoder_features: NotRequired[Any]  # audio features (torch tensor), encoder side


def token_inputs(prompt_token_ids: list[int], prompt: str | None = None) -> dict:
    return {"type": "token", "prompt_token_ids": prompt_token_ids, "prompt": prompt}


def build_explicit_enc_dec_prompt(
    encoder_prompt: SingletonPrompt, decoder_prompt: SingletonPrompt | None
) -> ExplicitEncoderDecoderPrompt:
    return ExplicitEncoderDecoderPrompt(encoder_prompt=encoder_prompt, decoder_prompt=decoder_prompt)


def zip_enc_dec_prompts(
    enc_prompts: Iterable[SingletonPrompt], dec_prompts: Iterable[SingletonPrompt | None]
) -> list[ExplicitEncoderDecoderPrompt]:
    enc_prompts, dec_prompts = list(enc_prompts), list(dec_prompts)
    if len(enc_prompts) != len(dec_prompts):
        raise ValueError(
            f"zip_enc_dec_prompts needs as many decoder prompts as encoder prompts, "
            f"got {len(enc_prompts)} and {len(dec_prompts)}"
        )
    return [build_explicit_enc_dec_prompt(e, d) for e, d in zip(enc_prompts, dec_prompts)]


def to_enc_dec_tuple_list(
    prompts: Iterable[ExplicitEncoderDecoderPrompt],
) -> list[tuple[SingletonPrompt, SingletonPrompt | None]]:
    return [(p["encoder_prompt"], p.get("decoder_prompt")) for p in prompts]


def is_explicit_encoder_decoder_prompt(prompt: Any) -> bool:
    return isinstance(prompt, dict) and "encoder_prompt" in prompt


def _check_singleton(prompt: Any, where: str) -> None:
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, dict):
        raise TypeError(
            f"{where} must be a str, TextPrompt or TokensPrompt, got {type(prompt).__name__}"
        )
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise TypeError(f"{where}.prompt_token_ids must be a list of ints")
    elif "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"{where}.prompt must be a str, got {type(prompt['prompt']).__name__}")
    else:
        raise ValueError(f"{where} needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")


class InputPreprocessor:
    """Turns any prompt form into ``EncoderDecoderLLMInputs`` for one model.

    The model-specific parts (default decoder prompt, audio features) come in
    as callables so that this module stays model-agnostic.
    """

    def __init__(
        self,
        tokenizer: Any,
        decoder_start_token_id: int,
        default_decoder_prompt: Callable[[], list[int]],
        audio_processor: Callable[[Any], Any] | None = None,
        prepare_decoder_prompt: Callable[[list[int]], list[int]] | None = None,
    ):
        self.tokenizer = tokenizer
        self.prepare_decoder_prompt = prepare_decoder_prompt
        self.decoder_start_token_id = decoder_start_token_id
        self.default_decoder_prompt = default_decoder_prompt
        self.audio_processor = audio_processor

    def _tokenize(self, text: str, *, decoder: bool) -> list[int]:
        if decoder:
            # A user's decoder text is control tokens and a continuation, not a
            # document: no <s> ... </s> wrapping.
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text)

    def _singleton(self, prompt: SingletonPrompt, where: str, *, decoder: bool):
        _check_singleton(prompt, where)
        if isinstance(prompt, str):
            prompt = TextPrompt(prompt=prompt)
        mm = prompt.get("multi_modal_data")
        if "prompt_token_ids" in prompt:
            ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
        else:
            text = prompt["prompt"]
            ids = self._tokenize(text, decoder=decoder) if text or decoder else []
        return ids, text, mm

    def _features(self, mm: dict[str, Any] | None, where: str) -> tuple[Any, int]:
        """Audio -> (features, number of encoder output positions)."""
        if not mm:
            return None, 0
        unknown = set(mm) - {"audio"}
        if unknown:
            raise ValueError(f"{where}.multi_modal_data supports only 'audio', got {sorted(unknown)}")
        if self.audio_processor is None:
            raise ValueError(f"{where} carries audio, but this model takes no audio input")
        return self.audio_processor(mm["audio"])

    def _prepare_decoder(self, ids: list[int]) -> list[int]:
        """<DEC> first, unless the model has its own rule (Whisper: a
        ``<|startofprev|>`` prompt carries its start token later)."""
        if self.prepare_decoder_prompt is not None:
            return self.prepare_decoder_prompt(ids)
        if not ids or ids[0] != self.decoder_start_token_id:
            ids = [self.decoder_start_token_id] + ids
        return ids

    def process(self, prompt: PromptType) -> EncoderDecoderLLMInputs:
        if is_explicit_encoder_decoder_prompt(prompt):
            unknown = set(prompt) - {"encoder_prompt", "decoder_prompt"}
            if unknown:
                raise ValueError(f"ExplicitEncoderDecoderPrompt has unknown keys {sorted(unknown)}")
            enc_ids, enc_text, enc_mm = self._singleton(prompt["encoder_prompt"], "encoder_prompt", decoder=False)
            features, num_enc = self._features(enc_mm, "encoder_prompt")
            if features is not None:
                enc_ids = [0] * num_enc  # placeholders: one per encoder output position
            dec = prompt.get("decoder_prompt")
            if dec is None:
                dec_ids, dec_text = self.default_decoder_prompt(), None
            else:
                dec_ids, dec_text, dec_mm = self._singleton(dec, "decoder_prompt", decoder=True)
                if dec_mm:
                    raise ValueError("decoder_prompt cannot carry multi_modal_data")
                dec_ids = self._prepare_decoder(dec_ids)
        else:
            ids, text, mm = self._singleton(prompt, "prompt", decoder=False)
            features, num_enc = self._features(mm, "prompt")
            if features is not None:
                # vLLM's audio form: the text is the decoder prompt, the audio the encoder input.
                enc_ids, enc_text = [0] * num_enc, None
                if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                    dec_ids, dec_text = list(prompt["prompt_token_ids"]), None
                else:
                    text = prompt["prompt"] if isinstance(prompt, dict) else prompt
                    dec_ids = self._tokenize(text, decoder=True) if text else []
                    dec_text = text or None
                dec_ids = self._prepare_decoder(dec_ids) if dec_ids else self.default_decoder_prompt()
            else:
                enc_ids, enc_text = ids, text
                dec_ids, dec_text = self.default_decoder_prompt(), None
        if features is None and not enc_ids:
            raise ValueError("the encoder prompt is empty: give at least one token or some text")
        out = EncoderDecoderLLMInputs(
            prompt_token_ids=dec_ids,
            prompt=dec_text,
            encoder_prompt_token_ids=enc_ids,
            encoder_prompt=enc_text,
        )
        if features is not None:
            out["encoder_features"] = features
        return out


def normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or a list of them -> a list (a list of ints is one token prompt)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [TokensPrompt(prompt_token_ids=list(prompts))]
        return list(prompts)
    raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
