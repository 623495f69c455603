"""Generated sample data: images of coloured shapes with captions (`sdflow_image.scenes`), a local HTTP server that
serves them (plus deliberately broken and slow URLs), and LAION-style parquet files that
point at it.

Tests, benchmarks and `sdflow demo` use this so that nothing is fetched from the internet:
the download job sees real HTTP, real 404s, real undecodable bytes and real timeouts."""

from __future__ import annotations

import io
import random
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from sdflow_image import scenes

TRAINING_SCENES = scenes.training_scenes()
FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg")}

# A slow URL must outlast any sensible per-URL timeout in a test, yet end on its own so a
# forgotten server never pins a thread for long.
MAX_SLOW_SECONDS = 10.0
CORRUPT_BODY = b"\xff\xd8\xff\xe0 this is not really a JPEG, the decoder must reject it\n"


class SampleDataError(ValueError):
    """An argument to the sample-data helpers is out of range."""


@dataclass(frozen=True)
class SampleImage:
    """One generated image, as the server serves it."""

    name: str  # file name under /images/, e.g. "img-00003.png"
    caption: str
    width: int
    height: int
    data: bytes
    content_type: str


@dataclass(frozen=True)
class SampleRow:
    """One row of a LAION-style parquet file: LAION's WIDTH and HEIGHT (the original image's size) and its scores,
    `punsafe` and `pwatermark` (probabilities), `aesthetic` (about 1 to 10) and `similarity` (CLIP's, image and
    caption); None is a null."""

    url: str
    caption: str
    width: int | None = None
    height: int | None = None
    punsafe: float | None = None
    pwatermark: float | None = None
    aesthetic: float | None = None
    similarity: float | None = None


# LAION's score columns, in its parquet files' order (after URL, TEXT, WIDTH, HEIGHT).
SCORE_COLUMNS = ("similarity", "punsafe", "pwatermark", "aesthetic")
# The share of rows with_laion_scores() makes LAION-unsafe (punsafe above 0.5): a few in a hundred, so that a demo's
# `max_punsafe` filter has rows to drop.
UNSAFE_SHARE = 0.05


def with_laion_scores(row: SampleRow, rnd: random.Random) -> SampleRow:
    """The row with plausible LAION scores: mostly safe (punsafe near 0, a few above 0.5), watermark probability
    skewed low, aesthetic around 5, CLIP ViT-B/32 similarity 0.28 to 0.40 (LAION-5B kept English pairs above
    0.28)."""
    unsafe = rnd.random() < UNSAFE_SHARE
    return replace(
        row,
        punsafe=round(rnd.uniform(0.55, 0.99) if unsafe else rnd.random() ** 4 * 0.3, 4),
        pwatermark=round(rnd.random() ** 3, 4),
        aesthetic=round(min(9.5, max(1.0, rnd.gauss(5.0, 0.8))), 3),
        similarity=round(rnd.uniform(0.28, 0.40), 4),
    )


@dataclass(frozen=True)
class LaionSample:
    """A parquet file written by `make_laion_parquet` and what a download of it should yield."""

    path: Path
    rows: tuple[SampleRow, ...]
    good: dict[str, str] = field(default_factory=dict)  # url -> caption, rows that must download
    missing_urls: tuple[str, ...] = ()
    corrupt_urls: tuple[str, ...] = ()
    slow_urls: tuple[str, ...] = ()

    @property
    def broken_urls(self) -> tuple[str, ...]:
        return self.missing_urls + self.corrupt_urls + self.slow_urls


def _draw(rnd: random.Random, width: int, height: int) -> tuple[Image.Image, str]:
    # Only scenes outside the held-out set: the prompt-adherence score asks for those, and a
    # model must compose them from what it was taught, never have seen them as captions.
    scene = rnd.choice(TRAINING_SCENES)
    return scenes.draw(scene, width, height, rnd), scene.caption


# Photo-like images: no real photograph can be fetched here, so these stand in for a user's own data
# where the scene grammar does not apply: a landscape (sky gradient, horizon, sun, textured ground,
# pixel noise as a camera adds) and a free-form caption in LAION's style, longer than the tiny CLIP's
# 16 tokens, as real captions often outrun CLIP's 77.
_SKIES = {"dawn": ((255, 170, 120), (120, 140, 200)), "noon": ((120, 180, 255), (200, 230, 255)),
          "dusk": ((60, 40, 110), (240, 120, 60)), "overcast": ((150, 150, 160), (200, 200, 205))}  # fmt: skip
_GROUNDS = {"meadow": (70, 140, 60), "desert": (210, 180, 110), "lake": (40, 90, 150), "snowfield": (235, 240, 245)}


def _mix(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> tuple[int, int, int]:
    return (round(a[0] + (b[0] - a[0]) * t), round(a[1] + (b[1] - a[1]) * t), round(a[2] + (b[2] - a[2]) * t))


def _draw_photo(rnd: random.Random, width: int, height: int) -> tuple[Image.Image, str]:
    # PIL only: this runs in the orchestration venv, which has no numpy.
    sky, ground = rnd.choice(sorted(_SKIES)), rnd.choice(sorted(_GROUNDS))
    top, bottom = _SKIES[sky]
    horizon = rnd.randint(height // 3, 2 * height // 3)
    image = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(image)
    for y in range(horizon):
        draw.line([(0, y), (width, y)], fill=_mix(top, bottom, y / max(1, horizon - 1)))
    sun = rnd.random() < 0.5
    if sun:
        cx, cy, r = rnd.randint(0, width - 1), rnd.randint(0, max(0, horizon - 1)), max(2, width // 10)
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(255, 240, 180))
    # Textured ground: seeded noise (Image.effect_noise is not: the images must repeat for a seed), tinted
    # with the ground's colour, over everything below the horizon.
    texture = Image.frombytes("L", (width, height - horizon), rnd.randbytes(width * (height - horizon))).convert("RGB")
    tint = Image.new("RGB", texture.size, _GROUNDS[ground])
    image.paste(Image.blend(tint, texture, 0.25), (0, horizon))
    article = "an" if sky[0] in "aeiou" else "a"
    caption = f"a wide landscape photo of a {ground} under {article} {sky} sky" + (
        ", the sun low and bright" if sun else ""
    )
    caption += rnd.choice(["", ", shot on film", ", high resolution stock photography, 4k wallpaper"])
    return image, caption


KINDS = {"scenes": _draw, "photos": _draw_photo}


def make_images(
    count: int,
    *,
    seed: int = 0,
    min_size: int = 64,
    max_size: int = 192,
    formats: Sequence[str] = ("png", "jpeg"),
    prefix: str = "img",
    kind: str = "scenes",
) -> list[SampleImage]:
    """`count` small images with a caption that describes them; deterministic for a given seed. `kind`:
    "scenes" (a coloured shape on a coloured background, the scene grammar) or "photos" (photo-like
    landscapes with free-form captions). Formats alternate over `formats`."""
    if count < 0:
        raise SampleDataError(f"count must be >= 0, got {count}")
    if not 8 <= min_size <= max_size:
        raise SampleDataError(f"need 8 <= min_size <= max_size, got min_size={min_size} max_size={max_size}")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise SampleDataError(f"formats must be a non-empty subset of {sorted(FORMATS)}, got {list(formats)}")
    if kind not in KINDS:
        raise SampleDataError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    draw = KINDS[kind]
    rnd = random.Random(seed)
    images = []
    for i in range(count):
        width, height = rnd.randint(min_size, max_size), rnd.randint(min_size, max_size)
        image, caption = draw(rnd, width, height)
        fmt = formats[i % len(formats)]
        pil_format, content_type = FORMATS[fmt]
        buffer = io.BytesIO()
        image.save(buffer, format=pil_format)
        ext = "jpg" if fmt == "jpeg" else fmt
        images.append(SampleImage(f"{prefix}-{i:05d}.{ext}", caption, width, height, buffer.getvalue(), content_type))
    return images


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0]
        app.count_hit(path)
        kind, _, name = path.lstrip("/").partition("/")
        if kind == "images" and name in app.images:
            image = app.images[name]
            self._send(HTTPStatus.OK, image.data, image.content_type)
        elif kind == "corrupt":
            self._send(HTTPStatus.OK, CORRUPT_BODY, "image/jpeg")
        elif kind == "slow":
            # Wakes early when the server stops, so stop() never waits on a sleeping thread.
            app.stopping.wait(app.slow_seconds)
            self._send(HTTPStatus.OK, app.slow_image.data, app.slow_image.content_type)
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout test): nothing left to tell it

    def log_message(self, format: str, *args: object) -> None:
        pass  # thousands of requests per benchmark: keep test output readable


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The default backlog of 5 drops the SYNs of a downloader opening dozens of connections
    # at once; the retransmit after 1 s then reads as a timeout on a perfectly good URL.
    request_queue_size = 1024
    app: ImageServer


class ImageServer:
    """A threaded HTTP server on 127.0.0.1 (ephemeral port) serving generated images.

    Paths: /images/<name> (a served SampleImage), /missing/<n>.jpg (404),
    /corrupt/<n>.jpg (200, image/jpeg, bytes no decoder accepts), /slow/<n>.jpg (a valid
    JPEG after `slow_seconds`). Use as a context manager or call start()/stop()."""

    def __init__(self, images: Iterable[SampleImage] = (), *, slow_seconds: float = 3.0) -> None:
        if not 0 <= slow_seconds <= MAX_SLOW_SECONDS:
            raise SampleDataError(f"slow_seconds must be within [0, {MAX_SLOW_SECONDS}], got {slow_seconds}")
        self.slow_seconds = slow_seconds
        self.images: dict[str, SampleImage] = {}
        self.slow_image = make_images(1, seed=12345, formats=("jpeg",), prefix="slow")[0]
        self.stopping = threading.Event()
        self.hits: Counter[str] = Counter()
        self._hits_lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.add(images)

    def add(self, images: Iterable[SampleImage]) -> None:
        """Serve more images under /images/<name> (a later image with the same name wins)."""
        for image in images:
            self.images[image.name] = image

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("ImageServer is not running: call start() or use it in a with block")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def url_for(self, name: str) -> str:
        return f"{self.base_url}/images/{name}"

    def missing_url(self, n: int = 0) -> str:
        return f"{self.base_url}/missing/{n}.jpg"

    def corrupt_url(self, n: int = 0) -> str:
        return f"{self.base_url}/corrupt/{n}.jpg"

    def slow_url(self, n: int = 0) -> str:
        return f"{self.base_url}/slow/{n}.jpg"

    def count_hit(self, path: str) -> None:
        with self._hits_lock:
            self.hits[path] += 1

    def start(self) -> ImageServer:
        if self._server is not None:
            return self
        self.stopping.clear()
        server = _Server(("127.0.0.1", 0), _Handler)
        server.app = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="sdflow-image-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> ImageServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def write_parquet(path: str | Path, rows: Iterable[SampleRow], url_col: str = "URL", caption_col: str = "TEXT") -> Path:
    """Write a LAION-style parquet (url, caption, WIDTH, HEIGHT and LAION's scores: similarity, punsafe,
    pwatermark, aesthetic); zero rows gives an empty file with the full schema."""
    if url_col == caption_col:
        raise SampleDataError(f"url_col and caption_col must differ, both are {url_col!r}")
    rows = list(rows)
    schema = pa.schema(
        [(url_col, pa.string()), (caption_col, pa.string()), ("WIDTH", pa.int64()), ("HEIGHT", pa.int64())]
        + [(name, pa.float64()) for name in SCORE_COLUMNS]
    )
    columns: dict[str, list[Any]] = {url_col: [r.url for r in rows], caption_col: [r.caption for r in rows]}
    columns |= {"WIDTH": [r.width for r in rows], "HEIGHT": [r.height for r in rows]}
    columns |= {name: [getattr(r, name) for r in rows] for name in SCORE_COLUMNS}
    table = pa.table(columns, schema=schema)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def make_laion_parquet(
    path: str | Path,
    server: ImageServer,
    *,
    good: int = 30,
    missing: int = 0,
    corrupt: int = 0,
    slow: int = 0,
    seed: int = 0,
    url_col: str = "URL",
    caption_col: str = "TEXT",
    formats: Sequence[str] = ("png", "jpeg"),
    min_size: int = 64,
    max_size: int = 192,
    kind: str = "scenes",
) -> LaionSample:
    """Generate `good` images (`kind`: make_images'), serve them from the running `server`, and write a
    parquet that lists them mixed (deterministically shuffled) with missing, corrupt and slow URLs, each row
    with plausible LAION scores (with_laion_scores)."""
    images = make_images(
        good, seed=seed, formats=formats, min_size=min_size, max_size=max_size, prefix=f"s{seed}", kind=kind
    )
    server.add(images)
    good_rows = [SampleRow(server.url_for(i.name), i.caption, i.width, i.height) for i in images]
    missing_urls = tuple(server.missing_url(n) for n in range(missing))
    corrupt_urls = tuple(server.corrupt_url(n) for n in range(corrupt))
    slow_urls = tuple(server.slow_url(n) for n in range(slow))
    bad_rows = [SampleRow(url, f"broken url {url}") for url in (*missing_urls, *corrupt_urls, *slow_urls)]
    # Scores from a stream of their own: the rows' order and images stay what they were before rows had scores.
    scores = random.Random(f"scores-{seed}")
    rows = [with_laion_scores(row, scores) for row in good_rows + bad_rows]
    good_rows = rows[: len(good_rows)]
    random.Random(seed).shuffle(rows)
    written = write_parquet(path, rows, url_col=url_col, caption_col=caption_col)
    return LaionSample(
        path=written,
        rows=tuple(rows),
        good={r.url: r.caption for r in good_rows},
        missing_urls=missing_urls,
        corrupt_urls=corrupt_urls,
        slow_urls=slow_urls,
    )
