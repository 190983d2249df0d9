"""Prompts -> ``EncoderDecoderLLMInputs``.

A request names an encoder input (text, tokens, audio, or audio features the
encoder reads as they are) and optionally a
decoder prompt. Singleton prompts go to the encoder and the decoder gets the
model's default prompt (BART: ``[<DEC>, <BOS>]``); an explicit decoder prompt
is tokenized as vLLM tokenizes it (seed 002: any sub-prompt that is not a token
list, with the tokenizer's defaults) and gets ``<DEC>`` prepended unless it
already starts with it. Token ids may be lists of ints, numpy integers or 1-D
integer arrays. A batch of prompts is validated whole before any audio becomes
features, and its audio becomes features in one batched call.

Audio may also come as the features the encoder reads, computed by the caller
(``multi_modal_data={"audio_features": tensor}``, Whisper: an ``(n_mels, 3000)``
log-mel window): what a transcription job gives when it computed a whole
file's log-mel once. They must have the shape the model's audio processor makes.
"""
from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, TypedDict, Union

import numpy as np
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


class _Features:
    """An ``audio_features`` prompt's tensor, checked (module docstring)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


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


@contextlib.contextmanager
def prompt_errors(index: int | None) -> Iterator[None]:
    """Prefix a ValueError/TypeError raised inside with ``prompt {index}: `` (kept
    as is for ``None``), so a refused batch says which prompt was bad."""
    try:
        yield
    except (ValueError, TypeError) as e:
        if index is None:
            raise
        cls = TypeError if isinstance(e, TypeError) else ValueError
        raise cls(f"prompt {index}: {e}") from None


def _is_token_id(t: Any) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))


def _token_ids(value: Any, where: str) -> list[int]:
    """A list or tuple of ints (numpy integers too) or a 1-D integer numpy array -> list[int]."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise TypeError(f"{where} must be a 1-D array of integers, got shape "
                            f"{value.shape} and dtype {value.dtype}")
        return value.tolist()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where} must be a list of ints, got {type(value).__name__}")
    if set(map(type, value)) <= {int}:  # the common case, checked at C speed
        return list(value)
    bad = next((t for t in value if not _is_token_id(t)), None)
    if bad is not None:
        raise TypeError(f"{where} must be a list of ints, got an item {bad!r} of type {type(bad).__name__}")
    return [int(t) for t in value]


@dataclass
class _Parsed:
    """One prompt taken apart, before its audio (if any) becomes features."""

    enc_ids: list[int]  # encoder token ids; replaced by placeholders when audio is given
    enc_text: str | None
    audio: Any  # the raw audio input (path, (array, rate), array) or None
    dec_ids: list[int] | None  # None: the model's default decoder prompt
    dec_text: str | None


class InputPreprocessor:
    """Turns any prompt form into ``EncoderDecoderLLMInputs`` for one model.

    Text is tokenized as vLLM does, with the tokenizer's defaults unless the
    caller passes ``tokenization_kwargs`` (the engine passes
    ``add_special_tokens=False`` for Whisper, as vLLM does); then the decoder
    prompt gets ``<DEC>`` prepended unless it starts with it. For BART a decoder
    text ``"Hi"`` becomes ``[2, 0, <Hi>, 2]``.

    The model-specific parts (default decoder prompt, audio features) come in
    as callables so that this module stays model-agnostic. ``audio_processor``
    takes a list of audio inputs and ``labels=`` (how errors name each input)
    and returns one ``(features, number of encoder positions)`` per input; a
    model with an audio processor needs audio in every prompt. ``audio_features_shape``
    (``((n_mels, frames), encoder positions)``) admits ``audio_features`` prompts
    of that shape.
    """

    def __init__(
        self,
        tokenizer: Any,
        decoder_start_token_id: int,
        default_decoder_prompt: Callable[[], list[int]],
        audio_processor: Callable[..., list[tuple[Any, int]]] | None = None,
        prepare_decoder_prompt: Callable[[list[int]], list[int]] | None = None,
        *,
        audio_features_shape: tuple[tuple[int, int], int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.prepare_decoder_prompt = prepare_decoder_prompt
        self.decoder_start_token_id = decoder_start_token_id
        self.default_decoder_prompt = default_decoder_prompt
        self.audio_processor = audio_processor
        # ((n_mels, frames) of the features the audio processor makes, encoder positions they give):
        # what an ``audio_features`` prompt must match
        self.audio_features_shape = audio_features_shape

    def _tokenize(self, text: str, kwargs: dict[str, Any]) -> list[int]:
        return list(self.tokenizer.encode(text, **kwargs))

    def _singleton(self, prompt: Any, where: str, kwargs: dict[str, Any], *,
                   tokenize_empty: bool) -> tuple[list[int], str | None, Any]:
        """-> (token ids, text, audio or None). Empty text tokenizes to [] unless
        ``tokenize_empty`` (a decoder ``""`` is still special tokens for BART)."""
        if isinstance(prompt, str):
            return (self._tokenize(prompt, kwargs) if prompt or tokenize_empty else []), prompt, None
        if not isinstance(prompt, dict):
            raise TypeError(f"{where} must be a str, TextPrompt or TokensPrompt, got {type(prompt).__name__}")
        if "prompt" not in prompt and "prompt_token_ids" not in prompt:
            raise ValueError(f"{where} needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
        audio = self._audio(prompt.get("multi_modal_data"), where)
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"{where}.prompt must be a str, got {type(text).__name__}")
            return _token_ids(prompt["prompt_token_ids"], f"{where}.prompt_token_ids"), text, audio
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise TypeError(f"{where}.prompt must be a str, got {type(text).__name__}")
        if audio is not None:
            return [], text, audio  # the caller decides what the text is for
        return (self._tokenize(text, kwargs) if text or tokenize_empty else []), text, None

    def _audio(self, mm: Any, where: str) -> Any:
        if mm is None:
            return None
        if not isinstance(mm, dict):
            raise TypeError(f"{where}.multi_modal_data must be a dict such as {{'audio': ...}}, "
                            f"got {type(mm).__name__}")
        unknown = set(mm) - {"audio", "audio_features"}
        if unknown:
            raise ValueError(f"{where}.multi_modal_data supports only 'audio' or 'audio_features', "
                             f"got {sorted(unknown)}")
        if mm.get("audio") is not None and mm.get("audio_features") is not None:
            raise ValueError(f"{where}.multi_modal_data: give 'audio' or 'audio_features', not both")
        if mm.get("audio") is None and mm.get("audio_features") is None:
            return None
        if self.audio_processor is None:
            raise ValueError(f"{where} carries audio, but this model takes no audio input")
        if mm.get("audio") is not None:
            return mm["audio"]
        where = f"{where}.multi_modal_data['audio_features']"
        return _Features(self._check_features(mm["audio_features"], where))

    def _check_features(self, value: Any, where: str) -> Any:
        """A 2-D float tensor (or array) of the shape the audio processor makes."""
        import torch

        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} must be a torch tensor or numpy array, got {type(value).__name__}")
        if not value.is_floating_point():
            raise TypeError(f"{where} must hold floats, got {value.dtype}")
        shape = self.audio_features_shape[0] if self.audio_features_shape else None
        if shape is None or tuple(value.shape) != tuple(shape):
            raise ValueError(f"{where} must have shape {shape} (this model's features), got {tuple(value.shape)}")
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{where} holds NaN or infinite values")
        return value

    def _prepare_decoder(self, ids: list[int]) -> list[int]:
        """<DEC> first, unless the model has its own rule (Whisper: a
        ``<|startofprev|>`` prompt carries its start token later)."""
        if self.prepare_decoder_prompt is not None:
            return self.prepare_decoder_prompt(ids)
        if not ids or ids[0] != self.decoder_start_token_id:
            ids = [self.decoder_start_token_id] + ids
        return ids

    def _parse(self, prompt: Any, kwargs: dict[str, Any]) -> _Parsed:
        if is_explicit_encoder_decoder_prompt(prompt):
            unknown = set(prompt) - {"encoder_prompt", "decoder_prompt"}
            if unknown:
                raise ValueError(f"ExplicitEncoderDecoderPrompt has unknown keys {sorted(unknown)}")
            enc_ids, enc_text, audio = self._singleton(prompt["encoder_prompt"], "encoder_prompt", kwargs,
                                                       tokenize_empty=False)
            dec = prompt.get("decoder_prompt")
            dec_ids = dec_text = None
            if dec is not None:
                if isinstance(dec, dict) and dec.get("multi_modal_data") is not None:
                    raise ValueError("decoder_prompt cannot carry multi_modal_data")
                ids, dec_text, _ = self._singleton(dec, "decoder_prompt", kwargs, tokenize_empty=True)
                dec_ids = self._prepare_decoder(ids)
            parsed = _Parsed(enc_ids, enc_text, audio, dec_ids, dec_text)
        else:
            ids, text, audio = self._singleton(prompt, "prompt", kwargs, tokenize_empty=False)
            if audio is None:
                parsed = _Parsed(ids, text, None, None, None)
            else:
                # vLLM's audio form: the text (or ids) is the decoder prompt, the
                # audio the encoder input; an empty one means the model's default.
                if not ids and text:
                    ids = self._tokenize(text, kwargs)
                dec_ids = self._prepare_decoder(ids) if ids else None
                parsed = _Parsed([], None, audio, dec_ids, text or None)
        if parsed.audio is None:
            if self.audio_processor is not None:
                raise ValueError("this model reads audio: the prompt needs multi_modal_data="
                                 "{'audio': (array, sample_rate)} (or a path); LLM.transcribe takes "
                                 "audio files directly")
            if not parsed.enc_ids:
                raise ValueError("the encoder prompt is empty: give at least one token or some text")
        return parsed

    def process(self, prompt: PromptType, *,
                tokenization_kwargs: dict[str, Any] | None = None) -> EncoderDecoderLLMInputs:
        """One prompt; errors are not prefixed with an index."""
        return self._process([prompt], tokenization_kwargs, indexed=False)[0]

    def process_batch(self, prompts: Sequence[PromptType], *,
                      tokenization_kwargs: dict[str, Any] | None = None) -> list[EncoderDecoderLLMInputs]:
        """Every prompt of a call, validated before any features are computed,
        then the audio of all of them in one batched feature call. Errors name
        the prompt's index ("prompt 3: ...")."""
        return self._process(prompts, tokenization_kwargs, indexed=True)

    def _process(self, prompts: Sequence[PromptType], tokenization_kwargs: dict[str, Any] | None,
                 *, indexed: bool) -> list[EncoderDecoderLLMInputs]:
        kwargs = dict(tokenization_kwargs or {})
        parsed = []
        for i, prompt in enumerate(prompts):
            with prompt_errors(i if indexed else None):
                parsed.append(self._parse(prompt, kwargs))
        with_audio = [i for i, p in enumerate(parsed)
                      if p.audio is not None and not isinstance(p.audio, _Features)]
        features: dict[int, tuple[Any, int]] = {}
        if with_audio:
            labels = [f"prompt {i}: audio" if indexed else "audio" for i in with_audio]
            computed = self.audio_processor([parsed[i].audio for i in with_audio], labels=labels)
            features = dict(zip(with_audio, computed))
        for i, p in enumerate(parsed):
            if isinstance(p.audio, _Features):  # checked against audio_features_shape in _parse
                features[i] = (p.audio.tensor, self.audio_features_shape[1])
        outs = []
        for i, p in enumerate(parsed):
            out = EncoderDecoderLLMInputs(
                prompt_token_ids=p.dec_ids if p.dec_ids is not None else self.default_decoder_prompt(),
                prompt=p.dec_text,
                encoder_prompt_token_ids=p.enc_ids,
                encoder_prompt=p.enc_text,
            )
            if i in features:
                feats, num_positions = features[i]
                out["encoder_prompt_token_ids"] = [0] * num_positions  # one per encoder output position
                out["encoder_features"] = feats
            outs.append(out)
        return outs


def normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or a list of them -> a list (a list or 1-D array of ints is one token prompt)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        return [TokensPrompt(prompt_token_ids=_token_ids(prompts, "prompts"))]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(_is_token_id(t) for t in prompts):
            return [TokensPrompt(prompt_token_ids=[int(t) for t in prompts])]
        return list(prompts)
    raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
