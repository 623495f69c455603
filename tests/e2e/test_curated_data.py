"""Curated data through the local cloud (issue 33): the demo's filters drop rows before download, the
dedup job finds a URL and an image duplicated across shards and keeps a near-identical pair, and the
notification and the dataset index say what was kept and why."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from sdflow import samples
from sdflow.demo import DemoOptions, prepare_inputs, run_pipeline
from sdflow.local.cloud import LocalCloud
from tests.constants import TIME_SCALE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OPTIONS = DemoOptions(
    shards=2,
    images_per_shard=12,
    instance_count=1,
    max_train_steps=2,
    vae_steps=0,
    min_prompt_adherence=None,
    eval_inference_steps=2,
    eval_in_training=False,
    clip_steps=None,
)


@pytest.fixture
def image_server() -> Iterator[samples.ImageServer]:
    with samples.ImageServer() as server:
        yield server


def _one_pixel_changed(image: samples.SampleImage, name: str) -> samples.SampleImage:
    """The same picture with one pixel turned to its opposite: a distinct image that must stay."""
    picture = Image.open(io.BytesIO(image.data)).convert("RGB")
    red, green, blue = picture.getpixel((0, 0))
    picture.putpixel((0, 0), (255 - red, 255 - green, 255 - blue))
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return replace(image, name=name, data=out.getvalue(), content_type="image/png")


def _plant_duplicates(server: samples.ImageServer, inputs: Path) -> None:
    """Shard 1 gains a copy of one of shard 0's URLs, shard 0's next image under a new URL, and a
    near-identical copy of a third image under another URL (all rows kept by the demo's filters)."""
    first = pq.read_table(inputs / "part-00000.parquet").to_pylist()
    kept = [row for row in first if (row["punsafe"] or 0) <= 0.5 and (row["pwatermark"] or 0) <= 0.9]
    served = [row for row in kept if "/images/" in row["URL"]]
    same_url, same_image, near = served[0], served[1], served[2]
    image = server.images[same_image["URL"].rsplit("/", 1)[1]]
    server.add([replace(image, name="copy-" + image.name)])
    near_image = server.images[near["URL"].rsplit("/", 1)[1]]
    server.add([_one_pixel_changed(near_image, "near-" + near_image.name + ".png")])
    second = pq.read_table(inputs / "part-00001.parquet")
    rows = [
        *second.to_pylist(),
        dict(same_url),
        {**same_image, "URL": server.url_for("copy-" + image.name)},
        {**near, "URL": server.url_for("near-" + near_image.name + ".png")},
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=second.schema), inputs / "part-00001.parquet")


def test_curated_run_filters_deduplicates_across_shards_and_reports_the_counts(
    tmp_path: Path, image_server: samples.ImageServer
) -> None:
    with LocalCloud(tmp_path, port=0, time_scale=TIME_SCALE) as cloud:
        s3 = cloud.client("s3")
        prepare_inputs(s3, cloud.bucket, tmp_path, image_server, OPTIONS)
        _plant_duplicates(image_server, tmp_path / "inputs")
        s3.upload_file(
            str(tmp_path / "inputs" / "part-00001.parquet"), cloud.bucket, "datasets/demo/part-00001.parquet"
        )

        result = run_pipeline(cloud, tmp_path, OPTIONS)

        assert result["progress"].status == "SUCCEEDED"
        [message] = cloud.sns_messages()
        text = message["message"]
        assert re.search(r"→ 2 duplicates \([\d.]+%\): 1 url, 1 image", text), text
        assert re.search(r"→ \d+ filtered \([\d.]+%\): .*by max_punsafe=0\.5", text), text
        execution = result["execution_arn"].rsplit(":", 1)[1]
        index = json.loads(
            s3.get_object(Bucket=cloud.bucket, Key=f"runs/{execution}/dataset/index.json")["Body"].read()
        )
        curation = index["curation"]
        assert (curation["url_duplicates"], curation["image_duplicates"]) == (1, 1)
        assert curation["kept"] == index["total_samples"]
        assert re.search(rf"→ {index['total_samples']:,} kept for training", text), text
        [dropped_shard] = [shard for shard in index["shards"] if shard.get("dropped_file")]
        dropped = json.loads(
            s3.get_object(Bucket=cloud.bucket, Key="runs/" + dropped_shard["dropped_file"])["Body"].read()
        )
        assert len(dropped["keys"]) == 2  # both copies in shard 1; the near-identical image stays
