"""Rendering the block list: Markdown (``docs/REPRODUCTION.md``) and a standalone HTML
page with its CSS (``docs/reproduction/index.html``).
"""

from __future__ import annotations

import html
import re

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; \
margin: 0; color: #1d232a;
       background: #fafbfc; line-height: 1.45; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 60px; background: #fff; }
h1 { font-size: 1.8em; margin-top: 0.3em; }
h2 { font-size: 1.35em; margin-top: 2.2em; padding-top: 0.6em; border-top: 2px solid #e3e7eb; }
h3 { font-size: 1.05em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.86em; }
th, td { border: 1px solid #d5dbe1; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #eef2f6; }
tbody tr:nth-child(even) { background: #f7f9fb; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; \
font-size: 0.9em; }
pre { background: #f3f5f7; padding: 10px 12px; overflow-x: auto; border-radius: 4px; }
p code, li code { background: #f1f3f5; padding: 0 3px; border-radius: 3px; }
img { max-width: 100%; border: 1px solid #e3e7eb; margin: 0.6em 0; }
.small { font-size: 0.82em; color: #4a5560; margin: 0.2em 0; }
.wide { overflow-x: auto; }
"""


def _inline_html(text: str) -> str:
    """Escapes text, then renders `code`, **bold** and [label](#anchor)."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    out = re.sub(r"\[([^\]]+)\]\((#[A-Za-z0-9_.-]+)\)", r'<a href="\2">\1</a>', out)
    return out


def _is_num(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] in "∞—") and len(cell) < 40


def render_html(blocks: list[tuple], title: str) -> str:
    out = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        "<main>",
    ]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            anchor = f' id="{html.escape(b[2])}"' if len(b) > 2 else ""
            out.append(f"<{kind}{anchor}>{_inline_html(b[1])}</{kind}>")
        elif kind == "p":
            out.append(f"<p>{_inline_html(b[1])}</p>")
        elif kind == "small":
            out.append(f'<p class="small">{_inline_html(b[1])}</p>')
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{_inline_html(i)}</li>" for i in b[1]) + "</ul>")
        elif kind == "code":
            out.append(f"<pre><code>{html.escape(b[1], quote=False)}</code></pre>")
        elif kind == "img":
            out.append(f'<p><img src="{html.escape(b[1])}" alt="{html.escape(b[2])}"></p>')
        elif kind == "table":
            head, rows = b[1], b[2]
            out.append('<div class="wide"><table>')
            out.append(
                "<thead><tr>"
                + "".join(f"<th>{html.escape(h)}</th>" for h in head)
                + "</tr></thead>"
            )
            out.append("<tbody>")
            for row in rows:
                out.append(
                    "<tr>"
                    + "".join(
                        f'<td class="num">{html.escape(c)}</td>'
                        if j and _is_num(c)
                        else f"<td>{html.escape(c)}</td>"
                        for j, c in enumerate(row)
                    )
                    + "</tr>"
                )
            out.append("</tbody></table></div>")
        else:  # pragma: no cover
            raise ValueError(kind)
    out += ["</main>", "</body>", "</html>", ""]
    return "\n".join(out)


def _md_cell(text: str) -> str:
    """A table cell as plain text, as the HTML page shows it: Markdown and HTML characters
    (record text may hold any) are backslash-escaped."""
    return re.sub(r"([\\`*_\[\]<>|&])", r"\\\1", text).replace("\n", " ")


def render_markdown(blocks: list[tuple], img_prefix: str) -> str:
    out = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            level = {"h1": "#", "h2": "##", "h3": "###"}[kind]
            if len(b) > 2:
                out.append(f'<a id="{b[2]}"></a>\n')
            out.append(f"{level} {b[1]}\n")
        elif kind == "p":
            out.append(b[1] + "\n")
        elif kind == "small":
            out.append(f"<sub>{b[1]}</sub>\n")
        elif kind == "ul":
            out.append("\n".join(f"- {i}" for i in b[1]) + "\n")
        elif kind == "code":
            out.append(f"```bash\n{b[1]}\n```\n")
        elif kind == "img":
            out.append(f"![{b[2]}]({img_prefix}{b[1]})\n")
        elif kind == "table":
            head, rows = b[1], b[2]
            lines = [
                "| " + " | ".join(_md_cell(h) for h in head) + " |",
                "|" + "|".join("---" for _ in head) + "|",
            ]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines) + "\n")
    return "\n".join(out)
