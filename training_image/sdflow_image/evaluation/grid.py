"""holdout.png: for a sample of held-out captions, the real image beside what the base and the
trained model drew for its caption, the caption written beside them, a header row naming the
columns. Small images are scaled up without smoothing, so a 32-pixel render stays legible."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from PIL import Image, ImageDraw

HOLDOUT_GRID_FILE = "holdout.png"
MAX_ROWS = 16
COLUMNS = ("held-out", "base", "trained")
CELL = 128
GAP = 4
HEADER = 20
CAPTION_WIDTH = 320
CAPTION_CHARS = 48  # characters per line of PIL's default font at CAPTION_WIDTH
CAPTION_LINES = 8
LINE_HEIGHT = 14
WHITE, BLACK = (255, 255, 255), (0, 0, 0)


def _cell(image: Image.Image) -> Image.Image:
    image = image.convert("RGB")
    smaller = image.width <= CELL and image.height <= CELL
    return image.resize((CELL, CELL), Image.Resampling.NEAREST if smaller else Image.Resampling.BILINEAR)


def holdout_grid(
    real: Sequence[Image.Image], base: Sequence[Image.Image], trained: Sequence[Image.Image], captions: Sequence[str]
) -> Image.Image:
    """The first MAX_ROWS samples, one row each: real | base | trained | caption."""
    if not (len(real) == len(base) == len(trained) == len(captions)) or not captions:
        raise ValueError(
            f"need one real, base and trained image per caption, got {len(real)}, {len(base)}, "
            f"{len(trained)} for {len(captions)} captions"
        )
    rows = min(MAX_ROWS, len(captions))
    width = len(COLUMNS) * (CELL + GAP) + CAPTION_WIDTH
    grid = Image.new("RGB", (width, HEADER + rows * (CELL + GAP)), WHITE)
    draw = ImageDraw.Draw(grid)
    for column, name in enumerate((*COLUMNS, "caption")):
        draw.text((column * (CELL + GAP) + 4, 4), name, fill=BLACK)
    for row in range(rows):
        y = HEADER + row * (CELL + GAP)
        for column, images in enumerate((real, base, trained)):
            grid.paste(_cell(images[row]), (column * (CELL + GAP), y))
        lines = textwrap.wrap(captions[row], CAPTION_CHARS)
        if len(lines) > CAPTION_LINES:
            lines = [*lines[: CAPTION_LINES - 1], lines[CAPTION_LINES - 1][: CAPTION_CHARS - 1] + "…"]
        for number, line in enumerate(lines):
            draw.text((len(COLUMNS) * (CELL + GAP) + 4, y + 4 + number * LINE_HEIGHT), line, fill=BLACK)
    return grid
