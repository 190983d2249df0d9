"""``POST /v1/completions``: OpenAI's request and response shapes over ``AsyncLLMEngine``."""
from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from encdec.engine.async_llm_engine import AsyncLLMEngine, AsyncRequest, final_output
from encdec.entrypoints.openai.protocol import APIError, CompletionRequest
from encdec.entrypoints.openai.sse import DONE, sse
from encdec.inputs import ExplicitEncoderDecoderPrompt, TokensPrompt
from encdec.outputs import CompletionOutput, RequestOutput
from encdec.sampling_params import BeamSearchParams, SamplingParams
from encdec.structured_output.requests import request_constraint

_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__ if not f.startswith("_")}


def refusal(e: Exception) -> APIError:
    """A ``ValueError``/``TypeError`` from validation -> a 400 that names its field
    (the message's first word, after the "prompt N: " of a prompt list)."""
    msg = str(e)
    first = re.sub(r"^prompt \d+: ", "", msg).split(" ", 1)[0]
    param = first if first in _SAMPLING_FIELDS or first in ("prompt", "decoder_prompt") else None
    for name in ("structured_outputs", "response_format"):  # "structured_outputs.json cannot ..."
        if re.match(rf"{name}\b", first):
            param = name
    return APIError(400, msg, param=param)


def beam_search_params(req: CompletionRequest) -> Any:
    """``use_beam_search=true`` -> ``BeamSearchParams``: the one place beam search is routed."""
    if req.stream:
        raise APIError(400, "use_beam_search cannot be streamed", param="use_beam_search")
    try:
        return BeamSearchParams(
            beam_width=max(req.n, req.best_of or 0), max_tokens=req.max_tokens,
            min_tokens=req.min_tokens, length_penalty=req.length_penalty,
            num_return_sequences=req.n, ignore_eos=req.ignore_eos,
            temperature=req.temperature or 0.0, stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=request_constraint(req.structured_outputs, req.response_format))
    except (ValueError, TypeError) as e:
        raise refusal(e) from None


def to_sampling_params(req: CompletionRequest) -> Any:
    if req.use_beam_search:
        return beam_search_params(req)
    if req.length_penalty != 1.0:
        raise APIError(400, "length_penalty applies only with use_beam_search=true",
                       param="length_penalty")
    bias = req.logit_bias or {}
    if any(not k.lstrip("-").isdigit() for k in bias):
        raise APIError(400, f"logit_bias keys must be token ids, got {sorted(bias)[:5]}", param="logit_bias")
    opts: dict[str, Any] = dict(
        n=req.n, best_of=req.best_of, max_tokens=req.max_tokens, stop=req.stop, seed=req.seed,
        logprobs=req.logprobs, logit_bias=req.logit_bias, min_tokens=req.min_tokens,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        prompt_logprobs=req.prompt_logprobs, extra_args=req.vllm_xargs)
    optional = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                    repetition_penalty=req.repetition_penalty,
                    presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty)
    opts.update({k: v for k, v in optional.items() if v is not None})
    try:
        opts["structured_outputs"] = request_constraint(req.structured_outputs, req.response_format)
        return SamplingParams(**opts)
    except (ValueError, TypeError) as e:
        raise refusal(e) from None


def to_prompts(req: CompletionRequest) -> list[Any]:
    p = req.prompt
    if isinstance(p, str):
        prompts: list[Any] = [p]
    elif not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif all(isinstance(t, int) for t in p):
        prompts = [TokensPrompt(prompt_token_ids=list(p))]
    else:
        prompts = [x if isinstance(x, str) else TokensPrompt(prompt_token_ids=list(x)) for x in p]
    if req.decoder_prompt is None:
        return prompts
    dec = req.decoder_prompt
    dec = dec if isinstance(dec, str) else TokensPrompt(prompt_token_ids=list(dec))
    return [ExplicitEncoderDecoderPrompt(encoder_prompt=e, decoder_prompt=dec) for e in prompts]


class TokenText:
    """Token id -> its text, for logprobs (cached: the same ids recur)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int, as_id: bool) -> str:
        if as_id:
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def usage(outs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) + len(o.encoder_prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class CompletionServer:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.token_text = TokenText(engine.tokenizer)

    async def create(self, req: CompletionRequest, is_disconnected: Any) -> dict | AsyncIterator[str]:
        """The response JSON, or (``stream=true``) an iterator of SSE lines. Errors
        in the request raise ``APIError`` before anything streams."""
        req.refuse_unsupported()
        params = to_sampling_params(req)
        prompts = to_prompts(req)
        base = f"cmpl-{uuid.uuid4().hex}"
        arrival = time.time()
        requests = [AsyncRequest(f"{base}-{i}", p, params, req.priority, req.stream, arrival)
                    for i, p in enumerate(prompts)]
        try:
            streams = await self.engine.add_requests(requests)
        except (ValueError, TypeError) as e:
            refused = refusal(e)
            if refused.param == "structured_outputs" and req.response_format is not None:
                refused.param = "response_format"  # the field this request spelled it with
            raise refused from None
        created = int(arrival)
        if req.stream:
            hold = getattr(params, "output_text_buffer_length", 0)
            return self._stream(req, base, created, streams, hold)
        collect = asyncio.ensure_future(asyncio.gather(*(final_output(s) for s in streams)))
        while not collect.done():
            await asyncio.wait([collect], timeout=1.0)
            if not collect.done() and await is_disconnected():
                collect.cancel()  # each stream's close aborts its request
                raise APIError(499, "client closed the request")
        outs: list[RequestOutput] = collect.result()
        for o in outs:
            if o.error:
                raise APIError(400, o.error, param="prompt")
        choices = []
        for i, o in enumerate(outs):
            for c in o.outputs:
                choice = {"index": i * req.n + c.index, "text": c.text,
                          "logprobs": self._logprobs(req, c, 0, 0),
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(o)
                choices.append(choice)
        return {"id": base, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage(outs)}

    def _logprobs(self, req: CompletionRequest, c: CompletionOutput, start: int, offset: int) -> dict | None:
        """OpenAI's legacy logprobs object for the tokens of ``c`` from ``start`` on,
        the first at character ``offset`` of the text."""
        if req.logprobs is None or c.logprobs is None:
            return None
        as_id = req.return_tokens_as_token_ids
        ids = c.token_ids[start:]
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lps in zip(ids, c.logprobs[start:start + len(ids)]):
            text = self.token_text(tid, as_id)
            tokens.append(text)
            token_lps.append(max(lps[tid].logprob, -9999.0))
            tops.append({self.token_text(t, as_id): max(lp.logprob, -9999.0) for t, lp in lps.items()})
            offsets.append(offset)
            offset += len(text)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens,
                "top_logprobs": tops}

    def _prompt_logprobs(self, o: RequestOutput) -> list | None:
        if o.prompt_logprobs is None:
            return None
        return [None if lps is None else
                {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                          "decoded_token": self.token_text(t, False)} for t, lp in lps.items()}
                for lps in o.prompt_logprobs]

    async def _stream(self, req: CompletionRequest, base: str, created: int,
                      streams: list[AsyncIterator[RequestOutput]], hold: int) -> AsyncIterator[str]:
        head = {"id": base, "object": "text_completion", "created": created, "model": self.model_name}
        try:
            async with contextlib.aclosing(_merge(streams)) as merged:
                async for line in self._chunks(req, head, merged, hold):
                    yield line
        except APIError as e:
            yield sse(e.response_body())
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(APIError(500, f"{type(e).__name__}: {e}", type="internal_error").response_body())
        yield DONE

    async def _chunks(self, req: CompletionRequest, head: dict, merged: AsyncIterator[tuple[int, RequestOutput]],
                      hold: int) -> AsyncIterator[str]:
        """One chunk per choice that moved; while a stop string could still end a
        choice, its last ``hold`` characters wait (the stop string is cut from the text)."""
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars, tokens) sent
        closed: set[int] = set()  # choices whose finish_reason was sent
        last: dict[int, RequestOutput] = {}
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        async for i, out in merged:
            last[i] = out
            if out.error:
                raise APIError(400, out.error, param="prompt")
            for c in out.outputs:
                index = i * req.n + c.index
                chars, ntok = sent.get(index, (0, 0))
                done = c.finish_reason is not None
                end = len(c.text) if done else max(chars, len(c.text) - hold)
                if index in closed or (end == chars and len(c.token_ids) == ntok and not done):
                    continue
                choice = {"index": index, "text": c.text[chars:end],
                          "logprobs": self._logprobs(req, c, ntok, chars),
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                sent[index] = (end, len(c.token_ids))
                if done:
                    closed.add(index)
                chunk = {**head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = usage(list(last.values()))
                yield sse(chunk)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage(list(last.values()))})


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
