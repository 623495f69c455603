"""Simple scenes: one coloured shape on a coloured background, and the captions that describe them.

One grammar serves three places: the demo's generated dataset draws scenes and captions them,
the tiny model's tokenizer learns its merges from the captions, and the prompt-adherence score
(`sdflow_image.evaluation.adherence`) parses a prompt back into the scene it asks for. A fixed set of scenes
is held out of the demo's training captions, so the score measures whether a model composes
colours and shapes it was taught separately, not whether it memorised captions.

Pure Python and Pillow: the orchestration side imports it too (no torch)."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass

from PIL import Image, ImageDraw

# Far apart in RGB, so the nearest palette colour of a generated pixel is unambiguous.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 220, 40),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
    "orange": (250, 140, 20),
    "purple": (140, 50, 180),
}
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
HELDOUT_COUNT = 48
HELDOUT_SEED = 0

_PROMPT = re.compile(r"^an? (?P<fg>[a-z]+) (?P<shape>[a-z]+) on an? (?P<bg>[a-z]+) background$")
GRAMMAR = "a <colour> <shape> on a <colour> background"


class PromptGrammarError(ValueError):
    """A prompt the adherence score cannot read: it does not follow GRAMMAR with known words."""


@dataclass(frozen=True, order=True)
class Scene:
    foreground: str
    shape: str
    background: str

    @property
    def caption(self) -> str:
        return f"a {self.foreground} {self.shape} on a {self.background} background"


def _known(word: str, allowed: Iterable[str], what: str, prompt: str) -> None:
    words = list(allowed)
    if word not in words:
        raise PromptGrammarError(f"prompt {prompt!r}: unknown {what} {word!r}; use one of {', '.join(words)}")


def parse_prompt(prompt: str) -> Scene:
    """The scene a prompt asks for; raises PromptGrammarError naming the prompt and the fix."""
    match = _PROMPT.match(" ".join(prompt.lower().split()))
    if match is None:
        raise PromptGrammarError(f"prompt {prompt!r} does not follow the grammar {GRAMMAR!r}")
    fg, shape, bg = match["fg"], match["shape"], match["bg"]
    _known(fg, COLORS, "colour", prompt)
    _known(shape, SHAPES, "shape", prompt)
    _known(bg, COLORS, "colour", prompt)
    if fg == bg:
        raise PromptGrammarError(f"prompt {prompt!r}: the shape and the background have the same colour {fg!r}")
    return Scene(fg, shape, bg)


def all_scenes() -> list[Scene]:
    """Every scene of the grammar: 8 foregrounds x 7 backgrounds x 3 shapes = 168."""
    return [Scene(fg, shape, bg) for fg in COLORS for bg in COLORS if fg != bg for shape in SHAPES]


def heldout_scenes(count: int = HELDOUT_COUNT, seed: int = HELDOUT_SEED) -> list[Scene]:
    """A fixed sample of scenes kept out of the demo's training captions, balanced so that every
    colour appears as a foreground and as a background and every shape appears: the score's
    chance level does not depend on which colours happened to be picked."""
    scenes = all_scenes()
    if not 0 < count < len(scenes):
        raise ValueError(f"count must be within 1..{len(scenes) - 1}, got {count}")
    rnd = random.Random(seed)
    rnd.shuffle(scenes)
    # Round-robin over (foreground, shape) so each foreground and each shape is equally represented.
    by_key: dict[tuple[str, str], list[Scene]] = {}
    for scene in scenes:
        by_key.setdefault((scene.foreground, scene.shape), []).append(scene)
    keys = sorted(by_key, key=lambda k: (list(COLORS).index(k[0]), SHAPES.index(k[1])))
    rnd.shuffle(keys)
    chosen: list[Scene] = []
    while len(chosen) < count:
        for key in keys:
            if by_key[key] and len(chosen) < count:
                chosen.append(by_key[key].pop())
    return sorted(chosen)


def training_scenes(heldout: list[Scene] | None = None) -> list[Scene]:
    """Every scene that is not held out."""
    excluded = set(heldout_scenes() if heldout is None else heldout)
    return [scene for scene in all_scenes() if scene not in excluded]


def shape_box(width: int, height: int, rnd: random.Random) -> tuple[int, int, int, int]:
    """The shape's bounding box: it covers the middle three quarters of the image and leaves a
    margin of at least 1/16 on every side, so the centre pixels are foreground and the border
    pixels background, whatever the randomness."""
    left, top = rnd.randint(width // 16, width // 8), rnd.randint(height // 16, height // 8)
    right = rnd.randint(7 * width // 8 - 1, width - 1 - width // 16)
    bottom = rnd.randint(7 * height // 8 - 1, height - 1 - height // 16)
    return left, top, right, bottom


def draw(scene: Scene, width: int, height: int, rnd: random.Random) -> Image.Image:
    """The scene as an RGB image; the shape's exact box comes from `rnd`."""
    image = Image.new("RGB", (width, height), COLORS[scene.background])
    pen = ImageDraw.Draw(image)
    left, top, right, bottom = shape_box(width, height, rnd)
    fill = COLORS[scene.foreground]
    if scene.shape == "square":
        pen.rectangle((left, top, right, bottom), fill=fill)
    elif scene.shape == "circle":
        pen.ellipse((left, top, right, bottom), fill=fill)
    else:
        pen.polygon([((left + right) // 2, top), (right, bottom), (left, bottom)], fill=fill)
    return image
