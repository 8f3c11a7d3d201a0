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


def test_fp8_row_roundtrip_within_e4m3_rounding():
    import torch

    from deepinfer.backend.kv_formats_v41 import dequantize_fp8_rows_v41, quantize_fp8_rows_v41

    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    rows = quantize_fp8_rows_v41(x)
    assert rows.shape == (5, 528) and rows.dtype == torch.uint8
    back = dequantize_fp8_rows_v41(rows).double()
    # e4m3 has 3 mantissa bits: round-to-nearest error is at most 2^-4 relative per value,
    # and subnormal values (below 2^-6 x scale) at most half their spacing 2^-9 x scale.
    scale = torch.exp2(rows[:, 512:].double() - 127).repeat_interleave(32, dim=-1)
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale * 2**-10 + 1e-12).all()


def test_fp4_row_roundtrip_within_e2m1_rounding():
    import torch

    from deepinfer.backend.kv_formats_v41 import dequantize_fp4_rows_v41, quantize_fp4_rows_v41

    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rows = quantize_fp4_rows_v41(x)
    assert rows.shape == (5, 288) and rows.dtype == torch.uint8
    back = dequantize_fp4_rows_v41(rows).double()
    # e2m1 spacing is at most 2 (between 4 and 6) in units of the scale, so round-to-nearest
    # errs by at most 1 x scale; the e4m3 scale itself (amax/6, 2^-4 relative) can clip amax
    # by a further 6 x 2^-4 x scale.
    s = rows[:, 256:].contiguous().view(torch.float8_e4m3fn).double()
    s = s.repeat_interleave(16, dim=-1)
    assert ((back - x).abs() <= s * (1 + 6 * 2**-4) + 1e-12).all()


def test_fp4_index_key_roundtrip_within_e2m1_rounding():
    import torch

    from deepinfer.backend.kv_formats_v41 import (
        dequantize_fp4_index_keys_v41,
        quantize_fp4_index_keys_v41,
    )

    k = torch.randn(7, 128, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    rows = quantize_fp4_index_keys_v41(k)
    assert rows.shape == (7, 68) and rows.dtype == torch.uint8
    back = dequantize_fp4_index_keys_v41(rows).double()
    # the power-of-two scale keeps amax/scale <= 6, so no clipping: the error is at most
    # half the widest e2m1 spacing (2) in units of the scale.
    s = torch.exp2(rows[:, 64:].double() - 127).repeat_interleave(32, dim=-1)
    assert ((back - k).abs() <= s + 1e-12).all()


def test_graph_safe_e2m1_codes_equal_the_mxfp4_codes():
    """The KV quantisers' arithmetic e2m1 rounding (no host tensor, so graph capture takes it)
    gives fp4.e2m1_codes' codes: a fine grid over +-6 and every tie between two magnitudes."""
    import torch

    from deepinfer.backend import fp4
    from deepinfer.backend.kv_formats_v41 import _e2m1_codes

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    y = torch.cat([torch.linspace(-6, 6, 4801), ties, -ties, torch.tensor([0.0, -0.0, 6.0, -6.0])])
    assert torch.equal(_e2m1_codes(y), fp4.e2m1_codes(y))


def test_index_keys_are_mxfp4_weights_bytes():
    """The index keys' bytes are MXFP4's (fp4.quantize_weight's packing and UE8M0 scales)."""
    import torch

    from deepinfer.backend import fp4
    from deepinfer.backend.kv_formats_v41 import quantize_fp4_index_keys_v41

    k = torch.randn(6, 128, generator=torch.Generator().manual_seed(3)) * 4
    packed, scales = fp4.quantize_weight(k)
    assert torch.equal(quantize_fp4_index_keys_v41(k), torch.cat([packed, scales], dim=-1))
