"""The inference worker: loads the model once, admits requests, runs them one at a time.

Inference is serialized: one pipeline call at a time per pipeline (a GPU holds one model copy
and concurrent calls would only thrash it), run in a worker thread so /ping stays responsive.
Admission is by time (serve_admission): what is admitted can finish within SageMaker's
invocation limit at the model's measured speed, however many requests that is. A request that
could not finish alone is the caller's to change (400, naming the limit and what would fit);
one that could, but not behind the work already admitted, is told when to retry (BusyError with
`retry_after_s`, answered 429 by serve_app). Every generation's service time is fed back into
the admission's estimate.

Work whose client has gone is dropped: before it starts, and between denoising steps
through diffusers' `callback_on_step_end` (diffusers 0.29 calls it as
`callback(pipe, step, timestep, tensors)` after each step). A request still running when
SageMaker's limit has passed is stopped too: SageMaker has already answered its caller.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from sdflow_image import families
from sdflow_image.serving.serve_admission import Admission, RefusedError, Ticket
from sdflow_image.serving.serve_model import (
    ServeError,
    ServeSettings,
    StepTiming,
    calibrate,
    default_size,
    load_pipeline,
    read_model_info,
    serving_devices,
    to_png,
)
from sdflow_image.serving.serve_request import BadRequestError, InvocationRequest

LOG = logging.getLogger("sdflow.serve")

PipelineLoader = Callable[[ServeSettings], Any]
Calibrator = Callable[[Any, int], StepTiming]


class BusyError(ServeError):
    """Too much work is already admitted for this request to end within the limit."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClientGoneError(ServeError):
    """The client disconnected before the generation ended."""


class DeadlineError(ServeError):
    """The generation ran past SageMaker's limit (the estimate was short): SageMaker has answered its caller."""


@dataclass
class Generation:
    images: list[bytes]  # PNG files
    seed: int
    width: int
    height: int
    elapsed_s: float


@dataclass
class Job:
    """One admitted request and what the worker needs to drop it early."""

    request: InvocationRequest
    width: int
    height: int
    estimate_s: float
    gone: threading.Event
    deadline: float  # time.monotonic() past which SageMaker has answered the caller itself


class ModelServer:
    """Holds the pipelines' load state (one per serving device) and runs one generation at a time on each."""

    def __init__(
        self,
        settings: ServeSettings,
        loader: PipelineLoader = load_pipeline,
        calibrator: Calibrator = calibrate,
    ):
        self.settings = settings
        self._loader = loader
        self._calibrator = calibrator
        self.status: Literal["loading", "ready", "failed"] = "loading"
        self.error: str | None = None
        self.timing: StepTiming | None = None
        self.default_size = 0
        self.devices = serving_devices(settings)
        self._pipes: list[Any] = []
        # Each pipeline runs one generation at a time; the pool hands out the free ones.
        self._pipe_locks = [threading.Lock() for _ in self.devices]
        self._free: asyncio.Queue[int] | None = None
        # Touched only on the event loop thread.
        self.admission = Admission(settings.invocation_limit_s, len(self.devices), max_waiting=settings.max_queue)

    @property
    def admitted(self) -> int:
        """Requests running or waiting."""
        return self.admission.admitted

    def start_loading(self) -> threading.Thread:
        # A daemon thread: a SIGTERM during a long load must not wait for the load to end.
        thread = threading.Thread(target=self._load, name="sdflow-model-loader", daemon=True)
        thread.start()
        return thread

    def _load(self) -> None:
        started = time.monotonic()
        model_dir = self.settings.model_dir
        LOG.info("loading model from %s", model_dir)
        try:
            info = read_model_info(model_dir)
            pipes = [self._loader(replace(self.settings, device=device)) for device in self.devices]
            size = default_size(info, pipes[0])
            timing = self._calibrator(pipes[0], size)
        except Exception as exc:  # reported by /ping (500) and the log, not raised into nowhere
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = "failed"
            LOG.exception("model failed to load from %s", model_dir)
            return
        self._pipes, self.default_size, self.timing = pipes, size, timing
        self.status = "ready"
        LOG.info(
            "model ready in %.1f s on %s: default size %d, %.3f s per step + %.3f s per image at %d²",
            time.monotonic() - started,
            ", ".join(self.devices),
            size,
            timing.step_s,
            timing.overhead_s,
            timing.size,
        )

    def plan(self, request: InvocationRequest, gone: threading.Event, arrived: float) -> Job:
        """The job for a request, or BadRequestError when it could not finish within the limit."""
        assert self.timing is not None, "plan() before the model is ready"
        limit = self.settings.invocation_limit_s
        width = request.width or self.default_size
        height = request.height or self.default_size
        shape = {"images": request.num_images, "width": width, "height": height}
        estimate = self.timing.estimate_s(steps=request.num_inference_steps, **shape)
        if estimate > limit:
            fits = self.timing.max_steps(limit_s=limit, **shape)
            advice = (
                f"at most {fits} num_inference_steps fit at this size and num_images"
                if fits
                else "no step count fits at this size and num_images; lower width, height or num_images"
            )
            raise BadRequestError(
                f"this request would take about {estimate:.0f} s ({request.num_inference_steps} steps, "
                f"{request.num_images} image(s) at {width}x{height}) but SageMaker's InvokeEndpoint "
                f"allows a model {limit:g} s to respond; {advice}",
                field="num_inference_steps",
                estimated_s=round(estimate, 1),
                limit_s=limit,
                max_num_inference_steps=fits,
            )
        return Job(request, width, height, estimate, gone, arrived + limit)

    async def generate(self, job: Job) -> Generation:
        """Admit, queue and run one job: BusyError when it would not end within the limit,
        ClientGoneError or DeadlineError when dropped."""
        try:
            ticket = self.admission.admit(job.estimate_s)
        except RefusedError as exc:
            raise BusyError(str(exc), exc.retry_after_s) from None
        if self._free is None:
            self._free = asyncio.Queue()
            for index in range(len(self.devices)):
                self._free.put_nowait(index)
        try:
            index = await self._free.get()
            try:
                if job.gone.is_set():
                    raise ClientGoneError("the client went away while the request was queued")
                return await self._run(job, index, ticket)
            finally:
                self._free.put_nowait(index)
        finally:
            self.admission.release(ticket)

    async def _run(self, job: Job, index: int, ticket: Ticket) -> Generation:
        started = time.monotonic()
        if started > job.deadline:
            # SageMaker has answered its caller already: the GPU has better things to do.
            raise DeadlineError(
                f"not started: SageMaker's {self.settings.invocation_limit_s:g} s limit passed while it waited"
            )
        self.admission.start(ticket)
        try:
            generation = await asyncio.to_thread(self._generate_blocking, job, index)
        except DeadlineError:
            # Stopped at the limit: the time it ran is a lower bound on what it would have taken,
            # which teaches the estimate only that the model is slower than it thought.
            elapsed = time.monotonic() - started
            if elapsed > self.admission.cost_s(job.estimate_s):
                self.admission.record(job.estimate_s, elapsed)
            raise
        self.admission.record(job.estimate_s, time.monotonic() - started)
        return generation

    def _generate_blocking(self, job: Job, index: int = 0) -> Generation:
        import torch

        request = job.request
        seed = request.seed if request.seed is not None else secrets.randbelow(2**31)
        LOG.info(
            "generating %d image(s) %dx%d steps=%d guidance=%.2f seed=%d on %s (estimate %.1f s)",
            request.num_images,
            job.width,
            job.height,
            request.num_inference_steps,
            request.guidance_scale,
            seed,
            self.devices[index],
            job.estimate_s,
        )
        started = time.monotonic()
        # A CPU generator gives the same images for the same seed on any device.
        generator = torch.Generator("cpu").manual_seed(seed)
        # The asyncio lock orders requests; this one guards the pipeline itself should a
        # cancelled request's thread still be running when the next one starts.
        with self._pipe_locks[index]:
            try:
                pipe = self._pipes[index]
                result = pipe(
                    **families.call_kwargs(pipe, request.prompt, request.negative_prompt, request.guidance_scale),
                    num_inference_steps=request.num_inference_steps,
                    width=job.width,
                    height=job.height,
                    num_images_per_prompt=request.num_images,
                    generator=generator,
                    output_type="pil",
                    callback_on_step_end=_stop_when_gone(job, self.settings.invocation_limit_s),
                )
            except torch.cuda.OutOfMemoryError:
                # The request asked for more than this GPU holds: the caller's to change, and the
                # server stays up for the next one once the cached blocks are given back.
                torch.cuda.empty_cache()
                raise BadRequestError(
                    f"{request.num_images} image(s) of {job.width}x{job.height} do not fit in this GPU's memory; "
                    "ask for fewer num_images or a smaller width and height",
                    field="num_images",
                ) from None
        pngs = [to_png(image) for image in result.images]
        elapsed = time.monotonic() - started
        LOG.info("generated %d image(s) in %.2f s", len(pngs), elapsed)
        return Generation(images=pngs, seed=seed, width=job.width, height=job.height, elapsed_s=elapsed)


def _stop_when_gone(job: Job, limit_s: float) -> Callable[..., dict[str, Any]]:
    total = job.request.num_inference_steps

    def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        # Raising ends the denoising loop at once; setting pipe._interrupt would still decode.
        if job.gone.is_set():
            raise ClientGoneError(f"the client went away after step {step + 1} of {total}")
        if time.monotonic() > job.deadline:
            raise DeadlineError(
                f"stopped after step {step + 1} of {total}: SageMaker's {limit_s:g} s limit passed "
                f"(estimated {job.estimate_s:.1f} s) and its caller has been told the request timed out; "
                "retry with fewer num_inference_steps, num_images or pixels"
            )
        return {}

    return on_step_end
