"""The semantic sample set of seed 000 §9, run two ways and reported apart.

- Structural (always): the offline provider's deterministic answers through the real planning, units and
  aggregation. Asserted: every item's section and status are legal, every fact's original is reachable
  through an item's evidence (alias → part ref → UTF-16 range of the sealed text), empty sections show
  "Not recorded.", both versions of a record stay apart, an attachment's bytes never reach an item, and the
  lines the offline rules recognise are filed as those rules say. This is NOT a semantic acceptance.
- Evaluation (only with ``MERGE_PROVIDER__KIND=openai`` and its ``MERGE_PROVIDER__…`` settings): the same
  samples through that model; it reports which facts the details and the brief carry and asserts only that
  the handoff was built.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from extraction_testing import SnapshotBuilder
from model_server_testing import MODEL, FakeModelServer, completion
from semantic_samples import CONTINUATION, SAMPLES, Fact, Sample

from continuum_merge.extraction import ExtractionSettings, aggregate, plan_units, run_unit
from continuum_merge.extraction.aggregate import NOT_RECORDED
from continuum_merge.extraction.schema import SECTIONS, STATUSES
from continuum_merge.settings import MergeSettings
from continuum_runtime.provider import (
    ModelProvider,
    OfflineProvider,
    OpenAICompatibleProvider,
    ProviderSettings,
    open_provider,
)

ATTACHMENT = b"SECRET-ATTACHMENT-BYTES"


def build(sample: Sample, package_dir: Path) -> Path:
    """The sample sealed as a snapshot: record ids count per session, a second version reuses the first's."""
    builder = SnapshotBuilder(package_dir)
    ids: list[int] = []
    counters: dict[str, int] = {}
    second_versions = {second: first for first, second in sample.versions}
    for index, message in enumerate(sample.messages):
        if index in second_versions:
            ids.append(ids[second_versions[index]])
        else:
            counters[message.session] = counters.get(message.session, 0) + 1
            ids.append(counters[message.session])
        record_ref = builder.add(message.session, ids[-1], message.role, message.text)
        if sample.never and index == 0:
            builder.add_asset(record_ref, ATTACHMENT)
    return builder.seal()


async def handoff_of(package: Path, provider: ModelProvider) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Extract and aggregate with `provider`; every detail item and the brief."""
    settings = ExtractionSettings()
    budget = settings.unit_budget()
    results = [
        (await run_unit(unit, package, provider, model="", budget=budget)).path
        for unit in plan_units(package, processor_version="samples-1", budget=budget)
    ]
    await aggregate(package, results, provider, model="", budget=budget, brief_tokens=settings.brief_tokens)
    items = [item for path in results for item in json.loads(path.read_bytes())["items"]]
    return items, json.loads((package / "handoff" / "brief.json").read_bytes())


def cited_text(package: Path, evidence: dict[str, Any]) -> str:
    """The original text an evidence entry points at: its part's UTF-16 range in the sealed snapshot."""
    record_ref, part = evidence["recordRef"], evidence["part"]
    assert evidence["ref"] == f"r_{record_ref}:p{part}"
    text = (package / "snapshot" / "text" / f"{record_ref}-{part}.txt").read_text(encoding="utf-8")
    start, end = evidence["utf16"]
    return text.encode("utf-16-le")[start * 2 : end * 2].decode("utf-16-le")


def items_citing(package: Path, items: list[dict[str, Any]], fact: Fact) -> list[dict[str, Any]]:
    return [item for item in items if any(fact.quote in cited_text(package, e) for e in item["evidence"])]


# What the offline provider's rules file recognised lines as (error → failed, a command seen is not a test
# passed → unverified, a file path → recorded change, a to-do → pending): structure, not meaning.
OFFLINE_FILING = {
    "A changed the field": ("changes", "recorded"),
    "A's validation": ("validation_failures", "unverified"),
    "B reads name": ("changes", "recorded"),
    "open integration": ("conflicts_todos", "pending"),
    "the failure": ("validation_failures", "failed"),
    "the constraint": ("conflicts_todos", "pending"),
}


@pytest.mark.parametrize("sample", SAMPLES, ids=[sample.name.split(":")[0] for sample in SAMPLES])
async def test_structural_run_with_the_offline_provider(sample: Sample, tmp_path: Path) -> None:
    package = build(sample, tmp_path)
    items, brief = await handoff_of(package, OfflineProvider())
    assert items
    for item in items:
        assert item["section"] in SECTIONS and item["status"] in STATUSES and item["content"].strip()
        # Every evidence entry resolves to original text of this snapshot.
        assert item["evidence"] and all(cited_text(package, evidence) for evidence in item["evidence"])
    for fact in sample.facts:
        citing = items_citing(package, items, fact)
        assert citing, f"{sample.name}: nothing cites the original of {fact.name!r}"
        if fact.name in OFFLINE_FILING:
            assert {(item["section"], item["status"]) for item in citing} == {OFFLINE_FILING[fact.name]}
    for never in sample.never:
        assert never not in json.dumps(items) and never not in json.dumps(brief)
    if sample.versions:
        refs = [
            {e["recordRef"] for item in items_citing(package, items, fact) for e in item["evidence"]}
            for fact in sample.facts
        ]
        assert refs[0] and refs[1] and not refs[0] & refs[1], "two versions of one record stay apart"
    handoff = (package / "handoff" / "handoff.md").read_text(encoding="utf-8")
    filed = {item["section"] for item in items}
    for section in SECTIONS:
        body = handoff.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
        assert (NOT_RECORDED in body) is (section not in filed), section
    assert brief["items"] and all(item["section"] in SECTIONS for item in brief["items"])


async def test_structural_continuation_sample_keeps_both_sides_and_their_sources(tmp_path: Path) -> None:
    """A's change and validation and B's reading of the old field and open item all reach the details,
    each citing its own source's original."""
    package = build(CONTINUATION, tmp_path)
    items, _ = await handoff_of(package, OfflineProvider())
    sources = {
        fact.name: {e["sessionId"] for item in items_citing(package, items, fact) for e in item["evidence"]}
        for fact in CONTINUATION.facts
    }
    assert sources == {
        "A changed the field": {"A"},
        "A's validation": {"A"},
        "B reads name": {"B"},
        "open integration": {"B"},
    }


def carried(fact: Fact, contents: list[str]) -> bool:
    return any(all(word.lower() in content.lower() for word in fact.keywords) for content in contents)


@pytest.mark.skipif(
    os.environ.get("MERGE_PROVIDER__KIND") != "openai",
    reason="semantic evaluation needs an OpenAI-compatible endpoint (MERGE_PROVIDER__KIND=openai, ...)",
)
async def test_semantic_evaluation_with_a_configured_model(tmp_path: Path) -> None:
    """Reports, per sample and fact, whether the details and the brief carry it and how it was filed."""
    provider = open_provider(MergeSettings().provider)
    report: list[dict[str, Any]] = []
    try:
        for number, sample in enumerate(SAMPLES):
            package = build(sample, tmp_path / str(number))
            items, brief = await handoff_of(package, provider)
            details = [item["content"] for item in items]
            summary = [item["content"] for item in brief["items"]]
            for fact in sample.facts:
                citing = items_citing(package, items, fact)
                report.append(
                    {
                        "sample": sample.name,
                        "fact": fact.name,
                        "inDetails": carried(fact, details),
                        "inBrief": carried(fact, summary),
                        "cited": bool(citing),
                        "filedAsLabelled": any(
                            (i["section"], i["status"]) == (fact.section, fact.status) for i in citing
                        ),
                    }
                )
    finally:
        await provider.aclose()
    # Shown with `pytest -s`: the evaluation's result, reported apart from the structural run's.
    sys.stdout.write(json.dumps({"kind": "semantic evaluation (not structural)", "facts": report}, indent=1) + "\n")
    assert report


async def test_the_evaluation_machinery_with_a_scripted_http_model(tmp_path: Path) -> None:
    """The continuation sample through the real HTTP client, the scripted model answering as a faithful one
    would (each labelled fact, citing the message it comes from): the labels reach the details and the brief
    unchanged and the evaluation's checks find every fact. A check of the machinery, not of a model."""
    server = FakeModelServer()
    await server.start()
    provider = OpenAICompatibleProvider(ProviderSettings(kind="openai", base_url=server.url, model=MODEL))
    try:
        aliases = {
            fact.name: f"i{next(n for n, m in enumerate(CONTINUATION.messages, 1) if fact.quote in m.text)}"
            for fact in CONTINUATION.facts
        }
        items = [
            {
                "section": fact.section,
                "status": fact.status,
                "content": f"{fact.name}: {' '.join(fact.keywords)}",
                "evidence": [aliases[fact.name]],
            }
            for fact in CONTINUATION.facts
        ]
        server.script(completion(json.dumps({"schemaVersion": 2, "items": items})))
        details, brief = await handoff_of(build(CONTINUATION, tmp_path), provider)
    finally:
        await provider.aclose()
        await server.stop()
    package = tmp_path
    for fact in CONTINUATION.facts:
        citing = items_citing(package, details, fact)
        assert [(item["section"], item["status"]) for item in citing] == [(fact.section, fact.status)]
        assert carried(fact, [item["content"] for item in details])
        assert carried(fact, [item["content"] for item in brief["items"]])
    assert len(server.requests) == 1
