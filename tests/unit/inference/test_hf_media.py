"""The hf server's image handling (inference/server/media.py) without a server: references, budgets and
placeholder expansion with the tiny VLM's real image processor. The server itself: test_hf_server_vision.py."""

from __future__ import annotations

import base64
import io

import pytest

from areal_cli.inference.server.media import MediaHandler, MediaPolicy, refs_for_prompts
from areal_cli.inference.server.schema import BadRequest

PAD = 398


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def processor():
    from areal_cli.models.tiny_vl import image_processor

    return image_processor()


def _handler(processor, **kw) -> MediaHandler:
    return MediaHandler(processor, PAD, MediaPolicy(**{"allowed_roots": [], **kw}))


def test_placeholders_expand_to_each_images_tokens(processor):
    h = _handler(processor)
    ids, vis = h.prepare([1, PAD, 2, PAD, 3], [_url(_png(64, 64)), _url(_png(32, 96))])
    # 64x64: 8x8 patches of 8 px, merged 2x2 -> 16 tokens; 32 wide x 96 high: grid (t, h, w) = (1, 12, 4) -> 12
    assert vis.tokens_per_image == [16, 12] and vis.image_grid_thw.tolist() == [[1, 8, 8], [1, 12, 4]]
    assert ids == [1] + [PAD] * 16 + [2] + [PAD] * 12 + [3]
    assert vis.pixel_values.shape[0] == 64 + 48
    again, _ = h.prepare(ids, [_url(_png(64, 64)), base64.b64encode(_png(32, 96)).decode()])
    assert again == ids  # exact-length runs (a processor's output, a resubmission) are kept


@pytest.mark.parametrize("ids, n_images, needle", [
    ([1, PAD, PAD, 2], 1, "2 <|image_pad|> tokens but its image takes 16"),
    ([1, PAD, 2], 2, "1 image placeholder(s)"),
    ([1, 2], 1, "0 image placeholder(s)"),
])
def test_placeholder_mismatch_is_400(processor, ids, n_images, needle):
    with pytest.raises(BadRequest, match=needle.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        _handler(processor).prepare(ids, [_url(_png(64, 64))] * n_images)


def test_references_and_budgets(processor, tmp_path):
    png = _png(64, 64)
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(png)
    (tmp_path / "b.png").write_bytes(png)
    h = _handler(processor, allowed_roots=[str(tmp_path / "ok")])
    assert h.prepare([PAD], [str(tmp_path / "ok" / "a.png")])[0] == [PAD] * 16
    assert h.prepare([PAD], [f"file://{tmp_path / 'ok' / 'a.png'}"])[0] == [PAD] * 16
    cases = [
        (h, str(tmp_path / "b.png"), "outside the server's allowed media roots"),
        (h, str(tmp_path / "ok" / ".." / "b.png"), "outside the server's allowed media roots"),
        (_handler(processor), str(tmp_path / "ok" / "a.png"), "local image paths are not allowed"),
        (h, "https://example.com/a.png", "does not fetch URLs"),
        (h, "data:text/plain;base64,aGk=", "is not an image"),
        (h, base64.b64encode(b"garbage").decode(), "cannot decode the image"),
        (h, base64.b64encode(png[:40]).decode(), "cannot decode the image"),
        (_handler(processor, max_image_pixels=63 * 64), _url(png), "--max-image-pixels 4032"),
        (h, 12, "an image must be a data URL"),
    ]
    for handler, ref, needle in cases:
        with pytest.raises(BadRequest, match=needle.replace("(", r"\(")):
            handler.prepare([PAD], [ref])
    with pytest.raises(BadRequest, match="--max-image-tokens 31"):
        _handler(processor, max_image_tokens=31).prepare([PAD, 1, PAD], [_url(png)] * 2)
    assert _handler(processor, max_image_tokens=32).prepare([PAD, 1, PAD], [_url(png)] * 2)[0].count(PAD) == 32


def test_image_data_per_prompt():
    assert refs_for_prompts(None, 2, True) == [[], []]
    assert refs_for_prompts("x", 1, False) == [["x"]]
    assert refs_for_prompts(["x", "y"], 1, False) == [["x", "y"]]
    assert refs_for_prompts([["x"], None, "y"], 3, True) == [["x"], [], ["y"]]
    with pytest.raises(BadRequest, match="a list of 2 entries"):
        refs_for_prompts([["x"]], 2, True)
