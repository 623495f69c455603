"""The job environment: the Python that runs the training image's code on this machine.

The container's stack (torch, diffusers, Colossal-AI on Colossal-AI's declared versions) and the
orchestration's (moto, boto3, Powertools, the SAM translator) do not share one venv: Colossal-AI
pins uvicorn and transformers exactly, and the Lambda side needs no torch at all. `make setup`
builds `.venv-image` from the very requirements files the Dockerfile installs
(training_image/requirements.txt with training_image/constraints.txt), so a local download,
training or serving job runs what the container runs. Everything here that needs torch goes
through a subprocess of that Python.

The second image (the accelerate backend: today's torch, diffusers, transformers, accelerate and peft,
which Colossal-AI's pins exclude) has its own job environment, `.venv-accelerate`, built by `make setup`
from training_image/requirements-accelerate.txt: a job whose image is the stack's AccelerateImageUri runs
there (LocalSageMaker.python_for), with the same code from training_image/.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
TRAINING_IMAGE_DIR = REPO_ROOT / "training_image"
IMAGE_PYTHON_ENV = "SDFLOW_IMAGE_PYTHON"
DEFAULT_IMAGE_VENV = REPO_ROOT / ".venv-image"
ACCELERATE_PYTHON_ENV = "SDFLOW_ACCELERATE_PYTHON"
DEFAULT_ACCELERATE_VENV = REPO_ROOT / ".venv-accelerate"
# torch's OpenMP threads (libgomp) spin while they wait for work, which takes the cores every other
# process on this machine needs: the local cloud, the other jobs, a test suite's other worker.
# Passive threads sleep instead. Fitting the demo's VAE on a busy 2-core machine took 170 s and
# 61 s of CPU with the default, 28 s and 13 s passive.
WAIT_POLICY = "PASSIVE"


class JobEnvironmentMissing(RuntimeError):
    """The job environment's Python is not there: the local runtime cannot run the image's code."""


def _job_python(variable: str, venv: Path, requirements: str, what: str) -> str:
    configured = os.environ.get(variable, "").strip()
    candidate = Path(configured) if configured else venv / "bin" / "python"
    if not candidate.is_file():
        source = f"{variable}={configured}" if configured else str(candidate)
        raise JobEnvironmentMissing(
            f"the {what} Python ({source}) does not exist: run `make setup`, which builds "
            f"{venv.name} from training_image/{requirements}, or point {variable} "
            "at a Python that has those requirements"
        )
    return str(candidate)


def image_python() -> str:
    """$SDFLOW_IMAGE_PYTHON, else the repository's .venv-image; a clear error when neither exists."""
    return _job_python(IMAGE_PYTHON_ENV, DEFAULT_IMAGE_VENV, "requirements.txt", "job environment's")


def accelerate_python() -> str:
    """The second image's job environment: $SDFLOW_ACCELERATE_PYTHON, else the repository's .venv-accelerate;
    a clear error naming `make setup` when neither exists."""
    return _job_python(
        ACCELERATE_PYTHON_ENV, DEFAULT_ACCELERATE_VENV, "requirements-accelerate.txt", "accelerate job environment's"
    )


def image_environment() -> dict[str, str]:
    """This process's environment with the image's code importable (as WORKDIR /opt/ml/code is)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TRAINING_IMAGE_DIR), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    env.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    return env


def _build(command: list[str], what: str) -> Path:
    """Run one of the image's builders (`python -m sdflow_image.builders …`) in the job environment;
    the folder it printed last."""
    result = subprocess.run(command, env=image_environment(), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"building {what} failed ({' '.join(command)}):\n{result.stderr[-4000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def build_tiny_pipeline(out_dir: Path, seed: int = 0, vae_steps: int = 0) -> Path:
    """A tiny Stable Diffusion pipeline built offline by the image's own code, in the job environment
    (`vae_steps` > 0 fits its VAE to scene images first: what the demo's base model needs to learn)."""
    command = [image_python(), "-m", "sdflow_image.builders", str(out_dir), "--seed", str(seed)]
    command += ["--vae_steps", str(vae_steps)]
    return _build(command, "the tiny model")


def build_tiny_clip(out_dir: Path, seed: int = 0, train_steps: int = 0) -> Path:
    """A tiny transformers CLIPModel folder (sdflow_image.builders.tiny_clip), built in the job environment:
    the evaluation's CLIP model for its CLIP score and KID (`train_steps` > 0 fits it to the scenes first,
    so that its scores mean something)."""
    command = [image_python(), "-m", "sdflow_image.builders", str(out_dir), "--clip", "--seed", str(seed)]
    command += ["--clip_steps", str(train_steps)]
    return _build(command, "the tiny CLIP model")
