"""Images from a deployed endpoint, through the same InvokeEndpoint contract as `sdflow invoke`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sdflow.endpoints import generate
from sdflow.session import Session


class Predictor:
    """A text-to-image endpoint. A later run may update the endpoint blue/green: it serves the newest model."""

    def __init__(self, endpoint_name: str, session: Session | None = None) -> None:
        self.endpoint_name = endpoint_name
        self.session = session or Session.connect()

    def predict(self, prompt: str, **options: Any) -> bytes:
        """One PNG image. Options the container takes, e.g. num_inference_steps, guidance_scale, seed,
        width, height; None means the container's default."""
        return generate(self.session, self.endpoint_name, prompt, **options)

    def save(self, prompt: str, path: str | Path, **options: Any) -> Path:
        """predict(), written to `path`."""
        target = Path(path)
        target.write_bytes(self.predict(prompt, **options))
        return target

    def __repr__(self) -> str:
        return f"Predictor({self.endpoint_name!r})"
