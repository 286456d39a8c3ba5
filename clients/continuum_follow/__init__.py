"""Follow client: installs a session's live transcript (snapshot + suffix) and keeps it whole.

`RecordStore` is the pure state (no I/O), `FollowClient` the re-following loop around the Follow
RPC, and `Renderer` turns its updates into terminal text for `continuum follow`.
"""

from continuum_follow.client import Backoff, FollowClient, FollowError, Update, UpgradeRequiredError, load_message
from continuum_follow.render import Renderer
from continuum_follow.store import PROTOCOL, Cursor, Outcome, Prefix, RecordStore, Snapshot, Status, ToolRecord

__all__ = [
    "PROTOCOL",
    "Backoff",
    "Cursor",
    "FollowClient",
    "FollowError",
    "Outcome",
    "Prefix",
    "RecordStore",
    "Renderer",
    "Snapshot",
    "Status",
    "ToolRecord",
    "Update",
    "UpgradeRequiredError",
    "load_message",
]
