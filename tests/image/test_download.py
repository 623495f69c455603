"""The download job against a local HTTP server: real HTTP, real 404s, undecodable bytes
and URLs slower than the timeout; shards, stats, _SUCCESS, idempotence, the deadline and
the input checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sdflow.samples import ImageServer, LaionSample, SampleRow, make_laion_parquet, write_parquet
from sdflow_image import download

pytestmark = pytest.mark.image

REPO_ROOT = Path(__file__).resolve().parents[2]
GOOD, MISSING, CORRUPT, SLOW = 30, 2, 2, 2
SLOW_SECONDS = 3.0


def job_args(input_path: Path, output: Path, *extra: str) -> list[str]:
    # Small settings keep a run to a few seconds on a shared 2-core machine; 20 rows per
    # shard over 36 rows gives two shards, so the totals are summed across shards.
    return [
        "--input", str(input_path), "--output", str(output),
        "--image-size", "64", "--samples-per-shard", "20",
        "--processes", "1", "--threads", "8", "--url-timeout", "1",
        *extra,
    ]  # fmt: skip


@dataclass
class Run:
    sample: LaionSample
    output: Path
    opt_ml: Path
    status: int
    seconds: float


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    with ImageServer(slow_seconds=SLOW_SECONDS) as srv:
        yield srv


@pytest.fixture(scope="module")
def finished_run(server: ImageServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("download")
    sample = make_laion_parquet(
        root / "input" / "part-00000.parquet", server, good=GOOD, missing=MISSING, corrupt=CORRUPT, slow=SLOW
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDFLOW_OPT_ML", str(root / "opt_ml"))
        started = time.monotonic()
        status = download.main(download.parse_args(job_args(root / "input", root / "output")))
        seconds = time.monotonic() - started
    return Run(sample, root / "output", root / "opt_ml", status, seconds)


@pytest.fixture
def opt_ml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "opt_ml"
    monkeypatch.setenv("SDFLOW_OPT_ML", str(path))
    return path


def read_tar(path: Path) -> dict[str, dict[str, bytes]]:
    """key -> {extension: bytes} of a webdataset tar."""
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            key, _, ext = member.name.partition(".")
            data = tar.extractfile(member)
            assert data is not None, member.name
            samples.setdefault(key, {})[ext] = data.read()
    return samples


@pytest.mark.slow
def test_download_mixed_urls_writes_shards_with_captions(finished_run: Run) -> None:
    assert finished_run.status == 0
    tars = sorted(finished_run.output.glob("*.tar"))
    assert [t.name for t in tars] == ["00000.tar", "00001.tar"]
    seen: dict[str, str] = {}
    for tar in tars:
        for key, members in read_tar(tar).items():
            assert set(members) == {"jpg", "txt", "json"}, key
            assert members["jpg"][:3] == b"\xff\xd8\xff", f"{key}.jpg is not a JPEG"
            meta = json.loads(members["json"])
            assert meta["status"] == "success"
            assert members["txt"].decode() == meta["caption"]
            seen[meta["url"]] = members["txt"].decode()
    # every good URL is there once with its own caption; no broken or slow URL slipped in
    assert seen == finished_run.sample.good


@pytest.mark.slow
def test_download_success_marker_totals_match_stats_and_good_count(finished_run: Run) -> None:
    success = json.loads((finished_run.output / "_SUCCESS").read_text())
    stats = [json.loads(p.read_text()) for p in sorted(finished_run.output.glob("*_stats.json"))]
    assert len(stats) == 2
    assert success["samples"] == sum(s["successes"] for s in stats) == GOOD
    assert success["failed"] == MISSING + CORRUPT + SLOW
    assert success["failed_to_download"] == MISSING + SLOW  # 404s and timeouts
    assert success["failed_to_resize"] == CORRUPT  # undecodable bytes
    assert success["tar_files"] == ["00000.tar", "00001.tar"]
    assert (success["url_col"], success["caption_col"], success["image_size"]) == ("URL", "TEXT", 64)
    assert success["options"]["samples_per_shard"] == 20
    assert success["duration_s"] > 0
    # the work folder is gone and the processing job's ExitMessage reports the totals
    assert not (finished_run.output / download.WORK_DIR).exists()
    assert f"{GOOD} samples" in (finished_run.opt_ml / "output" / "message").read_text()
    assert not (finished_run.opt_ml / "output" / "failure").exists()


@pytest.mark.slow
def test_download_output_with_success_marker_rerun_is_noop(
    finished_run: Run, server: ImageServer, opt_ml: Path
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in finished_run.output.iterdir()}
    hits_before = sum(server.hits.values())
    started = time.monotonic()
    status = download.main(download.parse_args(job_args(finished_run.sample.path, finished_run.output)))
    assert status == 0
    assert time.monotonic() - started < 2.0
    assert {p.name: p.stat().st_mtime_ns for p in finished_run.output.iterdir()} == before
    assert sum(server.hits.values()) == hits_before  # not a single URL fetched again
    assert "already complete" in (opt_ml / "output" / "message").read_text()


@pytest.mark.slow
def test_download_deadline_exceeded_fails_within_bound(server: ImageServer, tmp_path: Path, opt_ml: Path) -> None:
    # Only slow URLs, a per-URL timeout longer than they take, and a deadline shorter than
    # that: only the deadline can end this run.
    sample = make_laion_parquet(tmp_path / "slow.parquet", server, good=0, slow=4, seed=7)
    deadline = 2.0
    started = time.monotonic()
    status = download.main(
        download.parse_args(
            [
                *job_args(sample.path, tmp_path / "out"),
                *("--url-timeout", "10", "--deadline-seconds", str(deadline)),
            ]
        )
    )
    elapsed = time.monotonic() - started
    assert status != 0
    assert elapsed < deadline + 8, f"took {elapsed:.1f} s for a {deadline} s deadline"
    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith("DeadlineExceeded")
    assert "--deadline-seconds" in failure
    assert (opt_ml / "output" / "message").read_text() == failure
    assert not (tmp_path / "out" / "_SUCCESS").exists()


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


def test_download_missing_column_failure_names_column(tmp_path: Path, opt_ml: Path) -> None:
    parquet = write_parquet(tmp_path / "in" / "x.parquet", [SampleRow("http://127.0.0.1:9/a.jpg", "a")])
    status = download.main(download.parse_args([*job_args(parquet, tmp_path / "out"), "--url-col", "url"]))
    assert status == 1
    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith("MissingColumn")
    assert "'url' (--url-col)" in failure
    assert "['URL', 'TEXT', 'WIDTH', 'HEIGHT']" in failure  # the columns that are there
    assert not (tmp_path / "out" / "_SUCCESS").exists()


def test_download_empty_parquet_fails(tmp_path: Path, opt_ml: Path) -> None:
    parquet = write_parquet(tmp_path / "empty.parquet", [])
    assert download.main(download.parse_args(job_args(parquet, tmp_path / "out"))) == 1
    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith("EmptyParquet")
    assert "empty.parquet has no rows" in failure


def test_download_unreadable_file_fails(tmp_path: Path, opt_ml: Path) -> None:
    bogus = tmp_path / "in" / "part.parquet"
    bogus.parent.mkdir()
    bogus.write_text("URL,TEXT\nhttp://example.com/a.jpg,a csv file, not parquet\n")
    assert download.main(download.parse_args(job_args(bogus.parent, tmp_path / "out"))) == 1
    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith("UnreadableParquet")
    assert "part.parquet is not a readable parquet file" in failure


def test_download_folder_with_two_parquets_fails(tmp_path: Path, opt_ml: Path) -> None:
    for name in ("a.parquet", "b.parquet"):
        write_parquet(tmp_path / "in" / name, [SampleRow("http://127.0.0.1:9/a.jpg", "a")])
    assert download.main(download.parse_args(job_args(tmp_path / "in", tmp_path / "out"))) == 1
    failure = (opt_ml / "output" / "failure").read_text()
    assert "exactly one parquet file, found 2: a.parquet, b.parquet" in failure


def test_download_bin_entrypoint_bad_argument_writes_failure(tmp_path: Path) -> None:
    env = {**os.environ, "SDFLOW_OPT_ML": str(tmp_path / "opt_ml")}
    entrypoint = REPO_ROOT / "training_image" / "bin" / "download"
    argv = ["--input", str(tmp_path), "--output", str(tmp_path / "out"), "--processes", "0"]
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
    assert failure.startswith("InvalidArguments")
    assert "--processes" in failure


def test_prepare_work_dir_same_options_keeps_finished_shards_for_resume(tmp_path: Path) -> None:
    work = tmp_path / download.WORK_DIR
    options = {"input": "a.parquet", "image_size": 64}
    download._prepare_work_dir(work, options)
    finished = work / "img2dataset" / "00000_stats.json"
    finished.write_text("{}")
    download._prepare_work_dir(work, dict(options))
    assert finished.exists(), "a rerun with the same options must resume, not start over"
    download._prepare_work_dir(work, {**options, "image_size": 128})
    assert not finished.exists(), "shards made with other options must not be mixed in"
    assert json.loads((work / "options.json").read_text())["image_size"] == 128
