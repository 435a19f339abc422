"""One intake for pictures (gemmaforge/intake.py): the same rules at prepare time (data/media_files.py, also eval's
suites), in training batches and evaluation (decode_picture) and in the server's requests (serve/protocol.py)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from gemmaforge.data.media_files import ImageFinder
from gemmaforge.errors import UserError
from gemmaforge.intake import check_picture, decode_picture, picture_sizes
from gemmaforge.serve.protocol import ApiError, Pictures


def encoded(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def test_decoding_names_what_is_wrong() -> None:
    png = encoded(Image.new("L", (3, 2), 7))
    image = decode_picture(png, "messages[0].images[0]")
    assert image.mode == "RGB" and image.size == (3, 2)
    with pytest.raises(UserError, match=r"messages\[0\].images\[1\]: not a picture PIL can read"):
        decode_picture(b"GIF89a not really", "messages[0].images[1]")
    huge = encoded(Image.new("1", (9000, 8000)))  # 72 M pixels, a few KiB on the wire
    with pytest.raises(UserError, match="the picture is 9000x8000 pixels, more than the 64,000,000 accepted; scale"):
        decode_picture(huge, "images[0]")
    with pytest.raises(UserError, match="3x2 pixels, more than the 5 accepted .what is left of the 64,000,000"):
        decode_picture(png, "images[1]", max_pixels=5)
    clear = encoded(Image.new("RGBA", (2, 1), (0, 0, 0, 0)))  # transparent black: white, as the processors do
    assert decode_picture(clear, "images[0]").tobytes() == bytes([255] * 6)


def test_pictures_are_turned_upright_as_transformers_load_image_turns_them(tmp_path: Path) -> None:
    """A phone photo stored sideways (EXIF orientation 6: rotate 90 degrees clockwise to view): decoded, sized and
    checked upright everywhere, pixel for pixel what transformers' own `load_image` gives; Gemma 4's token count
    follows the upright aspect ratio."""
    from transformers.image_utils import load_image

    stored = Image.new("RGB", (4, 2))
    stored.putdata([(i * 40, 255 - i * 30, (i * 70) % 256) for i in range(8)])
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "sideways.png"
    path.write_bytes(encoded(stored, exif=exif.tobytes()))

    upright = decode_picture(path.read_bytes(), str(path))
    reference = load_image(str(path)).convert("RGB")
    assert upright.size == reference.size == (2, 4)
    assert upright.tobytes() == reference.tobytes() != stored.transpose(Image.Transpose.ROTATE_90).tobytes()
    assert picture_sizes([path]) == [(2, 4)] and check_picture(path.read_bytes(), "x") == (2, 4)
    assert ImageFinder(tmp_path / "store").find(str(path), tmp_path, "line 1").width == 2
    plain = tmp_path / "plain.png"
    plain.write_bytes(encoded(stored))
    assert picture_sizes([plain]) == [(4, 2)] and decode_picture(plain.read_bytes(), "x").size == (4, 2)


BAD = {
    "float pixels": encoded(Image.new("F", (2, 2)), "TIFF"),
    "too many pixels": encoded(Image.new("1", (9000, 8000))),
    "truncated": encoded(Image.new("RGB", (64, 64), (9, 9, 9)), "JPEG")[:300],
}


@pytest.mark.parametrize("name", BAD)
def test_prepare_and_serve_refuse_a_picture_for_the_same_reason(name: str, tmp_path: Path) -> None:
    """Before, prepare and serve each had their own rules: serve took float images that training refused, and
    prepare took data URIs whose base64 serve refused."""
    uri = "data:image/png;base64," + base64.b64encode(BAD[name]).decode()
    with pytest.raises(ApiError) as served:
        Pictures().decode(uri, "images[0]")
    with pytest.raises(UserError) as prepared:
        ImageFinder(tmp_path).find(uri, tmp_path, "line 1")
    reason = served.value.message.removeprefix("images[0]: ")
    assert str(prepared.value).removeprefix("line 1: the embedded image: ") == reason
    assert reason.startswith(("the picture", "not a picture"))


@pytest.mark.parametrize("payload", ["iVBOR@@w0KGgo=", "not base64 at all!"])
def test_base64_that_does_not_decode_is_refused_in_data_as_in_requests(payload: str, tmp_path: Path) -> None:
    uri = f"data:image/png;base64,{payload}"
    with pytest.raises(UserError, match=r"^line 1: not valid base64$"):
        ImageFinder(tmp_path).find(uri, tmp_path, "line 1")
    with pytest.raises(ApiError, match=r"images\[0\]: not valid base64"):
        Pictures().decode(uri, "images[0]")
    with pytest.raises(UserError, match="expected a base64 data URI"):
        ImageFinder(tmp_path).find("data:image/png,rawbytes", tmp_path, "line 1")
