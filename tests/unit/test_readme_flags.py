"""The README's configuration table lists every `kvserve serve` flag, with its environment variable."""

from __future__ import annotations

import re
from pathlib import Path

from server.cli.flags import FLAGS

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_serve_flag_is_in_the_readme_configuration_table():
    table = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `--([a-z0-9-]+)` \| `(KVSERVE_[A-Z0-9_]+)` \|", table, flags=re.MULTILINE))
    for flag in FLAGS:
        name = flag.name.replace("_", "-")
        assert name in rows, f"--{name} is missing from the README's configuration table"
        assert rows[name] == f"KVSERVE_{flag.name.upper()}"
