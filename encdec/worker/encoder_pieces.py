"""The worker's side of encoder passes split across steps, and of encoder
outputs a step's prefills bring with them.

``EncoderPieces.run`` advances each split pass by the scheduler's pieces
(``SchedulerOutputs.encoder.pieces``; ``encdec.core.encoder_split`` says why) through
the model's staged encoder (``encdec.models.staged_encoder``), holding each
pass's state between steps; a pass's last piece leaves its output in
``outputs``, where the request's prefill (the same step) takes it, as it takes
an output an encoder worker computed (``LLMEngine.add_processed_request``).

``encoder_kwargs`` gives a step's prefills their encoder: the outputs they
brought, and one encoder call for those that brought none.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from encdec.core.scheduler_outputs import EncoderPiece
from encdec.models.staged_encoder import EncoderState
from encdec.sequence import SequenceGroupMetadata
from encdec.worker.prefill_rows import EncoderRows


class EncoderPieces:
    """Split encoder passes in progress, by request id."""

    def __init__(self, model: Any, backend: Any, device: torch.device, outputs: dict[str, torch.Tensor]):
        self.model, self.backend, self.device = model, backend, device
        self.outputs = outputs  # the runner's: request id -> encoder output (tokens, d_model)
        self.partial: dict[str, EncoderState] = {}

    def run(self, pieces: Sequence[EncoderPiece]) -> None:
        for piece in pieces:
            self._advance(piece)

    def _advance(self, piece: EncoderPiece) -> None:
        rid, rows = piece.request_id, piece.rows
        state = self.partial.pop(rid, None)
        if piece.start == 0:
            state = self._start(piece)
        elif state is None:
            raise RuntimeError(f"encoder piece of request {rid!r} from unit {piece.start}: its pass was never started")
        u = piece.start
        while u < piece.stop:
            layer, r0 = divmod(u, rows)
            r1 = min(rows, r0 + piece.stop - u)
            self.model.encoder_advance(state, layer, r0, r1)
            u += r1 - r0
        if piece.last:
            self.outputs[rid] = self.model.encoder_finish(state)
        else:
            self.partial[rid] = state

    def _start(self, piece: EncoderPiece) -> EncoderState:
        inputs = self.model.build_encoder_inputs([piece.token_ids], [piece.features], self.device)
        md = None if "encoder_features" in inputs else encoder_metadata(self.backend, [piece.rows], self.device)
        return self.model.encoder_start(inputs, md)

    def drop(self, request_id: str) -> None:
        """Forget the request's pass and output (it finished or was aborted)."""
        self.partial.pop(request_id, None)
        self.outputs.pop(request_id, None)


def encoder_kwargs(model: Any, backend: Any, device: torch.device, prefills: list[SequenceGroupMetadata],
                   enc: EncoderRows, outputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The model's encoder arguments for a step's prefills: their encoder inputs
    where none brought an output (the encoder runs inside the step's forward);
    else every output, those missing computed here in one call (the same model
    code, so exact either way). Each brought output is taken once."""
    given = [outputs.pop(m.request_id, None) for m in prefills]
    given = [g for g, m in zip(given, prefills) if not m.cross_kv_cached]
    if not given:
        return {}
    if all(g is None for g in given):
        return model.build_encoder_inputs(enc.tokens, enc.features, device)
    missing = [i for i, g in enumerate(given) if g is None]
    if missing:
        computed = encode_batch(model, backend, [enc.tokens[i] for i in missing],
                                [enc.features[i] for i in missing], device)
        for i, out in zip(missing, computed):
            given[i] = out
    return {"encoder_hidden": torch.cat([g.to(device, non_blocking=True) for g in given])}


def encode_batch(model: Any, backend: Any, ids: list[list[int]], features: list, device: torch.device
                 ) -> list[torch.Tensor]:
    """Each request's encoder output (its tokens, d_model) on ``device``: one
    encoder call for the batch, one request's tokens at a time in attention."""
    kwargs = model.build_encoder_inputs(ids, features, device)
    if "encoder_features" in kwargs:  # audio: (B, n_mels, frames) -> (B, enc_len, d)
        out = model.encode(kwargs["encoder_features"]).flatten(0, 1)
    else:
        md = encoder_metadata(backend, [len(i) for i in ids], device)
        out = model.encode(kwargs["encoder_input_ids"], kwargs["encoder_positions"], md)
    return list(out.split([len(i) for i in ids]))


def encoder_metadata(backend: Any, enc_lens: list[int], device: torch.device) -> Any:
    """Attention metadata for an encoder-only call: ``len(enc_lens)`` prefills of one
    placeholder decoder token each (never run), whose encoder tokens are packed
    one request after another; only the encoder's self-attention reads it."""
    n = len(enc_lens)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    e_start = [0]
    for e in enc_lens:
        e_start.append(e_start[-1] + e)
    tables = torch.zeros(n, 1, dtype=torch.int32, device=device)
    return backend.make_metadata(
        num_prefills=n, num_prefill_tokens=n, num_decode_tokens=0,
        slot_mapping=torch.zeros(n, dtype=torch.long, device=device),
        seq_lens=[1] * n, seq_lens_tensor=i32([1] * n), max_prefill_seq_len=1,
        max_decode_seq_len=0, max_query_len=1, query_start_loc=i32(list(range(n + 1))),
        seq_start_loc=i32(list(range(n + 1))), context_lens_tensor=i32([0] * n), block_tables=tables,
        encoder_seq_lens=list(enc_lens), encoder_seq_lens_tensor=i32(enc_lens),
        encoder_seq_start_loc=i32(e_start), max_encoder_seq_len=max(enc_lens),
        num_encoder_tokens=e_start[-1], cross_slot_mapping=torch.zeros(e_start[-1], dtype=torch.long, device=device),
        cross_block_tables=tables, block_size=1,
        block_tables_list=[[0]] * n, cross_block_tables_list=[[0]] * n)

