"""Request models (pydantic) and the error shape of the OpenAI-compatible server.

Pydantic checks types and names (unknown fields are refused: a typo is an
error, not a silent default); value ranges are ``SamplingParams``' own checks,
so the server and ``LLM.generate`` refuse the same things with the same words.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class ErrorInfo(BaseModel):
    message: str
    type: str  # "invalid_request_error" | "authentication_error" | "not_found_error" | ...
    param: str | None = None  # the offending field, when there is one
    code: int | None = None  # the HTTP status


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """Raised by a handler; the app turns it into ``ErrorResponse`` JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def response_body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.status)).model_dump()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(BaseModel):
    """OpenAI's ``/v1/completions`` fields, vLLM's extras, and ``decoder_prompt``."""

    model_config = ConfigDict(extra="forbid")

    # OpenAI
    model: str | None = None
    prompt: Prompt
    max_tokens: int | None = 16
    temperature: float | None = None  # None -> 1.0, OpenAI's default
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # OpenAI: an integer 0-5 (how many alternatives per token); strict, so that
    # ``true`` (the chat API's spelling) is refused rather than read as 1.
    logprobs: Annotated[int, Field(strict=True, ge=0, le=5)] | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    echo: bool | None = None  # refused when true
    suffix: str | None = None  # refused when set
    # vLLM
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    priority: int = 0
    vllm_xargs: dict[str, Any] | None = None  # -> SamplingParams.extra_args
    use_beam_search: bool = False
    length_penalty: float = 1.0
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>"
    # encdec: the decoder prompt (text or token ids); ``prompt`` is then the encoder prompt
    decoder_prompt: str | list[int] | None = None
    # vLLM: the output held to a constraint (StructuredOutputsParams' fields); OpenAI's
    # response_format ({"type": "json_object"} or "json_schema") is the other spelling
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        if self.echo:
            raise APIError(400, "echo is not supported: an encoder/decoder model does not "
                           "continue its prompt", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported (no insertion mode)", param="suffix")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise APIError(400, f"best_of ({self.best_of}) > n ({self.n}) cannot be streamed",
                           param="best_of")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true",
                           param="stream_options")


class TranscriptionRequest(BaseModel):
    """The multipart fields of ``/v1/audio/transcriptions`` and ``/translations`` (file aside)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    language: str | None = None  # ISO-639-1; translations take none (the target is English)
    prompt: str | None = None  # previous text: sent as <|startofprev|> + text
    response_format: Literal["json", "text", "srt", "vtt", "verbose_json"] = "json"
    temperature: float = 0.0
    timestamp_granularities: list[Literal["segment", "word"]] = Field(default_factory=list)
    structured_outputs: str | None = None  # vLLM's extra field, as JSON text: each segment's text held to it
    stream: bool = False
    stream_options: StreamOptions | None = None
    # faster-whisper's options, as its server (speaches) takes them: form fields named as
    # LLM.transcribe's; beam_size > 1: beam search at temperature 0; vad_filter: decode
    # Silero VAD's speech regions only (the ``vad`` extra)
    beam_size: int = 1
    vad_filter: bool = False
