"""MkDocs hooks: the benchmark notes under benchmarks/ join the site, and links keep their repository paths.

Every page links to the others as the files lie in the repository (docs/serving.md links
`../benchmarks/results/2026-12-02-serving.md`, a result file links `../../docs/serving.md`), so the
Markdown reads the same on a code host. The site puts docs/ at its root and benchmarks/ beside it:
`on_files` adds benchmarks/README.md and benchmarks/results/*.md, and `on_page_markdown` rewrites each
relative link from the repository's layout to the site's before MkDocs checks it (`--strict` then
fails on any link that leads nowhere).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
EXTRA = ("benchmarks/README.md", "benchmarks/results/*.md")
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def on_files(files, config):
  """Adds the benchmark notes, each under its repository path."""
  for pattern in EXTRA:
    for path in sorted(ROOT.glob(pattern)):
      files.append(
        File(
          path.relative_to(ROOT).as_posix(),
          src_dir=str(ROOT),
          dest_dir=config.site_dir,
          use_directory_urls=config.use_directory_urls,
        )
      )
  return files


def _repo_path(src_uri: str) -> str:
  """Where a site file lies in the repository."""
  return src_uri if src_uri.startswith("benchmarks/") else f"docs/{src_uri}"


def _site_path(repo_path: str) -> str | None:
  """Where a repository file lies in the site (None: not in the site)."""
  if repo_path.startswith("docs/"):
    return repo_path[len("docs/") :]
  if repo_path.startswith("benchmarks/"):
    return repo_path
  return None


def on_page_markdown(markdown, page, config, files):
  """Rewrites the page's relative links from repository paths to site paths."""
  here = posixpath.dirname(_repo_path(page.file.src_uri))
  site_here = posixpath.dirname(page.file.src_uri)

  def rewrite(match):
    target = match.group(2)
    if "://" in target or target.startswith(("/", "mailto:")):
      return match.group(0)
    site = _site_path(posixpath.normpath(posixpath.join(here, target)))
    if site is None:
      return match.group(0)
    return match.group(1) + posixpath.relpath(site, site_here or ".") + match.group(3)

  return LINK.sub(rewrite, markdown)
