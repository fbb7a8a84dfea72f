"""benchmarks/corpus.py: the one reader of a conversation corpus file, in each format it takes."""
import gzip
import json

from benchmarks.corpus import read_conversations

CONVS = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i} é"}, {"role": "assistant", "content": "a"}]}
         for i in range(3)]


def test_jsonl_gzipped_jsonl_and_json_list_read_the_same(tmp_path):
    lines = "".join(json.dumps(c) + "\n\n" for c in CONVS)  # blank lines are skipped
    (tmp_path / "c.jsonl").write_text(lines, encoding="utf-8")
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "c.json").write_text("\n  " + json.dumps(CONVS), encoding="utf-8")
    for name in ("c.jsonl", "c.jsonl.gz", "c.json"):
        assert list(read_conversations(tmp_path / name)) == CONVS, name


def test_jsonl_is_read_only_as_far_as_iterated(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(CONVS[0]) + "\n" + "{not json\n", encoding="utf-8")
    assert next(read_conversations(path)) == CONVS[0]  # the broken second line is never parsed
