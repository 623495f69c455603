"""The download job against a local HTTP server and moto's S3 on 127.0.0.1: real HTTP, real
404s, undecodable bytes and URLs slower than the timeout; shards uploaded as they finish, stats,
_SUCCESS, resume from S3, idempotence, SIGTERM, the deadline and the input checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from download_fixtures import BUCKET, S3, captions_in_s3, job_args

from sdflow.samples import ImageServer, LaionSample, SampleRow, make_images, make_laion_parquet, write_parquet
from sdflow_image.download import download, shard_upload

pytestmark = pytest.mark.image

REPO_ROOT = Path(__file__).resolve().parents[2]
GOOD, MISSING, CORRUPT, SLOW = 30, 2, 2, 2
SHARD_NAMES = {f"0000{n}{suffix}" for n in (0, 1) for suffix in (".tar", ".parquet", "_hashes.parquet", "_stats.json")}
FINISHED = {"hashes.parquet", "_SUCCESS"}  # the shards' hashes merged (the dedup job's input), then the marker


@dataclass
class Run:
    sample: LaionSample
    output_uri: str
    work: Path
    opt_ml: Path
    status: int
    seconds: float


@pytest.fixture(scope="module")
def finished_run(image_server: ImageServer, download_s3: S3, tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("download")
    sample = make_laion_parquet(
        root / "input" / "part-00000.parquet", image_server, good=GOOD, missing=MISSING, corrupt=CORRUPT, slow=SLOW
    )
    output_uri = download_s3.uri("finished")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDFLOW_OPT_ML", str(root / "opt_ml"))
        started = time.monotonic()
        status = download.main(download.parse_args(job_args(root / "input", output_uri, root / "work")))
        seconds = time.monotonic() - started
    return Run(sample, output_uri, root / "work", root / "opt_ml", status, seconds)


@pytest.mark.slow
def test_download_mixed_urls_writes_shards_with_captions_to_s3(finished_run: Run, download_s3: S3) -> None:
    assert finished_run.status == 0
    assert set(download_s3.names(finished_run.output_uri)) == SHARD_NAMES | FINISHED
    # every good URL is there once with its own caption; no broken or slow URL slipped in
    assert captions_in_s3(download_s3, finished_run.output_uri) == finished_run.sample.good


@pytest.mark.slow
def test_download_success_marker_totals_match_stats_and_good_count(finished_run: Run, download_s3: S3) -> None:
    success = json.loads(download_s3.read(finished_run.output_uri, "_SUCCESS"))
    stats = [json.loads(download_s3.read(finished_run.output_uri, f"0000{n}_stats.json")) for n in (0, 1)]
    assert success["samples"] == sum(s["successes"] for s in stats) == GOOD
    assert success["failed"] == MISSING + CORRUPT + SLOW
    assert success["failed_to_download"] == MISSING + SLOW  # 404s and timeouts
    assert success["failed_to_resize"] == CORRUPT  # undecodable bytes
    assert success["tar_files"] == ["00000.tar", "00001.tar"]
    assert (success["url_col"], success["caption_col"], success["image_size"]) == ("URL", "TEXT", 64)
    # No --filters: every row read is a row to download.
    rows = GOOD + MISSING + CORRUPT + SLOW
    assert (success["rows_read"], success["filter_drops"], success["rows_to_download"]) == (rows, {}, rows)
    assert success["options"]["samples_per_shard"] == 20
    # no held-out rate: nothing split, and the shards' options hash is the one from before the split
    assert (success["holdout_rate"], success["holdout_samples"], success["holdout_tar_files"]) == (0.0, 0, [])
    assert "holdout_rate" not in success["options"]
    assert not any("holdout_samples" in s for s in stats)
    assert success["resumed_shards"] == 0
    assert (success["hashes_file"], success["hashed_samples"]) == ("hashes.parquet", GOOD)
    # one img2dataset process: the shard it writes, and at most one finished shard awaiting upload
    assert 1 <= success["peak_local_tars"] <= 2
    assert success["duration_s"] > 0
    # the work folder is gone and the processing job's ExitMessage reports the totals
    assert not finished_run.work.exists()
    assert f"{GOOD} samples" in (finished_run.opt_ml / "output" / "message").read_text()
    assert not (finished_run.opt_ml / "output" / "failure").exists()


@pytest.mark.slow
def test_download_prefix_with_success_marker_rerun_is_noop(
    finished_run: Run, image_server: ImageServer, download_s3: S3, opt_ml: Path, tmp_path: Path
) -> None:
    before = {
        name: (item["ETag"], item["LastModified"]) for name, item in download_s3.names(finished_run.output_uri).items()
    }
    hits_before = sum(image_server.hits.values())
    started = time.monotonic()
    argv = job_args(finished_run.sample.path, finished_run.output_uri, tmp_path / "work")
    assert download.main(download.parse_args(argv)) == 0
    assert time.monotonic() - started < 2.0
    after = {
        name: (item["ETag"], item["LastModified"]) for name, item in download_s3.names(finished_run.output_uri).items()
    }
    assert after == before
    assert sum(image_server.hits.values()) == hits_before  # not a single URL fetched again
    assert "already complete" in (opt_ml / "output" / "message").read_text()


# --- shards reach S3 as they finish; a retry resumes -----------------------------------------


@dataclass
class Interrupted:
    keys_at_stop: set[str]
    partial_tar_bytes: int  # size of the unfinished shard's local tar when the job was stopped
    status: int
    exit_message: str


def stop_after_first_shard(download_s3: S3, uri: str, work: Path, run: Any) -> Interrupted:
    """Run the job; once shard 00000 is complete in S3 while 00001 is being written locally,
    send this process SIGTERM, as SageMaker does to stop a job."""
    seen: dict[str, Any] = {}

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            names = set(download_s3.names(uri))
            partial = work / "img2dataset" / "00001.tar"
            if "00000_stats.json" in names and partial.exists():
                seen["keys"], seen["partial"] = names, partial.stat().st_size
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    status = run()
    watcher.join(timeout=5)
    assert "keys" in seen, "shard 00000 never reached S3 while the job ran"
    # A stop is not a failure (as the training job's): no failure file, the exit message says it.
    assert not (Path(os.environ["SDFLOW_OPT_ML"]) / "output" / "failure").exists()
    message = (Path(os.environ["SDFLOW_OPT_ML"]) / "output" / "message").read_text()
    return Interrupted(seen["keys"], seen["partial"], status, message)


@pytest.mark.slow
def test_download_stopped_job_retry_resumes_from_s3_with_same_set(
    download_s3: S3, tmp_path: Path, opt_ml: Path
) -> None:
    # Shard 00000: 20 fast images. Shard 00001: 5 fast images and one URL that takes 10 s, so
    # the job is still writing 00001.tar when 00000 must already be in S3.
    with ImageServer(slow_seconds=10.0) as server:
        images = make_images(25, seed=3, formats=("jpeg",), prefix="resume")
        server.add(images)
        rows = [SampleRow(server.url_for(i.name), i.caption, i.width, i.height) for i in images]
        rows.insert(20, SampleRow(server.slow_url(0), "the slow one"))
        parquet = write_parquet(tmp_path / "in" / "part.parquet", rows)
        uri, work = download_s3.uri("resumed"), tmp_path / "work"
        argv = [*job_args(parquet, uri, work), "--url_timeout", "30", "--deadline_seconds", "60"]

        stopped = stop_after_first_shard(download_s3, uri, work, lambda: download.main(download.parse_args(argv)))
        assert stopped.status == 128 + signal.SIGTERM
        assert stopped.exit_message.startswith("stopped by signal 15 (SageMaker stops jobs with SIGTERM); the shards")
        # shard 00000 was in S3 before the job ended; the unfinished 00001.tar never got there
        assert stopped.keys_at_stop == {"00000.tar", "00000.parquet", "00000_hashes.parquet", "00000_stats.json"}
        assert set(download_s3.names(uri)) == stopped.keys_at_stop
        first_shard_hits = {f"/images/{i.name}": server.hits[f"/images/{i.name}"] for i in images[:20]}
        assert all(count == 1 for count in first_shard_hits.values())

        server.slow_seconds = 0.0  # the retry meets a network that behaves
        status = download.main(download.parse_args(argv))

    assert status == 0, (opt_ml / "output" / "failure").read_text()
    # the retry fetched none of shard 00000's URLs again, only shard 00001's
    assert {path: server.hits[path] for path in first_shard_hits} == first_shard_hits
    assert all(server.hits[f"/images/{i.name}"] == 2 for i in images[20:])
    assert set(download_s3.names(uri)) == SHARD_NAMES | FINISHED
    success = json.loads(download_s3.read(uri, "_SUCCESS"))
    assert success["resumed_shards"] == 1
    assert success["hashed_samples"] == 26  # the skipped shard's hashes, taken from S3, included
    assert success["samples"] == 26
    assert success["failed"] == 0
    assert success["tar_files"] == ["00000.tar", "00001.tar"]
    assert set(captions_in_s3(download_s3, uri)) == {row.url for row in rows}


def test_shard_uploader_incomplete_stats_uploads_nothing(download_s3: S3, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    tarfile.open(shards / "00000.tar", "w").close()  # finished, with no sample
    (shards / "00000.parquet").write_bytes(b"parquet")
    stats = {"count": 3, "successes": 2, "failed_to_download": 1, "failed_to_resize": 0}
    full = json.dumps(stats, indent=4)
    (shards / "00000_stats.json").write_text(full[: len(full) // 2])  # img2dataset mid-write
    uri = download_s3.uri("sweep")
    uploader = shard_upload.ShardUploader(shard_upload.S3Prefix.parse(uri), {"image_size": 64})
    assert uploader.sweep(shards) == []
    assert download_s3.names(uri) == {}
    (shards / "00000_stats.json").write_text(full)
    assert uploader.sweep(shards) == [0]
    assert set(download_s3.names(uri)) == {"00000.tar", "00000.parquet", "00000_hashes.parquet", "00000_stats.json"}
    assert download_s3.read(uri, "00000.tar") == bytes(10240)  # an empty tar: its two end blocks, padded
    # the disk keeps only the stats file, which img2dataset needs to skip the shard
    assert sorted(p.name for p in shards.iterdir()) == ["00000_stats.json"]
    assert uploader.sweep(shards) == []  # uploaded once


def test_shard_uploader_resume_skips_incomplete_and_foreign_shards(download_s3: S3, tmp_path: Path) -> None:
    uri = download_s3.uri("resume-rules")
    prefix = shard_upload.S3Prefix.parse(uri)
    stats = json.dumps({"count": 1, "successes": 1, "failed_to_download": 0, "failed_to_resize": 0})
    ours = shard_upload.options_hash({"image_size": 64})
    theirs = shard_upload.options_hash({"image_size": 128})
    for stem, parts, digest in (
        ("00000", (".tar", ".parquet", "_hashes.parquet", "_stats.json"), ours),  # complete: taken
        ("00001", (".parquet", "_hashes.parquet", "_stats.json"), ours),  # no tar: an attempt died mid-shard
        ("00002", (".tar", ".parquet", "_hashes.parquet", "_stats.json"), theirs),  # other options
        ("00003", (".tar", ".parquet", "_stats.json"), ours),  # no hashes: made before them, redone
    ):
        for suffix in parts:
            download_s3.client.put_object(
                Bucket=BUCKET, Key=prefix.key(stem + suffix), Body=stats.encode(), Metadata={"sdflow-options": digest}
            )
    shards = tmp_path / "shards"
    shards.mkdir()
    uploader = shard_upload.ShardUploader(prefix, {"image_size": 64})
    assert uploader.resume(shards) == [0]
    assert [p.name for p in shards.iterdir()] == ["00000_stats.json"]
    assert uploader.uploaded == {0}


def test_download_missing_bucket_fails_naming_output_uri(
    image_server: ImageServer, download_s3: S3, tmp_path: Path, opt_ml: Path
) -> None:
    sample = make_laion_parquet(tmp_path / "in.parquet", image_server, good=2, seed=11)
    hits_before = sum(image_server.hits.values())
    argv = job_args(sample.path, "s3://no-such-bucket/runs/x/", tmp_path / "work")
    assert download.main(download.parse_args(argv)) == 1
    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith("OutputError")
    assert "s3://no-such-bucket/runs/x/ (--output_uri)" in failure
    assert "NoSuchBucket" in failure
    assert sum(image_server.hits.values()) == hits_before  # failed before downloading anything


def test_download_output_uri_not_s3_fails_naming_flag(tmp_path: Path) -> None:
    with pytest.raises(download.flags.FlagError, match="--output_uri: '/opt/ml/processing/output' is not an S3"):
        download.parse_args(job_args(tmp_path, "/opt/ml/processing/output", tmp_path / "work"))


@pytest.mark.slow
def test_download_deadline_exceeded_fails_within_bound(
    image_server: ImageServer, download_s3: S3, tmp_path: Path, opt_ml: Path
) -> None:
    # Only slow URLs, a per-URL timeout longer than they take, and a deadline shorter than
    # that: only the deadline can end this run.
    sample = make_laion_parquet(tmp_path / "slow.parquet", image_server, good=0, slow=4, seed=7)
    deadline = 2.0
    uri = download_s3.uri("deadline")
    started = time.monotonic()
    status = download.main(
        download.parse_args(
            [
                *job_args(sample.path, uri, tmp_path / "work"),
                *("--url_timeout", "10", "--deadline_seconds", str(deadline)),
            ]
        )
    )
    elapsed = time.monotonic() - started
    assert status != 0
    assert elapsed < deadline + 8, f"took {elapsed:.1f} s for a {deadline} s deadline"
    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith("DeadlineExceeded")
    assert "--deadline_seconds" in failure
    assert (opt_ml / "output" / "message").read_text() == failure
    assert download_s3.names(uri) == {}  # neither a partial shard nor _SUCCESS


def _spawn_grandchild_and_hang(pid_file: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    Path(pid_file).write_text(str(child.pid))
    time.sleep(60)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, just not yet reaped by its new parent


def test_run_with_deadline_hung_child_kills_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    started = time.monotonic()
    with pytest.raises(download.DeadlineExceeded):
        download.run_with_deadline(
            _spawn_grandchild_and_hang, (str(pid_file),), time.monotonic() + 1.5, tmp_path / "error.txt"
        )
    assert time.monotonic() - started < 5
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild), "the downloader's own children must die with it"


def _spawn_grandchild_and_return(pid_file: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    Path(pid_file).write_text(str(child.pid))


def test_run_with_deadline_finished_child_leaves_no_stragglers(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    download.run_with_deadline(
        _spawn_grandchild_and_return, (str(pid_file),), time.monotonic() + 30, tmp_path / "error.txt"
    )
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild), "a worker left behind by the downloader must not outlive the job"


def _raise_value_error() -> None:
    raise ValueError("boom in the downloader")


def test_run_with_deadline_child_error_is_reported(tmp_path: Path) -> None:
    with pytest.raises(download.DownloaderFailed, match="ValueError: boom in the downloader"):
        download.run_with_deadline(_raise_value_error, (), time.monotonic() + 30, tmp_path / "error.txt")


def bad_input_args(input_path: Path, tmp_path: Path, *extra: str) -> list[str]:
    # the input checks fail before S3 is touched: no S3 needed
    return job_args(input_path, f"s3://{BUCKET}/runs/bad/", tmp_path / "work", *extra)


def test_download_missing_column_failure_names_column(tmp_path: Path, opt_ml: Path) -> None:
    parquet = write_parquet(tmp_path / "in" / "x.parquet", [SampleRow("http://127.0.0.1:9/a.jpg", "a")])
    status = download.main(download.parse_args(bad_input_args(parquet, tmp_path, "--url_col", "url")))
    assert status == 1
    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith("MissingColumn")
    assert "'url' (--url_col)" in failure
    assert "['URL', 'TEXT', 'WIDTH', 'HEIGHT', 'similarity', 'punsafe', 'pwatermark', 'aesthetic']" in failure


def test_download_empty_parquet_fails(tmp_path: Path, opt_ml: Path) -> None:
    parquet = write_parquet(tmp_path / "empty.parquet", [])
    assert download.main(download.parse_args(bad_input_args(parquet, tmp_path))) == 1
    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith("EmptyParquet")
    assert "empty.parquet has no rows" in failure


def test_download_unreadable_file_fails(tmp_path: Path, opt_ml: Path) -> None:
    bogus = tmp_path / "in" / "part.parquet"
    bogus.parent.mkdir()
    bogus.write_text("URL,TEXT\nhttp://example.com/a.jpg,a csv file, not parquet\n")
    assert download.main(download.parse_args(bad_input_args(bogus.parent, tmp_path))) == 1
    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith("UnreadableParquet")
    assert "part.parquet is not a readable parquet file" in failure


def test_download_folder_with_two_parquets_fails(tmp_path: Path, opt_ml: Path) -> None:
    for name in ("a.parquet", "b.parquet"):
        write_parquet(tmp_path / "in" / name, [SampleRow("http://127.0.0.1:9/a.jpg", "a")])
    assert download.main(download.parse_args(bad_input_args(tmp_path / "in", tmp_path))) == 1
    failure = (opt_ml / "output" / "failure").read_text()
    assert "exactly one parquet file, found 2: a.parquet, b.parquet" in failure


def test_download_bin_entrypoint_bad_argument_writes_failure(tmp_path: Path) -> None:
    env = {**os.environ, "SDFLOW_OPT_ML": str(tmp_path / "opt_ml")}
    entrypoint = REPO_ROOT / "training_image" / "bin" / "download"
    argv = ["--input", str(tmp_path), "--output_uri", f"s3://{BUCKET}/x/", "--processes", "0"]
    result = subprocess.run(
        [sys.executable, str(entrypoint), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    failure = (tmp_path / "opt_ml" / "output" / "failure").read_text()
    assert failure.startswith("FlagError")
    assert "--processes: '0' must be >= 1" in failure
