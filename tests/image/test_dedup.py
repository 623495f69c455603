"""Global deduplication, the container side: the download job's per-sample hashes, and the dedup job
against moto's S3 on 127.0.0.1 (URL and image copies across shards, the keeper rule, the near-identical
pair that stays, unhashed shards, summary.json written last and never after a failure)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from data_fixtures import local_s3
from dedup_fixtures import found, plant, put_run, read_json
from PIL import Image

from sdflow_image import flags
from sdflow_image.dedup import job
from sdflow_image.download import hashes, shard_upload
from sdflow_image.download.hashes import url_hash

pytestmark = pytest.mark.image

BUCKET = "dedup-data"
TRAIN, HOLDOUT = "train", "holdout"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with local_s3() as client:
        client.create_bucket(Bucket=BUCKET)
        yield client


@pytest.fixture
def opt_ml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SDFLOW_OPT_ML", str(tmp_path / "opt_ml"))
    return tmp_path / "opt_ml"


def _run(s3: Any, run: str, tables: list[Any], tmp_path: Path, *, unhashed: tuple[int, ...] = ()) -> tuple[int, str]:
    manifest = put_run(s3, BUCKET, run, tables, unhashed=unhashed)
    output = f"s3://{BUCKET}/runs/{run}/dataset/dedup/"
    argv = ["--shards_manifest", manifest, "--output_uri", output, "--processes", "2", "--partitions", "3",
            "--work_dir", str(tmp_path / "work")]  # fmt: skip
    return job.main(job.parse_args(argv)), output


def _row(key: str, split: str, url: str, image: str) -> dict[str, Any]:
    return {"key": key, "split": split, "url_hash": url_hash(url), "image_hash": url_hash("image:" + image)}


# ------------------------------------------------------------------ the download job's hashes


def _jpeg(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")  # lossless: the decoded pixels are these
    return buffer.getvalue()


def _tar(path: Path, samples: list[tuple[str, bytes, dict[str, Any] | None]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, image, meta in samples:
            members = [(f"{key}.png", image), (f"{key}.txt", b"a caption")]
            members += [(f"{key}.json", json.dumps(meta).encode())] if meta is not None else []
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_shard_hashes_of_finished_tars_follow_the_contract(tmp_path: Path) -> None:
    a = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    b = a.copy()
    b[0, 0, 0] ^= 1
    _tar(tmp_path / "00000.tar", [("000000000", _jpeg(a), {"url": "  https://x.org/a.jpg\n"}),
                                  ("000000001", _jpeg(b), None),  # no .json: no URL to hash
                                  ("000000002", b"not an image", {"url": "https://x.org/c.jpg"})])  # fmt: skip
    _tar(tmp_path / "held.tar", [("000000003", _jpeg(a), {"url": "https://x.org/d.jpg"})])
    out = tmp_path / "00000_hashes.parquet"
    assert hashes.write_shard_hashes(tmp_path / "00000.tar", tmp_path / "held.tar", out) == 4
    table = pq.read_table(out)
    assert table.schema.field("url_hash").type == table.schema.field("image_hash").type
    assert str(table.schema.field("image_hash").type) == "fixed_size_binary[16]"
    rows = table.to_pylist()
    pixel_a = hashlib.sha256(b"7x5:RGB" + a.tobytes()).digest()[:16]
    assert [(r["key"], r["split"]) for r in rows] == [("000000000", TRAIN), ("000000001", TRAIN),
                                                       ("000000002", TRAIN), ("000000003", HOLDOUT)]  # fmt: skip
    assert rows[0]["url_hash"] == hashlib.sha256(b"https://x.org/a.jpg").digest()[:16]  # stripped
    assert rows[0]["image_hash"] == rows[3]["image_hash"] == pixel_a
    assert rows[1]["url_hash"] is None
    assert rows[1]["image_hash"] == hashlib.sha256(b"7x5:RGB" + b.tobytes()).digest()[:16] != pixel_a
    assert rows[2]["image_hash"] is None  # does not decode: never a duplicate of anything


def test_shard_uploader_retry_redoes_shards_without_hashes_and_merges_all(s3: Any, tmp_path: Path) -> None:
    uri = f"s3://{BUCKET}/runs/retry/dataset/shards/00000/"
    prefix = shard_upload.S3Prefix.parse(uri)
    stats = {"count": 1, "successes": 1, "failed_to_download": 0, "failed_to_resize": 0}
    shards = tmp_path / "shards"
    shards.mkdir()
    pixels = np.zeros((2, 2, 3), dtype=np.uint8)
    for stem in ("00000", "00001"):
        _tar(shards / f"{stem}.tar", [(f"{stem}0000", _jpeg(pixels), {"url": f"https://x.org/{stem}"})])
        (shards / f"{stem}.parquet").write_bytes(b"parquet")
        (shards / f"{stem}_stats.json").write_text(json.dumps(stats))
    first = shard_upload.ShardUploader(prefix, {"image_size": 64})
    assert first.sweep(shards) == [0, 1]
    s3.delete_object(Bucket=BUCKET, Key=prefix.key("00001_hashes.parquet"))  # as if made before hashes existed
    retry = shard_upload.ShardUploader(prefix, {"image_size": 64})
    assert retry.resume(tmp_path / "shards") == [0]
    assert retry.put_hashes(["00000"]) == {"hashes_file": "hashes.parquet", "hashed_samples": 1}
    merged = pq.read_table(io.BytesIO(s3.get_object(Bucket=BUCKET, Key=prefix.key("hashes.parquet"))["Body"].read()))
    assert merged.to_pylist()[0]["url_hash"] == url_hash("https://x.org/00000")


# ------------------------------------------------------------------ the dedup job


def test_dedup_job_finds_planted_copies_across_shards_and_keeps_near_identical_pair(
    s3: Any, tmp_path: Path, opt_ml: Path
) -> None:
    tables, planted = plant(shards=12, rows=30, dup_rate=0.3, seed=4)
    status, output = _run(s3, "planted", tables, tmp_path)
    assert status == 0, (opt_ml / "output" / "failure").read_text()
    summary = read_json(s3, output + "summary.json")
    dropped, files = found(s3, output, summary)
    assert dropped == planted.url | planted.image
    assert not dropped & planted.stays  # the one-pixel-apart pair, and the held-out sample
    assert (summary["url_duplicates"], summary["image_duplicates"]) == (len(planted.url), len(planted.image))
    assert summary["hashed_samples"] == sum(len(t) for t in tables)
    per_shard = summary["shards"]
    assert sum(s["url_duplicates"] + s["image_duplicates"] for s in per_shard.values()) == len(dropped)
    assert files == len({shard for shard, _ in dropped})
    assert per_shard["00000"]["dropped_file"] == "dropped/00000.json"
    assert (summary["version"], summary["partitions"], summary["unhashed_shards"]) == (1, 3, [])
    assert summary["peak_rss_mb"] > 0
    assert summary["duration_s"] > 0
    assert not (tmp_path / "work").exists()


def test_dedup_keeper_is_holdout_then_earlier_shard_then_smaller_key(s3: Any, tmp_path: Path, opt_ml: Path) -> None:
    tables = [
        [_row("a1", TRAIN, "u/held", "i1"), _row("a2", TRAIN, "u/a2", "i/shared"), _row("a3", TRAIN, "u/a3", "i3")],
        [_row("b1", HOLDOUT, "u/held", "i/b1"), _row("b2", TRAIN, "u/b2", "i/shared"), _row("b0", TRAIN, "u/a3", "ix")],
        [_row("c2", TRAIN, "u/c", "i/c2"), _row("c1", TRAIN, "u/c", "i/c1"), _row("c3", HOLDOUT, "u/c3", "i/c1")],
    ]  # fmt: skip
    status, output = _run(s3, "keepers", tables, tmp_path)
    assert status == 0, (opt_ml / "output" / "failure").read_text()
    summary = read_json(s3, output + "summary.json")
    dropped, _ = found(s3, output, summary)
    assert dropped == {
        ("00000", "a1"),  # a held-out sample's URL: the held-out copy wins, though in a later shard
        ("00001", "b2"),  # the image of a2, in an earlier shard
        ("00001", "b0"),  # the URL of a3 (smaller key, but a later shard)
        ("00002", "c2"),  # the URL of c1: same shard, the smaller key wins
        ("00002", "c1"),  # kept by URL, but the image of held-out c3
    }
    shards = summary["shards"]
    assert (shards["00002"]["url_duplicates"], shards["00002"]["image_duplicates"]) == (1, 1)


def test_dedup_copy_by_url_and_image_counts_once_as_url(s3: Any, tmp_path: Path, opt_ml: Path) -> None:
    tables = [[_row("a", TRAIN, "u/same", "i/same")], [_row("b", TRAIN, "u/same", "i/same")]]
    status, output = _run(s3, "both", tables, tmp_path)
    assert status == 0
    summary = read_json(s3, output + "summary.json")
    assert (summary["url_duplicates"], summary["image_duplicates"]) == (1, 0)
    assert read_json(s3, output + "dropped/00001.json") == {"shard_id": "00001", "keys": ["b"]}
    assert summary["shards"]["00000"] == {"url_duplicates": 0, "image_duplicates": 0, "dropped_file": None}


def test_dedup_unhashed_shards_listed_and_unfinished_ignored(s3: Any, tmp_path: Path, opt_ml: Path) -> None:
    row = _row("k", TRAIN, "u/one", "i/one")
    status, output = _run(s3, "older", [[row], [dict(row, key="k2")], None, [dict(row, key="k3")]], tmp_path,
                          unhashed=(1,))  # fmt: skip
    assert status == 0
    summary = read_json(s3, output + "summary.json")
    assert summary["unhashed_shards"] == ["00001"]
    assert set(summary["shards"]) == {"00000", "00003"}  # 00002 has no _SUCCESS: not in the run's data
    assert summary["hashed_samples"] == 2
    assert read_json(s3, output + "dropped/00003.json")["keys"] == ["k3"]


def test_dedup_failing_midway_writes_failure_and_no_summary(s3: Any, tmp_path: Path, opt_ml: Path) -> None:
    manifest = put_run(s3, BUCKET, "broken", [[_row("a", TRAIN, "u", "i")], [_row("b", TRAIN, "u", "i")]])
    s3.put_object(Bucket=BUCKET, Key="runs/broken/dataset/shards/00001/hashes.parquet", Body=b"not parquet")
    output = f"s3://{BUCKET}/runs/broken/dataset/dedup/"
    argv = ["--shards_manifest", manifest, "--output_uri", output, "--processes", "2", "--work_dir", str(tmp_path)]
    assert job.main(job.parse_args(argv)) == 1
    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith("BadHashes: ")
    assert "shards/00001/hashes.parquet is not a readable parquet" in failure
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/broken/dataset/dedup/").get("KeyCount") == 0


def test_dedup_missing_manifest_fails_naming_flag(s3: Any, tmp_path: Path, opt_ml: Path) -> None:
    argv = ["--shards_manifest", f"s3://{BUCKET}/runs/none/shards.json", "--output_uri", f"s3://{BUCKET}/o/",
            "--work_dir", str(tmp_path)]  # fmt: skip
    assert job.main(job.parse_args(argv)) == 1
    assert (
        "--shards_manifest s3://dedup-data/runs/none/shards.json does not exist"
        in (opt_ml / "output" / "failure").read_text()
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--output_uri", "s3://b/o/"], "--shards_manifest"),
        (["--shards_manifest", "s3://b/s.json", "--output_uri", "s3://b/o/", "--partitions", "0"], "must be >= 1"),
        (["--shards_manifest", "shards.json", "--output_uri", "s3://b/o/"], "is not an S3 object URI"),
    ],
)
def test_dedup_bad_flag_error_names_it(argv: list[str], message: str) -> None:
    with pytest.raises(flags.FlagError, match=message):
        job.parse_args(argv)
