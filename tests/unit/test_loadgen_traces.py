"""Trace readers: every format from a small fixture written here, detection, errors, and
the two real traces the repository ships in traces/."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from loadgen.traces import (
    BAILIAN_BLOCK,
    MOONCAKE_BLOCK,
    TraceError,
    TraceRequest,
    detect_format,
    parse_datetime_s,
    read_trace,
    write_trace,
)
from tests.shared_traces import AZURE_HEAD, azure_slice, trace_path


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def jsonl(path: Path, rows: list[dict]) -> Path:
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def test_azure_csv(tmp_path: Path) -> None:
    p = write(
        tmp_path / "azure.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:46.1805900,10,1\n",
    )
    assert detect_format(p) == "azure"
    reqs = read_trace(p)
    # Sorted by arrival, the first at 0; the 7-digit fractions kept exactly.
    assert [(r.input_tokens, r.output_tokens) for r in reqs] == [(10, 1), (374, 44), (396, 109)]
    assert reqs[0].arrival_s == 0
    assert reqs[1].arrival_s == pytest.approx(0.5, abs=1e-6)
    assert reqs[2].arrival_s == pytest.approx(4.814579, abs=1e-6)
    assert all(r.model is None and r.hash_ids == () for r in reqs)


def test_datetime_parsing_is_robust() -> None:
    a = parse_datetime_s("2023-11-16 18:15:46.6805900")
    b = parse_datetime_s("2023-11-16T18:15:46.68059")
    c = parse_datetime_s("2023-11-16 18:15:47")
    assert a == pytest.approx(b) and c - a == pytest.approx(0.31941, abs=1e-6)
    assert parse_datetime_s("2023-11-16 18:15:46.5+00:00") == pytest.approx(a - 0.18059, abs=1e-6)


def test_burstgpt_old_and_new_columns(tmp_path: Path) -> None:
    old = write(
        tmp_path / "old.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,GPT-4,1087,0,1087,API log\n",
    )
    new = write(
        tmp_path / "new.csv",
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,"
        "Total tokens,Log Type\n"
        "10.5,s1,1.2,ChatGPT,100,20,120,Conversation log\n"
        "11.0,s1,0.8,ChatGPT,150,30,180,Conversation log\n",
    )
    assert detect_format(old) == detect_format(new) == "burstgpt"
    a = read_trace(old)
    assert [(r.arrival_s, r.model, r.input_tokens, r.output_tokens, r.kind) for r in a] == [
        (0.0, "ChatGPT", 472, 18, "Conversation log"),
        (40.0, "GPT-4", 1087, 0, "API log"),
    ]
    b = read_trace(new)
    assert [r.session_id for r in b] == ["s1", "s1"] and b[1].arrival_s == 0.5


def test_mooncake_jsonl(tmp_path: Path) -> None:
    p = jsonl(
        tmp_path / "mc.jsonl",
        [
            {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]},
            {"timestamp": 30535, "input_length": 6472, "output_length": 26, "hash_ids": [46, 52]},
        ],
    )
    assert detect_format(p) == "mooncake"
    a, b = read_trace(p)
    assert a.arrival_s == 0 and b.arrival_s == pytest.approx(3.053)  # milliseconds
    assert a.hash_ids == (46, 47) and a.block_size == MOONCAKE_BLOCK == 512
    assert (b.input_tokens, b.output_tokens) == (6472, 26)


def test_bailian_jsonl_sessions_follow_parents(tmp_path: Path) -> None:
    base = {"type": "text", "hash_ids": [1, 2, 3]}
    p = jsonl(
        tmp_path / "qwen.jsonl",
        [
            {
                "chat_id": 159,
                "parent_chat_id": -1,
                "timestamp": 61.114,
                "input_length": 521,
                "output_length": 132,
                "turn": 1,
                **base,
            },
            {
                "chat_id": 7,
                "parent_chat_id": -1,
                "timestamp": 61.5,
                "input_length": 40,
                "output_length": 10,
                "turn": 1,
                "type": "search",
                "hash_ids": [9, 10, 11],
            },
            {
                "chat_id": 160,
                "parent_chat_id": 159,
                "timestamp": 75.0,
                "input_length": 700,
                "output_length": 50,
                "turn": 2,
                **base,
            },
            {
                "chat_id": 161,
                "parent_chat_id": 160,
                "timestamp": 90.25,
                "input_length": 900,
                "output_length": 5,
                "turn": 3,
                **base,
            },
        ],
    )
    assert detect_format(p) == "bailian"
    reqs = read_trace(p)
    assert [r.arrival_s for r in reqs] == pytest.approx([0, 0.386, 13.886, 29.136])  # seconds
    assert [r.session_id for r in reqs] == ["159", "7", "159", "159"]
    assert [r.turn for r in reqs] == [1, 1, 2, 3]
    assert reqs[2].parent_id == "159" and reqs[0].parent_id is None
    assert reqs[1].kind == "search" and reqs[0].block_size == BAILIAN_BLOCK == 16


def test_meshserve_format_round_trips(tmp_path: Path) -> None:
    reqs = [
        TraceRequest(
            0.0, 100, 10, model="a", hash_ids=(1, 2), block_size=16, session_id="a-0", turn=1
        ),
        TraceRequest(1.25, 300, 20, model="b"),
    ]
    write_trace(tmp_path / "t.jsonl", reqs)
    assert detect_format(tmp_path / "t.jsonl") == "meshserve"
    assert read_trace(tmp_path / "t.jsonl") == reqs


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty file"),
        ("a,b,c\n1,2,3\n", "unknown trace format"),
        ('{"foo": 1}\n', "unknown JSONL trace"),
        ("{not json\n", "not a JSON object"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12x,3\n", ":2:"),
        ('{"timestamp": 1, "input_length": 5}\n', "unknown JSONL trace"),
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 2}\n{"timestamp": 2}\n',
            "missing field 'input_length'",
        ),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
    ],
)
def test_unreadable_traces_name_file_and_reason(tmp_path: Path, text: str, why: str) -> None:
    p = write(tmp_path / "bad.trace", text)
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert str(p) in str(e.value) and why in str(e.value)


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "nope.csv")
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00\x81garbage")
    with pytest.raises(TraceError, match="not a text file"):
        read_trace(tmp_path / "bin")


def test_real_azure_trace() -> None:
    """The Azure trace in traces/, or (in a checkout without it) its first 300 requests kept
    in tests/data: this test always runs."""
    path = azure_slice()
    azure = read_trace(path)
    assert (azure[0].input_tokens, azure[0].output_tokens) == (374, 44)
    assert azure[0].arrival_s == 0 and all(
        a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(azure)
    )
    if path == AZURE_HEAD:
        assert len(azure) == 300
    else:
        assert len(azure) == 19366
        assert 3000 < azure[-1].arrival_s < 3700  # about one hour


MOONCAKE = trace_path("mooncake_conversation.jsonl")


def test_real_mooncake_trace() -> None:
    """The Mooncake conversation trace the repository ships in traces/."""
    mc = read_trace(MOONCAKE)
    assert len(mc) == 12031 and mc[0].hash_ids[0] == 0 and mc[0].block_size == 512
    # Mooncake's ids cover the prompt: ceil(input / 512) of them.
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in mc[:200])
