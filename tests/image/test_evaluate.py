"""The evaluate job on the tiny model: a model folder and its model.tar.gz, evaluation.json and the
grid, prompts from a flag or a file, early failures naming the bad prompt or folder, and a stand-in
model that draws every prompt exactly scoring 1.0 against the random base."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from evaluation_fixtures import scene_samples, write_holdout_tar
from PIL import Image

from sdflow_image import holdout, scenes
from sdflow_image.evaluation import adherence, evaluate, grid

pytestmark = pytest.mark.image

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "a red circle on a blue background",
    "a yellow square on a black background",
    "a white triangle on a green background",
]
ACCURACIES = {"foreground_accuracy", "background_accuracy", "shape_accuracy"}
STOPPED = "stopped by signal 15 (SageMaker stops jobs with SIGTERM) before it wrote evaluation.json"


@pytest.fixture(autouse=True)
def opt_ml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SDFLOW_OPT_ML", str(tmp_path / "opt_ml"))
    return tmp_path / "opt_ml"


def job_args(model_dir: Path, base: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model_dir", str(model_dir), "--base_model_dir", str(base), "--output_dir", str(out),
        "--num_inference_steps", "2", *extra,
    ]  # fmt: skip


def run_job(argv: list[str]) -> int:
    return evaluate.main(evaluate.parse_args(argv))


def exit_message(opt_ml: Path) -> str:
    return (opt_ml / "output" / "message").read_text()


def assert_evaluation(out: Path, prompts: int) -> dict[str, Any]:
    document = json.loads((out / "evaluation.json").read_text())
    assert document["prompts"] == prompts
    assert document["grid"] == "adherence.png"
    assert set(document["base"]) == ACCURACIES
    for value in (document["prompt_adherence"], document["base_prompt_adherence"], *document["base"].values()):
        assert 0.0 <= value <= 1.0
    for key in ACCURACIES:
        assert 0.0 <= document[key] <= 1.0
    assert len(document["results"]) == prompts
    assert document["metrics"]["prompt_adherence"] == {
        "base": document["base_prompt_adherence"], "trained": document["prompt_adherence"], "samples": prompts,
    }  # fmt: skip
    # No --holdout_dir, no --clip_model_dir: the held-out metrics are listed, not guessed.
    assert [m["metric"] for m in document["missing"]] == ["clip_score", "kid", "fid"]
    assert all(m["reason"].startswith("no held-out samples: ") for m in document["missing"])
    assert document["holdout"]["samples"] == 0
    assert document["holdout"]["grid"] is None
    with Image.open(out / "adherence.png") as grid:
        assert grid.size[0] > 0
    return document


def test_evaluate_model_folder_writes_evaluation_and_grid(
    evaluation_models: dict[str, Path], tmp_path: Path, opt_ml: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "evaluation"

    status = run_job(
        job_args(evaluation_models["trained"], evaluation_models["base"], out, "--prompts", json.dumps(PROMPTS))
    )

    assert status == 0
    document = assert_evaluation(out, len(PROMPTS))
    assert document["settings"]["resolution"] == 32  # from sdflow_model.json
    printed = capsys.readouterr().out
    assert f"eval:prompt_adherence={document['prompt_adherence']:.6f}" in printed
    assert f"eval:base_prompt_adherence={document['base_prompt_adherence']:.6f}" in printed
    assert "prompt adherence: base " in printed
    assert "(3 prompts)" in printed
    message = exit_message(opt_ml)
    assert message.startswith("ok: prompt_adherence (↑ better) base ")
    assert message.endswith("(3 samples); missing: clip_score, kid, fid")


def test_evaluate_model_tar_gz_is_extracted_and_scored_alike(
    evaluation_models: dict[str, Path], tmp_path: Path
) -> None:
    prompts = ["--prompts", json.dumps(PROMPTS)]
    work = tmp_path / "work"
    run_job(job_args(evaluation_models["trained"], evaluation_models["base"], tmp_path / "folder", *prompts))

    status = run_job(
        job_args(
            evaluation_models["archive"], evaluation_models["base"], tmp_path / "tar", *prompts, "--work_dir", str(work)
        )
    )

    assert status == 0
    from_tar, from_folder = (json.loads((tmp_path / n / "evaluation.json").read_text()) for n in ("tar", "folder"))
    assert from_tar == from_folder
    assert list(work.iterdir()) == []  # the extracted model is gone


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("prompts.json", json.dumps(PROMPTS)),
        ("prompts.txt", f"# held out\n{PROMPTS[0]}\n\n  {PROMPTS[1]}  \n# {PROMPTS[2]}\n{PROMPTS[2]}\n"),
    ],
)
def test_read_prompts_json_or_text_file_reads_every_prompt(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    args = evaluate.parse_args(job_args(tmp_path, tmp_path, tmp_path, "--prompts_file", str(tmp_path / name)))

    assert evaluate.read_prompts(args) == PROMPTS


def test_read_prompts_neither_flag_gives_held_out_prompts(tmp_path: Path) -> None:
    args = evaluate.parse_args(job_args(tmp_path, tmp_path, tmp_path))

    assert evaluate.read_prompts(args) == adherence.default_prompts()


def test_read_prompts_too_many_fails_naming_limit(tmp_path: Path) -> None:
    args = evaluate.parse_args(job_args(tmp_path, tmp_path, tmp_path, "--prompts", json.dumps(PROMPTS * 100)))

    with pytest.raises(evaluate.EvaluationError, match="at most 256"):
        evaluate.read_prompts(args)


def test_evaluate_prompt_outside_grammar_exits_nonzero_naming_it(
    evaluation_models: dict[str, Path], tmp_path: Path, opt_ml: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPTS[0]}\na photo of a cat\n")
    argv = job_args(
        evaluation_models["trained"], evaluation_models["base"], tmp_path / "out", "--prompts_file", str(prompts)
    )

    # Through bin/evaluate, as SageMaker starts it: it fails before any model is loaded.
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "training_image" / "bin" / "evaluate"), *argv],
        capture_output=True, text=True, timeout=60, check=False,  # SDFLOW_OPT_ML: the opt_ml fixture's
    )  # fmt: skip

    assert result.returncode != 0
    message = exit_message(opt_ml)
    assert "prompt 2: prompt 'a photo of a cat'" in message
    assert scenes.GRAMMAR in message
    assert "a photo of a cat" in (opt_ml / "output" / "failure").read_text()
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_evaluate_sigterm_while_rendering_ends_in_a_sentence_and_exits_stopped(
    evaluation_models: dict[str, Path], tmp_path: Path, opt_ml: Path
) -> None:
    # The 48 held-out scene prompts at 200 steps: rendering runs far longer than the stop takes.
    argv = job_args(
        evaluation_models["trained"], evaluation_models["base"], tmp_path / "out", "--scene_adherence", "true"
    )
    argv[argv.index("--num_inference_steps") + 1] = "200"
    job = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "training_image" / "bin" / "evaluate"), *argv],
        stderr=subprocess.PIPE, text=True,  # SDFLOW_OPT_ML: the opt_ml fixture's
    )  # fmt: skip
    assert job.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    for line in job.stderr:
        lines.append(line)
        if " rendering " in line:
            time.sleep(1.0)  # inside the pipelines' loading or rendering
            job.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "no 'rendering' line in time:\n" + "".join(lines[-30:])
    rest = job.communicate(timeout=120)[1]
    log = "".join(lines) + rest

    assert job.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.endswith(f"{STOPPED}."), last
    # A stop is not a failure (as the training job's): no failure file, and the exit message says it.
    assert not (opt_ml / "output" / "failure").exists()
    assert exit_message(opt_ml) == f"{STOPPED}."
    assert not (tmp_path / "out" / "evaluation.json").exists()


@pytest.mark.parametrize("flag", ["--model_dir", "--base_model_dir"])
def test_evaluate_folder_without_model_index_fails_naming_flag_and_fix(
    evaluation_models: dict[str, Path], tmp_path: Path, opt_ml: Path, flag: str
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(evaluation_models["base"], broken)
    (broken / "model_index.json").unlink()
    model_dir, base = (
        (broken, evaluation_models["base"]) if flag == "--model_dir" else (evaluation_models["trained"], broken)
    )

    status = run_job(job_args(model_dir, base, tmp_path / "out", "--prompts", json.dumps(PROMPTS)))

    assert status == 1
    message = exit_message(opt_ml)
    assert f"{flag} {broken} holds no diffusers pipeline (model_index.json missing); mount" in message


def test_evaluate_corrupt_model_tar_gz_fails_naming_flag(
    tmp_path: Path, evaluation_models: dict[str, Path], opt_ml: Path
) -> None:
    folder = tmp_path / "artifact"
    folder.mkdir()
    (folder / "model.tar.gz").write_bytes(b"not a tar file")

    status = run_job(job_args(folder, evaluation_models["base"], tmp_path / "out", "--prompts", json.dumps(PROMPTS)))

    assert status == 1
    assert f"--model_dir {folder / 'model.tar.gz'} is not a readable tar.gz archive" in exit_message(opt_ml)


def test_evaluate_corrupt_weights_fail_naming_flag(
    tmp_path: Path, evaluation_models: dict[str, Path], opt_ml: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(evaluation_models["trained"], broken)
    for weights in (broken / "unet").glob("*.safetensors"):
        weights.write_bytes(b"truncated")

    status = run_job(job_args(broken, evaluation_models["base"], tmp_path / "out", "--prompts", json.dumps(PROMPTS)))

    assert status == 1
    assert f"--model_dir {broken}: the pipeline does not load" in exit_message(opt_ml)


class DrawingPipeline:
    """Stands in for a model that follows every prompt exactly: it draws the prompt's scene."""

    def set_progress_bar_config(self, **_: Any) -> None:
        pass

    def __call__(self, *, prompt: list[str], height: int, width: int, **_: Any) -> Any:
        # By name, as adherence.render passes it (families.call_kwargs: FLUX.2 klein's first is an image).
        rnd = random.Random(0)
        images = [scenes.draw(scenes.parse_prompt(p), width, height, rnd) for p in prompt]
        return type("Output", (), {"images": images})()


def test_evaluate_model_drawing_each_prompt_scores_one_against_random_base(
    evaluation_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_load = adherence.load_pipeline

    def load(path: Path, device: Any, **kwargs: Any) -> Any:
        return DrawingPipeline() if Path(path) == evaluation_models["trained"] else real_load(path, device, **kwargs)

    monkeypatch.setattr(adherence, "load_pipeline", load)
    out = tmp_path / "out"

    status = run_job(
        job_args(evaluation_models["trained"], evaluation_models["base"], out, "--scene_adherence", "true")
    )

    assert status == 0
    document = assert_evaluation(out, scenes.HELDOUT_COUNT)
    assert document["prompt_adherence"] == 1.0
    assert document["shape_accuracy"] == 1.0
    assert document["base_prompt_adherence"] < 0.3  # chance is 1/8 per colour
    assert all(r["foreground_ok"] and r["background_ok"] for r in document["results"])


# --- held-out metrics -------------------------------------------------------------------------


def write_holdout(root: Path, count: int) -> list[str]:
    """`count` scene samples in two tars under root/holdout/; the captions in selection order."""
    samples = scene_samples(count)
    write_holdout_tar(root / "holdout" / "00000.tar", samples[: count // 2])
    write_holdout_tar(root / "holdout" / "00001.tar", samples[count // 2 :])
    return [s.caption for s in sorted(samples, key=lambda s: holdout.holdout_fraction(s.url or s.key))]


def test_evaluate_holdout_with_clip_writes_metrics_missing_and_grid(
    evaluation_models: dict[str, Path], tiny_clip_dir: Path, tmp_path: Path, opt_ml: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    captions = write_holdout(tmp_path / "data", 6)
    out = tmp_path / "evaluation"
    extra = ["--holdout_dir", str(tmp_path / "data"), "--holdout_samples", "4", "--clip_model_dir", str(tiny_clip_dir)]

    status = run_job(job_args(evaluation_models["trained"], evaluation_models["base"], out, *extra))

    assert status == 0
    document = json.loads((out / "evaluation.json").read_text())
    assert list(document["metrics"]) == ["clip_score", "kid"]
    clip, kid = document["metrics"]["clip_score"], document["metrics"]["kid"]
    assert clip["samples"] == kid["samples"] == kid["subset_size"] == 4
    assert 0.0 <= clip["base"] <= 100.0
    # Every subset of 4 is the whole set: the std would be 0, no error bar, so it is not reported.
    assert set(kid) == {"base", "trained", "samples", "subset_size"}
    # The "trained" model is the base's copy: same weights, same seed per caption, same scores.
    assert clip["trained"] == clip["base"]
    assert kid["trained"] == kid["base"]
    assert [m["metric"] for m in document["missing"]] == ["fid", "prompt_adherence"]
    assert "4 held-out samples, fewer than the CLIP model's 32 feature dimensions" in document["missing"][0]["reason"]
    assert document["holdout"]["captions"] == captions[:4]
    assert document["holdout"]["grid"] == "holdout.png"
    assert document["holdout"]["candidates"] == 6
    assert document["clip_model"] == {"projection_dim": 32, "source": "--clip_model_dir"}
    assert "grid" not in document  # no scene adherence, no adherence.png
    assert not (out / "adherence.png").exists()
    with Image.open(out / "holdout.png") as picture:
        assert picture.height == grid.HEADER + 4 * (grid.CELL + grid.GAP)
    assert f"eval:clip_score={clip['trained']:.6f}" in capsys.readouterr().out
    message = exit_message(opt_ml)
    clip_line = f"clip_score (↑ better) base {clip['base']:.2f} → trained {clip['trained']:.2f} (4 samples)"
    assert message.startswith(f"ok: {clip_line}; kid (↓ better) base ")
    assert message.endswith("; missing: fid, prompt_adherence")


def test_evaluate_holdout_without_clip_lists_clip_metrics_missing(
    evaluation_models: dict[str, Path], tmp_path: Path
) -> None:
    write_holdout(tmp_path / "data", 2)
    out = tmp_path / "evaluation"
    extra = ["--holdout_dir", str(tmp_path / "data"), "--scene_adherence", "true", "--prompts", json.dumps(PROMPTS[:1])]

    status = run_job(job_args(evaluation_models["trained"], evaluation_models["base"], out, *extra))

    assert status == 0
    document = json.loads((out / "evaluation.json").read_text())
    assert list(document["metrics"]) == ["prompt_adherence"]
    assert document["missing"] == [
        {"metric": name, "reason": "no CLIP model: set evaluation.clip_model_uri"}
        for name in ("clip_score", "kid", "fid")
    ]
    assert document["holdout"]["samples"] == 2
    assert document["clip_model"] is None
    assert (out / "holdout.png").is_file()
    assert (out / "adherence.png").is_file()


def test_evaluate_drawing_model_scores_closer_to_held_out_than_random_base(
    evaluation_models: dict[str, Path], tiny_clip_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_load = adherence.load_pipeline

    def load(path: Path, device: Any, *args: Any, **kwargs: Any) -> Any:
        return (
            DrawingPipeline()
            if Path(path) == evaluation_models["trained"]
            else real_load(path, device, *args, **kwargs)
        )

    monkeypatch.setattr(adherence, "load_pipeline", load)
    write_holdout(tmp_path / "data", 40)
    out = tmp_path / "evaluation"
    extra = ["--holdout_dir", str(tmp_path / "data"), "--holdout_samples", "32", "--clip_model_dir", str(tiny_clip_dir)]

    status = run_job(job_args(evaluation_models["trained"], evaluation_models["base"], out, *extra))

    assert status == 0
    metrics = json.loads((out / "evaluation.json").read_text())["metrics"]
    assert metrics["fid"]["samples"] == 32  # N == projection_dim: FID is computed
    assert metrics["kid"]["trained"] < metrics["kid"]["base"]
    assert metrics["fid"]["trained"] < metrics["fid"]["base"]


def test_evaluate_neither_holdout_nor_scene_adherence_fails_naming_flags(
    evaluation_models: dict[str, Path], tmp_path: Path, opt_ml: Path
) -> None:
    status = run_job(job_args(evaluation_models["trained"], evaluation_models["base"], tmp_path / "out"))

    assert status == 1
    message = exit_message(opt_ml)
    assert message.startswith("EvaluationError: nothing to evaluate: pass --holdout_dir")
    assert "--scene_adherence true" in message
    assert not (tmp_path / "out").exists()


def test_evaluate_holdout_dir_without_tars_fails_when_nothing_else(
    evaluation_models: dict[str, Path], tmp_path: Path, opt_ml: Path
) -> None:
    (tmp_path / "data").mkdir()
    argv = job_args(
        evaluation_models["trained"],
        evaluation_models["base"],
        tmp_path / "out",
        "--holdout_dir",
        str(tmp_path / "data"),
    )

    status = run_job(argv)

    assert status == 1
    assert f"nothing to evaluate: --holdout_dir {tmp_path / 'data'} holds no .tar file" in exit_message(opt_ml)


def test_evaluate_bad_clip_folder_fails_before_rendering(
    evaluation_models: dict[str, Path], tmp_path: Path, opt_ml: Path
) -> None:
    write_holdout(tmp_path / "data", 2)
    extra = ["--holdout_dir", str(tmp_path / "data"), "--clip_model_dir", str(tmp_path / "no-clip")]

    status = run_job(job_args(evaluation_models["trained"], evaluation_models["base"], tmp_path / "out", *extra))

    assert status == 1
    assert f"--clip_model_dir {tmp_path / 'no-clip'} does not exist" in exit_message(opt_ml)
    assert not (tmp_path / "out").exists()
