"""Tiny random targets of the model families draftlab users serve, built from `transformers` configs (no network).

Every target has the tokenizer of `conftest.build_tokenizer()` (about 320 tokens, ChatML), hidden size 64, a few
layers, and keeps what makes its family different from Llama: attention biases (Qwen2), q/k norms (Qwen3, OLMo 2),
mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss), sliding windows (Mistral; Gemma 3 and gpt-oss mixing sliding and
full layers with a window the prompts pass), tied and scaled embeddings (Qwen2/3, Gemma 3), fused projections
(Phi-3), post-norms (OLMo 2), multipliers (Granite), attention sinks (gpt-oss) and recurrent linear-attention
layers (the hybrid). `build_family(name, tokenizer)` returns the frozen model; `save_family` writes the HF folder a
run's `target.path` names.
"""
from __future__ import annotations

from pathlib import Path

import torch

HIDDEN = 64
LAYERS = 4
SLIDING_WINDOW = 12   # the chat-templated prompts alone are longer: decoding runs past the window

# family -> (config class, model class, family-specific config keys). Shared keys are added in `family_config`.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # q/k/v biases, tied head. initializer_range 0.2: at 0.02 a tied random model only repeats its last input token
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True, "initializer_range": 0.2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {                                   # q/k norms, tied head
        "head_dim": 16, "tie_word_embeddings": True, "initializer_range": 0.2}),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),  # v0.1's window: longer than any run
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "tie_word_embeddings": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None}),          # fused qkv_proj / gate_up_proj
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),                               # post-norms, full q/k norms
    "granite": ("GraniteConfig", "GraniteForCausalLM", {                            # Granite 3's multipliers
        "embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.0625}),
    "gptoss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2),
        "max_position_embeddings": 131072}),                   # its YaRN rope expects the real context length
    # hybrid: gated DeltaNet (recurrent state) layers between full-attention layers, and a sparse MoE
    "qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}),
}
HYBRID = "qwen3next"
DENSE_OR_MOE = [name for name in FAMILIES if name != HYBRID]


def family_config(name: str, tokenizer):
    import transformers

    config_class, _, own = FAMILIES[name]
    keys = dict(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    keys.update(own)
    return getattr(transformers, config_class)(**keys)


def build_family(name: str, tokenizer, seed: int = 0):
    """The frozen, eval-mode tiny random model of family `name`."""
    import transformers

    torch.manual_seed(seed)
    config = family_config(name, tokenizer)
    model = getattr(transformers, FAMILIES[name][1])(config).eval()
    # Sharpen the random model a little (as conftest.build_tiny_llama) so greedy decoding is not a coin toss
    # between near-equal logits: the LM head x4, or, when it is tied to the embedding, the final norm's scale.
    with torch.no_grad():
        if config.tie_word_embeddings:
            norm = model.model.norm.weight
            if name == "gemma3":             # Gemma's RMSNorm scales by (1 + weight)
                norm.copy_((1.0 + norm) * 4.0 - 1.0)
            else:
                norm.mul_(4.0)
        else:
            model.get_output_embeddings().weight.mul_(4.0)
    return model.requires_grad_(False)


def save_family(name: str, tokenizer, folder: Path):
    """The model of `build_family` saved as an HF folder (config, safetensors, tokenizer); returns the model."""
    model = build_family(name, tokenizer)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model
