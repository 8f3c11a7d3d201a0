import pytest

from deepinfer.models.vision_layout import ImageTokenIds, aligned_grid, image_token_count, image_token_layout

IDS = ImageTokenIds(start=100, end=101, newline=102, image=103)


@pytest.mark.parametrize(("n_h", "n_w"), [(1, 1), (2, 3), (4, 1), (3, 5)])
def test_layout_rows_and_count(n_h, n_w):
    ids = image_token_layout(n_h, n_w, IDS)
    assert len(ids) == image_token_count(n_h, n_w)
    assert ids[0] == IDS.start and ids[-1] == IDS.end
    body = ids[1:-1]
    rows = [body[r * (n_w + 1) : (r + 1) * (n_w + 1)] for r in range(n_h)]
    assert all(row == [IDS.image] * n_w + [IDS.newline] for row in rows)


def test_aligned_grid_and_bad_sizes():
    assert aligned_grid(56, 84, patch=14, downsample=2) == (2, 3)
    with pytest.raises(ValueError, match="multiple of patch"):
        aligned_grid(50, 84, patch=14, downsample=2)
    with pytest.raises(ValueError, match="positive"):
        image_token_layout(0, 2, IDS)
