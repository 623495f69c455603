"""The held-out split: membership by the URL's hash, the split of a finished tar, the download job
with --holdout_rate (uploads, _SUCCESS, a retry that resumes), and the training reader, which never
sees a held-out sample, across a save and resume of its position."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pyarrow.parquet as pq
import pytest
from data_fixtures import KeyTokenizer, tiny_jpeg
from download_fixtures import BUCKET, S3, captions_in_s3, job_args, read_tar

from sdflow.samples import ImageServer, LaionSample, make_laion_parquet
from sdflow_image.download import download, shard_upload
from sdflow_image.download.holdout_split import HoldoutSplitError, split_tar
from sdflow_image.holdout import holdout_fraction, is_held_out, sample_url
from sdflow_image.training.data import make_dataloader
from sdflow_image.training.data_source import KEYS_KEY, iter_samples

pytestmark = pytest.mark.image

RATE = 0.5  # 30 good URLs: both shards hold held-out samples but with a chance of 2**-13 at worst
GOOD, MISSING, CORRUPT, SLOW = 30, 2, 2, 2


# ------------------------------------------------------------------ membership


def test_holdout_fraction_is_first_eight_sha256_bytes_over_two_to_64() -> None:
    url = "http://127.0.0.1:8000/images/cat.jpg"
    digest = hashlib.sha256(url.encode("utf-8")).hexdigest()
    assert holdout_fraction(url) == int(digest[:16], 16) / 2**64
    assert (
        holdout_fraction("http://x/é.jpg")
        == int(hashlib.sha256("http://x/é.jpg".encode()).hexdigest()[:16], 16) / 2**64
    )


def test_is_held_out_rate_bounds_and_share_of_many_urls() -> None:
    urls = [f"http://host/{i}.jpg" for i in range(20_000)]
    assert not any(is_held_out(url, 0.0) for url in urls)
    assert all(is_held_out(url, 1.0) for url in urls)
    share = sum(is_held_out(url, 0.1) for url in urls) / len(urls)
    assert 0.09 < share < 0.11  # binomial sd 0.002: uniform, not clustered


# ------------------------------------------------------------------ splitting one tar


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


def img2dataset_tar(path: Path, samples: int, *, no_url: tuple[int, ...] = (), odd_json: tuple[int, ...] = ()) -> None:
    """A tar laid out as img2dataset's webdataset writer does: per sample jpg, json, txt (sorted)."""
    with tarfile.open(path, "w") as tar:
        for i in range(samples):
            key = f"{i:09d}"
            meta: Any = {"url": f"http://127.0.0.1:9/images/{i}.jpg", "key": key, "caption": f"c{i}"}
            if i in no_url:
                meta.pop("url")
            _add(tar, f"{key}.jpg", tiny_jpeg(i))
            _add(tar, f"{key}.json", b"[not an object" if i in odd_json else json.dumps(meta).encode())
            _add(tar, f"{key}.txt", f"c{i}".encode())


def members(path: Path) -> list[tuple[str, bytes]]:
    found = []
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            handle = tar.extractfile(member)
            assert handle is not None, member.name
            found.append((member.name, handle.read()))
    return found


def reader_keys(path: Path) -> list[str]:
    """The sample keys the training reader reads from the tar: a valid webdataset shard."""
    with path.open("rb") as stream:
        return [sample.key for sample in iter_samples(stream, 0, path.name)]


def test_split_tar_held_out_set_is_exactly_urls_below_rate(tmp_path: Path) -> None:
    img2dataset_tar(tmp_path / "00000.tar", 200, no_url=(3, 7), odd_json=(11,))
    original = members(tmp_path / "00000.tar")
    urls = {}
    for name, data in original:
        if name.endswith(".json"):
            urls[name[:9]] = sample_url(name[:9], data)
    assert urls["000000003"] == "000000003"  # no url: the key stands in
    assert urls["000000011"] == "000000011"  # .json not an object: the key stands in
    expected_held = {key for key, url in urls.items() if holdout_fraction(url) < 0.3}

    counts = split_tar(tmp_path / "00000.tar", tmp_path / "train.tar", tmp_path / "held.tar", 0.3)

    assert (counts.kept, counts.held_out) == (200 - len(expected_held), len(expected_held))
    assert 40 < len(expected_held) < 80
    assert set(reader_keys(tmp_path / "held.tar")) == expected_held
    assert set(reader_keys(tmp_path / "train.tar")) == set(urls) - expected_held
    # same member names, bytes and order: each part is the original with the other's samples taken out
    for part, keep in (("held.tar", True), ("train.tar", False)):
        assert members(tmp_path / part) == [(n, d) for n, d in original if (n[:9] in expected_held) == keep]


def test_split_tar_rate_one_holds_out_all_and_leaves_valid_empty_tar(tmp_path: Path) -> None:
    img2dataset_tar(tmp_path / "00000.tar", 5)
    counts = split_tar(tmp_path / "00000.tar", tmp_path / "train.tar", tmp_path / "held.tar", 1.0)
    assert (counts.kept, counts.held_out) == (0, 5)
    assert reader_keys(tmp_path / "train.tar") == []
    assert members(tmp_path / "held.tar") == members(tmp_path / "00000.tar")


def test_split_tar_not_a_tar_raises_naming_it(tmp_path: Path) -> None:
    (tmp_path / "00004.tar").write_bytes(b"x" * 1000)
    with pytest.raises(HoldoutSplitError, match=r"could not split 00004\.tar"):
        split_tar(tmp_path / "00004.tar", tmp_path / "t.tar", tmp_path / "h.tar", 0.5)


def test_download_holdout_rate_out_of_range_names_flag(tmp_path: Path) -> None:
    with pytest.raises(download.flags.FlagError, match=re.escape("--holdout_rate: '1.5' must be <= 1")):
        download.parse_args(job_args(tmp_path, f"s3://{BUCKET}/x/", tmp_path, "--holdout_rate", "1.5"))
    with pytest.raises(download.flags.FlagError, match=re.escape("--holdout_rate: '-0.1' must be >= 0")):
        download.parse_args(job_args(tmp_path, f"s3://{BUCKET}/x/", tmp_path, "--holdout_rate", "-0.1"))
    assert download.parse_args(job_args(tmp_path, f"s3://{BUCKET}/x/", tmp_path)).holdout_rate == 0.0


# ------------------------------------------------------------------ the uploader


STATS = {"count": 20, "successes": 20, "failed_to_download": 0, "failed_to_resize": 0}


def finished_shard(folder: Path, stem: str, samples: int = 20) -> None:
    folder.mkdir(exist_ok=True)
    img2dataset_tar(folder / f"{stem}.tar", samples)
    (folder / f"{stem}.parquet").write_bytes(b"parquet")
    (folder / f"{stem}_stats.json").write_text(json.dumps(STATS, indent=4))


def _recording(method: Any, written: list[str]) -> Any:
    def call(**kwargs: Any) -> Any:
        written.append(kwargs["Key"])
        return method(**kwargs)

    return call


def test_shard_uploader_holdout_rate_uploads_both_parts_before_stats(
    download_s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards, uri = tmp_path / "shards", download_s3.uri("sweep-holdout")
    finished_shard(shards, "00000")
    original = read_tar((shards / "00000.tar").read_bytes())
    expected_held = {key for key, m in original.items() if is_held_out(json.loads(m["json"])["url"], 0.5)}
    uploader = shard_upload.ShardUploader(shard_upload.S3Prefix.parse(uri), {"image_size": 64}, holdout_rate=0.5)
    written: list[str] = []
    # upload_file's transfers of these small files end in the client's own put_object too
    monkeypatch.setattr(uploader.client, "put_object", _recording(uploader.client.put_object, written))

    assert uploader.sweep(shards) == [0]

    names = ["00000.tar", "holdout/00000.tar", "00000.parquet", "00000_hashes.parquet", "00000_stats.json"]
    assert set(download_s3.names(uri)) == set(names)
    # the stats object, the shard's completion marker, is still the last one written
    assert [key.rpartition("00000/")[2] for key in written] == names
    hashed = pq.read_table(io.BytesIO(download_s3.read(uri, "00000_hashes.parquet"))).to_pylist()
    assert {row["key"] for row in hashed if row["split"] == "holdout"} == expected_held  # both parts hashed
    assert {row["key"] for row in hashed if row["split"] == "train"} == set(original) - expected_held
    assert set(read_tar(download_s3.read(uri, "holdout/00000.tar"))) == expected_held
    assert set(read_tar(download_s3.read(uri, "00000.tar"))) == set(original) - expected_held
    stats = json.loads(download_s3.read(uri, "00000_stats.json"))
    assert stats == {**STATS, "holdout_samples": len(expected_held)}
    # the disk keeps only the stats file (img2dataset's resume marker)
    assert sorted(str(p.relative_to(shards)) for p in shards.rglob("*") if p.is_file()) == ["00000_stats.json"]


def test_shard_uploader_resume_takes_shard_only_with_its_holdout_tar(download_s3: S3, tmp_path: Path) -> None:
    uri = download_s3.uri("resume-holdout")
    prefix = shard_upload.S3Prefix.parse(uri)
    options = {"image_size": 64, "holdout_rate": 0.5}
    digest = shard_upload.options_hash(options)
    for stem, held, with_holdout_tar in (("00000", 3, True), ("00001", 2, False), ("00002", 0, False)):
        names = [f"{stem}.tar", f"{stem}.parquet", f"{stem}_hashes.parquet"]
        names += [f"holdout/{stem}.tar"] if with_holdout_tar else []
        for name in names:
            download_s3.client.put_object(Bucket=BUCKET, Key=prefix.key(name), Body=b"x")
        body = json.dumps({**STATS, "holdout_samples": held}).encode()
        download_s3.client.put_object(
            Bucket=BUCKET, Key=prefix.key(f"{stem}_stats.json"), Body=body, Metadata={"sdflow-options": digest}
        )
    shards = tmp_path / "shards"
    shards.mkdir()
    uploader = shard_upload.ShardUploader(prefix, options, holdout_rate=0.5)
    # 00001 says it held 2 samples out, but its holdout tar never reached S3: redone
    assert uploader.resume(shards) == [0, 2]
    assert sorted(p.name for p in shards.iterdir()) == ["00000_stats.json", "00002_stats.json"]


# ------------------------------------------------------------------ the download job


@dataclass
class HoldoutRun:
    sample: LaionSample
    argv: list[str]
    output_uri: str
    status: int
    held_urls: set[str]  # the good URLs whose fraction is below RATE


@pytest.fixture(scope="module")
def holdout_run(image_server: ImageServer, download_s3: S3, tmp_path_factory: pytest.TempPathFactory) -> HoldoutRun:
    root = tmp_path_factory.mktemp("holdout-download")
    sample = make_laion_parquet(
        root / "input" / "part-00000.parquet",
        image_server,
        good=GOOD,
        missing=MISSING,
        corrupt=CORRUPT,
        slow=SLOW,
        seed=5,
    )
    output_uri = download_s3.uri("holdout")
    argv = job_args(root / "input", output_uri, root / "work", "--holdout_rate", str(RATE))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDFLOW_OPT_ML", str(root / "opt_ml"))
        status = download.main(download.parse_args(argv))
    held = {url for url in sample.good if is_held_out(url, RATE)}
    return HoldoutRun(sample, argv, output_uri, status, held)


@pytest.mark.slow
def test_download_holdout_rate_splits_each_shard_by_url(holdout_run: HoldoutRun, download_s3: S3) -> None:
    assert holdout_run.status == 0
    uri = holdout_run.output_uri
    assert 0 < len(holdout_run.held_urls) < GOOD
    held = captions_in_s3(download_s3, uri, "holdout/")
    kept = captions_in_s3(download_s3, uri)
    assert set(held) == holdout_run.held_urls
    assert set(kept) == set(holdout_run.sample.good) - holdout_run.held_urls
    assert held | kept == holdout_run.sample.good  # every good URL once, with its caption

    success = json.loads(download_s3.read(uri, "_SUCCESS"))
    assert success["holdout_rate"] == RATE
    assert success["samples"] == len(kept)  # the training samples only
    assert success["holdout_samples"] == len(held)
    assert success["failed"] == MISSING + CORRUPT + SLOW
    assert success["tar_files"] == ["00000.tar", "00001.tar"]
    listed = set(download_s3.names(uri))
    assert success["holdout_tar_files"] == sorted(n for n in listed if n.startswith("holdout/"))
    assert success["holdout_tar_files"]  # non-empty ones only, and at least one
    assert success["options"]["holdout_rate"] == RATE


@pytest.mark.slow
def test_download_holdout_tar_missing_retry_redoes_only_that_shard(
    holdout_run: HoldoutRun, image_server: ImageServer, download_s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job killed after a shard's tar but before its holdout tar left no complete shard: with
    _SUCCESS and one holdout tar gone, the retry redoes that shard alone and ends as before."""
    uri = holdout_run.output_uri
    before = json.loads(download_s3.read(uri, "_SUCCESS"))
    broken = before["holdout_tar_files"][-1]  # holdout/NNNNN.tar
    prefix = shard_upload.S3Prefix.parse(uri)
    for name in ("_SUCCESS", broken):
        download_s3.client.delete_object(Bucket=BUCKET, Key=prefix.key(name))
    hits = dict(image_server.hits)
    argv = [*holdout_run.argv[:5], str(tmp_path / "work"), *holdout_run.argv[6:]]  # a fresh volume

    monkeypatch.setenv("SDFLOW_OPT_ML", str(tmp_path / "opt_ml"))
    assert download.main(download.parse_args(argv)) == 0, (tmp_path / "opt_ml" / "output" / "failure").read_text()

    after = json.loads(download_s3.read(uri, "_SUCCESS"))
    assert after["resumed_shards"] == 1
    for key in ("samples", "holdout_samples", "tar_files", "holdout_tar_files", "failed"):
        assert after[key] == before[key], key
    redone = int(broken.removeprefix("holdout/").removesuffix(".tar"))
    rows = holdout_run.sample.rows[redone * 20 : (redone + 1) * 20]
    fetched = {path for path, count in image_server.hits.items() if count > hits.get(path, 0)}
    assert fetched == {urlsplit(row.url).path for row in rows}
    assert set(captions_in_s3(download_s3, uri, "holdout/")) == holdout_run.held_urls


# ------------------------------------------------------------------ the training reader


def _loader_args(index: str) -> SimpleNamespace:
    return SimpleNamespace(
        dataset_dir=f"s3://{BUCKET}/runs/", dataset_index=index, resolution=8, train_batch_size=3,
        dataloader_num_workers=0, interleave_shards=2, seed=0, center_crop=True, random_flip=False,
    )  # fmt: skip


def _draws(loader: Any, batches: int) -> list[str]:
    """The `<tar>#<key>` of every sample of the next `batches` batches."""
    iterator: Iterator[dict[str, Any]] = iter(loader)
    try:
        return [entry for _ in range(batches) for entry in json.loads(next(iterator)[KEYS_KEY])]
    finally:
        iterator.close()  # type: ignore[attr-defined]


@pytest.mark.slow
def test_training_loader_over_split_dataset_never_reads_held_out_across_resume(
    holdout_run: HoldoutRun, download_s3: S3
) -> None:
    """index.json as Build dataset index writes it (shards[*].tar_files from _SUCCESS); two epochs
    and more, stopped and resumed from the saved position: not one held-out URL, nothing skipped."""
    uri = holdout_run.output_uri
    success = json.loads(download_s3.read(uri, "_SUCCESS"))
    folder = shard_upload.S3Prefix.parse(uri).prefix.removeprefix("runs/")
    tar_files = [folder + name for name in success["tar_files"]]
    index = {"version": 1, "run_id": "holdout", "total_samples": success["samples"], "image_size": 64,
             "shards": [{"shard_id": "00000", "tar_files": tar_files, "samples": success["samples"]}],
             "failed_shards": []}  # fmt: skip
    index_key = "holdout/dataset/index.json"
    download_s3.client.put_object(Bucket=BUCKET, Key=f"runs/{index_key}", Body=json.dumps(index).encode())
    url_of = {}
    for name in success["tar_files"]:
        for key, files in read_tar(download_s3.read(uri, name)).items():
            url_of[f"{folder}{name}#{key}"] = json.loads(files["json"])["url"]
    args, batches, stop = _loader_args(index_key), 2 * success["samples"] // 3 + 2, 5

    straight = _draws(make_dataloader(args, KeyTokenizer(), rank=0, world_size=1), batches)
    loader = make_dataloader(args, KeyTokenizer(), rank=0, world_size=1)
    first = _draws(loader, stop)
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = _draws(make_dataloader(args, KeyTokenizer(), rank=0, world_size=1, state=state), batches - stop)

    assert first + resumed == straight  # exact resume, unchanged by the split
    urls = [url_of[entry] for entry in straight]
    assert not set(urls) & holdout_run.held_urls
    assert set(urls) == set(holdout_run.sample.good) - holdout_run.held_urls  # every training sample read
