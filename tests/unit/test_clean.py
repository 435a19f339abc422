import pytest

from gemmaforge.config import CleanConfig
from gemmaforge.data.clean import clean_messages, remove_control_chars, strip_html


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("<p>第一段</p><p>第二段</p>", "\n第一段\n\n第二段\n"),
        ('<a href="x">链接</a> &lt;b&gt; &#x4E2D;&#25991; AT&T', "链接 <b> 中文 AT&T"),
        ("<script>alert(1)</script>正文<!-- 注释 -->", "正文"),
        ("vector<int> v; if (a<b && c>d)", "vector<int> v; if (a<b && c>d)"),  # not HTML tags
        ("`<br>` and\n```\n<div>&amp;</div>\n```\n<br>", "`<br>` and\n```\n<div>&amp;</div>\n```\n\n"),
        ("<start_of_turn>user", "<start_of_turn>user"),
        ("一<br><br><br><br>二", "一\n\n二"),
    ],
)
def test_strip_html(raw: str, expected: str) -> None:
    assert strip_html(raw) == expected


def test_control_chars() -> None:
    assert remove_control_chars("a\x00b\x1bc\u200bd\ufeffe\ufffd\r\nf\rg\th") == "abcde\nf\ng\th"
    assert remove_control_chars("emoji 👩\u200d💻 keeps its joiner") == "emoji 👩\u200d💻 keeps its joiner"
    assert remove_control_chars("lone \ud800 surrogate") == "lone  surrogate"


def test_clean_messages_reports_kinds_and_respects_switches() -> None:
    messages = [{"role": "user", "content": "<b>ｆｕｌｌ</b>\x07"}, {"role": "assistant", "content": "ＡＢＣ，好"}]
    cleaned, changes = clean_messages(messages, CleanConfig(unicode_normalization="NFKC"))
    assert cleaned == [{"role": "user", "content": "full"}, {"role": "assistant", "content": "ABC,好"}]
    assert changes == {"html", "control_chars", "unicode"}
    off = CleanConfig(strip_html=False, remove_control_chars=False)
    assert clean_messages(messages, off) == (messages, set())
