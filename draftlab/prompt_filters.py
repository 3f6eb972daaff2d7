"""Filters for synthesised prompts, and the n-gram overlap check against benchmark prompts.

Pure functions over text (no model): word n-grams, near-duplicate removal by word-shingle Jaccard, length bounds,
a language / quality check, a category mix, keyword heuristics that say whether a prompt looks like its category,
and `filter_rows`, which runs them in order over synthesised rows and counts what each removed.

Rows are prompt rows as `draftlab.synthesis` writes them: `{"id", "category", "messages", "synth": {"finish"}}`,
`messages` either `[user]` or `[user, assistant, user]` (a follow-up conversation).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

WORD = re.compile(r"[a-z0-9]+")
# Template markup that must never appear in a user's message: ChatML / Llama / Mistral special tokens, and a role
# header at the start of a line (the model writing the next turn's header itself).
LEAK = re.compile(r"<\|[a-z_]+\|>|</?s>|\[/?INST\]|<</?SYS>>|^\s*(user|assistant|system)\s*(:|\n|$)",
                  re.IGNORECASE | re.MULTILINE)
ENGLISH = frozenset("the a an to of in and is are you i my me how what can for with this that it on be do "
                    "please write your which why who when".split())
# Words a prompt of each MT-bench category tends to use; a crude check of whether steering worked.
CATEGORY_WORDS = {
    "writing": "write story poem essay email blog letter speech article draft compose script song haiku slogan "
               "lyrics novel",
    "roleplay": "pretend imagine roleplay role character persona act actor embody impersonate",
    "reasoning": "puzzle riddle logic logical reasoning deduce suppose paradox fallacy teaser",
    "math": "calculate solve equation sum area probability percent percentage integer math triangle average root "
            "fraction algebra geometry multiply divide",
    "coding": "code python function program programming javascript sql java algorithm implement bug script regex "
              "api html css",
    "extraction": "extract summarize summarise summary table json identify parse categorize keywords names dates",
    "stem": "science scientific physics chemistry biology engineering energy cell quantum climate molecule dna atom "
            "experiment medicine",
    "humanities": "history historical philosophy literature culture religion economics politics society ethics war "
                  "century art music law",
}


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words (punctuation and markup dropped), the unit of every n-gram here."""
    return WORD.findall(text.lower())


def ngrams(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    """Every run of n consecutive words; a text shorter than n has none."""
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


def shingles(text: str, n: int = 3) -> set[tuple[str, ...]]:
    """Word n-grams for near-duplicate detection; a text shorter than n is one shingle of all its words."""
    tokens = words(text)
    return ngrams(tokens, n) if len(tokens) >= n else ({tuple(tokens)} if tokens else set())


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


# ----------------------------------------------------------------------------------------------------------
# duplicates


def find_duplicates(texts: list[str], threshold: float = 0.7, n: int = 3) -> dict[int, tuple[str, int]]:
    """Texts that repeat an earlier one: {index: ("exact" | "near", index of the earlier text it repeats)}.

    Exact = the same words; near = word-shingle Jaccard >= threshold with a text kept before it. Exact Jaccard is
    computed only against kept texts that share a shingle (an inverted index), so the cost follows the overlap.
    """
    seen: dict[str, int] = {}
    postings: dict[tuple, list[int]] = {}
    sets: dict[int, set] = {}
    found = {}
    for i, text in enumerate(texts):
        key = " ".join(words(text))
        if key in seen:
            found[i] = ("exact", seen[key])
            continue
        mine = shingles(text, n)
        shared = Counter(j for s in mine for j in postings.get(s, ()))
        best = max(shared, key=lambda j: (shared[j] / (len(mine) + len(sets[j]) - shared[j]), -j), default=None)
        if best is not None and shared[best] / (len(mine) + len(sets[best]) - shared[best]) >= threshold:
            found[i] = ("near", best)
            continue
        seen[key], sets[i] = i, mine
        for s in mine:
            postings.setdefault(s, []).append(i)
    return found


# ----------------------------------------------------------------------------------------------------------
# one prompt's problems


def length_problem(text: str, min_words: int, max_words: int) -> str | None:
    count = len(text.split())
    if count < min_words:
        return f"under {min_words} words"
    if count > max_words:
        return f"over {max_words} words"
    return None


def quality_problem(text: str, system_prompt: str = "") -> str | None:
    """Why `text` is not a usable English user message, or None: empty, template markup leaking in, not
    (mostly-ASCII) English, the steering system prompt echoed back, or a loop of repeated phrases."""
    stripped = text.strip()
    if not stripped:
        return "empty"
    if LEAK.search(stripped):
        return "template markup"
    visible = [c for c in stripped if not c.isspace()]
    non_ascii = sum(not c.isascii() for c in visible) / len(visible)
    letters = sum(c.isalpha() for c in visible) / len(visible)
    tokens = words(stripped)
    if non_ascii > 0.05 or letters < 0.5 or not ENGLISH.intersection(tokens):
        return "not English"
    if system_prompt and (jaccard(shingles(stripped), shingles(system_prompt)) >= 0.5
                          or " ".join(words(system_prompt)) in " ".join(tokens)):
        return "system prompt echoed"
    trigrams = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)]
    if len(trigrams) >= 12 and len(set(trigrams)) / len(trigrams) < 0.6:
        return "repetitive"
    return None


def looks_like(text: str, category: str) -> bool:
    """Whether `text` uses at least one word typical of `category` (CATEGORY_WORDS): a rough steering check."""
    vocab = set(CATEGORY_WORDS[category].split())
    return bool(vocab.intersection(words(text)))


# ----------------------------------------------------------------------------------------------------------
# overlap with benchmark prompts


def ngram_index(texts: list[str], n: int) -> set[tuple[str, ...]]:
    """All word n-grams of the benchmark texts."""
    index = set()
    for text in texts:
        index |= ngrams(words(text), n)
    return index


def overlap_count(text: str, index: set, n: int) -> int:
    """How many of the text's word n-grams occur in the index."""
    return len(ngrams(words(text), n) & index)


# ----------------------------------------------------------------------------------------------------------
# category mix


def mix_quota(counts: dict[str, int], shares: dict[str, float], tolerance: float = 0.0) -> dict[str, int]:
    """The most rows per category such that the categories keep their target shares: the total T is the largest
    that every category can fill (count >= share * T), then each gets round(share * T); a category without a share
    gets none. `tolerance` t > 0 lets a category keep up to round(share * T * (1 + t)) rows, so one scarce category
    does not cut every other one to its level (the kept shares then stay within a factor 1 + t of each other's)."""
    weight = sum(v for v in shares.values() if v > 0)
    target = {c: v / weight for c, v in shares.items() if v > 0}
    total = min((counts.get(c, 0) / v for c, v in target.items()), default=0)
    return {c: min(counts.get(c, 0), int(round(v * total * (1 + tolerance)))) for c, v in target.items()}


def apply_mix(categories: list[str], shares: dict[str, float], tolerance: float = 0.0) -> list[int]:
    """Indices kept (the first ones of each category, in order) so that the categories follow `shares` (within a
    factor 1 + tolerance, see `mix_quota`)."""
    quota = mix_quota(Counter(categories), shares, tolerance)
    taken, keep = Counter(), []
    for i, c in enumerate(categories):
        if taken[c] < quota.get(c, 0):
            taken[c] += 1
            keep.append(i)
    return keep


# ----------------------------------------------------------------------------------------------------------
# the whole pass over synthesised rows


@dataclass
class FilterSettings:
    min_words: int = 4             # a user turn shorter than this is dropped
    max_words: int = 300           # ... and one longer
    dedup_threshold: float = 0.7   # word-3-shingle Jaccard at or above which a first turn repeats an earlier one
    overlap_n: int = 13            # prompts sharing a word n-gram of this length with a benchmark are dropped
    report_n: tuple[int, ...] = (8, 13)   # n-gram lengths whose overlap figures are reported
    mix_tolerance: float = 0.0     # a category may keep up to (1 + this) x its share of the scarcest one's total


def user_turns(row: dict) -> list[str]:
    return [m["content"] for m in row["messages"] if m["role"] == "user"]


def turn_problem(text: str, finish: str, system_prompt: str, s: FilterSettings) -> tuple[str, str] | None:
    """(filter, reason) that removes one user turn, or None: unfinished, length, quality."""
    if finish != "eos":
        return "unfinished", "the user turn did not end within the token limit"
    reason = length_problem(text, s.min_words, s.max_words)
    if reason:
        return "length", reason
    reason = quality_problem(text, system_prompt)
    return ("quality", reason) if reason else None


def overlap_figures(rows: list[dict], bench: dict[str, list[str]], ns: tuple[int, ...]) -> dict:
    """{bench name: {"n=8": prompts sharing at least one 8-gram with it, ...}} over every user turn of `rows`."""
    figures = {}
    for name, texts in bench.items():
        figures[name] = {}
        for n in ns:
            index = ngram_index(texts, n)
            figures[name][f"n={n}"] = sum(any(overlap_count(t, index, n) for t in user_turns(r)) for r in rows)
    return figures


def filter_rows(rows: list[dict], shares: dict[str, float], bench: dict[str, list[str]],
                system_prompts: dict[str, str], s: FilterSettings | None = None) -> tuple[list[dict], dict]:
    """Run the filters in order over synthesised rows; returns (kept rows, report).

    Order: first user turn unfinished / length / quality -> exact and near duplicates (first turns) -> n-gram
    overlap with the benchmarks -> category mix. A follow-up turn that fails a check is cut off (the conversation
    stays as a one-turn prompt) and counted under `follow_ups_cut`. `report["removed"]` counts the rows each filter
    removed; the overlap figures are given before and after the overlap filter.
    """
    s = s or FilterSettings()
    removed = Counter()
    reasons = Counter()
    cut = Counter()
    passed = []
    for row in rows:
        finish = row.get("synth", {}).get("finish", ["eos"] * 3)
        turns = user_turns(row)
        problem = turn_problem(turns[0], finish[0], system_prompts.get(row["category"], ""), s)
        if problem:
            removed[problem[0]] += 1
            reasons[f"{problem[0]}: {problem[1]}"] += 1
            continue
        if len(turns) > 1:
            follow = turn_problem(turns[1], finish[-1], "", s)
            if follow:
                cut[follow[0]] += 1
                row = {**row, "messages": row["messages"][:1]}
        passed.append(row)
    dupes = find_duplicates([user_turns(r)[0] for r in passed], s.dedup_threshold)
    for kind, _ in dupes.values():
        removed[f"{kind} duplicate"] += 1
    unique = [r for i, r in enumerate(passed) if i not in dupes]
    before = overlap_figures(unique, bench, s.report_n)
    indexes = {name: ngram_index(texts, s.overlap_n) for name, texts in bench.items()}
    clean = [r for r in unique if not any(overlap_count(t, ix, s.overlap_n) for t in user_turns(r)
                                          for ix in indexes.values())]
    removed["benchmark overlap"] = len(unique) - len(clean)
    kept = [clean[i] for i in apply_mix([r["category"] for r in clean], shares, s.mix_tolerance)]
    removed["category mix"] = len(clean) - len(kept)
    report = {"rows": len(rows), "kept": len(kept),
              "removed": {k: removed.get(k, 0) for k in ("unfinished", "length", "quality", "exact duplicate",
                                                         "near duplicate", "benchmark overlap", "category mix")},
              "reasons": dict(reasons.most_common()), "follow_ups_cut": dict(cut),
              "overlap_before": before, "overlap_after": overlap_figures(kept, bench, s.report_n),
              "overlap_drop_n": s.overlap_n}
    return kept, report
