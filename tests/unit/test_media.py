"""Images from URLs under the media policy (pagedllm/multimodal/media.py, media_http.py): data
URLs, remote fetches from allowed hosts only (a local http.server in a thread), file:// under
the allowed folder, and decoding limits. No model needed."""

from __future__ import annotations

import base64
import http.server
import io
import os
import struct
import threading
import time
import zlib

import pytest
from PIL import Image

from pagedllm.config import EngineConfig
from pagedllm.multimodal.media import MediaPolicy, decode_image, load_image_url


def _png(size=(4, 3), color=(10, 200, 30), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height (8-bit RGB) and holds one tiny IDAT: a few dozen bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00"))
            + chunk(b"IEND", b""))


POLICY = MediaPolicy()


# ---------------------------------------------------------------- data URLs and decoding


@pytest.mark.parametrize("fmt,media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                            ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_data_url_formats(fmt, media_type):
    buf = io.BytesIO()
    Image.new("RGB", (16, 8), (250, 0, 0)).save(buf, format=fmt)
    img = load_image_url(_data_url(buf.getvalue(), media_type), POLICY)
    assert img.mode == "RGB" and img.size == (16, 8)
    r, g, b = img.getpixel((3, 3))
    assert r > 200 and g < 40 and b < 40


def test_png_pixels_exact_and_alpha_over_white():
    img = load_image_url(_data_url(_png(color=(10, 200, 30))), POLICY)
    assert img.getpixel((0, 0)) == (10, 200, 30)
    transparent = load_image_url(_data_url(_png(mode="RGBA", color=(0, 0, 0, 0))), POLICY)
    assert transparent.mode == "RGB" and transparent.getpixel((1, 1)) == (255, 255, 255)
    gray = load_image_url(_data_url(_png(mode="L", color=77)), POLICY)
    assert gray.mode == "RGB" and gray.getpixel((0, 0)) == (77, 77, 77)


def test_exif_orientation_applied():
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.new("RGB", (20, 10), (0, 0, 255)).save(buf, format="JPEG", exif=exif)
    assert load_image_url(_data_url(buf.getvalue(), "image/jpeg"), POLICY).size == (10, 20)


def test_data_url_line_breaks_tolerated():
    b64 = base64.encodebytes(_png((40, 40))).decode()  # 76-column lines
    assert "\n" in b64
    assert load_image_url(f"data:image/png;base64,{b64}", POLICY).size == (40, 40)


def test_undecodable_bytes():
    with pytest.raises(ValueError, match="could not be decoded as an image"):
        load_image_url(_data_url(b"definitely not an image" * 10), POLICY)
    truncated = _png((64, 64))[:60]
    with pytest.raises(ValueError, match="could not be decoded"):
        load_image_url(_data_url(truncated), POLICY)
    with pytest.raises(ValueError, match="empty"):
        decode_image(b"", POLICY)


def test_unsupported_format_named():
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PPM")
    with pytest.raises(ValueError, match="image format PPM is not supported; supported: PNG, JPEG"):
        load_image_url(_data_url(buf.getvalue()), POLICY)


@pytest.mark.parametrize("url,message", [
    ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain'"),
    ("data:image/png,rawbytes", "only base64 data URLs"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64", "needs a ','"),
    ("ftp://example.com/a.png", "unsupported scheme 'ftp'"),
    ("just-a-name.png", "unsupported scheme '(none)'"),
    ("", "non-empty `url`"),
])
def test_bad_urls(url, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_image_url(url, POLICY)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pixel_bomb_refused_before_decoding():
    bomb = _png_header(100_000, 100_000)
    assert len(bomb) < 100
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"10000000000 pixels, more than the limit "
                                         r"of 16777216 \(--max-image-pixels"):
        load_image_url(_data_url(bomb), POLICY)
    assert time.perf_counter() - t0 < 1.0
    # under PIL's own cap (2 x 89478485), over ours: our check, from the header
    medium = _png_header(10_000, 10_000)
    with pytest.raises(ValueError, match=r"10000x10000 = 100000000 pixels, more than the limit "
                                         r"of 16777216 \(--max-image-pixels\)"):
        load_image_url(_data_url(medium), POLICY)
    # above PIL's cap with a raised --max-image-pixels: still a ValueError naming the flag
    with pytest.raises(ValueError, match="10000000000 pixels.*--max-image-pixels; PIL refuses"):
        decode_image(bomb, MediaPolicy(max_image_pixels=10**12))
    assert time.perf_counter() - t0 < 1.0
    # our cap below the image's size, the image otherwise fine
    with pytest.raises(ValueError, match="4x3 = 12 pixels, more than the limit of 11"):
        decode_image(_png(), MediaPolicy(max_image_pixels=11))


def test_too_many_bytes_in_data_url():
    data = _png((64, 64))
    small = MediaPolicy(max_image_bytes=len(data) - 1)
    with pytest.raises(ValueError, match=r"larger than \d+ bytes \(--max-image-bytes\)"):
        load_image_url(_data_url(data), small)
    assert load_image_url(_data_url(data), MediaPolicy(max_image_bytes=len(data))).size == (64, 64)


def test_policy_from_config(tmp_path):
    config = EngineConfig(allowed_media_domains=["Example.COM."], allowed_local_media_path=str(tmp_path),
                          media_fetch_timeout=2, max_image_bytes=123, max_image_pixels=456)
    policy = MediaPolicy.from_config(config)
    assert policy.allowed_media_domains == frozenset({"example.com"})
    assert policy.allowed_local_media_path == os.path.realpath(tmp_path)
    assert (policy.fetch_timeout_s, policy.max_image_bytes, policy.max_image_pixels) == (2.0, 123, 456)
    default = MediaPolicy.from_config(EngineConfig())
    assert default == MediaPolicy()  # the knobs' defaults are the policy's


@pytest.mark.parametrize("kwargs,message", [
    ({"allowed_local_media_path": "/no/such/folder"}, "not an existing folder"),
    ({"allowed_media_domains": ["http://a.com/"]}, "host names"),
    ({"allowed_media_domains": [""]}, "list of host names"),
    ({"media_fetch_timeout": 0}, "media_fetch_timeout must be a positive"),
    ({"max_image_bytes": 0}, "max_image_bytes must be a positive integer"),
    ({"max_image_pixels": 1.5}, "max_image_pixels must be a positive integer"),
])
def test_media_knobs_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


# ---------------------------------------------------------------- file:// URLs


def test_file_urls(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(_png((5, 6)))
    outside = tmp_path / "secret.png"
    outside.write_bytes(_png((7, 7)))
    (root / "link.png").symlink_to(outside)
    policy = MediaPolicy(allowed_local_media_path=os.path.realpath(root))

    assert load_image_url(f"file://{root}/a.png", policy).size == (5, 6)
    assert load_image_url(f"file://localhost{root}/a.png", policy).size == (5, 6)
    with pytest.raises(ValueError, match="outside the allowed local media path"):
        load_image_url(f"file://{outside}", policy)
    with pytest.raises(ValueError, match="outside the allowed local media path"):
        load_image_url(f"file://{root}/../secret.png", policy)
    with pytest.raises(ValueError, match="outside the allowed local media path"):
        load_image_url(f"file://{root}/link.png", policy)  # a symlink out is resolved first
    with pytest.raises(ValueError, match="outside the allowed local media path"):
        load_image_url(f"file://{root}%2F..%2Fsecret.png", policy)  # encoded ..
    with pytest.raises(ValueError, match="cannot open the file"):
        load_image_url(f"file://{root}/missing.png", policy)
    with pytest.raises(ValueError, match="not a host"):
        load_image_url(f"file://example.com{root}/a.png", policy)
    with pytest.raises(ValueError, match="not a regular file"):
        load_image_url(f"file://{root}", policy)
    with pytest.raises(ValueError, match="--max-image-bytes"):
        load_image_url(f"file://{root}/a.png", MediaPolicy(allowed_local_media_path=str(root),
                                                           max_image_bytes=10))


def test_file_urls_refused_by_default(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    with pytest.raises(ValueError, match="file:// URLs are refused.*--allowed-local-media-path"):
        load_image_url(f"file://{tmp_path}/a.png", MediaPolicy())


def test_fifo_is_not_read(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    policy = MediaPolicy(allowed_local_media_path=os.path.realpath(tmp_path))
    with pytest.raises(ValueError, match="not a regular file"):
        load_image_url(f"file://{tmp_path}/pipe.png", policy)  # returns at once: O_NONBLOCK


# ---------------------------------------------------------------- http(s) URLs


PNG = _png((9, 4))


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        port = self.server.server_address[1]
        path = self.path
        if path == "/img.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif path == "/slow.png":
            time.sleep(1.5)
            self._send(200, PNG)
        elif path == "/dribble.png":  # headers at once, then a byte every 0.1 s
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        elif path == "/huge-declared.png":
            self._send(200, b"", {"Content-Length": str(10**9)})
        elif path == "/huge-streamed.png":  # no length: read until the cap, then dropped
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"\0" * 4096)
            except (BrokenPipeError, ConnectionResetError):
                pass
        elif path == "/redirect-same":
            self._send(302, b"", {"Location": "/img.png"})
        elif path == "/redirect-other":
            self._send(302, b"", {"Location": f"http://localhost:{port}/img.png"})
        elif path == "/redirect-loop":
            self._send(302, b"", {"Location": "/redirect-loop"})
        elif path == "/redirect-file":
            self._send(302, b"", {"Location": "file:///etc/passwd"})
        else:
            self._send(404, b"no")


@pytest.fixture(scope="module")
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


ALLOW_LOCAL = MediaPolicy(allowed_media_domains=frozenset({"127.0.0.1"}), fetch_timeout_s=0.5)


def test_remote_refused_by_default(http_server):
    with pytest.raises(ValueError, match="remote images are refused.*--allowed-media-domains"):
        load_image_url(f"{http_server}/img.png", MediaPolicy())
    other = MediaPolicy(allowed_media_domains=frozenset({"example.com"}))
    with pytest.raises(ValueError, match="host '127.0.0.1' is not in --allowed-media-domains"):
        load_image_url(f"{http_server}/img.png", other)
    # userinfo cannot disguise the host that is contacted
    with pytest.raises(ValueError, match="host '127.0.0.1' is not in"):
        load_image_url(f"http://example.com@{http_server[7:]}/img.png", other)


def test_allowed_domain_fetched(http_server):
    img = load_image_url(f"{http_server}/img.png", ALLOW_LOCAL)
    assert img.size == (9, 4) and img.mode == "RGB"
    assert load_image_url(f"{http_server}/redirect-same", ALLOW_LOCAL).size == (9, 4)


def test_slow_server_times_out(http_server):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"slow\.png'.*within 0.5 s \(--media-fetch-timeout\)"):
        load_image_url(f"{http_server}/slow.png", ALLOW_LOCAL)
    assert time.perf_counter() - t0 < 1.4
    with pytest.raises(ValueError, match="--media-fetch-timeout"):  # one deadline for the body
        load_image_url(f"{http_server}/dribble.png", ALLOW_LOCAL)
    assert time.perf_counter() - t0 < 3.0


def test_redirect_off_the_allow_list_refused(http_server):
    with pytest.raises(ValueError, match="redirected from .*host 'localhost' is not in "
                                         "--allowed-media-domains"):
        load_image_url(f"{http_server}/redirect-other", ALLOW_LOCAL)
    with pytest.raises(ValueError, match="only http\\(s\\) URLs are fetched"):
        load_image_url(f"{http_server}/redirect-file", ALLOW_LOCAL)
    with pytest.raises(ValueError, match="more than 5 redirects"):
        load_image_url(f"{http_server}/redirect-loop", ALLOW_LOCAL)


def test_remote_byte_cap(http_server):
    small = MediaPolicy(allowed_media_domains=frozenset({"127.0.0.1"}), max_image_bytes=10_000)
    with pytest.raises(ValueError, match=r"larger than 10000 bytes \(--max-image-bytes\)"):
        load_image_url(f"{http_server}/huge-declared.png", small)
    with pytest.raises(ValueError, match=r"larger than 10000 bytes \(--max-image-bytes\)"):
        load_image_url(f"{http_server}/huge-streamed.png", small)


def test_http_error_status(http_server):
    with pytest.raises(ValueError, match="answered HTTP 404"):
        load_image_url(f"{http_server}/missing.png", ALLOW_LOCAL)


def test_unreachable_host():
    policy = MediaPolicy(allowed_media_domains=frozenset({"127.0.0.1"}), fetch_timeout_s=2)
    with pytest.raises(ValueError, match="could not fetch it"):
        load_image_url("http://127.0.0.1:9/img.png", policy)  # discard port: refused
