#!/usr/bin/env python3
"""Generate tests/golden/tokenizer/corpus.txt: the strings kvlab's tokenizers are checked on against llama.cpp.

Deterministic (fixed seed): hand-written seed fragments (English prose, code, numbers and dates, contractions,
punctuation, CJK, emoji, combining marks, other scripts, unusual whitespace) are kept as they are and also combined
at random with runs of spaces, tabs, newlines and CRLFs. Every string is valid UTF-8 and uses only characters
assigned in this Python's Unicode version (so a table generated from the same unicodedata classifies them all).
One string per line; a backslash escapes \\n \\r \\t and itself. Usage:
    python3 tools/gen_tokenizer_corpus.py > tests/golden/tokenizer/corpus.txt
"""
import random
import sys
import unicodedata

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
    "Call me Ishmael. Some years ago - never mind how long precisely - I thought I would sail about a little.",
    "In a hole in the ground there lived a hobbit.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "The cache holds keys and values for every token the model has seen so far.",
    "Attention is all you need, or so they said in 2017.",
    "She sells sea shells by the sea shore.",
    "Peter Piper picked a peck of pickled peppers!",
    "HELLO WORLD, THIS IS A SHOUTING SENTENCE.",
    "hello world",
    " Hello world",
    "Hello World!",
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine.",
    "Mr. and Mrs. Dursley, of number four, Privet Drive, were proud to say that they were perfectly normal.",
    "e.g. i.e. etc. vs. a.m. p.m. U.S.A.",
    "Well... I don't know -- maybe?",
    "What?! No way!!! Really???",
    "The year's best; the years' best.",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ab ab ab ab ab ab ab ab",
    "Don't you think it's time we'd gone? I'll say we've waited; they're late.",
    "DON'T SHOUT. IT'S LATE. WE'VE GONE. THEY'RE HERE. I'LL GO. I'M OK. HE'D KNOW.",
    "don't Don't DON'T dOn'T",
    "'s 't 're 've 'm 'll 'd",
    "'S 'T 'RE 'VE 'M 'LL 'D",
    "rock 'n' roll, 'tis, 'twas, ma'am, o'clock, y'all",
    "\"Quoted,\" she said. 'Single quoted.' `backticks`",
    "Le café est fermé. Où est la bibliothèque? Ça va très bien.",
    "Straße, Größe, Übermaß, naïve, façade, jalapeño, smörgåsbord",
    "Ελληνικά: Καλημέρα κόσμε",
    "Русский: Привет, мир! Как дела?",
    "עברית: שלום עולם",
    "العربية: مرحبا بالعالم",
    "हिन्दी: नमस्ते दुनिया",
    "ไทย: สวัสดีชาวโลก",
    "한국어: 안녕하세요 세계",
    "日本語: こんにちは世界。カタカナもひらがなも。",
    "中文：你好，世界！我们今天学习分词。",
    "Tiếng Việt: Xin chào thế giới",
    "Türkçe: Merhaba dünya, ığüşöç İĞÜŞÖÇ",
    "Polski: Zażółć gęślą jaźń",
    "Ѐ ѐ Ё ё Ђ ђ",
    "ÀÁÂÃÄÅàáâãäå",
    "ǅǈǋǲ titlecase digraphs",
]

CODE = [
    "int main(void) { return 0; }",
    "for (int i = 0; i < n; i++) {\n\tsum += a[i] * b[i];\n}",
    "def f(x):\n    return x ** 2 + 1\n",
    "if __name__ == '__main__':\n    main()",
    "#include <stdio.h>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))",
    "x = [1, 2, 3]; y = {'a': 1, \"b\": 2}",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<div class=\"main\"><p>Hello</p></div>",
    "a+=1;b-=2;c*=3;d/=4;e%=5;f<<=6;g>>=7;h&=8;i|=9;j^=10;",
    "x=>x*2 && y || !z != w == v",
    "$HOME/bin:/usr/local/bin:/usr/bin",
    "git commit -m \"fix: off-by-one in kv_append\"",
    "https://example.com/path?query=1&other=two#frag",
    "user@example.org, first.last+tag@sub.domain.co.uk",
    "{\"key\": [true, false, null, 1.5e-3]}",
    "    indented four\n        indented eight\n\tand a tab",
    "// comment\n/* block\n   comment */",
    "#!/usr/bin/env bash\nset -euo pipefail\necho \"$@\"",
    "printf(\"%d %s %5.2f\\n\", n, s, x);",
    "__init__ __name__ _private __dunder__",
    "camelCaseIdentifier snake_case_identifier SCREAMING_CASE kebab-case-identifier",
    "0x1F 0b1010 0o777 1e10 3.14159 -42 +7",
    "a[i][j] = b[j][i]",
    "```python\nprint('hi')\n```",
    "| col1 | col2 |\n|------|------|\n| a    | b    |",
]

NUMBERS = [
    "1", "12", "123", "1234", "12345", "123456", "1234567", "12345678", "123456789", "1234567890",
    "3.14", "2.71828", "1,000,000", "1.000.000,50", "-273.15", "+1 (555) 123-4567",
    "2024-01-15", "15/01/2024", "01/15/2024", "2024-01-15T13:45:30Z", "13:45:30", "1:05 p.m.",
    "January 1, 2000", "1st 2nd 3rd 4th 21st 22nd 101st", "$1,234.56", "€99.99", "£5", "¥1000", "50%",
    "10^6", "6.022e23", "1/2 3/4 7/8", "½ ¼ ¾ ⅓", "² ³ ¹ ⁴", "①②③ ⑴⑵⑶", "ⅠⅡⅢⅣ ⅰⅱⅲ",
    "٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "〇一二三四五", "１２３４５ ＡＢＣ", "𝟘𝟙𝟚𝟛",
    "3 apples and 42 oranges", "version 1.2.3-beta.4", "IPv4 192.168.0.1", "ISBN 978-3-16-148410-0",
    "000000", "007", "9999999999999999999999",
]

PUNCT = [
    "!!!", "???", "...", "…", "---", "—", "–", "()", "[]", "{}", "<>", "«»", "„“", "‘’", "\"\"", "''",
    "@#$%^&*", "~`|\\", "!?.,;:", "-_=+", "§¶•°", "™®©", "←↑→↓", "∀∃∈∉∑∏√∞≈≠≤≥", "★☆♠♣♥♦",
    "¡Hola! ¿Qué tal?", "a-b_c.d,e;f:g", "(a)[b]{c}<d>", "«Bonjour»", "『括弧』「かっこ」【】",
    "，。、；：？！", "٫٬؟", "।॥",
]

EMOJI = [
    "😀", "😀😃😄", "👍", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸🇫🇷🇯🇵", "❤️", "✨🎉🚀", "🤖 robot",
    "I ❤️ NY", "Good job 👍🏻!", "🙂🙃", "🐍 python", "🦀 rust", "🍕🍔🍟", "⌚⌛", "☕ coffee", "1️⃣2️⃣3️⃣", "#️⃣",
]

COMBINING = [
    "e\u0301", "cafe\u0301", "n\u0303", "a\u0308\u0304", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f",
    "\u1100\u1161\u11a8", "क्षत्रिय", "ñ vs n\u0303", "Å vs A\u030a", "ﬁ ﬂ ﬀ", "\u0627\u064e\u0644\u0652",
    "o\u0302\u0323", "x\u20d7", "a\u0332b\u0332c\u0332",
]

SPACES = [
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r", " \n", "\n ", " \t ", "\t\n",
    "\u00a0", "\u3000", "\u2003", "\u2009", "\u200b", "\u2028", "\u2029", "\u0085", "\u000b", "\u000c", "\u1680",
    "\u202f", "\u205f", "\ufeff",
]

FRAGMENTS = PROSE + CODE + NUMBERS + PUNCT + EMOJI + COMBINING
SEPARATORS = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n\t", "    ", "", ", ", ". "] + SPACES


def ok(s):
    return all(unicodedata.category(c) != "Cn" for c in s)


def escape(s):
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def main():
    rng = random.Random(20250301)
    out = []
    seen = set()

    def add(s):
        if s and s not in seen and ok(s):
            seen.add(s)
            out.append(s)

    for s in FRAGMENTS + SPACES:
        add(s)
        add(" " + s)
        add(s + " ")
        add(s + "\n")
    for a in SPACES:                      # whitespace between and around words
        for b in ("word", "1", "!", "x y"):
            add(a + b)
            add(b + a + b)
            add(b + a + a + b)
    words = " ".join(PROSE).split()
    while len(out) < 2100:
        k = rng.choice([1, 2, 2, 3, 3, 4])
        parts = []
        for _ in range(k):
            r = rng.random()
            if r < 0.35:
                parts.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))))
            elif r < 0.45:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
            else:
                parts.append(rng.choice(FRAGMENTS))
        s = ""
        for p in parts:
            s += (rng.choice(SEPARATORS) if s else rng.choice(["", "", "", " ", "\n", "  "])) + p
        if rng.random() < 0.15:
            s += rng.choice(SEPARATORS)
        add(s[:300])
    sys.stdout.write("".join(escape(s) + "\n" for s in out))


if __name__ == "__main__":
    main()
