"""Every relative link in the repository's Markdown points at a file or folder that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from repo_paths import REPO

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / f for f in out.stdout.split() if (REPO / f).is_file()]


def test_relative_links_resolve():
    broken = []
    for md in markdown_files():
        for n, line in enumerate(md.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                    continue                      # a URL or an anchor on the same page
                path = target.split("#", 1)[0]
                if not (md.parent / path).exists():
                    broken.append(f"{md.relative_to(REPO)}:{n}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
