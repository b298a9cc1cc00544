"""Which Hugging Face architectures privgrad trains: results/hf_coverage.md.

Each architecture is built from a tiny configuration (random weights, nothing downloaded) as
a sequence classifier (a causal LM where transformers has no classifier for it), as an
image classifier for the vision ones, or as an audio classifier for the speech ones, and
goes through ``privgrad.make_private`` and one epoch of DP-SGD (40 examples, expected batch
10, ε = 3). make_private's probe is the check:
it refuses a model unless, on its probe examples, each example's per-sample gradient is
autograd's gradient of that example's loss and their sum the batch's gradient
(``privgrad.per_sample.independence``). A row says "trains", "refused" with privgrad's
reason, or "not built" when transformers itself failed on the tiny configuration or the
inputs (not a privgrad result). A model refused for its BatchNorm is tried again after
``privgrad.layers.replace_batch_norm`` (each BatchNorm swapped for a GroupNorm), and its
detail says how that went.

    python experiments/scripts/hf_coverage.py            # writes results/hf_coverage.md
    python experiments/scripts/hf_coverage.py bart t5    # prints those rows only
"""

from __future__ import annotations

import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

import privgrad
from privgrad.errors import PrivgradError
from privgrad.layers import replace_batch_norm
from privgrad.records import code_version

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "hf_coverage.md"
VOCAB, LENGTH, CLASSES, N, BATCH = 40, 8, 3, 40, 10
PAD, BOS, EOS = 0, 1, 2
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=64, max_position_embeddings=64, num_labels=CLASSES,
    pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=EOS,
)  # fmt: skip
# mixtures of experts: 4 experts, 2 per token (each config reads the names it knows)
MOE = dict(
    num_key_value_heads=1, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32,
)  # fmt: skip
# gated delta nets (linear attention) beside full attention: 2 heads of 16, then the same
# with experts; use_cache=False as for every mixer below
GATED = dict(
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"],
    use_cache=False,
)  # fmt: skip
GATED_MOE = dict(MOE, **GATED, head_dim=16, shared_expert_intermediate_size=32)
# DeBERTa as its checkpoints are configured: relative attention (a position table projected
# per layer), for v2 as DeBERTa-v3's (shared query/key projections, the table normalised)
DEBERTA = dict(relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=8)
DEBERTA_V3 = dict(
    DEBERTA, position_buckets=8, share_att_key=True, norm_rel_ebd="layer_norm",
)  # fmt: skip
# per architecture: configuration keywords beyond SMALL (names it does not map to its own;
# None drops one of SMALL's)
TEXT = {
    "bert": {}, "roberta": {}, "distilbert": dict(dim=32, hidden_dim=64, n_heads=2, n_layers=2),
    "albert": dict(embedding_size=16), "electra": dict(embedding_size=16),
    "deberta-v2": DEBERTA_V3, "xlm-roberta": {}, "mpnet": {}, "funnel": dict(
    num_hidden_layers=None, d_head=16, d_inner=64, block_sizes=[1, 1]),
    "gpt2": {}, "gpt_neox": {}, "gptj": dict(rotary_dim=8), "bloom": {}, "falcon": {},
    "opt": dict(word_embed_proj_dim=32, ffn_dim=64), "llama": {},
    "mistral": dict(num_key_value_heads=1), "qwen2": dict(num_key_value_heads=1),
    "gemma": dict(head_dim=16, num_key_value_heads=1), "phi": {},
    "stablelm": dict(num_key_value_heads=1),
    "bart": dict(encoder_ffn_dim=64, decoder_ffn_dim=64),
    "mbart": dict(encoder_ffn_dim=64, decoder_ffn_dim=64),
    "t5": dict(d_ff=64, d_kv=16),
    "mt5": dict(d_ff=64, d_kv=16), "umt5": dict(d_ff=64, d_kv=16), "camembert": {},
    "big_bird": dict(attention_type="original_full"), "esm": {},
    "mobilebert": dict(embedding_size=16, intra_bottleneck_size=32, true_hidden_size=32),
    "biogpt": {}, "codegen": dict(n_embd=32, n_layer=2, n_head=2, rotary_dim=8),
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=4),
    "gpt_bigcode": {}, "mpt": dict(d_model=32, n_heads=2, n_layers=2), "persimmon": {},
    "phi3": {}, "olmo": {}, "olmo2": {}, "qwen3": dict(num_key_value_heads=1, head_dim=16),
    "gemma2": dict(head_dim=16, num_key_value_heads=1), "roformer": {}, "ernie": {},
    "rembert": dict(input_embedding_size=16, output_embedding_size=16), "layoutlm": {},
    "markuplm": {}, "fnet": {}, "megatron-bert": {}, "yoso": {}, "mra": {},
    "data2vec-text": {}, "luke": dict(entity_vocab_size=10, entity_emb_size=16),
    "mvp": dict(encoder_ffn_dim=64, decoder_ffn_dim=64),
    "canine": {}, "starcoder2": {}, "cohere": {}, "granite": {}, "modernbert": {},
    "deberta": DEBERTA, "longformer": dict(attention_window=4), "ibert": {},
    "xlnet": dict(d_model=32, n_layer=2, n_head=2, d_inner=64, max_position_embeddings=None),
    "mixtral": dict(num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2),
    "mamba": dict(use_cache=False), "rwkv": {},
    "gemma3_text": dict(head_dim=16, num_key_value_heads=1), "glm": {}, "glm4": {},
    "olmo3": {}, "smollm3": dict(num_key_value_heads=1, head_dim=16),
    "helium": dict(num_key_value_heads=1, head_dim=16),
    "nemotron": dict(num_key_value_heads=1, head_dim=16),
    "exaone4": dict(num_key_value_heads=1, head_dim=16),
    "ministral": dict(num_key_value_heads=1, head_dim=16, sliding_window=None),
    "arcee": {}, "eurobert": {}, "diffllama": {}, "convbert": dict(embedding_size=32),
    "flaubert": dict(emb_dim=32, n_layers=2, n_heads=2),
    "xlm": dict(emb_dim=32, n_layers=2, n_heads=2),
    "openai-gpt": dict(n_embd=32, n_layer=2, n_head=2),
    "ctrl": dict(n_embd=32, n_layer=2, n_head=2, dff=64),
    "roberta-prelayernorm": {}, "xlm-roberta-xl": {}, "squeezebert": dict(embedding_size=32),
    "plbart": dict(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
    ),
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(MOE, head_dim=16), "olmoe": MOE, "phimoe": MOE, "granitemoe": MOE,
    "gpt_oss": dict(MOE, head_dim=16, layer_types=["full_attention", "sliding_attention"]),
    "ernie4_5_moe": dict(MOE, moe_num_experts=4, moe_k=2),
    "glm4_moe": dict(MOE, n_routed_experts=4, first_k_dense_replace=0, n_group=1, topk_group=1),
    "hunyuan_v1_moe": dict(MOE, head_dim=16), "minimax": dict(MOE, head_dim=16),
    "flex_olmo": MOE, "exaone_moe": dict(MOE, head_dim=16),
    "deepseek_v3": dict(
        MOE, num_key_value_heads=2, n_routed_experts=4, n_group=1, topk_group=1,
        first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1,
    ),
    "jamba": dict(MOE, use_cache=False, attn_layer_period=2, attn_layer_offset=1),
    "llama4_text": dict(
        MOE, num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=64,
        head_dim=16, interleave_moe_layer_step=1, no_rope_layers=[1, 1],
    ),
    "cohere2": dict(num_key_value_heads=1), "ernie4_5": dict(num_key_value_heads=1, head_dim=16),
    "seed_oss": dict(num_key_value_heads=1, head_dim=16), "apertus": dict(num_key_value_heads=1),
    "hunyuan_v1_dense": dict(num_key_value_heads=1, head_dim=16),
    "bitnet": dict(num_key_value_heads=1), "doge": dict(num_key_value_heads=1),
    "lfm2": dict(num_key_value_heads=1),
    # state-space and linear-attention mixers (use_cache=False: make_private's check runs in
    # eval mode, where these models would otherwise build a cache holding the batch's state)
    "falcon_h1": dict(
        num_key_value_heads=1, use_cache=False, mamba_d_ssm=64, mamba_n_heads=4,
        mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8,
    ),
    "mamba2": dict(
        num_heads=4, head_dim=16, state_size=16, n_groups=1, chunk_size=8, use_cache=False
    ),
    "falcon_mamba": dict(state_size=16, use_cache=False),
    "bamba": dict(
        num_key_value_heads=1, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_chunk_size=8, attn_layer_indices=[1], use_cache=False,
    ),
    "zamba": dict(
        attention_hidden_size=64, attention_head_dim=32, num_key_value_heads=2,
        n_mamba_heads=2, mamba_dt_rank=4, num_hidden_layers=3,
        layers_block_type=["linear_attention", "hybrid", "hybrid"],
        use_mamba_kernels=False, use_cache=False,
    ),
    "zamba2": dict(
        attention_hidden_size=64, attention_head_dim=32, num_key_value_heads=2,
        mamba_d_state=16, n_mamba_heads=4, mamba_headdim=16, chunk_size=8,
        layers_block_type=["linear_attention", "hybrid"], use_mamba_kernels=False,
        use_cache=False,
    ),
    "granitemoehybrid": dict(
        MOE, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8,
        layer_types=["mamba", "attention"], use_cache=False,
    ),
    "nemotron_h": dict(
        head_dim=16, num_key_value_heads=1, ssm_state_size=16, mamba_num_heads=4,
        mamba_head_dim=16, n_groups=1, chunk_size=8, use_mamba_kernels=False,
        layers_block_type=["linear_attention", "full_attention"], use_cache=False,
    ),
    "qwen3_next": GATED_MOE,
    "qwen3_5_text": dict(GATED, num_key_value_heads=1, head_dim=16),
    "olmo_hybrid": dict(GATED, num_key_value_heads=2),
    "qwen3_5_moe_text": GATED_MOE,
    "lara_mini": GATED_MOE,
    "bailing_hybrid": dict(
        MOE, num_experts_per_token=2, num_expert_group=1, topk_group=1, linear_head_dim=16,
        linear_num_heads=2, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        head_dim=16, qk_head_dim=16, num_key_value_heads=2, use_cache=False,
    ),
    "kimi_linear": dict(
        MOE, num_experts_per_token=2, linear_head_dim=16, linear_num_heads=2,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=16, qk_head_dim=16,
        use_cache=False,
    ),
}  # fmt: skip
# two-tower models (CLIP, SigLIP): their image tower as an image classifier
VISION = dict(
    image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=2, intermediate_size=64,
)  # fmt: skip
TEXT_TOWER = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=64,
)  # fmt: skip
IMAGE = {
    "vit": dict(image_size=32, patch_size=8, num_channels=3),
    "deit": dict(
        image_size=32, patch_size=8, num_channels=3, architectures=["DeiTForImageClassification"]
    ),
    "convnext": dict(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2),
    "resnet": dict(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8),
    "beit": dict(image_size=32, patch_size=8, num_channels=3, use_relative_position_bias=True),
    "dinov2": dict(image_size=32, patch_size=8, num_channels=3),
    "vit_msn": dict(image_size=32, patch_size=8, num_channels=3),
    "convnextv2": dict(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2),
    "focalnet": dict(image_size=32, patch_size=4, num_channels=3, embed_dim=8, depths=[1, 1]),
    "poolformer": dict(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_encoder_blocks=2,
        patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1], pool_size=3,
    ),
    "swin": dict(
        image_size=32, patch_size=4, num_channels=3, embed_dim=8, depths=[1, 1],
        num_heads=[1, 2], window_size=4, hidden_size=None, num_hidden_layers=None,
        num_attention_heads=None,
    ),
    "efficientnet": dict(
        image_size=32, num_channels=3, width_coefficient=0.25, depth_coefficient=0.25,
        hidden_dim=320,
    ),
    "mobilevit": dict(
        image_size=32, num_channels=3, hidden_sizes=[16, 16, 16], num_attention_heads=2,
        neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32],
    ),
    "data2vec-vision": dict(image_size=32, patch_size=8, num_channels=3),
    "dinov2_with_registers": dict(image_size=32, patch_size=8, num_channels=3),
    "ijepa": dict(image_size=32, patch_size=8, num_channels=3),
    "segformer": dict(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
        hidden_sizes=[8, 16], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
        mlp_ratios=[2, 2], decoder_hidden_size=16, hidden_size=None, num_hidden_layers=None,
    ),
    "pvt_v2": dict(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
        hidden_sizes=[8, 16], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
        mlp_ratios=[2, 2], hidden_size=None, num_hidden_layers=None,
    ),
    "clip": dict(vision_config=VISION, text_config=TEXT_TOWER),
    "siglip": dict(vision_config=VISION, text_config=TEXT_TOWER),
    "swinv2": dict(
        image_size=32, patch_size=4, num_channels=3, embed_dim=8, depths=[1, 1],
        num_heads=[1, 2], window_size=4, hidden_size=None, num_hidden_layers=None,
        num_attention_heads=None,
    ),
    "cvt": {},
}  # fmt: skip


# speech models on the raw waveform (400 samples), as audio classifiers, SpecAugment on
SPEECH = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=2, num_labels=CLASSES, mask_time_prob=0.3,
    mask_time_length=2,
)  # fmt: skip
AUDIO = {
    name: SPEECH
    for name in (
        "wav2vec2", "hubert", "wavlm", "sew", "sew-d", "unispeech", "unispeech-sat",
        "data2vec-audio", "wav2vec2-conformer",
    )
}  # fmt: skip


def text_batch(n: int, seed: int) -> dict:
    """Token ids padded with PAD after 3..LENGTH tokens, the last real one EOS (classifiers
    like BART's read it), and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, LENGTH), generator=g)
    lengths = torch.randint(3, LENGTH + 1, (n,), generator=g)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    ids = ids * mask
    ids[torch.arange(n), lengths - 1] = EOS
    return {"input_ids": ids, "attention_mask": mask}


def next_token_loss(logits, ids):
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"
    ).sum(1)


def build(name: str):
    """(model, inputs, labels, loss_fn or None, head) for the architecture ``name``."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    if name in AUDIO:
        config = transformers.AutoConfig.for_model(name, **AUDIO[name])
        model = transformers.AutoModelForAudioClassification.from_config(config)
        g = torch.Generator().manual_seed(1)
        x = {"input_values": torch.randn(N, 400, generator=g)}
        return model, x, torch.arange(N) % CLASSES, None, "audio classifier"
    image = name in IMAGE
    extra = IMAGE[name] if image else TEXT[name]
    kw = {k: v for k, v in {**SMALL, **extra}.items() if v is not None}
    config = transformers.AutoConfig.for_model(name, **kw)
    if image:
        model = transformers.AutoModelForImageClassification.from_config(config)
        g = torch.Generator().manual_seed(1)
        x = {"pixel_values": torch.randn(N, 3, 32, 32, generator=g)}
        return model, x, torch.arange(N) % CLASSES, None, "image classifier"
    x = text_batch(N, 1)
    if config.model_type in auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        model = transformers.AutoModelForSequenceClassification.from_config(config)
        return model, x, torch.arange(N) % CLASSES, None, "sequence classifier"
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model, x, x["input_ids"], next_token_loss, "causal LM"


def clipped(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def row(name: str) -> tuple[str, str, str, str]:
    """(architecture, head, outcome, detail); a model refused for its BatchNorm is tried
    again after :func:`privgrad.layers.replace_batch_norm`, and the detail says how that
    went."""
    torch.manual_seed(0)
    try:
        model, x, y, loss_fn, head = build(name)
        with torch.no_grad():  # transformers' own failure on these inputs is not privgrad's
            model.eval()(**{k: v[:BATCH] for k, v in x.items()})
        model.train()
    except Exception as e:  # noqa: BLE001 (reported as a row)
        return name, "", "not built", clipped(f"{type(e).__name__}: {e}")
    outcome, detail = attempt(model, x, y, loss_fn)
    if outcome == "refused" and "BatchNorm mixes" in detail:
        torch.manual_seed(0)
        model = replace_batch_norm(build(name)[0])
        again, how = attempt(model, x, y, loss_fn)
        detail = clipped(detail, 250) + f" — after replace_batch_norm(model): {again}, {how}"
    return name, head, outcome, clipped(detail, 600)


def attempt(model, x, y, loss_fn) -> tuple[str, str]:
    """(outcome, detail) of make_private and one epoch of DP-SGD on ``model``."""
    kw = {} if loss_fn is None else {"loss_fn": loss_fn}
    try:
        start = time.perf_counter()
        trainer = privgrad.make_private(
            model, torch.optim.Adam(model.parameters(), lr=1e-3), (x, y), target_epsilon=3.0,
            epochs=1, batch_size=BATCH, seed=0, **kw,
        )  # fmt: skip
        for batch in trainer.batches():
            trainer.step(batch)
        seconds = time.perf_counter() - start
    except PrivgradError as e:
        return "refused", clipped(str(e))
    except Exception as e:  # noqa: BLE001 (a privgrad failure that is not a refusal)
        tb = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{Path(tb.filename).name}:{tb.lineno}"
        return "error", clipped(f"{type(e).__name__} at {where}: {e}")
    sampler = trainer.grad_sampler
    layouts = sorted(
        f"{sampler.names[m]}"
        for m in sampler.expanded
        | sampler.folded
        | (set(sampler.shared.sites) - sampler.shared.params)
    )
    detail = f"{trainer.steps} steps, ε = {trainer.epsilon():.3f}, {seconds:.1f} s"
    if layouts:
        detail += f"; layouts read after the check: {', '.join(layouts)}"
    if sampler.shared.params:
        n = len(sampler.shared.params)
        detail += f"; own parameters followed as tables: {n} layer{'s' if n > 1 else ''}"
    return "trains", detail


def main(names: list[str]) -> None:
    import transformers

    rows = [row(n) for n in names]
    lines = [
        "| architecture | built as | outcome | detail |",
        "|---|---|---|---|",
        *(f"| {a} | {h} | {o} | {d.replace('|', '/')} |" for a, h, o, d in rows),
    ]
    if names != [*TEXT, *IMAGE, *AUDIO]:
        print("\n".join(lines))
        return
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    counts = {o: sum(r[2] == o for r in rows) for o in ("trains", "refused", "error", "not built")}
    OUT.write_text(
        "# Hugging Face architectures under privgrad\n\n"
        f"Written by `python experiments/scripts/hf_coverage.py` (commit {commit}, code "
        f"version {code_version()}, transformers {transformers.__version__}, torch "
        f"{torch.__version__}, CPU). Each architecture is built from a tiny configuration "
        "(random weights), goes through `make_private` (whose probe refuses it unless each "
        "example's per-sample gradient is autograd's gradient of its loss, on its probe "
        "examples) and one epoch of DP-SGD: 40 examples, expected batch 10, ε = 3. A tiny "
        "configuration is not the released model: a layer a larger configuration adds "
        "(another attention form, a cache) is not exercised here. A model refused for its "
        "BatchNorm is tried again after `privgrad.layers.replace_batch_norm(model)` (each "
        "BatchNorm swapped for a GroupNorm); its detail says how that went.\n\n"
        + ", ".join(f"{n} {o}" for o, n in counts.items())
        + ".\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print(OUT.read_text())


if __name__ == "__main__":
    main(sys.argv[1:] or [*TEXT, *IMAGE, *AUDIO])
