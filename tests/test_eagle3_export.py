"""Specification of the EAGLE-3 export (`cospec.models.eagle3_export`).

The files are read back with plain ``json`` and ``safetensors`` and checked against the names the
engines' loaders use (constants below, each naming its source). The central property: a reference
written from vLLM's EAGLE-3 layer (vllm/model_executor/models/llama_eagle3.py, with the pairing of
vllm/v1/spec_decode/eagle.py), reading only the exported files, computes what cospec's draft
computes on the same entries, up to fp32 rounding (1e-5: RoPE angles differ, positions being one
lower there). Round trips through `read_eagle3_export` are bit-exact from the projected feature on;
the projection itself agrees to 1e-6 (its K input blocks are stored in ascending tap order).
"""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from cospec.config import ModelConfig
from cospec.models.draft import Eagle3Draft
from cospec.models.eagle3_export import export_eagle3, read_eagle3_export
from cospec.models.llama import Transformer

CFG = ModelConfig(vocab_size=50, hidden_size=32, num_layers=6, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, max_seq_len=64)
TAPS = (3, 1, 2)  # out of order on purpose: exports are ascending
DRAFT_MLP = 48

# vLLM llama_eagle3.py (Eagle3LlamaForCausalLM, LlamaModel) and SpecForge llama3_eagle.py
# (LlamaForCausalLMEagle3) read these from config.json; SpecForge's configs/*-eagle3.json have them.
CONFIG_FIELDS = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": DRAFT_MLP, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "max_position_embeddings": 64, "rope_theta": 10000.0,
    "vocab_size": 50, "attention_bias": False,
}
# vLLM v1/worker/gpu/spec_decode/eagle/eagle3_utils.py reads the top-level list, and captures the
# input of each id's layer (models/llama.py); SGLang (and SpecForge through it) reads eagle_config's
# and adds 1 itself (set_eagle3_layers_to_capture). Taps (1, 2, 3) are layer outputs.
VLLM_LAYER_IDS = [2, 3, 4]
EAGLE_CONFIG = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
# Weight names: SpecForge's module names (midlayer.*), which vLLM's load_weights renames to
# layers.0.* and SGLang's llama_eagle3.py loads as they are; d2t/t2d as SpecForge's buffers and
# vLLM's draft_id_to_target_id. C = 32, V = 50, K = 3.
WEIGHT_SHAPES = {
    "fc.weight": (32, 96), "embed_tokens.weight": (50, 32),
    "midlayer.input_layernorm.weight": (32,), "midlayer.hidden_norm.weight": (32,),
    "midlayer.self_attn.q_proj.weight": (32, 64), "midlayer.self_attn.k_proj.weight": (16, 64),
    "midlayer.self_attn.v_proj.weight": (16, 64), "midlayer.self_attn.o_proj.weight": (32, 32),
    "midlayer.post_attention_layernorm.weight": (32,),
    "midlayer.mlp.gate_proj.weight": (DRAFT_MLP, 32),
    "midlayer.mlp.up_proj.weight": (DRAFT_MLP, 32),
    "midlayer.mlp.down_proj.weight": (32, DRAFT_MLP), "norm.weight": (32,),
    "lm_head.weight": (50, 32), "d2t": (50,), "t2d": (50,),
}


def make_draft(cfg: ModelConfig = CFG, seed: int = 0) -> tuple[Transformer, Eagle3Draft]:
    torch.manual_seed(seed)
    policy = Transformer(cfg).eval()
    draft = Eagle3Draft.from_policy(policy, tap_layers=TAPS, intermediate_size=DRAFT_MLP).eval()
    with torch.no_grad():  # norms of ones would hide a swapped input_layernorm/hidden_norm
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    return policy, draft


def reduce_head(draft: Eagle3Draft, target_ids: list[int]) -> torch.Tensor:
    """Give `draft` a head over `target_ids` only; returns its d2t."""
    old = draft.lm_head.weight.data
    draft.lm_head = nn.Linear(old.shape[1], len(target_ids), bias=False)
    draft.lm_head.weight.data.copy_(old[target_ids])
    return torch.tensor(target_ids) - torch.arange(len(target_ids))


def policy_taps(policy: Transformer, tokens_BT: torch.Tensor) -> dict[int, torch.Tensor]:
    with torch.no_grad():
        return policy(tokens_BT, tap_layers=TAPS).taps


# ----------------------------------------------------------------------------- the files

def test_config_json_has_the_fields_the_engines_read(tmp_path):
    _, draft = make_draft()
    export_eagle3(draft, tmp_path / "d")
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert {k: hf[k] for k in CONFIG_FIELDS} == CONFIG_FIELDS
    assert hf["draft_vocab_size"] == 50
    assert hf["eagle_aux_hidden_state_layer_ids"] == VLLM_LAYER_IDS
    assert hf["eagle_config"] == EAGLE_CONFIG
    assert hf["rope_scaling"] is None and hf["rope_parameters"]["rope_type"] == "default"


def test_weights_have_the_names_shapes_and_dtypes_the_engines_read(tmp_path):
    _, draft = make_draft()
    export_eagle3(draft, tmp_path / "d")
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == WEIGHT_SHAPES
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


def test_a_full_vocabulary_head_gets_an_identity_map_and_reads_back_as_none(tmp_path):
    _, draft = make_draft()
    export_eagle3(draft, tmp_path / "d")
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert not tensors["d2t"].any() and tensors["t2d"].all()
    assert read_eagle3_export(tmp_path / "d")[1] is None


def test_a_bfloat16_draft_is_written_and_read_back_in_bfloat16(tmp_path):
    _, draft = make_draft()
    draft = draft.to(torch.bfloat16)
    export_eagle3(draft, tmp_path / "d")
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["torch_dtype"] == "bfloat16"
    assert load_file(tmp_path / "d" / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    back = read_eagle3_export(tmp_path / "d")[0].state_dict()
    for name, t in draft.state_dict().items():
        if name != "fc.weight":  # stored with its blocks in ascending tap order
            assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], t), name


def test_config_parses_as_the_llama_config_the_engines_build_from_it(tmp_path):
    from transformers import AutoConfig, LlamaConfig

    _, draft = make_draft()
    export_eagle3(draft, tmp_path / "d", max_position_embeddings=4096)
    hf = AutoConfig.from_pretrained(tmp_path / "d")
    assert isinstance(hf, LlamaConfig) and hf.max_position_embeddings == 4096
    assert hf.eagle_aux_hidden_state_layer_ids == VLLM_LAYER_IDS
    assert hf.eagle_config == EAGLE_CONFIG and hf.draft_vocab_size == 50


# ----------------------------------------------------------------------------- round trips

@torch.no_grad()
def assert_same_draft(a: Eagle3Draft, b: Eagle3Draft, policy: Transformer) -> None:
    tokens = torch.randint(0, a.policy_config.vocab_size, (2, 7))
    taps = policy_taps(policy, tokens)
    feat = a.project(taps)
    # b's fc blocks are in ascending tap order: the same sum, added in another order.
    torch.testing.assert_close(b.project(taps), feat, rtol=0, atol=1e-6)
    out_a, out_b = a(tokens, feat), b(tokens, feat)
    assert torch.equal(out_a.logits, out_b.logits) and torch.equal(out_a.hidden, out_b.hidden)


def test_round_trip_computes_bit_identical_features_logits_and_hidden(tmp_path):
    policy, draft = make_draft()
    export_eagle3(draft, tmp_path / "d")
    back, d2t = read_eagle3_export(tmp_path / "d")
    assert back.tap_layers == (1, 2, 3) and d2t is None
    assert back.policy_config.num_layers == CFG.num_layers
    assert back.config.intermediate_size == DRAFT_MLP
    assert_same_draft(draft, back, policy)


def test_a_deeper_draft_is_refused_rather_than_exported_without_its_further_layers(tmp_path):
    deep = Eagle3Draft(CFG, num_layers=2)
    with pytest.raises(ValueError, match="one decoder layer.*draft.eagle3_layers"):
        export_eagle3(deep, tmp_path / "d")
    assert not (tmp_path / "d").exists()


@torch.no_grad()
def test_the_proposal_scale_is_folded_into_the_exported_head(tmp_path):
    """The engines draw from the head's logits: the export's must be the scaled ones, k * z."""
    policy, draft = make_draft()
    draft.proposal_scale = 1.3
    export_eagle3(draft, tmp_path / "d")
    back, _ = read_eagle3_export(tmp_path / "d")
    assert back.proposal_scale == 1.0
    tokens = torch.randint(0, CFG.vocab_size, (2, 7))
    feat = draft.project(policy_taps(policy, tokens))
    torch.testing.assert_close(back(tokens, feat).logits, 1.3 * draft(tokens, feat).logits)


def test_reduced_vocabulary_writes_d2t_offsets_and_the_t2d_mask_and_round_trips(tmp_path):
    policy, draft = make_draft()
    target_ids = [0, 3, 4, 10, 11, 12, 30, 49]
    d2t = reduce_head(draft, target_ids)
    export_eagle3(draft, tmp_path / "d", d2t=d2t)
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert hf["vocab_size"] == 50 and hf["draft_vocab_size"] == 8
    assert tuple(tensors["lm_head.weight"].shape) == (8, 32)
    assert (torch.arange(8) + tensors["d2t"]).tolist() == target_ids  # draft id + d2t = target id
    assert tensors["t2d"].nonzero().flatten().tolist() == target_ids
    back, d2t_back = read_eagle3_export(tmp_path / "d")
    assert torch.equal(d2t_back, d2t)
    assert_same_draft(draft, back, policy)


def test_q_k_v_biases_are_written_as_vllm_attention_bias_with_a_zero_o_proj_bias(tmp_path):
    cfg = replace(CFG, qkv_bias=True)
    policy, draft = make_draft(cfg)
    export_eagle3(draft, tmp_path / "d")
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert hf["attention_bias"] is True
    assert tuple(tensors["midlayer.self_attn.q_proj.bias"].shape) == (32,)
    assert not tensors["midlayer.self_attn.o_proj.bias"].any()
    assert_same_draft(draft, read_eagle3_export(tmp_path / "d")[0], policy)


def test_llama3_rope_scaling_is_written_for_transformers_4_and_5_and_read_back(tmp_path):
    cfg = replace(CFG, rope_scaling="llama3", rope_scaling_factor=4.0, rope_original_max_len=16)
    policy, draft = make_draft(cfg)
    export_eagle3(draft, tmp_path / "d")
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    assert hf["rope_scaling"] == scaling
    assert hf["rope_parameters"] == {**scaling, "rope_theta": 10000.0}
    back = read_eagle3_export(tmp_path / "d")[0]
    assert back.config.rope_scaling == "llama3" and back.config.rope_scaling_factor == 4.0
    assert_same_draft(draft, back, policy)


# ----------------------------------------------------------------------------- refusals

def test_a_reduced_head_without_d2t_is_refused(tmp_path):
    _, draft = make_draft()
    reduce_head(draft, [1, 2, 3])
    with pytest.raises(ValueError, match="pass d2t"):
        export_eagle3(draft, tmp_path / "d")


@pytest.mark.parametrize("target_ids,message", [([3, 2, 5], "strictly increasing"),
                                                ([1, 2, 50], "outside the vocabulary")])
def test_d2t_that_specforge_t2d_cannot_express_is_refused(tmp_path, target_ids, message):
    _, draft = make_draft()
    reduce_head(draft, [0, 1, 2])
    d2t = torch.tensor(target_ids) - torch.arange(3)
    with pytest.raises(ValueError, match=message):
        export_eagle3(draft, tmp_path / "d", d2t=d2t)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("taps,message", [((1, 2, 5), "last layer"), ((1, 1, 2), "repeat")])
def test_taps_an_engine_cannot_capture_are_refused(tmp_path, taps, message):
    torch.manual_seed(0)
    draft = Eagle3Draft(CFG, tap_layers=taps)
    with pytest.raises(ValueError, match=message):
        export_eagle3(draft, tmp_path / "d")


# ----------------------------------------------------------------------------- vLLM's function

def rms_norm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x_HTD, positions_T, theta):
    D = x_HTD.shape[-1]
    angle = positions_T.float()[:, None] / theta ** (torch.arange(0, D, 2).float() / D)
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    return x_HTD * cos + torch.cat([-x_HTD[..., D // 2:], x_HTD[..., :D // 2]], -1) * sin


def vllm_eagle3_reference(path, aux_states, tokens_T, positions_T):
    """vLLM's EAGLE-3 first draft step from the exported files alone: fc over the taps in
    ascending layer order, the layer (norm_before_residual false), the final norm, the head, and
    d2t's scatter into the target vocabulary. Returns (logits [T, V], pre-norm hidden [T, C])."""
    hf = json.loads((path / "config.json").read_text())
    w = load_file(path / "model.safetensors")
    eps, H, Hkv = hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"]
    D, T = hf["head_dim"], len(tokens_T)
    L = lambda name, x: x @ w[f"midlayer.{name}.weight"].T  # noqa: E731
    feat = torch.cat(aux_states, -1) @ w["fc.weight"].T
    emb = w["embed_tokens.weight"][tokens_T]
    x = torch.cat([rms_norm(emb, w["midlayer.input_layernorm.weight"], eps),
                   rms_norm(feat, w["midlayer.hidden_norm.weight"], eps)], -1)
    theta = hf["rope_theta"]
    q = rotate(L("self_attn.q_proj", x).view(T, H, D).transpose(0, 1), positions_T, theta)
    k = rotate(L("self_attn.k_proj", x).view(T, Hkv, D).transpose(0, 1), positions_T, theta)
    v = L("self_attn.v_proj", x).view(T, Hkv, D).transpose(0, 1)
    k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
    scores = (q @ k.transpose(1, 2)) / D ** 0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, H * D)
    h = feat + L("self_attn.o_proj", attn)
    m = rms_norm(h, w["midlayer.post_attention_layernorm.weight"], eps)
    h = h + L("mlp.down_proj", F.silu(L("mlp.gate_proj", m)) * L("mlp.up_proj", m))
    draft_logits = rms_norm(h, w["norm.weight"], eps) @ w["lm_head.weight"].T
    logits = torch.full((T, hf["vocab_size"]), float("-inf"))
    logits[:, torch.arange(hf["draft_vocab_size"]) + w["d2t"]] = draft_logits
    return logits, h


@torch.no_grad()
def test_exported_draft_computes_in_vllm_what_cospec_computes_without_its_entry_0(tmp_path):
    """vLLM's entry i pairs the feature of position i with token s_{i+1} at position i; cospec's
    entry t = i + 1 holds the same pair at position t. cospec also has an entry 0 (s_0, zero
    feature) that vLLM lacks: with it the outputs differ, without it they agree."""
    policy, draft = make_draft()
    target_ids = list(range(0, 50, 2))
    d2t = reduce_head(draft, target_ids)
    export_eagle3(draft, tmp_path / "d", d2t=d2t)
    T = 9
    tokens = torch.randint(0, 50, (1, T))
    taps = policy_taps(policy, tokens)
    ref_logits, ref_hidden = vllm_eagle3_reference(
        tmp_path / "d", [taps[t][0, :-1] for t in sorted(TAPS)], tokens[0, 1:], torch.arange(T - 1))
    feat = draft.project(taps)[:, :-1]  # entry t reads the feature of position t - 1
    ours = draft(tokens[:, 1:], feat, positions_BT=torch.arange(1, T)[None])
    torch.testing.assert_close(ours.hidden[0], ref_hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.logits[0], ref_logits[:, target_ids], rtol=0, atol=1e-5)
    assert torch.isinf(ref_logits[:, 1::2]).all()  # ids outside the draft vocabulary
    with_entry_0 = draft(tokens, torch.cat([torch.zeros_like(feat[:, :1]), feat], 1))
    assert not torch.allclose(with_entry_0.logits[0, 1:], ours.logits[0], atol=1e-3)
