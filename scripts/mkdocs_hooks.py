"""MkDocs hooks: the repository's README.md is the site's front page.

``on_files`` adds README.md as the page ``index.md``; ``on_page_markdown`` rewrites its links into ``docs/``
(``docs/training.md``) to the pages beside it (``training.md``), so the same file reads well on a code host and
on the site. Nothing here needs a network or a plugin: hooks are part of MkDocs itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS_LINK = re.compile(r"\]\(docs/")


def on_files(files: Files, config: Any) -> Files:
    """Adds README.md as the front page, ``index.md``."""
    files.append(File.generated(config, "index.md", abs_src_path=str(README)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """On the front page, a link into ``docs/`` points at the page beside it."""
    if page.file.src_uri == "index.md":
        return DOCS_LINK.sub("](", markdown)
    return markdown
