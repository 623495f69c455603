"""Prompt adherence without a downloaded model: does a generated image show the colours (and
the shape) its prompt asks for?

Prompts follow the scene grammar (`sdflow_image.scenes`). An image is read the way the scenes
are drawn: the border ring is background, the centre is foreground (every drawn shape covers
the centre and leaves a margin), and the shape comes from how much of its bounding box the
foreground fills (square ~1, circle ~pi/4, triangle ~1/2). Colours are the nearest palette
colour to a median, so blur and a little colour drift do not change the reading.

The headline score is the mean over prompts of the share of the two colours read right: a
model that ignores its prompt scores about 1/8 (eight colours), one that follows it 1.0. Shape
accuracy is reported beside it (chance 1/3).

`compare` is the one evaluation of a trained model against its base: the training job's
end-of-training score (--eval_adherence) and the `evaluate` processing job both call it."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from sdflow_image import scenes

GRID_FILE = "adherence.png"

# Fill ratio of the foreground's bounding box, between the ideal shapes' 1, pi/4 and 1/2.
SQUARE_MIN_FILL = 0.89
CIRCLE_MIN_FILL = 0.64


@dataclass(frozen=True)
class Reading:
    """What an image shows, in the grammar's words."""

    foreground: str
    background: str
    shape: str | None  # None: no foreground region to measure


@dataclass
class AdherenceReport:
    score: float
    foreground_accuracy: float
    background_accuracy: float
    shape_accuracy: float
    prompts: int
    results: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self, *, with_results: bool = True) -> dict[str, Any]:
        data = asdict(self)
        if not with_results:
            data.pop("results")
        return data


_PALETTE_NAMES = list(scenes.COLORS)
_PALETTE = np.array([scenes.COLORS[name] for name in _PALETTE_NAMES], dtype=np.float32)


def nearest_colour(rgb: np.ndarray) -> str:
    return _PALETTE_NAMES[int(np.argmin(((_PALETTE - rgb) ** 2).sum(axis=1)))]


def _shape(pixels: np.ndarray, foreground: str, background: str) -> str | None:
    fg, bg = np.array(scenes.COLORS[foreground], np.float32), np.array(scenes.COLORS[background], np.float32)
    mask = ((pixels - fg) ** 2).sum(axis=2) < ((pixels - bg) ** 2).sum(axis=2)
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if rows.size < 2 or cols.size < 2:
        return None
    box = mask[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    fill = float(box.mean())
    if fill >= SQUARE_MIN_FILL:
        return "square"
    return "circle" if fill >= CIRCLE_MIN_FILL else "triangle"


def read_image(image: Image.Image) -> Reading:
    """The foreground and background colours and the shape an image shows."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    height, width = pixels.shape[:2]
    ring = max(1, min(height, width) // 16)
    border = np.concatenate(
        [
            pixels[:ring].reshape(-1, 3),
            pixels[-ring:].reshape(-1, 3),
            pixels[:, :ring].reshape(-1, 3),
            pixels[:, -ring:].reshape(-1, 3),
        ]
    )
    centre = pixels[3 * height // 8 : 5 * height // 8 + 1, 3 * width // 8 : 5 * width // 8 + 1].reshape(-1, 3)
    background = nearest_colour(np.median(border, axis=0))
    foreground = nearest_colour(np.median(centre, axis=0))
    shape = _shape(pixels, foreground, background) if foreground != background else None
    return Reading(foreground, background, shape)


def score_images(images: Sequence[Image.Image], prompts: Sequence[str]) -> AdherenceReport:
    """Score each image against its prompt; raises scenes.PromptGrammarError for a prompt the
    grammar cannot read, and ValueError when the counts differ."""
    if len(images) != len(prompts) or not prompts:
        raise ValueError(f"need one image per prompt and at least one prompt, got {len(images)} and {len(prompts)}")
    results: list[dict[str, Any]] = []
    for image, prompt in zip(images, prompts, strict=True):
        wanted, seen = scenes.parse_prompt(prompt), read_image(image)
        results.append(
            {
                "prompt": prompt,
                "foreground": seen.foreground,
                "background": seen.background,
                "shape": seen.shape,
                "foreground_ok": seen.foreground == wanted.foreground,
                "background_ok": seen.background == wanted.background,
                "shape_ok": seen.shape == wanted.shape,
            }
        )
    count = len(results)

    def share(key: str) -> float:
        return sum(r[key] for r in results) / count

    fg, bg = share("foreground_ok"), share("background_ok")
    return AdherenceReport(
        score=(fg + bg) / 2,
        foreground_accuracy=fg,
        background_accuracy=bg,
        shape_accuracy=share("shape_ok"),
        prompts=count,
        results=results,
    )


def default_prompts() -> list[str]:
    """The held-out prompts: scenes the demo's data never shows as captions."""
    return [scene.caption for scene in scenes.heldout_scenes()]


def render(
    pipe: Any,
    prompts: Sequence[str],
    *,
    resolution: int,
    num_inference_steps: int = 20,
    guidance_scale: float = 5.0,
    seed: int = 0,
    batch_size: int = 16,
    keep: Callable[[int, Image.Image], Image.Image] | None = None,
) -> list[Image.Image]:
    """One image per prompt, each from its own seeded generator (the same prompt and seed give
    the same image whatever the batch), with the pipeline's own scheduler. `keep(i, image)` shapes
    prompt i's image as soon as it is drawn (the evaluation shrinks all but its grid's rows)."""
    import torch

    from sdflow_image import families

    images: list[Image.Image] = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        generators = [torch.Generator(device="cpu").manual_seed(seed + start + i) for i in range(len(chunk))]
        with torch.no_grad():
            out = pipe(
                **families.call_kwargs(pipe, chunk, None, guidance_scale),
                height=resolution,
                width=resolution,
                num_inference_steps=num_inference_steps,
                generator=generators,
                output_type="pil",
            )
        images.extend(out.images if keep is None else [keep(start + i, im) for i, im in enumerate(out.images)])
    return images


def make_grid(rows: Sequence[Sequence[Image.Image]], *, cell: int = 64, columns: int = 8) -> Image.Image:
    """Rows of images (e.g. base, trained) as one picture: each prompt's images side by side,
    `columns` prompts per line, small images scaled up without smoothing so they stay legible."""
    if not rows or not rows[0]:
        raise ValueError("make_grid needs at least one image")
    per_prompt = len(rows)
    count = len(rows[0])
    lines = (count + columns - 1) // columns
    gap = 4
    width = columns * (per_prompt * cell + gap)
    grid = Image.new("RGB", (width, lines * (cell + gap)), (255, 255, 255))
    for index in range(count):
        x0 = (index % columns) * (per_prompt * cell + gap)
        y0 = (index // columns) * (cell + gap)
        for k, row in enumerate(rows):
            grid.paste(row[index].convert("RGB").resize((cell, cell), Image.Resampling.NEAREST), (x0 + k * cell, y0))
    return grid


@dataclass
class Comparison:
    """A trained model and its base scored on the same prompts, with the images they drew."""

    base: AdherenceReport
    trained: AdherenceReport
    base_images: list[Image.Image]
    trained_images: list[Image.Image]

    def summary_line(self) -> str:
        return (
            f"prompt adherence: base {self.base.score:.2f} → trained {self.trained.score:.2f} "
            f"({self.trained.prompts} prompts)"
        )


def load_pipeline(
    model_dir: str | Path, device: Any, base_model_dir: str | Path | None = None, dtype: str = "float32"
) -> Any:
    """The model loaded as the serving container loads it (nothing from a hub, no safety checker,
    no progress bars; a LoRA adapter on `base_model_dir`), on `device`, in float32 by default so
    that scores do not depend on the precision ("auto": the endpoint's, serve_model.serving_dtype)."""
    from sdflow_image.serving.serve_model import ServeSettings
    from sdflow_image.serving.serve_model import load_pipeline as load_served

    settings = ServeSettings(model_dir=Path(model_dir), device=str(device), dtype=dtype)
    if base_model_dir is not None:
        settings = replace(settings, base_model_dir=Path(base_model_dir))
    return load_served(settings)


def render_with(
    load: Callable[[], Any],
    prompt_lists: Sequence[Sequence[str]],
    keeps: Sequence[Callable[[int, Image.Image], Image.Image] | None] | None = None,
    **options: Any,
) -> list[list[Image.Image]]:
    """Load one model, render each list of prompts (each list's prompt i from seed + i; `keeps`: each
    list's `render(keep=)`), free the model: the evaluation renders its held-out captions and its scene
    prompts in one load."""
    pipe = load()
    keeps = list(keeps) if keeps is not None else [None] * len(prompt_lists)
    images = [
        render(pipe, prompts, keep=keep, **options) if prompts else []
        for prompts, keep in zip(prompt_lists, keeps, strict=True)
    ]
    # Drop this model before the next one loads, so a GPU holds one model's weights at a time.
    del pipe
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return images


def compare_images(
    trained_images: list[Image.Image], base_images: list[Image.Image], prompts: Sequence[str], *, out_dir: str | Path
) -> Comparison:
    """Score both models' renders of the prompts; save the grid (each prompt: base | trained) as
    `out_dir/GRID_FILE`; print the scores as the metric lines SageMaker's metric definitions read."""
    result = Comparison(
        base=score_images(base_images, prompts),
        trained=score_images(trained_images, prompts),
        base_images=base_images,
        trained_images=trained_images,
    )
    make_grid([base_images, trained_images]).save(Path(out_dir) / GRID_FILE)
    print(f"eval:base_prompt_adherence={result.base.score:.6f}", flush=True)
    print(f"eval:prompt_adherence={result.trained.score:.6f}", flush=True)
    print(result.summary_line(), flush=True)
    return result


def compare(
    load_trained: Callable[[], Any],
    load_base: Callable[[], Any],
    prompts: Sequence[str],
    *,
    out_dir: str | Path,
    resolution: int,
    num_inference_steps: int = 20,
    guidance_scale: float = 5.0,
    seed: int = 0,
) -> Comparison:
    """Render the prompts with the trained model, then with the base (each loader is called when
    its turn comes, so loaders that read from disk keep one model in memory at a time); score
    both; save the grid (each prompt: base | trained) as `out_dir/GRID_FILE`; print the scores as
    the metric lines SageMaker's metric definitions read. Raises scenes.PromptGrammarError
    before anything is rendered when a prompt is outside the grammar."""
    for prompt in prompts:
        scenes.parse_prompt(prompt)
    options: dict[str, Any] = {
        "resolution": resolution,
        "num_inference_steps": num_inference_steps,
        "guidance_scale": guidance_scale,
        "seed": seed,
    }
    (trained_images,) = render_with(load_trained, [prompts], **options)
    (base_images,) = render_with(load_base, [prompts], **options)
    return compare_images(trained_images, base_images, prompts, out_dir=out_dir)
