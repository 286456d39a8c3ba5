"""Whether a unit's records depend on attachments nothing here can read (seed 000 §4.4, §6.3).

Attachments are never sent to a model: the text projection names them, the originals stay in
``assets/`` for the handoff's readers. Images and text can be read there later; anything else cannot.
An unreadable attachment beside words of the user's (or from the assistant or a tool) is not critical:
the original is kept and the text says it was there. A user message that consists only of unreadable
attachments is critical: whatever was asked is in them alone, and extraction would have to invent it,
so the unit stops with AttachmentUnreadable before any model call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from continuum_merge.extraction.errors import AttachmentUnreadable
from continuum_merge.extraction.package import FileRow, iter_files, read_text_part
from continuum_merge.extraction.plan import PartSpec

__all__ = ["READABLE_MEDIA_TYPES", "check_attachments", "readable"]

# What the handoff's readers understand: images through the runtimes' image path, JSON and text as text.
READABLE_MEDIA_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp", "application/json"})
# A raw record larger than this has more than attachment references in it: it is not read to find out.
_RAW_CHECK_BYTES = 64 * 1024


def readable(media_type: str) -> bool:
    """Whether an attachment of `media_type` can be read by the handoff's readers."""
    # Transcript keeps media types as `type/subtype`, in the case the uploader sent.
    base = media_type.lower()
    return base.startswith("text/") or base in READABLE_MEDIA_TYPES


def check_attachments(package_dir: Path, files_offset: int, own: Sequence[PartSpec]) -> None:
    """Raise AttachmentUnreadable when a user record among `own` (a unit's own parts, listed in
    files.jsonl from `files_offset` on) consists only of attachments of unreadable types.

    Reads files.jsonl only over the unit's records, and a candidate record's raw JSON (bounded).
    """
    users = {part.record_ref for part in own if part.role == "user"}
    if not users:
        return
    last = own[-1].record_ref
    unreadable: dict[str, list[str]] = {}
    raws: dict[str, FileRow] = {}
    seen_last = False
    for _, row in iter_files(package_dir, files_offset):
        if seen_last and row.record_ref != last:
            break
        seen_last = seen_last or row.record_ref == last
        if row.record_ref not in users:
            continue
        if row.kind == "raw":
            raws[row.record_ref] = row
        elif row.kind == "asset" and not readable(row.media_type):
            unreadable.setdefault(row.record_ref, []).append(row.media_type)
    for record_ref, media_types in unreadable.items():
        raw = raws.get(record_ref)
        if raw is not None and raw.size <= _RAW_CHECK_BYTES and not _has_words(package_dir, raw):
            raise AttachmentUnreadable(record_ref, tuple(sorted(set(media_types))))


def _has_words(package_dir: Path, raw: FileRow) -> bool:
    """Whether the record's message has any text part besides its attachments (raw JSON, verified)."""
    text = read_text_part(package_dir, raw.path, size=raw.size, sha256=raw.sha256)
    try:
        content = json.loads(text)["message"]["content"]
    except (ValueError, KeyError, TypeError):
        # Not a message as transcript's records are: nothing says it is attachments only.
        return True
    if not isinstance(content, list):
        return True
    return any(isinstance(part, dict) and str(part.get("text", "")).strip() for part in content)
