from pathlib import Path

from fleet.core.codes import CATALOGUE, Code, markdown_table

REQUIRED = {
    "OK", "OK_TRUNCATED", "OK_THINKING_FORCED", "E_INPUT_INVALID", "E_AUTH", "E_PROMPT_TOO_LONG",
    "E_COLLECT_FAILED", "E_THINK_LOOP", "E_EMPTY_ANSWER", "E_OUTPUT_INVALID",
    "E_UPSTREAM_TIMEOUT", "E_UPSTREAM_UNAVAILABLE", "E_UPSTREAM_ERROR", "E_CANCELLED",
    "E_DEADLINE", "E_INTERNAL",
}


def test_catalogue_covers_every_code_with_unique_numbers():
    assert set(CATALOGUE) == set(Code)
    numbers = [info.number for info in CATALOGUE.values()]
    assert len(numbers) == len(set(numbers))
    assert {c.value for c in Code} >= REQUIRED


def test_ok_codes_are_the_success_family():
    assert {c for c in Code if c.ok} == {c for c in Code if c.number < 100}


def test_docs_table_is_generated_from_the_catalogue():
    page = (Path(__file__).parents[2] / "docs" / "codes.md").read_text(encoding="utf-8")
    assert markdown_table() in page, "docs/codes.md is stale: paste the output of fleet codes"
