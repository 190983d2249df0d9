"""A small BART trained on the copy task (``copy_task``), saved as an HF checkpoint
our loader reads: the speculative decoding benchmark's model, since random weights
never copy and so never accept a copied draft.

Training is seeded and deterministic on CPU (``torch.use_deterministic_algorithms``,
a fixed thread count, data from ``random.Random(seed)``): the same options give the
same weights, and a directory whose manifest records the same options is reused
rather than trained again. The manifest also records the weights' sha256 and the
held-out exact-match accuracy the training reached.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, field

from encdec.bench.copy_task import CopyTask, first_word_id, make_example, make_examples, vocabulary

MANIFEST = "copy_model.json"
MANIFEST_VERSION = 1
# Held-out examples come from a seed the training data never uses.
HELD_OUT_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class TrainOptions:
    """Everything that decides the weights (the manifest stores it)."""

    task: CopyTask = field(default_factory=CopyTask)
    seed: int = 0
    steps: int = 4000  # on two threads: 90% held-out exact match, ~5 min on the shared 2-core host
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 50
    decay_steps: int | None = 1500  # lr decays linearly to a tenth over these, then stays (None: all steps)
    curriculum: float = 0.0  # share of the steps with shortened documents (task_at); 0: none
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    ffn: int = 256
    threads: int = 2  # part of what decides the weights (float sums split by thread); the same count, the same weights

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "d_model", "layers", "heads", "ffn", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainOptions.{name} must be an int >= 1, got {value!r}")
        if self.d_model % self.heads:
            raise ValueError(f"TrainOptions.d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
        if not 0.0 <= self.curriculum <= 1.0:
            raise ValueError(f"TrainOptions.curriculum must be in [0, 1], got {self.curriculum}")
        if self.decay_steps is not None and (not isinstance(self.decay_steps, int) or self.decay_steps <= self.warmup):
            raise ValueError(f"TrainOptions.decay_steps must be None or an int > warmup, got {self.decay_steps!r}")
        if not self.lr > 0 or self.warmup < 0:
            raise ValueError(f"TrainOptions.lr must be > 0 and warmup >= 0, got {self.lr}, {self.warmup}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def save_tokenizer(out_dir: str, task: CopyTask) -> int:
    """A word-level tokenizer over the task's vocabulary with BART's specials and
    post-processor (``<s> $A </s>``), saved as a ``PreTrainedTokenizerFast`` (as
    ``encdec.testing`` saves its tokenizers); returns its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = vocabulary(task.num_words)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation()])
    tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    fast.save_pretrained(out_dir)
    return len(fast)


def bart_config(opts: TrainOptions, vocab_size: int):
    """BART dims for ``opts``; the decoder starts ``[</s>, <s>]`` as bart-large-cnn
    does (``forced_bos_token_id`` 0), which is also our engine's default decoder prompt."""
    from transformers import BartConfig

    positions = max(opts.task.max_source_len(), opts.task.max_summary_len() + 2)
    return BartConfig(
        vocab_size=vocab_size, d_model=opts.d_model, encoder_layers=opts.layers, decoder_layers=opts.layers,
        encoder_attention_heads=opts.heads, decoder_attention_heads=opts.heads, encoder_ffn_dim=opts.ffn,
        decoder_ffn_dim=opts.ffn, max_position_embeddings=positions, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        forced_bos_token_id=0, forced_eos_token_id=None, architectures=["BartForConditionalGeneration"])


def generation_config():
    """Greedy, starting ``[</s>, <s>]`` (HF forces the <s>; our engine's default
    decoder prompt holds it), as bart-large-cnn's generation config says."""
    from transformers import GenerationConfig

    return GenerationConfig(decoder_start_token_id=2, forced_bos_token_id=0, bos_token_id=0, eos_token_id=2,
                            pad_token_id=1)


def source_ids(doc: list[int]) -> list[int]:
    """Encoder input: ``<s> doc </s>`` (what the tokenizer makes of the text)."""
    return [0, *doc, 2]


def _batch(examples: list[tuple[list[int], list[int]]]):
    """Padded encoder ids, mask and labels (``<s> summary </s>``; -100 where padded)."""
    import torch

    src = [source_ids(d) for d, _ in examples]
    tgt = [[0, *s, 2] for _, s in examples]
    n, m = max(map(len, src)), max(map(len, tgt))
    ids = torch.tensor([s + [1] * (n - len(s)) for s in src])
    mask = (ids != 1).long()
    labels = torch.tensor([t + [-100] * (m - len(t)) for t in tgt])
    return ids, mask, labels


def _lr_at(opts: TrainOptions, step: int) -> float:
    """Linear warm-up, then linear decay to a tenth over ``decay_steps``, then a tenth.
    A longer run with the same ``decay_steps`` repeats a shorter one's steps exactly
    and then goes on at the low rate (copying emerges at a point that depends on the
    schedule, so lengthening the schedule itself can lose it)."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    decay = opts.decay_steps or opts.steps
    frac = min(1.0, (step - opts.warmup) / max(1, decay - opts.warmup))
    return opts.lr * (1.0 - 0.9 * frac)


def task_at(opts: TrainOptions, step: int) -> CopyTask:
    """The task with documents shortened early in training: over the first
    ``opts.curriculum`` of the steps, documents hold a few sentences for its first
    half and grow to the task's length over its second. Short documents teach the
    copying attention in far fewer (and cheaper) steps; long ones then only stretch it."""
    task = opts.task
    lo, hi = task.sentences
    window = opts.curriculum * opts.steps
    ramp = min(1.0, max(0.0, (step - window / 2) / max(1.0, window / 2))) if opts.curriculum else 1.0
    start = task.marked[1] + 1
    top = max(start, round(start + (hi - start) * ramp))
    if top >= hi:
        return task
    return dataclasses.replace(task, sentences=(max(task.marked[1], round(top * lo / hi)), top))


def train(opts: TrainOptions, *, log=print):
    """A random-init BART trained for ``opts.steps`` AdamW steps on fresh examples
    (seeded). Sets torch's threads and deterministic mode for the call and restores them."""
    import torch
    from transformers import BartForConditionalGeneration

    vocab = len(vocabulary(opts.task.num_words))
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(opts.threads)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(opts.seed)
        model = BartForConditionalGeneration(bart_config(opts, vocab)).train()
        model.generation_config = generation_config()
        optim = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01)
        rng = random.Random(opts.seed)
        t0 = time.perf_counter()
        for step in range(opts.steps):
            for g in optim.param_groups:
                g["lr"] = _lr_at(opts, step)
            task = task_at(opts, step)
            ids, mask, labels = _batch([make_example(task, rng) for _ in range(opts.batch)])
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            if log and (step % 25 == 0 or step == opts.steps - 1):
                log(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - t0:6.1f} s")
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
    return model.eval()


def held_out(task: CopyTask, count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Examples no training run with ``seed`` sees (another seed's stream)."""
    return make_examples(task, count, seed + HELD_OUT_SEED_OFFSET)


def greedy_hf(model, docs: list[list[int]], max_new_tokens: int, batch: int = 32) -> list[list[int]]:
    """HF ``generate`` greedy outputs, less the ``[</s>, <s>]`` start and the final </s>;
    at most ``max_new_tokens`` after the start, as our engine's ``max_tokens`` counts
    (HF counts the forced <s> as a new token)."""
    import torch

    outs: list[list[int]] = []
    with torch.no_grad():
        for i in range(0, len(docs), batch):
            ids, mask, _ = _batch([(d, []) for d in docs[i:i + batch]])
            gen = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, do_sample=False,
                                 max_new_tokens=max_new_tokens + 1)
            outs += [until_eos(row[2:]) for row in gen.tolist()]
    return outs


def until_eos(ids: list[int]) -> list[int]:
    """``ids`` up to its first </s> (2), which is left out."""
    return ids[:ids.index(2)] if 2 in ids else list(ids)


def exact_match(predicted: list[list[int]], examples: list[tuple[list[int], list[int]]]) -> float:
    """Share of summaries reproduced token for token."""
    return sum(p == s for p, (_, s) in zip(predicted, examples)) / max(1, len(examples))


def weights_sha256(model) -> str:
    """A hash of every parameter's name, shape and bytes (state dict order)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def read_manifest(out_dir: str) -> dict | None:
    try:
        with open(os.path.join(out_dir, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def task_from_manifest(manifest: dict) -> CopyTask:
    """The task a checkpoint was trained on, from its manifest."""
    fields = manifest["options"]["task"]
    return CopyTask(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def reusable(out_dir: str, opts: TrainOptions) -> bool:
    """The directory holds a checkpoint trained with exactly ``opts``."""
    m = read_manifest(out_dir)
    return (m is not None and m.get("version") == MANIFEST_VERSION and m.get("options") == _jsonable(opts)
            and os.path.exists(os.path.join(out_dir, "model.safetensors")))


def _jsonable(opts: TrainOptions) -> dict:
    return json.loads(json.dumps(opts.to_json()))


def train_and_save(out_dir: str, opts: TrainOptions, *, eval_count: int = 200, log=print) -> dict:
    """Trains (unless ``out_dir`` already holds this training), saves the checkpoint,
    tokenizer and manifest, and returns the manifest."""
    log = log or (lambda line: None)
    if reusable(out_dir, opts):
        log(f"reusing {out_dir} (its manifest records these options)")
        return read_manifest(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    model = train(opts, log=log)
    seconds = time.perf_counter() - t0
    test = held_out(opts.task, eval_count, opts.seed)
    acc = exact_match(greedy_hf(model, [d for d, _ in test], opts.task.max_summary_len()), test)
    save_tokenizer(out_dir, opts.task)
    model.save_pretrained(out_dir)
    manifest = dict(version=MANIFEST_VERSION, options=_jsonable(opts), weights_sha256=weights_sha256(model),
                    held_out_exact_match=acc, held_out_count=eval_count, train_seconds=round(seconds, 1),
                    first_word_id=first_word_id())
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    log(f"held-out exact match {acc:.1%} of {eval_count}; trained in {seconds:.0f} s; saved {out_dir}")
    return manifest
