"""The README's settings table is the one shared/settings.py renders (scripts/gen-docs)."""

from pathlib import Path

from shared.settings import leaves
from shared.settings_doc import render

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_lists_every_setting_as_the_code_defines_it():
    text = README.read_text()
    assert render(text) == text, "README.md's settings table is stale: run scripts/gen-docs"
    for leaf in leaves():
        assert f"`{leaf.env}`" in text
