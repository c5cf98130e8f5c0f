"""A copy-heavy chat workload for speculative decoding (issue 26), fixed and seeded.

Built from the shipped held-out text (`pagedllm/data/heldout.txt`) and a handful of small code
snippets written here (not pagedllm's own source, which changes). Four categories, each a chat
conversation rendered with the model's chat template (as `LLM.chat` does):

- `edit`: "edit this passage" (a passage of 2-4 paragraphs quoted in the prompt; the answer is
  the passage again with a small change: typos fixed, a word upper-cased, a title added, ...);
- `summary`: "summarise this passage" (the answer reuses the passage's phrases);
- `code`: "repeat this code block with one change" (rename a function, change a constant, ...);
- `chat`: a multi-turn chat whose last user turn asks to quote or repeat an earlier assistant
  turn (the earlier turns are held-out paragraphs standing for the assistant's answers).

`copy_requests(tokenizer, n, seed)`: n requests, the categories in turn; the same (tokenizer,
n, seed) give the same requests, token for token.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from importlib import resources

CATEGORIES = ("edit", "summary", "code", "chat")
MAX_TOKENS = {"edit": 256, "summary": 128, "code": 256, "chat": 256}


@dataclass(frozen=True)
class CopyRequest:
    category: str
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int
    prompt: str = ""  # the conversation rendered with the chat template
    prompt_token_ids: tuple[int, ...] = ()

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def heldout_paragraphs() -> list[list[str]]:
    """The held-out text as documents (split at the `---` lines), each a list of paragraphs."""
    text = resources.files("pagedllm.data").joinpath("heldout.txt").read_text(encoding="utf-8")
    docs = []
    for doc in re.split(r"\n-{3,}\n", text):
        paras = [p.strip() for p in doc.split("\n\n") if p.strip()]
        if len(paras) >= 3:
            docs.append(paras)
    return docs


def _passage(rng: random.Random, docs: list[list[str]], lo: int = 350, hi: int = 900) -> str:
    """Consecutive paragraphs (not the title line) of one document, lo..hi characters where
    the document allows."""
    for _ in range(100):
        paras = rng.choice(docs)[1:]
        start = rng.randrange(len(paras))
        out = []
        for p in paras[start:]:
            if out and sum(map(len, out)) + len(p) > hi:
                break
            out.append(p)
        if lo <= sum(map(len, out)) <= hi:
            return "\n\n".join(out)
    raise RuntimeError("no passage of the wanted length in heldout.txt")


def _words(text: str, min_len: int = 6) -> list[str]:
    seen, out = set(), []
    for w in re.findall(r"[A-Za-z]+", text):
        if len(w) >= min_len and w.lower() not in seen:
            seen.add(w.lower())
            out.append(w)
    return out


def _typos(rng: random.Random, text: str, n: int = 3) -> str:
    """The text with n words misspelt (two inner letters swapped)."""
    words = [m for m in re.finditer(r"[a-z]{6,}", text)]
    picked = sorted(rng.sample(words, min(n, len(words))), key=lambda m: m.start())
    out, last = [], 0
    for m in picked:
        w = m.group()
        i = rng.randrange(1, len(w) - 2)
        out += [text[last:m.start()], w[:i] + w[i + 1] + w[i] + w[i + 2:]]
        last = m.end()
    return "".join(out) + text[last:]


def _edit(rng: random.Random, docs) -> tuple[tuple[str, str], ...]:
    passage = _passage(rng, docs)
    kind = rng.randrange(5)
    if kind == 0:
        msg = ("Correct the spelling mistakes in the following passage and return the whole "
               f"corrected passage.\n\n{_typos(rng, passage)}")
    elif kind == 1:
        word = rng.choice(_words(passage))
        msg = (f"Return the following passage unchanged, except that every occurrence of the word "
               f"\"{word}\" is written in capital letters.\n\n{passage}")
    elif kind == 2:
        msg = f"Give the following passage a short title, then copy the passage below the title.\n\n{passage}"
    elif kind == 3:
        word = rng.choice(_words(passage))
        new = rng.choice(["purple", "enormous", "quietly", "Tuesday", "machine", "harbour"])
        msg = (f"Edit this passage: replace \"{word}\" with \"{new}\" and keep everything else as it "
               f"is.\n\n\"\"\"\n{passage}\n\"\"\"")
    else:
        msg = f"Rewrite the following passage in the first person, keeping its wording where you can.\n\n{passage}"
    return (("user", msg),)


def _summary(rng: random.Random, docs) -> tuple[tuple[str, str], ...]:
    passage = _passage(rng, docs)
    ask = rng.choice([
        "Summarise the following passage in three sentences.",
        "Summarise this passage, quoting its most important sentence.",
        "Write a short summary of the passage below, reusing its own words where possible.",
        "What are the main points of this passage? Answer with a short list.",
    ])
    return (("user", f"{ask}\n\n\"\"\"\n{passage}\n\"\"\""),)


# (code, function name, a literal in the code, its replacement)
CODE_SNIPPETS = [
    ('''def moving_average(values, window=3):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
''', "moving_average", "window=3", "window=5"),
    ('''import json


def load_settings(path, defaults=None):
    settings = dict(defaults or {})
    try:
        with open(path) as f:
            settings.update(json.load(f))
    except FileNotFoundError:
        pass
    for key, value in settings.items():
        if isinstance(value, str) and value.startswith("$"):
            settings[key] = value[1:].upper()
    return settings
''', "load_settings", "value[1:].upper()", "value[1:].lower()"),
    ('''class Stack:
    def __init__(self, limit=100):
        self.items = []
        self.limit = limit

    def push(self, item):
        if len(self.items) >= self.limit:
            raise OverflowError("stack is full")
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None
''', "push", "limit=100", "limit=64"),
    ('''function debounce(fn, delay = 250) {
  let timer = null;
  return function (...args) {
    if (timer !== null) {
      clearTimeout(timer);
    }
    timer = setTimeout(() => {
      timer = null;
      fn.apply(this, args);
    }, delay);
  };
}

module.exports = { debounce };
''', "debounce", "delay = 250", "delay = 100"),
    ('''#include <stdio.h>

static int count_words(const char *s) {
    int count = 0, in_word = 0;
    for (; *s; s++) {
        if (*s == ' ' || *s == '\\n' || *s == '\\t') {
            in_word = 0;
        } else if (!in_word) {
            in_word = 1;
            count++;
        }
    }
    return count;
}

int main(void) {
    printf("%d\\n", count_words("the quick brown fox"));
    return 0;
}
''', "count_words", "\"the quick brown fox\"", "\"jumps over the lazy dog\""),
    ('''SELECT customers.name,
       COUNT(orders.id) AS order_count,
       SUM(orders.total) AS revenue
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
GROUP BY customers.name
HAVING COUNT(orders.id) > 5
ORDER BY revenue DESC
LIMIT 10;
''', "customers", "LIMIT 10", "LIMIT 25"),
    ('''def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''', "binary_search", "return -1", "return None"),
    ('''def parse_duration(text):
    """'1h30m' -> 5400 seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    total, number = 0, ""
    for ch in text.strip():
        if ch.isdigit():
            number += ch
        elif ch in units and number:
            total += int(number) * units[ch]
            number = ""
        else:
            raise ValueError(f"bad duration: {text!r}")
    if number:
        total += int(number)
    return total
''', "parse_duration", '"s": 1', '"s": 1, "d": 86400'),
    ('''fn fizzbuzz(n: u32) -> String {
    match (n % 3, n % 5) {
        (0, 0) => "FizzBuzz".to_string(),
        (0, _) => "Fizz".to_string(),
        (_, 0) => "Buzz".to_string(),
        _ => n.to_string(),
    }
}

fn main() {
    for i in 1..=15 {
        println!("{}", fizzbuzz(i));
    }
}
''', "fizzbuzz", "1..=15", "1..=30"),
    ('''#!/usr/bin/env bash
set -euo pipefail

BACKUP_DIR=${BACKUP_DIR:-/var/backups}
KEEP=7

mkdir -p "$BACKUP_DIR"
stamp=$(date +%Y-%m-%d)
tar czf "$BACKUP_DIR/home-$stamp.tar.gz" /home
ls -1t "$BACKUP_DIR"/home-*.tar.gz | tail -n +$((KEEP + 1)) | xargs -r rm --
echo "backup written: $BACKUP_DIR/home-$stamp.tar.gz"
''', "BACKUP_DIR", "KEEP=7", "KEEP=14"),
]


def _code(rng: random.Random, i: int) -> tuple[tuple[str, str], ...]:
    code, name, old, new = CODE_SNIPPETS[i % len(CODE_SNIPPETS)]
    kind = (i // len(CODE_SNIPPETS) + rng.randrange(3)) % 3
    if kind == 0:
        ask = f"Repeat this code block with one change: replace `{old}` with `{new}`."
    elif kind == 1:
        ask = f"Rewrite the code below with `{name}` renamed to `{name}_v2`. Change nothing else."
    else:
        ask = "Repeat this code block with one change: add a one-line comment at the top saying what it does."
    return (("user", f"{ask}\n\n```\n{code}```"),)


def _chat(rng: random.Random, docs) -> tuple[tuple[str, str], ...]:
    doc = rng.choice(docs)
    title, paras = doc[0], doc[1:]
    a1 = _passage(random.Random(rng.random()), [doc], 250, 600)
    rest = [p for p in paras if p not in a1] or paras
    a2 = rest[rng.randrange(len(rest))]
    word = rng.choice(_words(a1) or ["the"])
    last = rng.choice([
        "Please repeat your first answer word for word.",
        f"Quote the sentence from your first answer that mentions \"{word}\", then explain it in one sentence.",
        "Put your two answers together into one text, keeping their wording.",
        f"Repeat your first answer, but write \"{word}\" in capital letters.",
    ])
    return (("user", f"Tell me about \"{title}\"."), ("assistant", a1),
            ("user", "Can you tell me a bit more?"), ("assistant", a2), ("user", last))


def copy_conversations(n: int = 64, seed: int = 0) -> list[CopyRequest]:
    """n requests (categories in turn), not yet rendered."""
    rng = random.Random(seed)
    docs = heldout_paragraphs()
    out = []
    for i in range(n):
        cat = CATEGORIES[i % len(CATEGORIES)]
        if cat == "edit":
            msgs = _edit(rng, docs)
        elif cat == "summary":
            msgs = _summary(rng, docs)
        elif cat == "code":
            msgs = _code(rng, i // len(CATEGORIES))
        else:
            msgs = _chat(rng, docs)
        out.append(CopyRequest(cat, msgs, MAX_TOKENS[cat]))
    return out


def copy_requests(tokenizer, n: int = 64, seed: int = 0) -> list[CopyRequest]:
    """The requests rendered with the tokenizer's chat template (what `LLM.chat` sends: the
    template's text, tokenized without adding special tokens again)."""
    from pagedllm.tokenizer import apply_chat_template

    out = []
    for r in copy_conversations(n, seed):
        text = apply_chat_template(tokenizer, r.conversation(), add_generation_prompt=True)
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        out.append(CopyRequest(r.category, r.messages, r.max_tokens, text, ids))
    return out
