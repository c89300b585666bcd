"""Plain-text tables for the command line."""

from collections.abc import Sequence


def format_table(rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart; the first row is the header."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )
