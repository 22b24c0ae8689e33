"""The docs come in two kinds, and this holds the line between them.

Guide pages (README.md and every page of docs/ outside docs/evidence/) describe the tool as it is: no dates,
no commit hashes, no history ("that morning", "kept as it was", numbered rounds of work). Measurements live on
evidence pages (docs/evidence/), each of which opens with a header that says what it answers and where its
figures come from: the question, the script, the command, the commit, the date and the machine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EVIDENCE = DOCS / "evidence"

_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?"
          r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_YEAR = r"(?:19|20)\d{2}"
DATE = re.compile(rf"\b{_YEAR}-\d{{2}}-\d{{2}}\b"                       # 2026-12-01
                  rf"|\b{_MONTH}\.?\s+(?:\d{{1,2}}(?:st|nd|rd|th)?,?\s+)?{_YEAR}\b"  # December 2026, Dec 1, 2026
                  rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}\.?,?\s+{_YEAR}\b")       # 1 December 2026
# A commit hash: 7 to 40 hex digits standing alone, with at least one digit and one letter (so neither a number
# nor an English word such as "decade" or "effaced"), not a hexadecimal literal (0x...) and not a file digest
# that a message prints after "sha256".
HASH = re.compile(r"(?<![\w.-])(?<!0x)(?<!sha256 )(?<!sha256:)"
                  r"(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
HISTORY = re.compile(r"\b(?:this|that|the same|earlier|later) (?:session|morning|afternoon|evening|night|day)\b"
                     r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th))"
                     r" session\b|\bsessions?\b|\bkept as it was\b|\byesterday\b|\bround \d+\b|\bround [IVX]+\b",
                     re.IGNORECASE)
FIELDS = ("Question", "Script", "Command", "Commit", "Date", "Machine")


def history_marks(text: str) -> list[str]:
    """Every date, commit hash or history phrase in `text`, as `line N: match` (empty when there is none)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in (DATE, HASH, HISTORY):
            found += [f"line {number}: {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def header_fields(text: str) -> dict[str, str]:
    """The header of an evidence page: the `- **Field:** value` items of the list that follows its title.

    A value runs over its continuation lines; the header ends at the first blank line after the list."""
    lines = text.splitlines()
    assert lines and lines[0].startswith("# "), "an evidence page starts with its title"
    fields, current = {}, None
    for line in lines[1:]:
        if not line.strip():
            if fields:
                break
            continue
        item = re.match(r"- \*\*(\w+?)s?:\*\*\s*(.*)", line)
        if item:
            current = item.group(1)
            fields[current] = item.group(2)
        elif current and line.startswith("  "):
            fields[current] += " " + line.strip()
        else:
            break
    return fields


def guide_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if EVIDENCE not in p.parents)]


def evidence_pages() -> list[Path]:
    return sorted(EVIDENCE.glob("*.md"))


@pytest.mark.unit
@pytest.mark.parametrize("planted", ["measured 2026-12-01 on two cores", "as of December 2026", "on 3 Dec 2026",
                                     "at commit 4e7d8a0 the sums", "(see 4726c32e91)", "run again that morning",
                                     "in this session", "the table, kept as it was", "Round 3 of the study",
                                     "the ninth session's run"])
def test_history_marks_catches_a_planted_date_hash_or_history(planted):
    assert history_marks(f"A line of the guide, {planted}, and more.")


@pytest.mark.unit
@pytest.mark.parametrize("ordinary", ["a decade of effaced facade", "1234567 tokens and 2,097,152 more",
                                      "float16 and bfloat16",
                                      "ridge 1e-3, tolerance 1e-12", "sha256 19995c6d20c1 now", "0xdeadbeef1",
                                      "median of 5 interleaved rounds", "round(sqrt(heads/2)) clusters",
                                      "transformers 5.24, torch 2.13", "the 2048-token windows", "Llama-3.2-1B",
                                      "`pruner_format` in config.json", "gpt2-small-random at T = 1024"])
def test_history_marks_leaves_ordinary_words_alone(ordinary):
    assert history_marks(ordinary) == []


@pytest.mark.unit
def test_the_guide_and_the_readme_carry_no_dates_hashes_or_history():
    found = [f"{page.relative_to(ROOT)}: {mark}"
             for page in guide_pages() for mark in history_marks(page.read_text())]
    assert not found, "dates, commit hashes and history belong on evidence pages (docs/evidence/):\n" + "\n".join(found)


@pytest.mark.unit
def test_every_evidence_page_opens_with_its_header():
    pages = evidence_pages()
    assert len(pages) >= 5, "the measurements live in docs/evidence/"
    problems = []
    for page in pages:
        fields = header_fields(page.read_text())
        missing = [f for f in FIELDS if not fields.get(f, "").strip()]
        if missing:
            problems.append(f"{page.name}: no {', '.join(missing)} in its header")
        if fields.get("Commit") and not HASH.search(fields["Commit"]):
            problems.append(f"{page.name}: its Commit field names no commit")
        if fields.get("Date") and not DATE.search(fields["Date"]):
            problems.append(f"{page.name}: its Date field has no date")
    assert not problems, "\n".join(problems)


@pytest.mark.unit
def test_header_fields_reads_a_header_and_misses_a_missing_field():
    page = ("# Evidence: x\n\n- **Question:** why\n- **Scripts:** `eval/a.py`,\n  `eval/b.py`\n"
            "- **Command:** `python eval/a.py`\n- **Commit:** `4726c32`\n- **Date:** 2026-12-04\n\nBody.\n")
    fields = header_fields(page)
    assert fields["Script"] == "`eval/a.py`, `eval/b.py`" and fields["Date"] == "2026-12-04"
    assert "Machine" not in fields and "Body." not in " ".join(fields.values())


# A stand-in left where a figure should go: an all-capitals name of letters joined by underscores (GEMMA_TIMES),
# outside code; quantization types carry digits (Q4_K_M) and symbols a one-letter part (R_KL), so neither matches.
PLACEHOLDER = re.compile(r"\b[A-Z]{2,}(?:_[A-Z]{2,})+\b")


def placeholders(text: str) -> list[str]:
    """Every placeholder name in `text` outside fenced code blocks and code spans."""
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
    return PLACEHOLDER.findall(prose)


@pytest.mark.unit
def test_placeholders_finds_a_stand_in_and_leaves_code_and_quant_types_alone():
    assert placeholders("On 2 CPU cores: GEMMA_TIMES.") == ["GEMMA_TIMES"]
    assert placeholders("Q4_K_M, R_KL, `HF_HUB_OFFLINE=1`\n```bash\nPRUNER_CACHE=x pruner\n```\n") == []


@pytest.mark.unit
def test_no_page_carries_a_placeholder_where_a_figure_belongs():
    found = [f"{page.relative_to(ROOT)}: {name}" for page in [*guide_pages(), *evidence_pages()]
             for name in placeholders(page.read_text())]
    assert not found, "\n".join(found)
