"""Text cleaning of message contents: HTML, control characters, Unicode normalisation.

Each function returns the new text; `clean_messages` reports which kinds of change it made so the
data stage can count them. HTML is only removed outside Markdown code (fenced blocks and `inline`),
and only for real HTML tag names, so `vector<int>` or a code answer that writes HTML survive.
"""

from __future__ import annotations

import html
import re
import unicodedata

from gemmaforge.chat.conversation import Message
from gemmaforge.config import CleanConfig

_TAG_NAMES = (
    "a|abbr|article|aside|b|big|blockquote|body|br|caption|center|cite|code|dd|del|div|dl|dt|em|figcaption|figure|"
    "font|footer|form|h[1-6]|head|header|hr|html|i|iframe|img|input|ins|label|li|link|main|mark|meta|nav|ol|"
    "option|p|pre|q|s|section|select|small|span|strike|strong|sub|sup|table|tbody|td|tfoot|th|thead|title|tr|"
    "tt|u|ul"
)
_BLOCK_TAGS = {"article", "blockquote", "br", "div", "dd", "dl", "dt", "footer", "h1", "h2", "h3", "h4", "h5", "h6",
               "header", "hr", "li", "ol", "p", "pre", "section", "table", "tr", "ul"}
_ATTRIBUTE = r"""\s+[a-zA-Z_:][-a-zA-Z0-9_:.]*(?:\s*=\s*(?:"[^"]*"|'[^']*'|[^\s"'=<>`]+))?"""
# Only well-formed tags: `a<b && c>d` in code or maths has no valid attribute list and stays.
_TAG = re.compile(rf"<(/?)({_TAG_NAMES})(?:{_ATTRIBUTE})*\s*/?>", re.IGNORECASE)
_SCRIPT_STYLE = re.compile(r"<(script|style)\b[^>]*>.*?</\1\s*>", re.IGNORECASE | re.DOTALL)
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_ENTITY = re.compile(r"&(?:#\d{1,7}|#[xX][0-9a-fA-F]{1,6}|[a-zA-Z][a-zA-Z0-9]{1,31});")
_CODE = re.compile(r"```.*?(?:```|\Z)|`[^`\n]+`", re.DOTALL)
_BLANK_LINES = re.compile(r"[ \t]*\n(?:[ \t]*\n){2,}")
# C0/C1 controls except \t \n \r, zero-width space / word joiner / BOM, the replacement character and
# lone surrogates (JSON can encode them; they break tokenizers and UTF-8 output).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\u2060\ufeff\ufffd\ud800-\udfff]")


def strip_html(text: str) -> str:
    if "<" not in text and "&" not in text:
        return text
    pieces, last = [], 0
    for code in _CODE.finditer(text):
        pieces += [_strip_html_prose(text[last : code.start()]), code.group()]
        last = code.end()
    pieces.append(_strip_html_prose(text[last:]))
    return "".join(pieces)


def _strip_html_prose(text: str) -> str:
    out = _COMMENT.sub("", _SCRIPT_STYLE.sub("", text))
    out = _TAG.sub(lambda m: "\n" if m.group(2).lower() in _BLOCK_TAGS else "", out)
    out = _ENTITY.sub(lambda m: html.unescape(m.group()), out)
    if out != text:
        out = _BLANK_LINES.sub("\n\n", out)
    return out


def remove_control_chars(text: str) -> str:
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL.sub("", text)


def clean_messages(messages: list[Message], config: CleanConfig) -> tuple[list[Message], set[str]]:
    """Cleaned copies of the messages, and the kinds of change made ('html', 'control_chars', 'unicode')."""
    changes: set[str] = set()
    cleaned: list[Message] = []
    for message in messages:
        text = message["content"]
        if config.remove_control_chars:
            text, before = remove_control_chars(text), text
            if text != before:
                changes.add("control_chars")
        if config.strip_html:
            text, before = strip_html(text), text
            if text != before:
                changes.add("html")
        if config.unicode_normalization:
            text, before = unicodedata.normalize(config.unicode_normalization, text), text
            if text != before:
                changes.add("unicode")
        cleaned.append({**message, "content": text})
    return cleaned, changes
