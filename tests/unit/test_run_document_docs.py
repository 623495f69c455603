"""docs/run-document.md's field tables are the run document's model: generated from it, and held to it here."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdflow_common import run_document_docs
from sdflow_common.run_document_docs import ALLOWED_NOTES, BLOCKS, DASH, block_model, main, render, table
from sdflow_common.training_options import PROCESSING_MAX_RUNTIME_LIMIT

DOCS = Path(__file__).resolve().parents[2] / "docs" / "run-document.md"


def _row(block: str, name: str) -> str:
    [row] = [line for line in table(block).splitlines() if line.startswith(f"| `{name}` |")]
    return row


def test_run_document_docs_committed_tables_are_the_models() -> None:
    page = DOCS.read_text(encoding="utf-8")
    assert render(page) == page, (
        "docs/run-document.md's field tables differ from the model: "
        "PYTHONPATH=layers/common .venv/bin/python -m sdflow_common.run_document_docs --write docs/run-document.md"
    )


def test_run_document_docs_processing_runtime_is_the_limit_validate_run_enforces() -> None:
    page = DOCS.read_text(encoding="utf-8")
    row = _row("download", "max_runtime_seconds")
    assert f"60 {DASH} {PROCESSING_MAX_RUNTIME_LIMIT} (9 days)" in row
    assert row in page
    assert "2419200" not in row


@pytest.mark.parametrize("path", sorted(ALLOWED_NOTES))
def test_run_document_docs_allowed_note_names_a_field_of_the_model(path: str) -> None:
    block, _, name = path.rpartition(".")
    assert name in block_model(block).model_fields


def test_run_document_docs_every_block_has_its_table_on_the_page() -> None:
    page = DOCS.read_text(encoding="utf-8")
    for block in BLOCKS:
        assert f"<!-- fields: {block} -->\n{table(block)}<!-- end fields -->" in page


def test_run_document_docs_check_of_a_page_with_a_changed_limit_fails(tmp_path: Path) -> None:
    page = tmp_path / "run-document.md"
    page.write_text(
        DOCS.read_text(encoding="utf-8").replace(f"60 {DASH} 777600 (9 days)", f"60 {DASH} 2419200 (28 days)")
    )
    assert main(["--check", str(page)]) == 1
    assert main(["--write", str(page)]) == 0
    assert main(["--check", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == DOCS.read_text(encoding="utf-8")


def test_run_document_docs_page_without_a_blocks_table_is_refused_naming_it() -> None:
    page = DOCS.read_text(encoding="utf-8").replace("<!-- fields: approval -->", "")
    with pytest.raises(run_document_docs.StaleDocs, match="no table for: approval"):
        render(page)
