"""The run document's `dataset.filters`: bounds on a LAION-style parquet's own columns, applied by each download
job before img2dataset sees a row, so a row filtered out is never fetched, stored or trained on.

The filter names (`min_width` … `max_caption_length`) are the names everywhere: the download job's `--filters`,
the `filter_drops` counts of its `_SUCCESS` and the dataset index. Their order here is the order the job applies
them in: a row several filters drop counts once, under the first (docs/contracts.md, "The download job").
The column each filter reads is configurable (`columns`, LAION's names by default); the caption length filters
read `dataset.caption_column`. Validate run checks every named column is in every parquet and of a fitting
type (dataset_files)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, field_validator, model_validator

from sdflow_common.training_options import FieldRefusal
from sdflow_common.training_options import StrictOptions as _Strict

# The order the download job applies the filters in; a row's drop counts under the first that fails.
FILTER_NAMES = (
    "min_width",
    "min_height",
    "max_aspect_ratio",
    "max_punsafe",
    "max_pwatermark",
    "min_aesthetic",
    "min_similarity",
    "min_caption_length",
    "max_caption_length",
)
CAPTION_FILTERS = ("min_caption_length", "max_caption_length")
# The `columns` entries each numeric filter reads (caption filters read dataset.caption_column).
FILTER_COLUMNS: dict[str, tuple[str, ...]] = {
    "min_width": ("width",),
    "min_height": ("height",),
    "max_aspect_ratio": ("width", "height"),
    "max_punsafe": ("punsafe",),
    "max_pwatermark": ("pwatermark",),
    "min_aesthetic": ("aesthetic",),
    "min_similarity": ("similarity",),
}
# A column name's length bound: each filter travels to the download job as one ContainerArguments item
# (SageMaker: at most 256 characters), and the longest, max_aspect_ratio's, names two columns. LAION's
# names are at most 10 characters.
COLUMN_NAME_LIMIT = 80


def _column(default: str, what: str) -> Any:
    return Field(default=default, min_length=1, max_length=COLUMN_NAME_LIMIT, description=f"Column holding {what}.")


class FilterColumns(_Strict):
    """The columns the filters read; LAION's names by default."""

    width: str = _column("WIDTH", "the original image's width in pixels (`min_width`, `max_aspect_ratio`)")
    height: str = _column("HEIGHT", "the original image's height in pixels (`min_height`, `max_aspect_ratio`)")
    punsafe: str = _column("punsafe", "the probability that the image is unsafe, 0 to 1 (`max_punsafe`)")
    pwatermark: str = _column(
        "pwatermark", "the probability that the image carries a watermark, 0 to 1 (`max_pwatermark`)"
    )
    aesthetic: str = _column("aesthetic", "the image's aesthetic score, about 1 to 10 in LAION (`min_aesthetic`)")
    similarity: str = _column("similarity", "the CLIP similarity of image and caption, -1 to 1 (`min_similarity`)")


class DatasetFilters(_Strict):
    """Rows kept only when every bound set holds; a row with no value (null or NaN) in a filtered column is dropped
    by that filter. Unset bounds (`null`) are not applied."""

    min_width: int | None = Field(
        default=None, strict=True, ge=1, description="Keep rows whose image is at least this wide (pixels)."
    )
    min_height: int | None = Field(
        default=None, strict=True, ge=1, description="Keep rows whose image is at least this high (pixels)."
    )
    max_aspect_ratio: float | None = Field(
        default=None,
        strict=True,
        allow_inf_nan=False,
        description=(
            "Keep rows whose aspect ratio, the longer side over the shorter (`max(w, h) / min(w, h)`, so 2 keeps 1:2 "
            "and 2:1), is at most this; 1 keeps square images only. A row with a side of 0 is dropped."
        ),
    )
    max_punsafe: float | None = Field(
        default=None,
        strict=True,
        ge=0,
        le=1,
        description="Keep rows whose `punsafe` (LAION's NSFW probability) is at most this.",
    )
    max_pwatermark: float | None = Field(
        default=None,
        strict=True,
        ge=0,
        le=1,
        description="Keep rows whose `pwatermark` (LAION's watermark probability) is at most this.",
    )
    min_aesthetic: float | None = Field(
        default=None,
        strict=True,
        allow_inf_nan=False,
        description=(
            "Keep rows whose aesthetic score is at least this (LAION-Aesthetics V2's subsets: 4.5, 5, 6, 6.25, 6.5)."
        ),
    )
    min_similarity: float | None = Field(
        default=None,
        strict=True,
        ge=-1,
        le=1,
        description="Keep rows whose CLIP image-caption similarity is at least this (LAION-5B was cut at 0.28 for "
        "English with ViT-B/32).",
    )
    min_caption_length: int | None = Field(
        default=None,
        strict=True,
        ge=0,
        description="Keep rows whose caption (`dataset.caption_column`) has at least this many characters.",
    )
    max_caption_length: int | None = Field(
        default=None, strict=True, ge=0, description="Keep rows whose caption has at most this many characters."
    )
    columns: FilterColumns = Field(default_factory=FilterColumns, description="The columns the filters read.")

    @field_validator("max_aspect_ratio")
    @classmethod
    def _ratio_at_least_one(cls, ratio: float | None) -> float | None:
        if ratio is not None and ratio < 1:
            raise ValueError(
                f"is {ratio:g}, but the longer side over the shorter is never below 1; set it to 1 or more "
                "(1 keeps square images only, 2 keeps up to 1:2 and 2:1)"
            )
        return ratio

    @model_validator(mode="after")
    def _bounds_make_sense(self) -> DatasetFilters:
        low, high = self.min_caption_length, self.max_caption_length
        if low is not None and high is not None and low > high:
            raise FieldRefusal(
                "min_caption_length",
                f"min_caption_length={low} is more than max_caption_length={high}: no caption fits, every row would "
                f"be dropped; lower min_caption_length or raise max_caption_length",
            )
        if not self.bounds():
            raise ValueError(
                f"sets no bound, so it filters nothing; set at least one of {', '.join(FILTER_NAMES)}, or remove "
                "dataset.filters"
            )
        return self

    def bounds(self) -> dict[str, int | float]:
        """The bounds that are set, in the order the download job applies them."""
        values = {name: getattr(self, name) for name in FILTER_NAMES}
        return {name: value for name, value in values.items() if value is not None}

    def columns_of(self, name: str, caption_column: str) -> tuple[str, ...]:
        """The parquet columns filter `name` reads."""
        if name in CAPTION_FILTERS:
            return (caption_column,)
        return tuple(getattr(self.columns, entry) for entry in FILTER_COLUMNS[name])

    def column_fields(self, name: str) -> tuple[str, ...]:
        """The run document fields that name filter `name`'s columns, in columns_of's order."""
        if name in CAPTION_FILTERS:
            return ("dataset.caption_column",)
        return tuple(f"dataset.filters.columns.{entry}" for entry in FILTER_COLUMNS[name])

    def job_arguments(self, caption_column: str) -> list[str]:
        """The download job's `--filters` values: one JSON object per bound set, `{name: {"columns": [...],
        "bound": value}}`, so that each stays within a ContainerArguments item's 256 characters."""
        return [
            json.dumps(
                {name: {"columns": list(self.columns_of(name, caption_column)), "bound": bound}},
                separators=(",", ":"),
                ensure_ascii=False,
            )
            for name, bound in self.bounds().items()
        ]


def filter_arguments(filters: DatasetFilters | None, caption_column: str) -> list[str]:
    """The download job's `--filters` values (DatasetFilters.job_arguments); none without filters."""
    return [] if filters is None else filters.job_arguments(caption_column)
