"""Data: row formats, malformed rows, the assistant loss mask under several chat templates, batching, prompts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import build_tokenizer
from draftlab.data import (ChatDataset, DataError, LengthBucketSampler, collate, encode_conversation, encode_prompt,
                           load_prompts, read_conversations)

PROMPTS_DIR = Path(__file__).resolve().parents[1] / "data_prep" / "prompts"
END = "<|im_end|>"

ONE_TURN = [{"role": "user", "content": "Repeat: The quick brown fox."},
            {"role": "assistant", "content": "The quick brown fox."}]
MULTI_TURN = [{"role": "system", "content": "Answer briefly."},
              {"role": "user", "content": "Write a short poem about the sea."},
              {"role": "assistant", "content": "The sea, the wind and the stars."},
              {"role": "user", "content": "Repeat: def add(a, b)"},
              {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"}]

# Templates other than the fixture's ChatML: a Zephyr-like one (headers in plain text, EOS closes a turn),
# one that trims the content, and one that renders the final assistant turn differently (as reasoning
# templates do), so prefixes of the conversation do not render as prefixes of the whole.
ZEPHYR = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
TRIMMING = ("{% for m in messages %}{{ bos_token + m['role'] + ': ' + m['content'] | trim }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant: ' }}{% endif %}")
LAST_TURN_DIFFERS = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\n(final) ' + m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def masked_runs(row: dict) -> list[list[int]]:
    """The token ids of each contiguous run of loss_mask == 1."""
    runs, current = [], []
    for tok, m in zip(row["input_ids"], row["loss_mask"]):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def with_template(template: str | None):
    tok = build_tokenizer()
    if template:
        tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [None, ZEPHYR, TRIMMING, LAST_TURN_DIFFERS], ids=["chatml", "zephyr", "trim",
                                                                                       "last_turn_differs"])
@pytest.mark.parametrize("messages", [ONE_TURN, MULTI_TURN], ids=["one_turn", "multi_turn"])
def test_loss_mask_is_exactly_the_assistant_replies(template, messages):
    tok = with_template(template)
    row = encode_conversation(tok, messages, max_length=None)
    assert len(row["input_ids"]) == len(row["loss_mask"])
    assert row["input_ids"] == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    if template == TRIMMING:
        replies = [r.strip() for r in replies]
    decoded = [tok.decode(run) for run in masked_runs(row)]
    assert len(decoded) == len(replies)
    for text, reply in zip(decoded, replies):
        # A token may straddle the header/reply boundary (" def" after "assistant:"): it is the first token
        # the model must produce, so it is trained on; only template whitespace may come with it.
        assert text.endswith(reply + END) and not text[:-len(reply + END)].strip()


def test_truncation_keeps_a_prefix_and_drops_conversations_without_assistant_tokens(tiny_tokenizer):
    full = encode_conversation(tiny_tokenizer, MULTI_TURN, max_length=None)
    cut = encode_conversation(tiny_tokenizer, MULTI_TURN, max_length=len(full["input_ids"]) // 2)
    assert len(cut["input_ids"]) == len(full["input_ids"]) // 2
    assert cut["input_ids"] == full["input_ids"][:len(cut["input_ids"])]
    assert cut["loss_mask"] == full["loss_mask"][:len(cut["loss_mask"])]
    first_assistant = full["loss_mask"].index(1)
    ds = ChatDataset([ONE_TURN, MULTI_TURN], tiny_tokenizer, max_length=first_assistant)
    assert len(ds) == 0 and sum(ds.dropped.values()) == 2
    ds = ChatDataset([ONE_TURN, MULTI_TURN], tiny_tokenizer, max_length=None)
    assert len(ds) == 2 and not ds.dropped and ds.lengths == [len(r["input_ids"]) for r in ds.rows]


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_every_row_format_parses_to_the_same_messages(tmp_path):
    q, a = "Write a short poem about the sea.", "The sea, the wind and the stars."
    expected = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    rows = [{"messages": expected},
            {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]},
            {"prompt": q, "response": a}, {"prompt": q, "completion": a}, {"prompt": q, "output": a}]
    convs, stats = read_conversations(str(write_lines(tmp_path / "mixed.jsonl", rows)))
    assert convs == [expected] * len(rows) and stats.kept == stats.rows == len(rows) and not stats.malformed
    (tmp_path / "list.json").write_text(json.dumps(rows))
    assert read_conversations(str(tmp_path / "list.json"))[0] == [expected] * len(rows)
    system = read_conversations(str(write_lines(tmp_path / "sys.jsonl", [
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": q},
                           {"from": "gpt", "value": a}]},
        {"system": "Be brief.", "prompt": q, "response": a}])))[0]
    assert system[0] == system[1] == [{"role": "system", "content": "Be brief."}] + expected


def test_malformed_rows_are_counted_with_their_lines_and_strict_mode_raises(tmp_path):
    good = {"messages": ONE_TURN}
    rows = [good, "{not json", [1, 2], {"messages": [{"role": "wizard", "content": "hi"}]},
            {"conversations": [{"from": "human", "value": 3}]}, {"body": "no known fields"},
            {"messages": [{"role": "user", "content": "a question with no answer"}]}, good, ""]
    path = write_lines(tmp_path / "bad.jsonl", rows)
    convs, stats = read_conversations(str(path))
    assert len(convs) == stats.kept == 2 and stats.rows == 8  # the blank line is not a row
    assert [where for where, _ in stats.malformed] == [f"{path}:{n}" for n in range(2, 8)]
    assert all(why for _, why in stats.malformed)
    assert "6 malformed" in str(stats) and f"{path}:2" in str(stats) and stats.summary().startswith(str(path))
    with pytest.raises(DataError, match=f"{path}:2"):
        read_conversations(str(path), strict=True)
    assert len(read_conversations(str(path), limit=1)[0]) == 1


def test_missing_or_invalid_sources_raise(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_conversations(str(tmp_path / "nope.jsonl"))
    (tmp_path / "obj.json").write_text('{"messages": []}')
    with pytest.raises(DataError, match="list of rows"):
        read_conversations(str(tmp_path / "obj.json"))


def test_fixture_chat_file_makes_a_dataset(tiny_chat_file, tiny_tokenizer):
    convs, stats = read_conversations(tiny_chat_file)
    assert stats.kept == 64 and not stats.malformed
    ds = ChatDataset(convs, tiny_tokenizer, max_length=256)
    assert len(ds) == 64 and max(ds.lengths) <= 256
    assert all(0 < sum(r["loss_mask"]) < len(r["input_ids"]) for r in ds.rows)


def test_collate_right_pads(tiny_chat_file, tiny_tokenizer):
    convs, _ = read_conversations(tiny_chat_file, limit=6)
    ds = ChatDataset(convs, tiny_tokenizer, max_length=None)
    rows = [ds[i] for i in range(len(ds))]
    batch = collate(rows, pad_token_id=tiny_tokenizer.pad_token_id)
    width = max(ds.lengths)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert all(t.shape == (len(rows), width) and t.dtype == torch.long for t in batch.values())
    assert batch["attention_mask"].sum(1).tolist() == ds.lengths
    for b, n in enumerate(ds.lengths):
        assert batch["input_ids"][b, :n].tolist() == rows[b]["input_ids"]
        assert (batch["input_ids"][b, n:] == tiny_tokenizer.pad_token_id).all()
        assert batch["attention_mask"][b, :n].all() and not batch["loss_mask"][b, n:].any()


def test_length_buckets_cover_each_index_once_and_group_similar_lengths():
    lengths = [(i * 37) % 101 + 1 for i in range(103)]
    sampler = LengthBucketSampler(lengths, batch_size=8, bucket_batches=4, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 13
    assert sorted(i for b in batches for i in b) == list(range(103))
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 0.5 * (max(lengths) - min(lengths))  # much tighter than random batches
    assert list(LengthBucketSampler(lengths, 8, 4, seed=1)) == batches  # deterministic
    sampler.set_epoch(1)
    assert list(sampler) != batches
    dropped = LengthBucketSampler(lengths, 8, 4, drop_last=True)
    assert len(dropped) == len(list(dropped)) == 12 and all(len(b) == 8 for b in dropped)


def test_bucketed_dataloader_yields_padded_batches(tiny_chat_file, tiny_tokenizer):
    from functools import partial

    convs, _ = read_conversations(tiny_chat_file)
    ds = ChatDataset(convs, tiny_tokenizer, max_length=None)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=LengthBucketSampler(ds.lengths, 8),
                                         collate_fn=partial(collate, pad_token_id=tiny_tokenizer.pad_token_id))
    batches = list(loader)
    assert sum(b["input_ids"].shape[0] for b in batches) == len(ds)
    assert all(b["attention_mask"].sum().item() <= b["input_ids"].numel() for b in batches)


def test_load_prompts_reads_every_prompt_format(tmp_path, tiny_prompt_file):
    prompts = load_prompts(tiny_prompt_file)
    assert len(prompts) == 8 and prompts[0].id == "p0" and prompts[0].messages[0]["role"] == "user"
    rows = [{"id": "a", "prompt": "Tell me a joke."},
            {"id": "b", "messages": ONE_TURN, "category": "copy"},  # answers file: keep up to the first user turn
            {"question_id": 7, "turns": ["First?", "Second?"], "category": "writing"},
            {"messages": MULTI_TURN}]
    p = load_prompts(str(write_lines(tmp_path / "p.jsonl", rows)))
    assert [x.id for x in p] == ["a", "b", "7", "3"]
    assert p[0].messages == [{"role": "user", "content": "Tell me a joke."}] and p[0].turns is None
    assert p[1].messages == ONE_TURN[:1] and p[1].category == "copy"
    assert p[2].messages == [{"role": "user", "content": "First?"}] and p[2].turns == ["First?", "Second?"]
    assert p[3].messages == MULTI_TURN[:2]
    assert len(load_prompts(str(tmp_path / "p.jsonl"), limit=2)) == 2


@pytest.mark.parametrize("bad, reason", [("{oops", "not valid JSON"), ({"id": "x"}, "no `messages`"),
                                         ({"id": "x", "turns": []}, "turns"),
                                         ({"id": "x", "messages": [{"role": "system", "content": "s"}]}, "no user"),
                                         ({"id": "a", "prompt": "again"}, "appears twice")])
def test_malformed_prompt_rows_name_file_and_line(tmp_path, bad, reason):
    path = write_lines(tmp_path / "p.jsonl", [{"id": "a", "prompt": "ok"}, bad])
    with pytest.raises(DataError, match=reason) as e:
        load_prompts(str(path))
    assert f"{path}:2" in str(e.value)
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_encode_prompt_ends_with_the_assistant_header(tiny_tokenizer):
    ids = encode_prompt(tiny_tokenizer, ONE_TURN[:1])
    assert ids.dtype == torch.long and ids.dim() == 1
    assert tiny_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    full = encode_conversation(tiny_tokenizer, ONE_TURN, max_length=None)["input_ids"]
    assert full[:len(ids)] == ids.tolist()  # the training layout continues the prompt layout


def test_shipped_prompt_files_load():
    train = load_prompts(str(PROMPTS_DIR / "train_prompts_small.jsonl"))
    assert len(train) == 400 and all(len(p.messages) == 1 for p in train)
    mtbench = load_prompts(str(PROMPTS_DIR / "mtbench.jsonl"))
    assert len(mtbench) == 80 and all(p.turns and len(p.turns) == 2 and p.category for p in mtbench)
    assert all(p.messages[0]["content"] == p.turns[0] for p in mtbench)


def test_a_prompt_file_that_is_a_folder_says_so(tmp_path):
    from draftlab.data import load_prompts
    from draftlab.errors import DataError

    with pytest.raises(DataError, match="is a folder: pass a .jsonl file"):
        load_prompts(str(tmp_path))
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
