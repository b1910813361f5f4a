"""docs/settings.md is the settings reference shared/settings.py renders (scripts/gen-docs),
and the README points to it instead of holding a copy."""

from pathlib import Path

from shared.settings import leaves
from shared.settings_doc import SECTIONS, render

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_DOC = ROOT / "docs" / "settings.md"


def test_the_settings_reference_lists_every_setting_as_the_code_defines_it():
    text = SETTINGS_DOC.read_text()
    assert render() == text, "docs/settings.md is stale: run scripts/gen-docs"
    for leaf in leaves():
        assert f"`{leaf.env}`" in text


def test_every_section_has_a_title():
    assert {leaf.section for leaf in leaves()} == set(SECTIONS)


def test_the_readme_points_to_the_settings_reference():
    readme = (ROOT / "README.md").read_text()
    assert "docs/settings.md" in readme
    assert "settings:begin" not in readme  # the table lives in docs/settings.md only
