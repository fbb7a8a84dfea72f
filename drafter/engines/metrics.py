"""Reading a server's speculative-decoding counters: Prometheus text (vLLM's /metrics), counter
deltas between two snapshots, and the acceptance length each engine's numbers give (vLLM's counters,
SGLang's per-request meta_info and its server-info average). Parsing only: no HTTP, no engine."""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

def sglang_accept_length(responses: Iterable[Mapping[str, Any]]) -> float | None:
    """sum(completion_tokens) / sum(spec_verify_ct) over /generate answers (includes the bonus
    token, contract section 5). None when nothing was verified (speculation off)."""
    tokens = verify = 0
    for resp in responses:
        meta = resp.get("meta_info", resp)
        tokens += int(meta.get("completion_tokens", 0) or 0)
        verify += int(meta.get("spec_verify_ct", 0) or 0)
    return tokens / verify if verify else None


def sglang_avg_accept_length(info: Mapping[str, Any]) -> float | None:
    """internal_states[0].avg_spec_accept_length: cumulative since boot or the last flush_cache."""
    states = info.get("internal_states") or []
    if states and isinstance(states[0], Mapping):
        value = states[0].get("avg_spec_accept_length")
        return float(value) if value is not None else None
    return None


# ---- Prometheus text (vLLM /metrics) ---------------------------------------------------------

_PROM_LINE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(?P<value>\S+)')
_PROM_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line; comments and malformed lines are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        labels = dict(_PROM_LABEL.findall(m.group("labels") or ""))
        samples.append((m.group("name"), labels, value))
    return samples


_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_spec_counters(text: str) -> dict[str, Any]:
    """Cumulative speculative-decoding counters, summed over engines (data-parallel ranks).

    prometheus_client exposes a counter `x` as `x_total` plus a `x_created` timestamp;
    `_created` is a unix time, not a count, and summing it in is a known bug (vllm#41916)."""
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0,
                           "accepted_per_position": {}, "present": False}
    for name, labels, value in parse_prometheus(text):
        if name.endswith("_created"):
            continue
        base = name[: -len("_total")] if name.endswith("_total") else name
        if base in _SPEC_COUNTERS:
            out[_SPEC_COUNTERS[base]] += value
            out["present"] = True
        elif base == _PER_POS and "position" in labels:
            pos = int(labels["position"])
            out["accepted_per_position"][pos] = out["accepted_per_position"].get(pos, 0.0) + value
    return out


def counters_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """after - before. A negative delta means the server restarted in between: refuse it
    rather than report a nonsense acceptance."""
    delta: dict[str, Any] = {}
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        delta[key] = after.get(key, 0.0) - before.get(key, 0.0)
    a, b = after.get("accepted_per_position", {}), before.get("accepted_per_position", {})
    delta["accepted_per_position"] = {p: a.get(p, 0.0) - b.get(p, 0.0) for p in sorted(set(a) | set(b))}
    values = [delta[k] for k in ("drafts", "draft_tokens", "accepted_tokens")]
    if any(v < 0 for v in values + list(delta["accepted_per_position"].values())):
        raise ValueError(f"counters went backwards (server restarted?): {delta}")
    return delta


def vllm_accept_length(delta: Mapping[str, Any]) -> float | None:
    """Mean acceptance length = 1 + accepted / drafts (the 1 is the bonus token)."""
    drafts = delta.get("drafts", 0.0)
    if not drafts:
        return None
    return 1.0 + delta.get("accepted_tokens", 0.0) / drafts
