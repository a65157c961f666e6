"""A test that needs the shared data says, when it is missing, what that data is and where it is
looked for (README "Running the tests"); under CI it fails instead of skipping."""

from __future__ import annotations

import pytest

from tests.gguffiles import SMOLLM2_FILES, SMOLLM2_SOURCE
from tests.llamafiles import STORIES_FILES, STORIES_SOURCE, shared_data_or_skip


@pytest.mark.parametrize(
    ("folder", "names", "source", "says"),
    [
        (
            "stories260K",
            STORIES_FILES,
            STORIES_SOURCE,
            "Karpathy's stories260K llama2.c checkpoint",
        ),
        ("smollm2", SMOLLM2_FILES, SMOLLM2_SOURCE, "llama.cpp's own outputs for SmolLM2"),
    ],
)
def test_a_missing_shared_folder_skips_saying_what_it_is_and_where(
    tmp_path, monkeypatch, folder, names, source, says
):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        shared_data_or_skip(tmp_path / folder, names, source)
    message = str(skipped.value)
    assert message.startswith(f"shared data {tmp_path / folder} is absent (missing {names[0]}, ")
    assert says in message
    assert "../shared/data beside the checkout, or in $GREENSERVE_SHARED_DATA" in message


def test_under_ci_a_missing_shared_folder_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        shared_data_or_skip(tmp_path / "stories260K", STORIES_FILES, STORIES_SOURCE)
