"""sdflow_image.gpu_check on a CPU machine, with a faked GPU device and driver file: a container that sees a GPU
while torch finds no CUDA fails at once, naming the host's driver and torch's CUDA; every entrypoint (training
launcher, serve, evaluate) refuses to start that way instead of running on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sdflow_image import gpu_check
from sdflow_image.evaluation import evaluate
from sdflow_image.serving import serve
from sdflow_image.training import launcher

R470 = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02  Thu May  2 14:37:44 UTC 2024\nGCC version:  gcc 7\n"


@pytest.fixture
def fake_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A /dev with nvidia0 and an R470 driver file, as the NVIDIA runtime gives a container on an old host."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    driver = tmp_path / "version"
    driver.write_text(R470)
    monkeypatch.setattr(gpu_check, "DEV_DIR", dev)
    monkeypatch.setattr(gpu_check, "DRIVER_VERSION_FILE", driver)
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    return tmp_path


def test_gpu_check_cpu_host_passes(tmp_path: Path) -> None:
    # The images set NVIDIA_VISIBLE_DEVICES=all as ENV: on a CPU host that names no device.
    assert gpu_check.problem(tmp_path, tmp_path / "version", {"NVIDIA_VISIBLE_DEVICES": "all"}) is None
    assert gpu_check.problem(tmp_path, tmp_path / "version", {}) is None


def test_gpu_check_device_without_cuda_fails_naming_driver_and_cuda(fake_gpu: Path) -> None:
    assert not torch.cuda.is_available()  # this machine: the case a too-old driver produces
    with pytest.raises(gpu_check.NoCudaError) as caught:
        gpu_check.require_cuda()
    message = str(caught.value)
    assert "/dev/nvidia0" in message
    assert "/dev/nvidiactl" not in message  # the control node is no GPU
    assert "host NVIDIA driver 470.256.02" in message
    assert f"(CUDA {torch.version.cuda})" in message
    assert "Refusing to run on the CPU" in message


def test_gpu_check_visible_devices_naming_gpus_without_nodes_fails(tmp_path: Path) -> None:
    found = gpu_check.problem(tmp_path, tmp_path / "absent", {"NVIDIA_VISIBLE_DEVICES": "0,1"})
    assert found is not None
    assert "NVIDIA_VISIBLE_DEVICES=0,1" in found
    assert "no NVIDIA driver version in" in found


@pytest.mark.parametrize(("cuda", "need"), [("13.2", "needs driver R580"), ("12.4", "needs driver R525")])
def test_gpu_check_names_the_branch_the_images_cuda_needs(fake_gpu: Path, cuda: str, need: str) -> None:
    def probe() -> tuple[bool, str, str | None, list[str]]:
        return False, "2.15.0", cuda, ["CUDA initialization: The NVIDIA driver on your system is too old"]

    found = gpu_check.problem(probe=probe)
    assert found is not None
    assert f"CUDA {cuda} {need} or newer" in found
    assert "torch said: CUDA initialization: The NVIDIA driver on your system is too old" in found


def test_gpu_check_gpu_with_cuda_passes(fake_gpu: Path) -> None:
    assert gpu_check.problem(probe=lambda: (True, "2.15.0", "13.2", [])) is None


def test_gpu_check_driver_version_is_the_kernel_modules(tmp_path: Path) -> None:
    path = tmp_path / "version"
    path.write_text(R470)
    assert gpu_check.host_driver(path) == "470.256.02"
    assert gpu_check.host_driver(tmp_path / "absent") is None


def test_launcher_gpu_without_cuda_fails_before_training_naming_driver(
    fake_gpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SDFLOW_OPT_ML", str(fake_gpu / "opt_ml"))
    assert launcher.main(["--max_train_steps", "1"]) != 0
    failure = (fake_gpu / "opt_ml" / "output" / "failure").read_text()
    assert "470.256.02" in failure


def test_serve_gpu_without_cuda_exits_1_naming_driver(fake_gpu: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = serve.parse_args(["--model_dir", str(fake_gpu / "model")], environ={})
    assert serve.main(args) == 1
    assert "host NVIDIA driver 470.256.02" in capsys.readouterr().err


def test_evaluate_gpu_without_cuda_fails_naming_driver(fake_gpu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDFLOW_OPT_ML", str(fake_gpu / "opt_ml"))
    args = evaluate.parse_args(
        [
            "--model_dir",
            str(fake_gpu / "model"),
            "--base_model_dir",
            str(fake_gpu / "base"),
            "--output_dir",
            str(fake_gpu / "out"),
        ]
    )
    assert evaluate.main(args) == 1
    assert "470.256.02" in (fake_gpu / "opt_ml" / "output" / "failure").read_text()


# --- cuda-compat first when the driver is older (start_cuda_compat.sh's rule) ------------------------------------


def _compat(tmp_path: Path, driver: str) -> tuple[dict[str, str], Path]:
    compat = tmp_path / "compat"
    compat.mkdir()
    (compat / "libcuda.so.580.95.05").touch()
    (compat / "libcuda.so.1").symlink_to("libcuda.so.580.95.05")
    version = tmp_path / "version"
    version.write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}  Tue Jan  1 00:00:00 UTC 2026\n")
    return {"SDFLOW_CUDA_COMPAT_DIR": str(compat), "LD_LIBRARY_PATH": "/opt/amazon/efa/lib"}, version


def test_compat_older_driver_starts_again_with_compat_first(tmp_path: Path) -> None:
    environ, version = _compat(tmp_path, "535.261.03")
    started: list[tuple[str, list[str], dict[str, str]]] = []
    gpu_check.enable_cuda_compat(environ, version, execve=lambda *call: started.append(call))
    [(executable, argv, env)] = started
    assert executable == argv[0]
    assert env["LD_LIBRARY_PATH"] == f"{tmp_path / 'compat'}:/opt/amazon/efa/lib"
    # The process started again finds the folder first and goes on: no loop.
    assert gpu_check.compat_library_path(env, version) is None


@pytest.mark.parametrize("driver", ["580.95.05", "580.105.08", "595.45.04"])
def test_compat_driver_as_new_as_compats_is_left_alone(tmp_path: Path, driver: str) -> None:
    environ, version = _compat(tmp_path, driver)
    assert gpu_check.compat_driver(tmp_path / "compat") == "580.95.05"
    assert gpu_check.compat_library_path(environ, version) is None


def test_compat_without_driver_file_or_compat_folder_is_left_alone(tmp_path: Path) -> None:
    environ, version = _compat(tmp_path, "535.261.03")
    assert gpu_check.compat_library_path(environ, tmp_path / "absent") is None
    assert gpu_check.compat_library_path({"LD_LIBRARY_PATH": "/x"}, version) is None
    assert gpu_check.compat_library_path({**environ, "SDFLOW_CUDA_COMPAT_DIR": str(tmp_path)}, version) is None


def test_gpu_check_with_compat_in_use_says_so(fake_gpu: Path) -> None:
    environ, _version = _compat(fake_gpu, "535.261.03")
    environ["LD_LIBRARY_PATH"] = environ["SDFLOW_CUDA_COMPAT_DIR"]
    found = gpu_check.problem(environ=environ, probe=lambda: (False, "2.15.0", "13.2", []))
    assert found is not None
    assert "with the cuda-compat 580.95.05 in use here" in found
