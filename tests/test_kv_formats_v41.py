import pytest

from deepinfer.backend.kv_formats_v41 import bytes_per_entry_v41


def test_published_bytes_per_token():
    assert bytes_per_entry_v41("window", 512, "auto") == 528
    assert bytes_per_entry_v41("main", 512, "auto") == 288
    assert bytes_per_entry_v41("index", 128, "auto") == 68
    assert bytes_per_entry_v41("main", 512, "fp8") == 528
    assert bytes_per_entry_v41("main", 512, "bf16") == 1024


def test_unknown_format_is_named():
    with pytest.raises(ValueError, match="fp3"):
        bytes_per_entry_v41("main", 512, "fp3")
