"""Which data dir a command works on: `--data-dir`, else $CONTINUUM_DATA_DIR, else ./.continuum.

`continuum up` keeps its databases, run files, logs and secrets there; `follow` and `cleanup` find
the running system's addresses and tokens there.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "CONTINUUM_DATA_DIR"
DEFAULT_DATA_DIR = Path(".continuum")
DATA_DIR_HELP = f"the data dir of `continuum up` (default: ${DATA_DIR_ENV} or ./{DEFAULT_DATA_DIR})"


def resolve_data_dir(given: Path | None) -> Path:
    """`given` (the command-line option) when set, else $CONTINUUM_DATA_DIR, else ./.continuum."""
    if given is not None:
        return given
    from_env = os.environ.get(DATA_DIR_ENV)
    return Path(from_env) if from_env else DEFAULT_DATA_DIR
