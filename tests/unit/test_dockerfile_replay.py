"""The Dockerfile build replay (.ci/dockerfile_replay.py, `make image-replay` in CI): what it
replays, what it does not and why, and that a failing RUN line fails it naming the line. The
replay itself (minutes: it installs the image's whole stack) runs in CI after `make test`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

_SPEC = importlib.util.spec_from_file_location("dockerfile_replay", REPO_ROOT / ".ci" / "dockerfile_replay.py")
assert _SPEC is not None
assert _SPEC.loader is not None
replay_tool = importlib.util.module_from_spec(_SPEC)
sys.modules["dockerfile_replay"] = replay_tool  # dataclasses resolve their module by name
_SPEC.loader.exec_module(replay_tool)


def test_not_replayed_is_exactly_the_apt_and_efa_lines_of_the_dockerfile() -> None:
    steps = replay_tool.parse()
    planned = replay_tool.plan(steps)
    runs = [s.value for s in planned if s.instruction == "RUN"]
    skipped = [r for r in runs if r in replay_tool.NOT_REPLAYED]
    assert len(skipped) == len(replay_tool.NOT_REPLAYED) == 2
    assert any("efa_installer.sh" in r for r in skipped)
    assert any(r.startswith("apt-get update") for r in skipped)
    replayed = [r for r in runs if r not in replay_tool.NOT_REPLAYED]
    assert any("pip install" in r for r in replayed), "the image's Python stack is replayed"
    for run in replayed:
        assert "apt-get" not in run, f"needs the base's OS: {run}"
        assert "curl" not in run, f"needs the open network: {run}"


def test_plan_unreplayed_line_changed_in_dockerfile_fails_naming_the_list(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    text = (replay_tool.DOCKERFILE).read_text().replace("--no-verify", "--no-verify --debug")
    dockerfile.write_text(text)
    with pytest.raises(replay_tool.ReplayError, match="NOT_REPLAYED lists a RUN line the Dockerfile no longer has"):
        replay_tool.plan(replay_tool.parse(dockerfile))


def test_plan_instruction_it_cannot_stand_for_fails_naming_the_line(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM base\nUSER nobody\nRUN true\n")
    with pytest.raises(replay_tool.ReplayError, match="line 2: USER is not replayed"):
        replay_tool.plan(replay_tool.parse(dockerfile), not_replayed={})


def test_replay_failing_run_line_fails_naming_its_line_after_running_those_before(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "FROM base\n"
        "ARG FLAVOUR=dev\n"
        "ENV BUILD_EXT=1 \\\n    TARGET=" + str(marker) + "\n"
        'RUN test "$BUILD_EXT" = 1 && test "$FLAVOUR" = dev && touch "$TARGET"\n'
        "RUN echo 'Could not find any kernel compatible with the current environment' >&2 && exit 1\n"
        "RUN touch never\n"
    )
    with pytest.raises(replay_tool.ReplayError, match=r"Dockerfile line 6: RUN exited 1 \(the image build would fail"):
        replay_tool.replay(replay_tool.parse(dockerfile), {}, not_replayed={})
    assert marker.exists(), "the line before ran, with the ARG and ENV values in effect"


def test_run_environment_is_build_values_over_host_network_settings_only() -> None:
    step = replay_tool.Step("RUN", "true", 9, args={"TORCH_VERSION": "2.5.1"}, envs={"PIP_NO_CACHE_DIR": "1"})
    host = {"HOME": "/home/ci", "PIP_INDEX_URL": "https://mirror/simple", "PIP_NO_CACHE_DIR": "0", "AWS_SECRET": "x"}
    env = replay_tool.run_environment(step, host)
    assert env == {
        "HOME": "/home/ci",
        "PIP_INDEX_URL": "https://mirror/simple",
        "PIP_NO_CACHE_DIR": "1",  # the Dockerfile's ENV wins
        "PATH": replay_tool.BASE_PATH,
        "TORCH_VERSION": "2.5.1",
    }


@pytest.mark.parametrize(
    ("relative", "excluded"),
    [
        ("sdflow_image/__pycache__/train.cpython-311.pyc", True),
        ("sdflow_image/builders/tiny_model.py", True),
        ("Dockerfile", True),
        ("weights/unet.safetensors", True),
        ("sdflow_image/training/train.py", False),
        ("bin/train", False),
    ],
)
def test_ignored_reads_the_contexts_dockerignore(relative: str, excluded: bool) -> None:
    assert replay_tool.ignored(relative, replay_tool.dockerignore_patterns()) is excluded
