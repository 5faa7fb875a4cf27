"""The one table renderer of the command line, as kubectl prints tables: columns padded to their widest cell,
never wrapped, numbers right-aligned where asked, trailing blanks cut."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def aligned(rows: Sequence[Sequence[str]], headers: Sequence[str] | None = None, right: Collection[int] = (),
            gap: str = "   ") -> str:
    """``rows`` under ``headers`` (None: none), the columns in ``right`` right-aligned, ``gap`` between columns;
    empty when there is neither a header nor a row."""
    table = ([headers] if headers else []) + list(rows)
    if not table:
        return ""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    out = []
    for r in table:
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(r, widths, strict=True))]
        out.append(gap.join(cells).rstrip())
    return "\n".join(out) + "\n"
