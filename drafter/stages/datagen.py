"""The `datagen` stage: the target rewrites the assistant turns of the prepared conversations.

Output (`datagen/<fingerprint>/`):
- `gen-00000.jsonl`, ...: one record per conversation, in prepared order:
  `{"id", "messages", "source_id", "finish_reasons", "usage": {"prompt_tokens", "completion_tokens"},
  "gen": {"model", "temperature", "max_tokens"}}` (`id` == `source_id`: one generation per prompt).
  A record does not name the server that answered it, so the same answers are the same bytes
  whichever servers (or fan-out children) gave them; the shard's marker counts, per server URL,
  the records whose last turn it answered (`servers`). Each assistant message is `{"role", "content"}` plus
  `"token_ids"`: the ids the engine generated for it, as returned (the stop token included when the
  engine returns it), present only when the server returned ids (drafter.engines
  `answer_token_ids`). The dump trains on these ids and re-tokenises only records without them
  (drafter.tokenize); records written before ids were recorded simply have none;
- `errors-00000.jsonl`, ...: `{"id", "reason", "attempts", "turn", "detail"}` for the
  conversations of that shard that could not be generated (only written when there are some). Like
  a record, an error record does not name its server (the detail has its address replaced by
  `<server>`): fan-out child k serves on `serve.port + k`, and the bytes must not depend on it. The
  shard's marker counts the servers (`servers`), and the log line of each failure names it.

Without earlier outputs to reuse, shard i holds conversations [i*shard_size, (i+1)*shard_size) of
the prepared split; each shard's marker records the digest of the conversations it was planned for,
so a killed run resumes at the shards without a verified `gen-i` of the same plan and never
duplicates or drops a sample.
`errors-i` is written before `gen-i`: `gen-i` is the shard's "done" mark.

Incremental (drafter.contracts.reuse): earlier outputs for the same target and settings are looked up; their
shards whose conversations are all still in the corpus are referenced whole, answers in their other
shards are copied, and only the remaining conversations are sent to the target (in new shards after
the referenced ones). `conversation-keys.jsonl` lists each shard's conversation keys for later runs.

Multi-turn conversations are regenerated turn by turn: turn k is asked with the history holding the
target's OWN earlier answers (the original answers are dropped), as the drafter will see at serving.

Re-tokenisation check (manifest `token_ids` and `retokenize_agreement`, per split): `token_ids`
counts the answers (assistant turns) with and without ids; `retokenize_agreement` is, over the
answers whose conversation carries ids, the fraction of the answer tokens the dump trains on (the
returned ids, plus the template's end of turn where the engine did not return its stop token) that
re-tokenising the text with the target's chat template reproduces, matched turn by turn as in-order
blocks (drafter.tokenize.retokenize_agreement); null when nothing could be measured (no ids, or the
target's tokenizer is not loadable where datagen runs). It is the diagnostic of what the text
alone would have given. The stage warns (log + summary line) when it is below
RETOKENIZE_WARN_BELOW (the dump uses the ids, so the warning says the text would have been wrong),
and when answers came without ids (the dump re-tokenises those: the drafter then trains on
sequences the target may not emit).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from drafter.config import LifecycleConfig, fingerprint_fields
from drafter.contracts import reuse
from drafter.datagen.generate import RetokenizeCheck, Shard, generate, run_sync, with_servers, write_shard_files
from drafter.datagen.plan import (RETOKENIZE_WARN_BELOW, manifest_meta, not_empty, plan_shards, token_id_line,
                                  token_id_warnings)
from drafter.formats import DATAGEN as STAGE
from drafter.formats import PREPARE, SPLITS, split_prefix
from drafter.stage_output import StageOutput, to_jsonl
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.shard_plan import Reused, ShardPlan
from drafter.stages.base import Built, StageContext, Summary
from drafter.target_identity import target_identity

log = logging.getLogger(__name__)

__all__ = ["RETOKENIZE_WARN_BELOW", "token_id_warnings"]

# Bump when what a datagen output holds changes for the same settings: 2 = answers carry the
# engine's token ids, so outputs written before (text only, re-tokenized by the dump) are neither
# skipped nor reused; 3 = records no longer name their server (the shard markers count them).
DATAGEN_RECORD_VERSION = 3


def needs(cfg: LifecycleConfig) -> tuple[str, ...]:
    return (PREPARE,)


@dataclass(frozen=True)
class Inputs:
    ctx: StageContext
    settings: dict  # everything that determines the answers except the corpus (the reuse key's content)
    check: RetokenizeCheck = field(compare=False)  # one per run: its tokenizer loads (or warns) once


def inputs(ctx: StageContext) -> Inputs:
    cfg = ctx.cfg
    # The answers depend on the target's weights and on the name requests use.
    target = {"served_name": cfg.target.served_name, **target_identity(cfg.target)}
    return Inputs(ctx, {"datagen": fingerprint_fields(cfg.datagen), "target": target, "splits": list(SPLITS),
                        "records": DATAGEN_RECORD_VERSION}, RetokenizeCheck(cfg))


def fingerprint(inputs: Inputs) -> str:
    """The datagen section's output fields, the target's identity and the prepared corpus."""
    return stage_fingerprint(STAGE, inputs.settings, [inputs.ctx.upstream[PREPARE]])


@dataclass(frozen=True, kw_only=True)
class DatagenShards(ShardPlan):
    """The plan (drafter.shard_plan) plus what computing and committing read: the new shards'
    conversations (answers found in earlier outputs filled in), every generated shard per split
    (referenced ones first) and the conversation keys of the referenced ones."""

    shards: tuple[Shard, ...]
    asked: Mapping[str, int]  # per new shard, its conversations without an answer found earlier
    names: Mapping[str, tuple[str, ...]]
    linked_keys: Mapping[str, list[str]] = field(default_factory=dict)


def plan(inputs: Inputs, out: StageOutput) -> DatagenShards:
    """Per split, earlier shards whose conversations are all still in the corpus are reused whole;
    the remaining conversations make new shards (drafter.datagen.plan), each computed from the keys
    of its conversations; a new shard whose answers were all found earlier is written by the run
    that commits (`local`), the others are asked. `errors-i` is `gen-i`'s companion."""
    cfg, store = inputs.ctx.cfg, inputs.ctx.store
    key = reuse.reuse_key(STAGE, inputs.settings)
    earlier = reuse.earlier_outputs(store, STAGE, key, out.fingerprint)
    shards, links = plan_shards(store, cfg, inputs.ctx.upstream[PREPARE], earlier)
    names = {split: tuple([name for name, _ in links if name.startswith(f"{split_prefix(split)}gen-")]
                          + [s.name for s in shards if s.split == split]) for split in SPLITS}
    reused = []
    for name, link in links:
        digest = reuse.digest(link.keys)
        reused.append(Reused(name, digest, link.source, link.source_name,
                             meta={**reuse.linked_meta(link.source.manifest.shard(link.source_name).meta),
                                   "input_digest": digest}))
    return DatagenShards(units=tuple(s.name for s in shards), inputs=tuple(s.digest for s in shards),
                         reused=tuple(reused), earlier=tuple(earlier), reuse_key=key,
                         local=frozenset(s.name for s in shards if not s.remaining),
                         asked={s.name: s.remaining for s in shards},
                         companions={n: n.replace("gen-", "errors-", 1) for split in SPLITS for n in names[split]},
                         also=frozenset({reuse.KEYS_SHARD}), shards=tuple(shards), names=names,
                         linked_keys={name: link.keys for name, link in links})


def compute(inputs: Inputs, out: StageOutput, plan: DatagenShards, wanted: Sequence[str],
            pending: Sequence[str]) -> dict:
    """Write the wanted shards: those whose answers are all copied directly; the others by asking
    the target through `datagen.server_urls` (OpenAI-compatible), or, with none given, through
    `serve.engine` serving the target alone, started here (this run, or each fan-out child its own)
    through the server session and always torn down. Returns this run's throughput. Raises
    DatagenServerDown, after saving every finished shard, when a server stops answering. The
    context's `on_line` receives the start-up log lines of a server started here."""
    ctx, cfg = inputs.ctx, inputs.ctx.cfg
    wanted = set(wanted)
    mine = [s for s in plan.shards if s.name in wanted]
    for shard in [s for s in mine if s.name in plan.local]:  # every answer copied: nothing to ask
        write_shard_files(out, shard, list(shard.records), [], inputs.check)
    asked = [s for s in mine if s.name not in plan.local]
    if not asked:
        return {}
    if resumed := len(plan.units) - len(pending):
        log.info("datagen: resuming %s, %d of %d shards already done", out.uri, resumed, len(plan.shards))
    total = sum(len(s.conversations) for s in plan.shards)
    done_before = total - sum(len(s.conversations) for s in asked)
    ask = lambda urls: run_sync(generate(out, cfg, asked, urls, ctx.progress, done_before, total, inputs.check))
    return with_servers(cfg, ask, ctx.on_line)


def finish(inputs: Inputs, out: StageOutput, plan: DatagenShards, this_run: dict, pending: Sequence[str]) -> Built:
    """The conversation keys of each shard (for later outputs' reuse), then the manifest meta."""
    cfg, names = inputs.ctx.cfg, plan.names
    # The keys of what each shard really holds (a conversation that failed is not in it).
    out.write_shard(reuse.KEYS_SHARD, to_jsonl(
        {"shard": name, "keys": plan.linked_keys.get(name) or [reuse.conversation_key(r) for r in out.read_jsonl(name)]}
        for split in SPLITS for name in names[split]))
    reused = {"earlier_outputs": [o.fingerprint for o in plan.earlier], "linked_shards": len(plan.reused),
              "linked_conversations": sum(len(keys) for keys in plan.linked_keys.values()),
              "copied_conversations": sum(len(s.conversations) - plan.asked[s.name] for s in plan.shards),
              "asked_conversations": sum(plan.asked[name] for name in pending)}
    resumed = len(plan.units) - len(pending)
    return Built(lambda committed: not_empty(cfg, manifest_meta(cfg, committed, names, inputs.ctx.upstream[PREPARE],
                                                                resumed, this_run, reused)),
                 expect=[*names["train"], *names["eval"], reuse.KEYS_SHARD])


def summarize(inputs: Inputs, out: StageOutput) -> Summary:
    meta = out.manifest.meta
    t = meta.get("throughput") or {}
    summary = [f"{meta['generated']} of {meta['conversations']} conversations generated, {meta['errors']} "
               f"errors {meta['errors_by_reason']}"]
    if (line := token_id_line(meta)) is not None:
        summary.append(line)
    for warning in token_id_warnings(meta):
        log.warning("datagen %s: %s", out.uri, warning)
        summary.append(f"WARNING: {warning}")
    if t.get("requests"):
        summary.append(f"{t['requests_per_s']:.2f} req/s, {t['tokens_per_s']:.1f} tok/s this run "
                       f"({', '.join(s['url'] for s in t.get('servers') or [])})")
    r = meta.get("reuse") or {}
    if r.get("linked_shards") or r.get("copied_conversations"):
        summary.append(f"reused from earlier outputs: {r['linked_shards']} shards referenced "
                       f"({r['linked_conversations']} conversations), {r['copied_conversations']} answers copied; "
                       f"{r['asked_conversations']} conversations asked")
    rows = [{"metric": k, "value": str(meta[k])} for k in (
        "conversations", "generated", "errors", "errors_by_reason", "turns", "completion_tokens",
        "finish_reasons", "token_ids", "retokenize_agreement", "shards", "resumed_shards") if k in meta]
    rows.append({"metric": "eval", "value": f"{meta['eval']['generated']} of {meta['eval']['conversations']} "
                                            f"held-out conversations generated"})
    rows += [{"metric": f"throughput.{k}", "value": str(v)} for k, v in t.items() if k != "servers"]
    return Summary(summary, rows)
