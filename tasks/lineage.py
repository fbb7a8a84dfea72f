"""What a lifecycle run publishes of where its result came from: the lineage record
(drafter.lineage) of the last output the run committed or found complete, as a markdown artifact."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from prefect.artifacts import create_markdown_artifact

from drafter.config import LifecycleConfig
from drafter.errors import describe
from drafter.lineage import lineage, to_text
from drafter.retrain.registry import list_registries
from drafter.secrets import Redactor, secret_values
from drafter.stage_output import StageOutput
from drafter.store import open_store
from tasks.common import log

ARTIFACT_KEY = "lineage"


def last_output(results: Mapping[str, dict], order: Iterable[str]) -> tuple[str, str] | None:
    """The (stage, fingerprint) of the last stage in `order` whose result names a stored output."""
    for name in reversed(list(order)):
        result = results.get(name) or {}
        if result.get("fingerprint"):
            return name, result["fingerprint"]
    return None


def lineage_markdown(cfg: LifecycleConfig, stage: str, fingerprint: str, profile: str | None = None) -> str:
    """The lineage of `<stage>/<fingerprint>` as markdown, secrets of the profile's serve env redacted."""
    store = open_store(cfg.storage, create=False)
    redact = Redactor(secret_values(cfg.serve.env, cfg.serve.extra_args))
    record = lineage(store, StageOutput.committed(store, stage, fingerprint), profile=profile, redact=redact,
                     registries=list_registries(store))
    return to_text(record, markdown=True)


def publish_lineage(cfg: LifecycleConfig, results: Mapping[str, dict], order: Iterable[str],
                    profile: str | None = None) -> str | None:
    """The `lineage` markdown artifact of the run's last output; None when it has none. A record
    that cannot be built is a warning in the run log, never a failure of the run."""
    last = last_output(results, order)
    if last is None:
        return None
    try:
        markdown = lineage_markdown(cfg, *last, profile=profile)
    except Exception as err:  # a display: it must never fail hours of work
        log().warning("lineage of %s/%s not published: %s", *last, describe(err))
        return None
    create_markdown_artifact(key=ARTIFACT_KEY, markdown=markdown,
                             description=f"lineage of {last[0]}/{last[1]}: `drafter lineage {last[0]}/{last[1]}`")
    return markdown
