"""A stop saves a checkpoint only when it can be written and uploaded before SageMaker's SIGKILL
(training.stop_save), through `Trainer.train` with its steps stubbed."""

from __future__ import annotations

import pytest

from sdflow_image.training import loop, stop_save

pytestmark = pytest.mark.image


QWEN_IMAGE_PARAMETERS = 20_400_000_000  # its transformer, trained whole: ~245 GB of checkpoint


def test_stop_save_decide_full_qwen_image_skips_naming_the_figures_and_a_lora_saves() -> None:
    full = stop_save.decide(12 * QWEN_IMAGE_PARAMETERS, 2.0, 110.0, measured=True)
    assert not full.save
    assert "244.80 GB per host (as the last checkpoint)" in full.reason
    assert "108 s of the 110 s stop window" in full.reason
    assert "lower checkpointing_steps" in full.reason
    lora = stop_save.decide(12 * 20_000_000, 2.0, 110.0, measured=True)  # a LoRA adapter and its Adam state
    assert lora.save


def test_stop_save_seconds_needed_write_then_upload_and_estimate_splits_sharded_state() -> None:
    gigabyte = 10**9
    assert stop_save.seconds_needed(gigabyte) == pytest.approx(gigabyte / 250e6 + gigabyte / 85e6)
    assert stop_save.seconds_needed(gigabyte, write_s=1.5, uploaded=False) == 1.5
    assert stop_save.estimate_part_bytes(1000, 2, sharded=True, ema=False) == 6000
    assert stop_save.estimate_part_bytes(1000, 2, sharded=False, ema=True) == 16000
    assert stop_save.stop_window_s({"SDFLOW_STOP_GRACE_S": "60"}) == 60.0
    assert stop_save.stop_window_s({}) == 110.0


def _stopping_trainer(
    last_part_bytes: int | None, last_save_s: float | None, s3_uri: str | None
) -> tuple[loop.Trainer, list[int]]:
    """A Trainer whose steps are stubs (loss 0.5), to run `train` up to a stop; returns it and the
    steps it saved a checkpoint at."""
    import argparse
    from types import SimpleNamespace

    import torch

    trainer = loop.Trainer.__new__(loop.Trainer)
    steps = {"max_train_steps": 10, "checkpointing_steps": 100, "gradient_accumulation_steps": 1}
    trainer.args = argparse.Namespace(**steps, seed=0, train_batch_size=1, use_ema=False, checkpoint_s3_uri=s3_uri)
    trainer.state, trainer.rank, trainer.world_size = loop.TrainState(), 0, 1
    trainer.device, trainer.loader = torch.device("cpu"), [{}] * 10
    trainer.last_part_bytes, trainer.last_save_s = last_part_bytes, last_save_s
    trainer.trainable_parameters = QWEN_IMAGE_PARAMETERS
    trainer.backend, trainer.ema = SimpleNamespace(replicated=False), None  # type: ignore[assignment]
    saved: list[int] = []
    trainer.save_checkpoint = lambda: saved.append(trainer.state.step)  # type: ignore[method-assign,assignment,return-value]
    trainer._step = lambda batches, generator: torch.tensor(0.5)  # type: ignore[method-assign]
    return trainer, saved


SYNCED = "s3://sdflow-data/runs/run-1/checkpoints/job-1/"


@pytest.mark.parametrize(
    ("last_part_bytes", "last_save_s", "s3_uri", "since_s", "saves"),
    [
        (10**6, None, SYNCED, 0.0, True),  # a small checkpoint
        (12 * QWEN_IMAGE_PARAMETERS, None, SYNCED, 0.0, False),  # a full Qwen-Image run's
        (3 * 10**9, None, SYNCED, 0.0, True),  # ~47 s to write and upload: fits in 110 s ...
        (3 * 10**9, None, SYNCED, 80.0, False),  # ... but not in the 30 s left after a step that took 80 s
        (None, None, SYNCED, 0.0, False),  # none saved yet: estimated from Qwen-Image's parameters, 12 B each
        (20 * 10**9, None, SYNCED, 0.0, False),  # 80 s to write at 250 MB/s, 235 s to upload
        (20 * 10**9, 20.0, None, 0.0, True),  # written in 20 s last time, and no S3 sync to wait for
    ],
)
def test_train_on_stop_saves_only_when_write_and_upload_fit_in_the_stop_window(
    last_part_bytes: int | None, last_save_s: float | None, s3_uri: str | None, since_s: float, saves: bool,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    import time

    monkeypatch.delenv("SDFLOW_STOP_GRACE_S", raising=False)
    trainer, saved = _stopping_trainer(last_part_bytes, last_save_s, s3_uri)
    stop = loop.StopFlag()
    stop.requested, stop.at = True, time.monotonic() - since_s
    with pytest.raises(loop.TrainingStopped) as stopped:
        trainer.train(stop)
    assert stopped.value.step == 1
    assert (stopped.value.saved, saved) == (saves, [1] if saves else [])
    if not saves:
        assert "not saving a checkpoint on this stop" in capsys.readouterr().err
