"""Audio loading and log-mel features: what users pass in, and parity with
``transformers.WhisperFeatureExtractor`` (80 and 128 bins) within 1e-4."""
from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from encdec.audio import N_FRAMES, load_audio, log_mel_spectrogram, pad_or_trim

torch.set_num_threads(1)


def tone(seconds: float, sr: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_matches_hf_feature_extractor(n_mels):
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(0)
    audios = [tone(2.5, 16000), 0.1 * rng.standard_normal(16000 * 31).astype(np.float32),
              tone(29.99, 16000, 1234.0) + 0.01 * rng.standard_normal(479840).astype(np.float32),
              np.zeros(100, np.float32)]
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    ref = fe(audios, sampling_rate=16000, return_tensors="pt").input_features
    ours = log_mel_spectrogram(audios, n_mels=n_mels)
    assert ours.shape == (4, n_mels, N_FRAMES)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # Batched equals one at a time (the floor is per input, not per batch).
    torch.testing.assert_close(log_mel_spectrogram(audios[1:2], n_mels=n_mels)[0], ours[1])
    # Short batches take the path that skips the zero tail of the window.
    short = log_mel_spectrogram([audios[0], audios[3]], n_mels=n_mels)
    torch.testing.assert_close(short, ref[[0, 3]], atol=1e-4, rtol=0)
    torch.testing.assert_close(short, ours[[0, 3]], atol=1e-6, rtol=0)


def test_log_mel_many_inputs_in_chunks_match_hf():
    """More inputs than one STFT call takes: chunks of mixed lengths (each chunk
    trims its own zero tail) still equal HF and the one-at-a-time result."""
    from transformers import WhisperFeatureExtractor

    from encdec.audio import _CHUNK

    rng = np.random.default_rng(1)
    lengths = [16000 * 30, 400, 16000 * 3, 16000 * 31, 12345, 16000 * 29, 800, 16000 * 7, 16000 * 30]
    assert len(lengths) > 2 * _CHUNK["cpu"]
    audios = [0.1 * rng.standard_normal(n).astype(np.float32) for n in lengths]
    ref = WhisperFeatureExtractor(feature_size=80)(audios, sampling_rate=16000, return_tensors="pt").input_features
    ours = log_mel_spectrogram(audios)
    assert ours.shape == (len(audios), 80, N_FRAMES)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    alone = torch.cat([log_mel_spectrogram([a]) for a in audios])
    torch.testing.assert_close(ours, alone, atol=1e-6, rtol=0)


def test_load_file_any_rate_and_channels(tmp_path):
    stereo = np.stack([tone(1.0, 44100), tone(1.0, 44100, 880.0)], axis=1)  # (n, 2) as soundfile
    path = tmp_path / "stereo.wav"
    sf.write(path, stereo, 44100)
    wav = load_audio(str(path))
    assert wav.dtype == np.float32 and wav.ndim == 1 and abs(len(wav) - 16000) <= 1
    mono16 = load_audio((stereo.T.copy(), 44100))  # (channels, n) as librosa gives
    assert abs(len(mono16) - 16000) <= 1
    np.testing.assert_allclose(load_audio((stereo, 44100)), mono16, atol=1e-6)
    pcm = (tone(0.5, 16000) * 32767).astype(np.int16)
    np.testing.assert_allclose(load_audio((pcm, 16000)), tone(0.5, 16000), atol=1e-4)
    same = tone(0.5, 16000)
    assert load_audio(same) is not None and np.array_equal(load_audio(torch.from_numpy(same)), same)


@pytest.mark.parametrize("audio, message", [
    ((np.zeros(0, np.float32), 16000), "empty"),
    ((np.zeros((3, 4, 5), np.float32), 16000), "1-D"),
    ((np.zeros((100, 200), np.float32), 16000), "at most 8 channels"),
    ((np.zeros(10, np.float32), -1), "sample_rate must be a positive integer number of Hz, got -1"),
    ((np.zeros(10, np.float32), 16000.5), "sample_rate must be a positive integer number of Hz, got 16000.5"),
    ((np.zeros(10, np.float32), float("nan")), "sample_rate must be a positive integer"),
    ((np.zeros(10, np.float32), True), "sample_rate must be a positive integer"),
    ((np.zeros(10, np.float32), "16000"), "sample_rate must be a positive integer number of Hz, got str"),
    ((np.zeros(10, np.float32), 16000, 1), r"\(array, sample_rate\)"),
    ((np.array(["a", "b"]), 16000), "dtype"),
    ((np.array([0.0, np.inf], np.float32), 16000), "NaN or infinite"),
    (("not an array", 16000), "numpy array"),
    (3.5, "must be a path"),
    ((np.zeros(10, np.float32), 1), "between 1000 and 384000 Hz, got 1$"),
    ((np.zeros(10, np.float32), 999), "between 1000 and 384000 Hz, got 999"),
    ((np.zeros(10, np.float32), 10**7), "between 1000 and 384000 Hz, got 10000000"),
])
def test_bad_arrays(audio, message):
    with pytest.raises(ValueError, match=message):
        load_audio(audio)


def test_paths_and_float_or_numpy_sample_rates(tmp_path):
    wav = tone(1.0, 22050)
    sf.write(tmp_path / "a.wav", wav, 22050)
    ref = load_audio((wav, 22050))
    assert abs(len(ref) - 16000) <= 1
    for rate in (22050.0, np.int64(22050), np.float32(22050)):
        np.testing.assert_array_equal(load_audio((wav, rate)), ref)
    np.testing.assert_allclose(load_audio(tmp_path / "a.wav"), ref, atol=1e-4)  # pathlib.Path


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_audio(str(tmp_path / "nope.wav"))
    junk = tmp_path / "junk.mp3"
    junk.write_bytes(b"\x00\x01garbage" * 10)
    with pytest.raises(ValueError, match="cannot be read as audio"):
        load_audio(junk)
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    with pytest.raises(ValueError, match="empty|cannot be read"):
        load_audio(empty)


def test_edge_sample_rates_are_taken():
    for rate in (1000, 384000):
        assert abs(len(load_audio((tone(0.5, rate, 100.0), rate))) - 8000) <= 1


def test_paths_that_are_not_files(tmp_path):
    with pytest.raises(ValueError, match="is a directory, not an audio file"):
        load_audio(tmp_path)
    with pytest.raises(ValueError, match="'/dev/null' is not a regular file"):
        load_audio("/dev/null")


@pytest.mark.parametrize("name, data, reason", [
    ("junk.wav", b"\x00\x01garbage" * 10, "libsndfile: Format not recognised; audioread: no installed backend"),
    ("short.wav", b"RIFF", "libsndfile: Format not recognised; audioread: the file ends inside its header"),
    ("junk.mp3", b"\x00\x01garbage" * 10, "libsndfile: its decoder found no audio it can read"),
])
def test_undecodable_files_give_the_decoders_reason(tmp_path, name, data, reason):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match="cannot be read as audio: " + reason):
        load_audio(tmp_path / name)


def test_pad_or_trim():
    x = torch.ones(5)
    assert pad_or_trim(x, 3).tolist() == [1, 1, 1]
    assert pad_or_trim(x, 7).tolist() == [1, 1, 1, 1, 1, 0, 0]


def test_whisper_features_are_computed_on_the_engines_device(monkeypatch):
    """The audio hook runs the STFT where it is told (the engine passes its own
    device) and hands back host tensors, equal to the host path's."""
    import encdec.audio
    from transformers import WhisperConfig

    from encdec.models.whisper import make_audio_processor

    seen, real = [], encdec.audio.log_mel_spectrogram

    def spy(audios, n_mels=80, device="cpu"):
        seen.append(str(device))
        return real(audios, n_mels=n_mels, device="cpu")

    monkeypatch.setattr(encdec.audio, "log_mel_spectrogram", spy)
    cfg = WhisperConfig(num_mel_bins=80, max_source_positions=1500)
    audios = [tone(1.0, 16000), tone(2.0, 16000, 880.0)]
    feats = make_audio_processor(cfg, "cuda:0")(audios)
    assert seen == ["cuda:0"]
    assert [(f.device.type, tuple(f.shape), n) for f, n in feats] == [("cpu", (80, N_FRAMES), 1500)] * 2
    torch.testing.assert_close(torch.stack([f for f, _ in feats]), real(audios), atol=0, rtol=0)


def test_the_engine_passes_its_device_to_the_audio_hook(monkeypatch, ct2_dir):
    from encdec import LLM
    from encdec.models import whisper

    devices, real = [], whisper.make_audio_processor
    monkeypatch.setattr(whisper, "make_audio_processor",
                        lambda cfg, device="cpu": devices.append(device) or real(cfg, device))
    LLM(str(ct2_dir), device="cpu", kv_cache_memory=64 << 20)
    assert devices == ["cpu"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_on_cuda_matches_the_host(n_mels):
    rng = np.random.default_rng(2)
    audios = [tone(2.5, 16000), 0.1 * rng.standard_normal(16000 * 30).astype(np.float32), np.zeros(100, np.float32)]
    host = log_mel_spectrogram(audios, n_mels=n_mels)
    gpu = log_mel_spectrogram(audios, n_mels=n_mels, device="cuda")
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), host, atol=1e-4, rtol=0)
