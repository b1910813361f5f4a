"""proto/ is generated from the messages and the subject catalogue; it must not drift."""

from pathlib import Path

from shared.proto_gen import render

PROTO = Path(__file__).resolve().parents[2] / "proto"


def test_proto_matches_the_messages():
    expected = render()
    on_disk = {
        p.relative_to(PROTO).as_posix(): p.read_text() for p in PROTO.rglob("*") if p.is_file()
    }
    stale = sorted(k for k in expected if on_disk.get(k) != expected[k])
    extra = sorted(set(on_disk) - set(expected))
    assert not stale and not extra, (
        f"proto/ is out of date (stale: {stale}, extra: {extra}); run scripts/gen-docs"
    )


def test_every_message_has_a_schema_with_its_tag():
    for rel, text in render().items():
        if rel.startswith("schemas/"):
            name = rel.removeprefix("schemas/").removesuffix(".json")
            assert f'"{name}"' in text  # the tag value a receiver dispatches on
