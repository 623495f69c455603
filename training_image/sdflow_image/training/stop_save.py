"""Whether a stopped job saves a checkpoint before it exits: only when it can also reach S3 in time.

SageMaker stops a training job (StopTrainingJob, a spot interruption) with SIGTERM and SIGKILLs the
container 120 s later; the workers get `SDFLOW_STOP_GRACE_S` of those (default 110 s:
training.elastic_run). A checkpoint counts for the next attempt only once SageMaker's sync has
uploaded it, and the sync sees it only once it is written: a checkpoint is staged and then renamed
into the synced folder (training.checkpoints), so writing and uploading follow one another. A
full run's DCP checkpoint is 12 B per trainable parameter (fp32 weights and Adam's two moments:
Qwen-Image's 20.4 B parameters are ~245 GB, FLUX.2 [klein] 9B's ~109 GB), which no host writes and
uploads in two minutes. A save that cannot finish in time buys nothing and costs: it competes for
the disk and the network with the upload of the last periodic checkpoint, and its local pruning
deletes older folders the sync may still be reading.

The rule: on a stop, save only when writing one host's part (the most of any host: hosts write
and upload in parallel) and then uploading it at UPLOAD_BYTES_PER_S fit in what is left of the
workers' grace after the step that noticed the stop. Otherwise skip the save, say why in the log,
and exit as stopped: the next attempt resumes from the last periodic checkpoint
(`checkpointing_steps` is what bounds the work lost). The bytes are those of the last checkpoint
this job saved or resumed from (its markers list every host's files); before the first one, an
estimate from the trainable parameters (`estimate_part_bytes`). The write takes as long as this
job's last save took, measured on its own disk; before the first, the bytes at WRITE_BYTES_PER_S.
The upload counts only when the job's checkpoints are synced to S3 (`checkpoint_s3_uri`, which the
pipeline's training jobs always have); a local run has nothing to upload.

The bandwidths are assumptions, chosen low: AWS documents neither the sync's throughput nor the
volume's for every instance type.
- WRITE_BYTES_PER_S, 250 MB/s: the ML storage volume is EBS gp2 on instances without instance
  storage (ResourceConfig.VolumeSizeInGB: "SageMaker doesn't provision Amazon EBS General Purpose
  SSD (gp2) storage" on NVMe instances such as ml.p4d, ml.g4dn, ml.g5, which write faster), and a
  gp2 volume's throughput is at most 250 MiB/s (EBS volume types).
- UPLOAD_BYTES_PER_S, 85 MB/s: one S3 connection (S3 performance guidelines, "Horizontal scaling":
  one concurrent request for each 85-90 MB/s of desired throughput); the sync's concurrency is
  not documented.
At these rates a stop-save fits when one host's part is below ~6 GB with 10 s of the grace gone:
LoRA runs and small full runs save on a stop; full runs of the large families rely on their
periodic checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sdflow_image.training.elastic_run import DEFAULT_STOP_GRACE_S

WRITE_BYTES_PER_S = 250e6
UPLOAD_BYTES_PER_S = 85e6
TRAINING_STATE_BYTES_PER_PARAMETER = 12  # fp32 weights, Adam's exp_avg and exp_avg_sq
EMA_BYTES_PER_PARAMETER = 4  # the fp32 EMA copy, rank 0's


@dataclass(frozen=True)
class Decision:
    save: bool
    reason: str


def stop_window_s(environ: dict[str, str] | None = None) -> float:
    """The seconds the workers have between the stop signal and SIGKILL (the launcher checked the value)."""
    raw = (os.environ if environ is None else environ).get("SDFLOW_STOP_GRACE_S", "")
    try:
        return float(raw) if raw else DEFAULT_STOP_GRACE_S
    except ValueError:
        return DEFAULT_STOP_GRACE_S


def seconds_needed(part_bytes: int, write_s: float | None = None, uploaded: bool = True) -> float:
    """Seconds to write one host's part (`write_s` when measured) and then upload it."""
    write = part_bytes / WRITE_BYTES_PER_S if write_s is None else write_s
    return write + (part_bytes / UPLOAD_BYTES_PER_S if uploaded else 0.0)


def estimate_part_bytes(trainable: int, hosts: int, *, sharded: bool, ema: bool) -> int:
    """One host's part of a checkpoint before any was measured: the trainable parameters' fp32
    weights and Adam state, split among the hosts when the plugin shards them (else host 0 writes
    all), and rank 0's EMA copy."""
    state = TRAINING_STATE_BYTES_PER_PARAMETER * trainable
    return (state // max(hosts, 1) if sharded else state) + (EMA_BYTES_PER_PARAMETER * trainable if ema else 0)


def decide(
    part_bytes: int, since_stop_s: float, window_s: float, *, measured: bool, write_s: float | None = None,
    uploaded: bool = True,
) -> Decision:  # fmt: skip
    """Save on this stop, or skip it: see the module docstring. `measured`: `part_bytes` are the
    last checkpoint's; `write_s`: the seconds its save took; `uploaded`: the sync uploads it."""
    needed = seconds_needed(part_bytes, write_s, uploaded)
    left = window_s - since_stop_s
    size = f"{part_bytes / 1e9:.2f} GB per host ({'as the last checkpoint' if measured else 'estimated'})"
    written = (
        f"written in {write_s:.0f} s (the last save's time)"
        if write_s is not None
        else f"written at {WRITE_BYTES_PER_S / 1e6:.0f} MB/s"
    )
    rates = f"{written}, uploaded at {UPLOAD_BYTES_PER_S / 1e6:.0f} MB/s" if uploaded else f"{written}, not uploaded"
    if needed <= left:
        return Decision(True, f"saving a checkpoint: {size} takes ~{needed:.0f} s {rates}; {left:.0f} s left")
    return Decision(
        False,
        f"not saving a checkpoint on this stop: {size} would take ~{needed:.0f} s {rates}, and {left:.0f} s "
        f"of the {window_s:.0f} s stop window are left; the next attempt resumes from the last periodic "
        "checkpoint (lower checkpointing_steps to lose fewer steps on a stop)",
    )
