"""Metrics reports shaped like upstream's ``lmcache.cli.metrics`` (what the batch returns).

A :class:`Metrics` holds sections of ``(key, label, value)`` entries (or table rows);
:meth:`Metrics.emit` renders them through its handlers (a terminal table on stdout for
the batched stream), :meth:`Metrics.to_dict` gives ``{"title": ..., "metrics": {section:
{key: value}}}`` with the unnamed section's entries at the top level of ``"metrics"``, the
same structure and the same terminal layout as upstream, so code that reads a 0.5.6
report reads ours. Written for this package; it does not import ``lmcache``.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import IO, Any

__all__ = [
    "FileHandler",
    "JsonFormatter",
    "Metrics",
    "MetricsFormatter",
    "MetricsHandler",
    "Section",
    "StreamHandler",
    "TerminalFormatter",
    "get_formatter",
]


class Section:
    """A named group of metrics, or a table once :meth:`set_columns` was called."""

    def __init__(self, key: str | None, label: str | None, list_group: str | None = None
                 ) -> None:
        self.key = key
        self.label = label
        self.list_group = list_group
        self.entries: list[tuple[str, str, Any]] = []
        self.columns: list[tuple[str, str]] = []
        self.rows: list[dict[str, Any]] = []

    def add(self, key: str, label: str, value: Any) -> None:
        """Record ``value`` under ``key`` (JSON) / ``label`` (terminal)."""
        self.entries.append((key, label, value))

    def set_columns(self, *columns: tuple[str, str]) -> None:
        """Make this section a table of ``(key, header)`` columns."""
        self.columns = list(columns)

    def add_row(self, **values: Any) -> None:
        """Append a table row (one value per column key).

        Raises:
            ValueError: No columns set, or a key that is not a column.
        """
        if not self.columns:
            raise ValueError("call set_columns() before add_row()")
        unknown = set(values) - {k for k, _ in self.columns}
        if unknown:
            raise ValueError(f"not columns of this table: {sorted(unknown)}")
        self.rows.append(values)

    def value(self, key: str) -> Any:
        """The value recorded under ``key`` (KeyError if none)."""
        for k, _label, v in self.entries:
            if k == key:
                return v
        raise KeyError(key)


def sections_to_dict(title: str, sections: list[Section]) -> dict[str, Any]:
    """``{"title", "metrics"}`` as upstream's ``sections_to_dict``."""
    metrics: dict[str, Any] = {}
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in sections:
        if s.key is None:
            metrics.update({k: v for k, _label, v in s.entries})
        elif s.columns:
            metrics[s.key] = [{k: row.get(k) for k, _h in s.columns} for row in s.rows]
        elif s.list_group is not None:
            groups.setdefault(s.list_group, []).append({k: v for k, _l, v in s.entries})
        else:
            metrics[s.key] = {k: v for k, _label, v in s.entries}
    metrics.update(groups)
    return {"title": title, "metrics": metrics}


class MetricsFormatter:
    """Renders a title and sections into a string."""

    def format(self, title: str, sections: list[Section]) -> str:
        """Render (subclasses)."""
        raise NotImplementedError


def _fmt_value(value: Any) -> str:
    if value is None:
        return "N/A"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _is_number(cell: str) -> bool:
    head = cell.rstrip("%").rsplit(" ", 1)[0] if " " in cell else cell.rstrip("%")
    try:
        float(head)
    except ValueError:
        return False
    return True


def _table(section: Section) -> list[str]:
    headers = [h for _k, h in section.columns]
    cells = [[_fmt_value(row.get(k)) if k in row else "" for k, _h in section.columns]
             for row in section.rows]
    widths = [max([len(headers[i])] + [len(r[i]) for r in cells]) for i in range(len(headers))]
    placeholders = {"", "--", "N/A", "unknown", "none"}
    right = []
    for i in range(len(headers)):
        vals = [r[i] for r in cells if r[i] not in placeholders]
        right.append(bool(vals) and all(_is_number(v) for v in vals))

    def line(vals: list[str]) -> str:
        return "  ".join(v.rjust(widths[i]) if right[i] else v.ljust(widths[i])
                         for i, v in enumerate(vals)).rstrip()

    out = [line(headers), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    out += [line(r) for r in cells] or ["(none)"]
    return out


class TerminalFormatter(MetricsFormatter):
    """Plain ASCII report: title in ``=`` rules, section headers in ``-`` rules.

    Args:
        width: Width of the report in characters.
    """

    def __init__(self, width: int = 48) -> None:
        self._width = width

    def format(self, title: str, sections: list[Section]) -> str:
        """Render as a terminal table."""
        w = self._width
        lines = [f" {title} ".center(w, "=")]
        for s in sections:
            if s.columns:
                lines += _table(s)
                continue
            if s.label is not None:
                lines.append(f" {s.label} ".center(w, "-"))
            for _key, label, value in s.entries:
                text, head = _fmt_value(value), f"{label}:"
                lines.append(f"{head}{' ' * max(1, w - len(head) - len(text))}{text}")
        lines.append("=" * w)
        return "\n".join(lines)


class JsonFormatter(MetricsFormatter):
    """Indented JSON of :func:`sections_to_dict`."""

    def __init__(self, indent: int = 2) -> None:
        self._indent = indent

    def format(self, title: str, sections: list[Section]) -> str:
        """Render as JSON."""
        return json.dumps(sections_to_dict(title, sections), indent=self._indent)


_FORMATTERS: dict[str, type[MetricsFormatter]] = {
    "terminal": TerminalFormatter, "json": JsonFormatter}


def get_formatter(name: str, **kwargs: Any) -> MetricsFormatter:
    """A formatter by name (``"terminal"``, ``"json"``); unknown keyword options are dropped.

    Raises:
        ValueError: An unknown name.
    """
    cls = _FORMATTERS.get(name)
    if cls is None:
        raise ValueError(f"Unknown format {name!r}. Available: {', '.join(sorted(_FORMATTERS))}")
    params = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in kwargs.items() if k in params})


class MetricsHandler:
    """Where a report goes, with the formatter that renders it."""

    def __init__(self, formatter: MetricsFormatter) -> None:
        self.formatter = formatter

    def emit(self, title: str, sections: list[Section]) -> None:
        """Write the report (subclasses)."""
        raise NotImplementedError


class StreamHandler(MetricsHandler):
    """Writes the report to a text stream (stdout by default)."""

    def __init__(self, formatter: MetricsFormatter | None = None,
                 stream: IO[str] | None = None) -> None:
        super().__init__(formatter or TerminalFormatter())
        self._stream = stream

    def emit(self, title: str, sections: list[Section]) -> None:
        """Write the rendered report and a newline."""
        stream = self._stream or sys.stdout
        stream.write(self.formatter.format(title, sections) + "\n")


class FileHandler(MetricsHandler):
    """Writes the report to a file (JSON by default)."""

    def __init__(self, path: str, formatter: MetricsFormatter | None = None) -> None:
        super().__init__(formatter or JsonFormatter())
        self.path = path

    def emit(self, title: str, sections: list[Section]) -> None:
        """Write the rendered report to :attr:`path`."""
        with open(self.path, "w") as f:
            f.write(self.formatter.format(title, sections) + "\n")


class Metrics:
    """A report: sections of metrics plus the handlers :meth:`emit` writes them to.

    Args:
        title: Title of the report.
    """

    def __init__(self, title: str) -> None:
        self._title = title
        self._sections: list[Section] = []
        self._by_key: dict[str | None, Section] = {}
        self._handlers: list[MetricsHandler] = []

    def title(self, title: str) -> None:
        """Set the title."""
        self._title = title

    def add_handler(self, handler: MetricsHandler) -> None:
        """Add a handler :meth:`emit` writes to."""
        self._handlers.append(handler)

    def add_section(self, key: str, label: str) -> Section:
        """Add a named section (ValueError if ``key`` exists)."""
        return self._new(Section(key, label))

    def add_list_section(self, group: str, key: str, label: str) -> Section:
        """Add a section collected with its ``group`` into a JSON list."""
        return self._new(Section(key, label, list_group=group))

    def add_table(self, key: str, label: str, *columns: tuple[str, str]) -> Section:
        """Add a table section with ``(key, header)`` columns."""
        s = self.add_section(key, label)
        s.set_columns(*columns)
        return s

    def _new(self, s: Section) -> Section:
        if s.key in self._by_key:
            raise ValueError(f"Section {s.key!r} already exists")
        self._sections.append(s)
        self._by_key[s.key] = s
        return s

    def __getitem__(self, key: str) -> Section:
        return self._by_key[key]

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def add(self, key: str, label: str, value: Any) -> None:
        """Record a top-level metric (the unnamed section, rendered first)."""
        if None not in self._by_key:
            s = Section(None, None)
            self._sections.insert(0, s)
            self._by_key[None] = s
        self._by_key[None].add(key, label, value)

    def emit(self) -> None:
        """Write the report to every handler."""
        for h in self._handlers:
            h.emit(self._title, self._sections)

    def render(self, fmt: str = "terminal", width: int = 80) -> str:
        """The report as a string (without emitting it)."""
        return get_formatter(fmt, width=width).format(self._title, self._sections)

    def to_dict(self) -> dict[str, Any]:
        """``{"title": ..., "metrics": {...}}`` (JSON-serialisable)."""
        return sections_to_dict(self._title, self._sections)

    def __str__(self) -> str:
        return self.render()
