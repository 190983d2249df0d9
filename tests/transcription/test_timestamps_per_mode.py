"""``timestamps`` per mode: the independent mode's choice; the sequential mode
always decodes timestamp tokens, so an explicit False there is refused."""
import pytest

from encdec.transcription import TranscribeOptions


def test_timestamps_false_is_refused_in_the_sequential_mode():
    with pytest.raises(ValueError, match="timestamps=False applies to mode='independent'"):
        TranscribeOptions(timestamps=False)
    assert TranscribeOptions().timestamps is None and TranscribeOptions(timestamps=True).timestamps
    assert TranscribeOptions(mode="independent", timestamps=False).timestamps is False
    with pytest.raises(TypeError, match="timestamps must be a bool"):
        TranscribeOptions(timestamps="no")
