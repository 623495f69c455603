"""A run's progress bar (tqdm.auto: a widget in a notebook, a text bar in a terminal)."""

from __future__ import annotations

from typing import Any

from sdflow.progress import Progress


class RunBar:
    """total = the run's shards once known, n = shards downloaded, postfix = the states running now."""

    def __init__(self, name: str, **tqdm_options: Any) -> None:
        from tqdm.auto import tqdm  # only a waiting caller who asked for a bar needs tqdm

        self.bar = tqdm(total=None, desc=name, unit="shard", **tqdm_options)

    def update(self, snap: Progress) -> None:
        if snap.shards_total is not None and self.bar.total != snap.shards_total:
            self.bar.reset(total=snap.shards_total)  # reset() also resizes a notebook's widget
        self.bar.n = snap.shards_done
        running = [state for state, status in snap.states.items() if status == "running"]
        postfix = ", ".join(running) if running else snap.status
        if "Train model" in running and snap.training_step is not None:
            postfix += f" (step {snap.training_step}, loss {snap.training_loss:.4f})"
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
