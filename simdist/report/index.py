"""``DIR/index.html``: a page linking every report in a directory, with its title and one-line summary."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import jinja2

TEMPLATES = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined)


class _Head(HTMLParser):
    """Reads a report's <title> and its ``<meta name="simdist-summary">``."""

    def __init__(self) -> None:
        super().__init__()
        self.title = ""
        self.summary = ""
        self.status = ""
        self._in_title = False
        self._seen_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        # only the document's own title: SVG plots carry <title> tooltips of their own further down
        if tag == "title" and not self._seen_title:
            self._in_title = True
        elif tag == "meta" and a.get("name") == "simdist-summary":
            self.summary = a.get("content") or ""
        elif tag == "meta" and a.get("name") == "simdist-status":
            self.status = a.get("content") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "title" and self._in_title:
            self._in_title, self._seen_title = False, True

    def handle_data(self, text: str) -> None:
        if self._in_title:
            self.title += text


def read_head(path: Path) -> tuple[str, str, str]:
    """(title, summary, status) of a report file; a page simdist did not write gives its file name, no summary
    and no status. Status: "pass", "fail" or "warn" (race findings), from the page or its summary."""
    head = _Head()
    # the title and summary sit in <head>: the first 64 KiB hold them, so large reports are not read whole
    with path.open(encoding="utf-8", errors="replace") as f:
        head.feed(f.read(65536))
    status = head.status
    if not status and head.summary:
        failed = head.summary.startswith(("FAIL", "DIVERGED"))
        status = "fail" if failed else "warn" if "race finding" in head.summary else "pass"
    return head.title.strip() or path.name, head.summary, status


def build_index(directory: str | Path) -> Path:
    """(Re)write ``directory/index.html`` listing every other ``*.html`` there, sorted by file name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise NotADirectoryError(
            f"simdist report: {str(directory)!r} is not a directory; give the directory the reports were written to"
        )
    entries = []
    for p in sorted(directory.glob("*.html")):
        if p.name != "index.html":
            title, summary, status = read_head(p)
            entries.append({"href": p.name, "title": title, "summary": summary, "status": status})
    out = directory / "index.html"
    out.write_text(_ENV.get_template("index.html.j2").render(entries=entries, directory=directory.name), encoding="utf-8")
    return out
