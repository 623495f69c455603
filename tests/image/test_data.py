"""The training data stream: shards read from S3 (moto on 127.0.0.1) or a folder, each rank and
worker a disjoint share, and a position that resumes batch for batch."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

import pytest
from data_fixtures import KeyTokenizer, keys_of, local_s3, upload_tree, write_key_shards

from sdflow_image.training import data_source
from sdflow_image.training.data import (
    Cursor,
    DataStateError,
    EmptyStreamError,
    InterleavedShards,
    ShardLoader,
    make_dataloader,
    split_work,
)
from sdflow_image.training.data_source import (
    DatasetIndexError,
    LocalSource,
    ShardReader,
    ShardReadError,
    iter_samples,
    load_index,
)

pytestmark = pytest.mark.image

BUCKET = "data"


def _args(root: str | Path, index: str, **overrides: Any) -> SimpleNamespace:
    values = {
        "dataset_dir": str(root), "dataset_index": index, "resolution": 8, "train_batch_size": 3,
        "dataloader_num_workers": 0, "interleave_shards": 2, "seed": 0, "center_crop": True, "random_flip": False,
    }  # fmt: skip
    return SimpleNamespace(**(values | overrides))


def _take(loader: ShardLoader, batches: int, *, pixels: bool = False) -> list[Any]:
    """Each batch's sample keys (and, with `pixels`, its pixel tensor: crops and flips included)."""
    iterator = iter(loader)
    try:
        taken = [next(iterator) for _ in range(batches)]
    finally:
        iterator.close()  # type: ignore[attr-defined]  # shuts the DataLoader's workers down
    if pixels:
        return [(keys_of(batch), batch["pixel_values"].flatten().tolist()) for batch in taken]
    return [keys_of(batch) for batch in taken]


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, str]:
    root = tmp_path / "runs"
    return root, write_key_shards(root, shards=5, samples_per_shard=7)


@pytest.fixture(scope="module")
def s3_dataset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Any]]:
    root = tmp_path_factory.mktemp("s3") / "runs"
    index = write_key_shards(root, shards=5, samples_per_shard=7)
    with local_s3() as client:
        client.create_bucket(Bucket=BUCKET)
        upload_tree(client, root, BUCKET)
        yield f"s3://{BUCKET}/runs/", index, client


# ------------------------------------------------------------------ reading tars from an offset


def test_iter_samples_next_offset_reopens_at_the_following_sample(dataset: tuple[Path, str]) -> None:
    root, _ = dataset
    tar = root / "run/dataset/shards/00000/00000.tar"
    whole = list(iter_samples(tar.open("rb"), 0, "t"))
    assert [s.key for s in whole] == [f"s00000{i:04d}" for i in range(7)]
    assert set(whole[0].files) == {"jpg", "txt", "json"}
    assert whole[-1].next_offset is None
    offset = whole[2].next_offset
    assert offset is not None
    with tar.open("rb") as handle:
        handle.seek(offset)
        rest = list(iter_samples(handle, offset, "t"))
    assert [s.key for s in rest] == [s.key for s in whole[3:]]
    assert [s.next_offset for s in rest] == [s.next_offset for s in whole[3:]]


class _FlakySource(LocalSource):
    """Streams that raise ConnectionError after `cut` bytes, for the first `failures` opens."""

    def __init__(self, root: Path, cut: int, failures: int) -> None:
        super().__init__(root)
        self.cut, self.failures = cut, failures
        self.opened: list[int] = []

    def open_stream(self, relative: str, offset: int) -> BinaryIO:
        self.opened.append(offset)
        handle = super().open_stream(relative, offset)
        if self.failures <= 0:
            return handle
        self.failures -= 1
        data = handle.read(self.cut)
        handle.close()

        class Broken(io.BytesIO):
            def read(self, size: int | None = -1) -> bytes:
                chunk = super().read(size)
                if not chunk:
                    raise ConnectionError("connection reset by peer")
                return chunk

        return Broken(data)


def test_shard_reader_dropped_connection_reopens_at_last_whole_sample(dataset: tuple[Path, str]) -> None:
    root, _ = dataset
    relative = "run/dataset/shards/00001/00000.tar"
    source = _FlakySource(root, cut=5000, failures=2)
    reader = ShardReader(source, relative)
    keys = []
    while (sample := reader.next_sample()) is not None:
        keys.append(sample.key)
    assert keys == [f"s00001{i:04d}" for i in range(7)]
    assert len(source.opened) == 3
    assert source.opened[1] > 0  # reopened mid-shard, not from byte 0


def test_shard_reader_connection_failing_every_time_raises_naming_shard(dataset: tuple[Path, str]) -> None:
    root, _ = dataset
    reader = ShardReader(_FlakySource(root, cut=100, failures=99), "run/dataset/shards/00001/00000.tar")
    with pytest.raises(ShardReadError, match=r"00001/00000\.tar: reading at byte 0 failed 4 times in a row"):
        reader.next_sample()


# ------------------------------------------------------------------ the index


def test_load_index_s3_reads_index_and_keeps_relative_tar_paths(s3_dataset: tuple[str, str, Any]) -> None:
    root, index_path, _ = s3_dataset
    index = load_index(root, index_path)
    assert index.shards == [f"run/dataset/shards/{i:05d}/00000.tar" for i in range(5)]
    assert index.total_samples == 35


def test_load_index_s3_missing_index_names_hyperparameter(s3_dataset: tuple[str, str, Any]) -> None:
    root, _, _ = s3_dataset
    with pytest.raises(DatasetIndexError, match=r"s3://data/runs/index\.json is missing: .*dataset_index"):
        load_index(root)


@pytest.mark.parametrize("index_path", ["../index.json", "/etc/index.json", ""])
def test_load_index_index_path_outside_root_raises(dataset: tuple[Path, str], index_path: str) -> None:
    with pytest.raises(DatasetIndexError, match="must be a path relative to dataset_dir"):
        load_index(dataset[0], index_path)


def test_load_index_tar_path_outside_root_raises(dataset: tuple[Path, str]) -> None:
    root, index_path = dataset
    index = json.loads((root / index_path).read_text())
    index["shards"][0]["tar_files"] = ["../elsewhere/00000.tar"]
    (root / index_path).write_text(json.dumps(index))
    with pytest.raises(DatasetIndexError, match=r"tar file '\.\./elsewhere/00000\.tar' must be a path relative"):
        load_index(root, index_path)


def test_load_index_local_tar_missing_raises_naming_it(dataset: tuple[Path, str]) -> None:
    root, index_path = dataset
    (root / "run/dataset/shards/00003/00000.tar").unlink()
    with pytest.raises(DatasetIndexError, match=r"1 tar file\(s\) listed in .* are missing, e\.g\. .*00003/00000"):
        load_index(root, index_path)


def test_loader_s3_tar_missing_raises_naming_its_uri(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    index_path = write_key_shards(root, shards=1, samples_per_shard=2, run="gone")
    with local_s3() as client:
        client.create_bucket(Bucket="gone")
        client.upload_file(str(root / index_path), "gone", f"runs/{index_path}")
        with pytest.raises(DatasetIndexError, match=r"s3://gone/runs/gone/dataset/shards/00000/00000\.tar is listed"):
            _take(make_dataloader(_args("s3://gone/runs/", index_path), KeyTokenizer(), rank=0, world_size=1), 1)


# ------------------------------------------------------------------ splitting


def test_split_work_fewer_shards_than_ranks_splits_samples_disjointly() -> None:
    seen = {split_work(["a.tar"], rank, 2, worker, 2)[1:] for rank in range(2) for worker in range(2)}
    assert seen == {(4, 0), (4, 1), (4, 2), (4, 3)}


@pytest.mark.parametrize(("shards", "world_size", "workers"), [(5, 2, 2), (1, 2, 2), (5, 3, 0), (2, 2, 3)])
def test_loader_ranks_read_disjoint_shares_covering_every_sample(
    tmp_path: Path, shards: int, world_size: int, workers: int
) -> None:
    root = tmp_path / "runs"
    index_path = write_key_shards(root, shards=shards, samples_per_shard=6)
    seen: list[set[str]] = []
    for rank in range(world_size):
        args = _args(root, index_path, train_batch_size=1, dataloader_num_workers=workers)
        loader = make_dataloader(args, KeyTokenizer(), rank=rank, world_size=world_size)
        seen.append({key for batch in _take(loader, 3 * shards * 6) for key in batch})
    everything = {f"s{s:05d}{i:04d}" for s in range(shards) for i in range(6)}
    assert set().union(*seen) == everything
    assert sum(len(share) for share in seen) == len(everything)  # no sample on two ranks


def test_loader_one_epoch_holds_each_sample_once_in_shuffled_order(dataset: tuple[Path, str]) -> None:
    root, index_path = dataset
    args = _args(root, index_path, train_batch_size=1, interleave_shards=3)
    keys = [batch[0] for batch in _take(make_dataloader(args, KeyTokenizer(), rank=0, world_size=1), 70)]
    first, second = keys[:35], keys[35:]
    assert sorted(first) == sorted(second) == sorted({f"s{s:05d}{i:04d}" for s in range(5) for i in range(7)})
    assert first != sorted(first)  # shards interleaved, not read one after another
    assert first != second  # a new order every epoch


# ------------------------------------------------------------------ resuming


def _resume_matches_uninterrupted(root: str | Path, index_path: str, stops: list[int], **overrides: Any) -> None:
    total = 30
    tokenizer = KeyTokenizer()
    args = _args(root, index_path, **overrides)
    straight = _take(make_dataloader(args, tokenizer, rank=0, world_size=1), total, pixels=True)
    for stop in stops:
        loader = make_dataloader(args, tokenizer, rank=0, world_size=1)
        before = _take(loader, stop, pixels=True)
        state = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint holds
        resumed = make_dataloader(args, tokenizer, rank=0, world_size=1, state=state)
        after = _take(resumed, total - stop, pixels=True)
        assert before + after == straight, f"resumed after batch {stop}"


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_loader_resume_from_state_repeats_and_skips_nothing(dataset: tuple[Path, str], workers: int) -> None:
    """30 batches of 3 from 35 samples: stops inside the first epoch, at its end and in later ones."""
    root, index_path = dataset
    _resume_matches_uninterrupted(
        root, index_path, [1, 5, 12, 23], dataloader_num_workers=workers, random_flip=True, center_crop=False
    )


def test_loader_resume_from_s3_with_workers_repeats_and_skips_nothing(s3_dataset: tuple[str, str, Any]) -> None:
    root, index_path, _ = s3_dataset
    _resume_matches_uninterrupted(root, index_path, [4, 17], dataloader_num_workers=2)


def test_loader_iterated_again_continues_after_last_batch(dataset: tuple[Path, str]) -> None:
    root, index_path = dataset
    args = _args(root, index_path, dataloader_num_workers=2)
    straight = _take(make_dataloader(args, KeyTokenizer(), rank=0, world_size=1), 8)
    loader = make_dataloader(args, KeyTokenizer(), rank=0, world_size=1)
    assert _take(loader, 3) + _take(loader, 5) == straight


def test_interleaved_shards_resume_reopens_shards_at_saved_offsets(dataset: tuple[Path, str]) -> None:
    root, _ = dataset
    shards = [f"run/dataset/shards/{i:05d}/00000.tar" for i in range(5)]
    source = _FlakySource(root, cut=0, failures=0)
    walk = InterleavedShards(source, shards, seed=1, width=2, cursor=Cursor())
    for _ in range(9):
        walk.next()
    saved = Cursor.from_json(json.loads(json.dumps(walk.cursor.__dict__)))
    expected = [walk.next()[0].key for _ in range(10)]  # type: ignore[index]
    source.opened.clear()
    resumed = InterleavedShards(source, shards, seed=1, width=2, cursor=saved)
    assert [resumed.next()[0].key for _ in range(10)] == expected  # type: ignore[index]
    assert any(offset > 0 for offset in source.opened)  # a ranged read, not the shard from its start


@pytest.mark.parametrize(
    ("field", "change"),
    [("world_size", {"world_size": 2}), ("num_workers", {"dataloader_num_workers": 1}), ("seed", {"seed": 5}),
     ("interleave_shards", {"interleave_shards": 3})],
)  # fmt: skip
def test_loader_state_from_other_split_raises_naming_field(
    dataset: tuple[Path, str], field: str, change: dict[str, Any]
) -> None:
    root, index_path = dataset
    loader = make_dataloader(_args(root, index_path), KeyTokenizer(), rank=0, world_size=1)
    _take(loader, 2)
    state = loader.state_dict()
    world_size = change.pop("world_size", 1)
    with pytest.raises(DataStateError, match=rf"saved with {field}=.*Resume with the same {field}"):
        make_dataloader(_args(root, index_path, **change), KeyTokenizer(), rank=0, world_size=world_size, state=state)


def test_loader_state_of_other_index_raises(dataset: tuple[Path, str], tmp_path: Path) -> None:
    root, index_path = dataset
    loader = make_dataloader(_args(root, index_path), KeyTokenizer(), rank=0, world_size=1)
    _take(loader, 1)
    other = tmp_path / "other"
    other_index = write_key_shards(other, shards=4, samples_per_shard=7)
    with pytest.raises(DataStateError, match="saved with shards="):
        make_dataloader(_args(other, other_index), KeyTokenizer(), rank=0, world_size=1, state=loader.state_dict())


def test_loader_malformed_state_raises(dataset: tuple[Path, str]) -> None:
    root, index_path = dataset
    loader = make_dataloader(_args(root, index_path), KeyTokenizer(), rank=0, world_size=1)
    state = loader.state_dict() | {"cursors": {"0": {"epoch": "x"}}}
    with pytest.raises(DataStateError, match="malformed"):
        make_dataloader(_args(root, index_path), KeyTokenizer(), rank=0, world_size=1, state=state)


def test_loader_rank_without_samples_raises_empty_stream(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    index_path = write_key_shards(root, shards=1, samples_per_shard=1)
    loader = make_dataloader(_args(root, index_path, train_batch_size=1), KeyTokenizer(), rank=1, world_size=2)
    with pytest.raises(EmptyStreamError, match=r"rank 1's share of the 1 tar file\(s\) yields no batch"):
        _take(loader, 1)


def test_s3_source_survives_pickling_for_workers() -> None:
    import pickle

    source = data_source.S3Source("s3://b/runs")
    copy = pickle.loads(pickle.dumps(source))
    assert (copy.bucket, copy.prefix) == ("b", "runs/")


# ------------------------------------------------------------------ skipping the dedup job's duplicates


def _drop(root: Path, index_path: str, dropped: dict[str, list[str]]) -> None:
    """Give shards (by shard_id) a dropped file, as build_index names the dedup job's output."""
    index = json.loads((root / index_path).read_text())
    for entry in index["shards"]:
        if entry["shard_id"] in dropped:
            relative = f"run/dataset/dedup/dropped/{entry['shard_id']}.json"
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_text(
                json.dumps({"shard_id": entry["shard_id"], "keys": dropped[entry["shard_id"]]})
            )
            entry["dropped_file"] = relative
    (root / index_path).write_text(json.dumps(index))


DROPPED = {"00000": ["s000000000", "s000000003"], "00002": ["s000020006"], "00004": ["s000040001", "s000040002"]}


def test_loader_dropped_keys_never_trained_and_the_rest_once_per_epoch(dataset: tuple[Path, str]) -> None:
    root, index_path = dataset
    _drop(root, index_path, DROPPED)
    kept = {f"s{s:05d}{i:04d}" for s in range(5) for i in range(7)} - {k for keys in DROPPED.values() for k in keys}
    args = _args(root, index_path, train_batch_size=1, interleave_shards=3)
    keys = [batch[0] for batch in _take(make_dataloader(args, KeyTokenizer(), rank=0, world_size=1), 2 * len(kept))]
    assert sorted(keys[: len(kept)]) == sorted(keys[len(kept) :]) == sorted(kept)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_with_dropped_keys_resume_repeats_and_skips_nothing(dataset: tuple[Path, str], workers: int) -> None:
    root, index_path = dataset
    _drop(root, index_path, DROPPED)
    _resume_matches_uninterrupted(root, index_path, [2, 9, 16], dataloader_num_workers=workers, random_flip=True)


def test_loader_rank_loads_only_its_own_shards_dropped_files(dataset: tuple[Path, str]) -> None:
    """Rank 1 of 5 reads shard 00001 only; the other shards' dropped files are unreadable and never opened."""
    root, index_path = dataset
    _drop(root, index_path, {"00001": ["s000010004"], **{s: [] for s in ("00000", "00002", "00003", "00004")}})
    for shard in ("00000", "00002", "00003", "00004"):
        (root / f"run/dataset/dedup/dropped/{shard}.json").write_text("not json")
    args = _args(root, index_path, train_batch_size=1)
    keys = {batch[0] for batch in _take(make_dataloader(args, KeyTokenizer(), rank=1, world_size=5), 12)}
    assert keys == {f"s00001{i:04d}" for i in range(7)} - {"s000010004"}
    with pytest.raises(DatasetIndexError, match=r"dropped/00000\.json is not valid JSON"):
        _take(make_dataloader(args, KeyTokenizer(), rank=0, world_size=5), 1)


def test_loader_state_saved_without_drops_refused_once_the_index_has_them(dataset: tuple[Path, str]) -> None:
    root, index_path = dataset
    args = _args(root, index_path)
    loader = make_dataloader(args, KeyTokenizer(), rank=0, world_size=1)
    _take(loader, 2)
    state = loader.state_dict()
    _drop(root, index_path, DROPPED)
    with pytest.raises(DataStateError, match="shards="):
        make_dataloader(args, KeyTokenizer(), rank=0, world_size=1, state=state)
