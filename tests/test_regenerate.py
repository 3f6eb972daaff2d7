"""Answer regeneration: rows written by the tiny target, resuming without duplicates, the regenerate CLI."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from draftlab.answers import answer_prompts, read_done_ids
from draftlab.data import DataError, load_prompts

ROOT = Path(__file__).resolve().parents[1]


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def regenerate_main():
    spec = importlib.util.spec_from_file_location("regenerate_script", ROOT / "data_prep" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def answered(tiny_target, tiny_prompt_file, tmp_path_factory):
    """All 8 fixture prompts answered once, in batches of 3 (the reference for the resume tests)."""
    model, tok = tiny_target
    prompts = load_prompts(tiny_prompt_file)
    out = tmp_path_factory.mktemp("answers") / "answers.jsonl"
    counts = answer_prompts(model, tok, prompts, str(out), max_new_tokens=12, batch_size=3, progress=False)
    return prompts, out, counts


def test_rows_are_chat_rows_answering_each_prompt(answered, tiny_target):
    prompts, out, counts = answered
    rows = sorted(rows_of(out), key=lambda r: int(r["id"][1:]))
    assert [r["id"] for r in rows] == [p.id for p in prompts]
    assert counts["answered"] == len(prompts) and counts["skipped"] == 0
    # p6 and p7 repeat the messages of p0 and p1 (the fixture cycles 6 texts): answered once, copied
    assert counts["duplicates"] == 2 and [r.get("copy_of") for r in rows[6:]] == ["p0", "p1"]
    assert all(r["backend"] == "transformers" and r["sampling"]["temperature"] == 0.0 for r in rows)
    assert counts["eos"] + counts["length"] == len(prompts)
    _, tok = tiny_target
    for row, prompt in zip(rows, prompts):
        assert row["messages"][-1] == rows[int(row.get("copy_of", row["id"])[1:])]["messages"][-1]
        assert row["messages"][:-1] == prompt.messages
        assert row["messages"][-1]["role"] == "assistant" and isinstance(row["messages"][-1]["content"], str)
        assert row["finish"] in ("eos", "length")
        if row["finish"] == "length":
            assert len(tok.encode(row["messages"][-1]["content"])) > 0


def test_left_padded_batches_answer_like_single_prompts(answered, tiny_target, tmp_path):
    prompts, out, _ = answered
    model, tok = tiny_target
    single = tmp_path / "single.jsonl"
    answer_prompts(model, tok, prompts, str(single), max_new_tokens=12, batch_size=1, progress=False)
    assert rows_of(single) == rows_of(out)


def test_resume_after_deleted_rows_and_a_truncated_last_line(answered, tiny_target, tmp_path):
    prompts, out, _ = answered
    model, tok = tiny_target
    reference = rows_of(out)
    lines = out.read_text().splitlines(keepends=True)
    path = tmp_path / "resumed.jsonl"
    path.write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])  # 4 rows, then a half-written one
    assert read_done_ids(str(path)) == {r["id"] for r in reference[:4]}
    assert path.read_text() == "".join(lines[:4])  # the half line was cut off
    counts = answer_prompts(model, tok, prompts, str(path), max_new_tokens=12, batch_size=3, progress=False)
    assert counts["skipped"] == 4 and counts["answered"] == len(prompts) - 4
    assert sorted(r["id"] for r in rows_of(path)) == sorted(r["id"] for r in reference)
    assert sorted(rows_of(path), key=lambda r: r["id"]) == sorted(reference, key=lambda r: r["id"])
    counts = answer_prompts(model, tok, prompts, str(path), max_new_tokens=12, progress=False)
    assert counts["answered"] == 0 and len(rows_of(path)) == len(prompts)


def test_more_prompts_extend_the_file(tiny_target, tiny_prompt_file, tmp_path):
    model, tok = tiny_target
    path = tmp_path / "grow.jsonl"
    answer_prompts(model, tok, load_prompts(tiny_prompt_file, limit=3), str(path), max_new_tokens=4, progress=False)
    first = rows_of(path)
    path.write_text(path.read_text().rstrip("\n"))  # a complete last row whose newline never came
    prompts = load_prompts(tiny_prompt_file)
    answer_prompts(model, tok, prompts + prompts[:2], str(path), max_new_tokens=4, progress=False)
    rows = rows_of(path)
    assert rows[:3] == first and sorted(r["id"] for r in rows) == sorted(p.id for p in prompts)
    assert {r["id"]: r.get("copy_of") for r in rows if "copy_of" in r} == {"p6": "p0", "p7": "p1"}


def test_a_corrupt_row_inside_the_file_is_not_overwritten(tiny_target, tiny_prompt_file, tmp_path):
    model, tok = tiny_target
    path = tmp_path / "corrupt.jsonl"
    text = '{"id": "p0", "messages": [], "finish": "eos"}\nnot json\n{"id": "p1", "messages": [], "finish": "eos"}\n'
    path.write_text(text)
    with pytest.raises(DataError, match=f"{path}:2"):
        answer_prompts(model, tok, load_prompts(tiny_prompt_file), str(path), max_new_tokens=4, progress=False)
    assert path.read_text() == text


def test_sampling_writes_rows(tiny_target, tiny_prompt_file, tmp_path):
    model, tok = tiny_target
    path = tmp_path / "sampled.jsonl"
    answer_prompts(model, tok, load_prompts(tiny_prompt_file, limit=4), str(path), max_new_tokens=6,
                   batch_size=4, temperature=1.0, progress=False)
    assert len(rows_of(path)) == 4


def test_regenerate_cli(tiny_target_dir, tiny_prompt_file, tmp_path, capsys):
    main = regenerate_main()
    out = tmp_path / "regen.jsonl"
    def args(num):
        return ["--target", tiny_target_dir, "--prompts", tiny_prompt_file, "--out", str(out), "--num", str(num),
                "--max-new-tokens", "4", "--batch-size", "2", "--no-progress"]

    assert main(args(3)) == 0
    assert [r["id"] for r in rows_of(out)] == ["p0", "p1", "p2"]
    assert main(args(5)) == 0  # two more, none repeated
    assert [r["id"] for r in rows_of(out)] == ["p0", "p1", "p2", "p3", "p4"]
    capsys.readouterr()
    assert main(["--target", tiny_target_dir, "--prompts", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "missing.jsonl" in err and "\n" not in err
    assert main(["--target", str(tmp_path / "nowhere"), "--prompts", tiny_prompt_file, "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
