"""The encoder alone, for a batch of processed requests.

An encoder worker (``encdec serve --ray --disaggregate``) runs this and sends
each request's encoder output to a decoder engine, which takes it in place of
its own encoder pass (``LLMEngine.add_processed_request(encoder_output=...)``):

    encoder worker                              decoder engine
    EncoderPass([(ids, features), ...])  --->   prefill: cross K/V = kv_proj(encoder output)
      -> [(enc_len, d_model), ...]              per decoder layer, written to its cross table

What crosses is the encoder output, not the cross K/V the decoder makes of it:
the cross K/V is ``2 * decoder_layers * num_kv_heads * head_size`` values per
encoder token against ``d_model`` (8x fewer bytes for Whisper's 4-layer turbo
decoder, 24x for BART-large's 12 layers), and the projection that turns one into
the other is a small part of a prefill (``encoder_transfer_bytes``).

The pass is the engine's own model code (``model.encode``) on the same
checkpoint, dtype and attention backend, one request's tokens at a time in
each attention call, so its outputs are the ones the engine's prefill makes.
"""
from __future__ import annotations

from typing import Any

import torch

from encdec.engine.arg_utils import EngineArgs
from encdec.worker.encoder_pieces import encode_batch
from encdec.worker.worker import Worker


class EncoderPass:
    """The checkpoint's model (loaded whole: the decoder's weights stay unused) and
    one call that encodes a batch of requests."""

    def __init__(self, args: EngineArgs):
        self.worker = Worker(args.load_config())
        self.model, self.device = self.worker.model, self.worker.device
        self.d_model: int = self.worker.model_config.hf_config.d_model

    @torch.inference_mode()
    def __call__(self, batch: list[tuple[list[int], Any]]) -> list[torch.Tensor]:
        """``[(encoder_prompt_token_ids, encoder_features or None)]`` of processed
        requests (``LLMEngine.process_request``'s inputs) -> each one's encoder
        output, (len(ids), d_model) on the CPU."""
        if not batch:
            return []
        out = encode_batch(self.model, self.worker.backend, [list(i) for i, _ in batch], [f for _, f in batch],
                           self.device)
        return [t.to("cpu") for t in out]


def encoder_transfer_bytes(hf_config: Any, enc_len: int, dtype_bytes: int) -> tuple[int, int]:
    """(encoder output, cross K/V) bytes of one request with ``enc_len`` encoder
    tokens: what an encoder worker could send a decoder engine."""
    cfg = hf_config
    d_model = cfg.d_model
    layers = (getattr(cfg, "decoder_layers", None) or getattr(cfg, "num_decoder_layers", None)
              or cfg.num_layers)
    heads = (getattr(cfg, "decoder_attention_heads", None) or getattr(cfg, "num_heads", None))
    head_size = getattr(cfg, "d_kv", None) or d_model // heads
    return enc_len * d_model * dtype_bytes, 2 * layers * enc_len * heads * head_size * dtype_bytes
