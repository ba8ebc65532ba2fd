"""Export the EAGLE-3 draft as the checkpoint that vLLM, SGLang and SpecForge load; read one back.

# C hidden size, V target vocab, Vd draft vocab (lm_head rows), K tapped layers (3)

Layout: a directory with ``config.json`` and ``model.safetensors`` (written atomically).

config.json (a Llama config of one layer, plus the EAGLE-3 fields):
- ``architectures ["LlamaForCausalLMEagle3"]``, ``model_type "llama"``, ``num_hidden_layers 1``,
  ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``intermediate_size`` (the draft's MLP), ``hidden_act "silu"``, ``rms_norm_eps``,
  ``tie_word_embeddings false``, ``max_position_embeddings``, ``torch_dtype``/``dtype``;
- RoPE as transformers 4 (``rope_theta``, ``rope_scaling``) and 5 (``rope_parameters``) write it;
- ``vocab_size`` V (the target's: the embedding's rows) and ``draft_vocab_size`` Vd (the head's);
- the tapped layers twice, because the engines count them differently (see below):
  ``eagle_aux_hidden_state_layer_ids`` (vLLM) and ``eagle_config.eagle_aux_hidden_state_layer_ids``
  with ``eagle_config.use_aux_hidden_state true`` (SGLang, SpecForge);
- ``attention_bias`` and ``norm_before_residual false`` (vLLM's reading of the layer);
- ``cospec.policy_num_layers``: ours, for `read_eagle3_export` only (the engines ignore it).

model.safetensors (no ``model.`` prefix; vLLM adds it itself):
``fc.weight`` [C, K*C], ``embed_tokens.weight`` [V, C], ``midlayer.input_layernorm.weight``,
``midlayer.hidden_norm.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.post_attention_layernorm.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight`` [Vd, C], ``d2t`` int64 [Vd], ``t2d`` bool [V].
``midlayer.*`` is SpecForge's module name; vLLM renames it to ``layers.0.*`` on load, while SGLang
reads only ``midlayer.*`` (it silently skips names it does not know), so it is the one all accept.

Read in (2025-26 snapshots): vLLM vllm/model_executor/models/llama_eagle3.py (layer, weight names,
d2t, midlayer rename), models/llama.py (which hidden state a layer id captures), v1/spec_decode/
eagle.py (token/feature pairing, embedding and head sharing), v1/worker/gpu_model_runner.py (the
captured states concatenated), v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (the top-level
layer-id field); SGLang python/sglang/srt/models/llama_eagle3.py and
speculative/eagle_worker.py; SpecForge specforge/modeling/draft/llama3_eagle.py,
specforge/export/to_sglang.py, specforge/algorithms/model_providers.py, configs/*-eagle3.json.

Tapped layers. cospec's ``tap_layers`` are 0-based ids of decoder layers whose OUTPUT is tapped.
- vLLM captures, for each id i, the residual stream entering decoder layer i (``hidden_states +
  residual`` before layer i runs), i.e. the output of layer i - 1: it gets ``tap + 1``. It can
  therefore not tap the last layer's output, which is refused here.
- SGLang adds 1 to the ids of ``eagle_config`` itself ("the ith layer takes the output of the
  (i-1)th"), and SpecForge passes them to SGLang: there ``tap`` is written as is.
Both engines concatenate the captured states in ascending layer order whatever the order of the
list, so the ids are written sorted and the K column blocks of ``fc.weight`` permuted to match.
Duplicate taps are refused (an engine would capture the layer once and feed fc K-1 states).

Reduced draft vocabulary. Draft id i stands for target id ``i + d2t[i]`` (vLLM scatters the draft
logits there and fills the rest with -inf; SGLang's ``hot_token_id`` is the same sum); ``t2d`` is
the mask of target ids the draft covers, which SpecForge uses to slice the target's logits, in
ascending order: so the target ids must be strictly increasing in draft id. A full-vocabulary head
gets an all-zero ``d2t`` and an all-true ``t2d`` rather than none: vLLM treats a missing d2t as
zeros anyway, SGLang's EAGLE-3 worker calls ``get_hot_token_id().to(...)`` unconditionally (fails
without d2t), and SpecForge's draft holds both as buffers.

What a user must know: where the exported draft computes differently from cospec's.
1. Pairing and positions: cospec's entry t holds token s_t and the feature of position t - 1 at
   position t; vLLM's entry i holds the feature of position i and token s_{i+1} at position i. The
   pairs are the same; positions are all one lower in vLLM, which RoPE does not see (scores depend
   on position differences only), so outputs agree to rounding.
2. Entry 0: cospec also has an entry for s_0 with a zero feature, whose key every later entry
   attends to (in training and in rollouts). vLLM, SGLang and SpecForge have no such entry, so
   there every draft query attends over one key fewer than in cospec: the function is not the
   same, and acceptance there may differ from what cospec measures.
3. Embedding: cospec co-trains the draft's copy of the embedding. vLLM keeps the exported one when
   it differs from the target's; SGLang always replaces it with the target's embedding.
4. q/k/v biases (a Qwen2-style policy): written as vLLM's ``attention_bias true`` with a zero
   ``o_proj`` bias (vLLM then biases o_proj too). SGLang's and SpecForge's EAGLE-3 layers have no
   q/k/v biases and drop them, so such an export is correct in vLLM only.
5. The proposal scale (`TappedDraft.proposal_scale`) is folded into ``lm_head.weight``: the
   engines draw from the head's logits, so they propose as cospec does. Read back, the draft has
   scale 1 and a head that much larger; so a draft trained further from an export starts from the
   scaled head.
6. ``max_position_embeddings`` defaults to the policy's ``max_seq_len`` (the run's length), and
   vLLM sizes the draft's RoPE table by it: pass the context length you will serve.
Further draft steps agree: each engine feeds the draft's pre-norm output hidden back as the next
step's feature (cospec's ``DraftOutput.hidden``), through ``hidden_norm`` and not through fc.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from cospec.config import ModelConfig
from cospec.models.draft import Eagle3Draft
from cospec.models.hf_checkpoint import (CONFIG_NAME, WEIGHTS_NAME, hf_rope_fields, rope_fields_from_hf,
                                         write_checkpoint_directory)

ARCHITECTURE = "LlamaForCausalLMEagle3"
OUR_LAYER = "layers.0."
EXPORTED_LAYER = "midlayer."


# ----------------------------------------------------------------------------- tap layers

def _check_taps(tap_layers: tuple[int, ...], num_layers: int) -> list[int]:
    """The taps sorted; ValueError where an engine could not capture them."""
    taps = sorted(tap_layers)
    if len(set(taps)) != len(taps):
        raise ValueError(f"draft.tap_layers {list(tap_layers)} repeat a layer: the engines capture "
                         f"each layer once, so an EAGLE-3 export needs distinct tap layers")
    if taps[-1] >= num_layers - 1:
        raise ValueError(f"draft.tap_layers {list(tap_layers)} tap the output of the policy's last "
                         f"layer ({num_layers - 1}), which vLLM cannot capture (it captures the "
                         f"input of layer id + 1 < {num_layers})")
    return taps


def _fc_ascending(fc_weight: Tensor, tap_layers: tuple[int, ...]) -> Tensor:
    """fc's [C, K*C] weight with its K input blocks reordered from tap_layers order to ascending."""
    blocks = fc_weight.chunk(len(tap_layers), dim=1)
    order = sorted(range(len(tap_layers)), key=lambda i: tap_layers[i])
    return torch.cat([blocks[i] for i in order], dim=1)


# ----------------------------------------------------------------------------- vocabulary map

def _vocab_map(d2t: Tensor | None, head_rows: int, vocab_size: int) -> tuple[Tensor, Tensor]:
    """(d2t int64 [Vd], t2d bool [V]), checking that d2t maps draft ids to ascending target ids."""
    if d2t is None:
        if head_rows != vocab_size:
            raise ValueError(f"the draft head has {head_rows} rows for a vocabulary of "
                             f"{vocab_size}: pass d2t (draft id + d2t[id] = target id)")
        d2t = torch.zeros(head_rows, dtype=torch.long)
    d2t = d2t.detach().cpu()
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or d2t.shape != (head_rows,):
        raise ValueError(f"d2t must be an integer tensor of shape ({head_rows},) (one offset per "
                         f"draft head row), got {d2t.dtype} {tuple(d2t.shape)}")
    target = torch.arange(head_rows) + d2t.long()
    if head_rows and (int(target.min()) < 0 or int(target.max()) >= vocab_size):
        raise ValueError(f"d2t maps draft ids outside the vocabulary [0, {vocab_size})")
    if bool((target[1:] <= target[:-1]).any()):
        raise ValueError("d2t must map draft ids to strictly increasing target ids (SpecForge's "
                         "t2d mask lists the draft's target ids in ascending order): sort the head "
                         "rows by target id")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target] = True
    return d2t.long(), t2d


# ----------------------------------------------------------------------------- config.json

def _rope_config(cfg: ModelConfig) -> dict:
    """The policy's RoPE keys as transformers 4 and 5 write them; rope_scaling null for plain RoPE
    (the engines read that key)."""
    return {"rope_scaling": None, **hf_rope_fields(cfg)}


def _eagle3_config(draft: Eagle3Draft, *, draft_vocab_size: int,
                  max_position_embeddings: int | None = None) -> dict:
    """The config.json dict of `draft` (see the module docstring for each field's reader)."""
    cfg, policy = draft.config, draft.policy_config
    taps = _check_taps(draft.tap_layers, policy.num_layers)
    dtype = str(draft.fc.weight.dtype).removeprefix("torch.")
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": False,
        "max_position_embeddings": max_position_embeddings or cfg.max_seq_len,
        **_rope_config(cfg),
        "vocab_size": policy.vocab_size, "draft_vocab_size": draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": [t + 1 for t in taps],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": taps, "use_aux_hidden_state": True},
        "attention_bias": cfg.qkv_bias, "mlp_bias": False, "norm_before_residual": False,
        "torch_dtype": dtype, "dtype": dtype,
        "cospec": {"policy_num_layers": policy.num_layers},
    }


# ----------------------------------------------------------------------------- export

def _eagle3_tensors(draft: Eagle3Draft, d2t: Tensor | None = None) -> dict[str, Tensor]:
    """The exported tensors by name (see the module docstring)."""
    V = draft.policy_config.vocab_size
    head_rows = draft.lm_head.weight.shape[0]
    if d2t is None and draft.vocab_ids is not None:  # the draft's own reduced vocabulary
        d2t = draft.vocab_ids.cpu() - torch.arange(head_rows)
    d2t_out, t2d = _vocab_map(d2t, head_rows, V)
    out: dict[str, Tensor] = {}
    for name, t in draft.state_dict().items():
        if name == "vocab_ids":  # written as d2t/t2d, the engines' form of the same map
            continue
        if name.startswith(OUR_LAYER):
            name = EXPORTED_LAYER + name.removeprefix(OUR_LAYER)
        out[name] = t.detach().cpu().contiguous()
    out["fc.weight"] = _fc_ascending(out["fc.weight"], draft.tap_layers).contiguous()
    if draft.proposal_scale != 1.0:  # folded into the head: the engines draw from its logits
        out["lm_head.weight"] = (out["lm_head.weight"] * draft.proposal_scale).contiguous()
    if draft.config.qkv_bias:
        # vLLM's attention_bias also gives o_proj a bias, which it would otherwise leave unloaded.
        o_proj = out[EXPORTED_LAYER + "self_attn.o_proj.weight"]
        out[EXPORTED_LAYER + "self_attn.o_proj.bias"] = o_proj.new_zeros(o_proj.shape[0])
    out["d2t"], out["t2d"] = d2t_out, t2d
    return out


def export_eagle3(draft: Eagle3Draft, path: str | Path, *, d2t: Tensor | None = None,
                  max_position_embeddings: int | None = None) -> None:
    """Write `draft` at `path` as an EAGLE-3 checkpoint directory (atomically).

    d2t: for a head of Vd < V rows, the offsets ``target id - draft id`` [Vd]; None for a head
    over the whole vocabulary or a draft that carries its own reduced vocabulary (``vocab_ids``). max_position_embeddings: the context the engine will serve
    (default: the policy's max_seq_len).
    """
    if len(draft.layers) != 1:
        # the layout below names one decoder layer ("midlayer"), as EAGLE-3's checkpoints do; a
        # deeper draft's other layers would have no name the engines are known to read
        raise ValueError(f"the EAGLE-3 export writes one decoder layer (EAGLE-3's layout); "
                         f"this draft has {len(draft.layers)} (draft.eagle3_layers)")
    head_rows = draft.lm_head.weight.shape[0]
    hf = _eagle3_config(draft, draft_vocab_size=head_rows,
                        max_position_embeddings=max_position_embeddings)
    write_checkpoint_directory(Path(path), _eagle3_tensors(draft, d2t), {CONFIG_NAME: hf})


# ----------------------------------------------------------------------------- read back

def _exported_taps(hf: dict) -> list[int]:
    """cospec tap layers (layer outputs) from eagle_config's ids or vLLM's (layer inputs, +1)."""
    ours = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm = hf.get("eagle_aux_hidden_state_layer_ids")
    if ours is not None and vllm is not None and [t + 1 for t in ours] != list(vllm):
        raise ValueError(f"config.json: eagle_config.eagle_aux_hidden_state_layer_ids={ours} and "
                         f"eagle_aux_hidden_state_layer_ids={vllm} name different layers")
    if ours is None and vllm is None:
        raise ValueError("config.json names no tapped layers (eagle_aux_hidden_state_layer_ids)")
    return sorted(ours if ours is not None else [t - 1 for t in vllm])


def _policy_config(hf: dict, taps: list[int]) -> ModelConfig:
    """The policy config the draft needs: the target's widths, vocabulary and RoPE. Its depth is
    ``cospec.policy_num_layers``, which only we write; for another exporter's checkpoint, the least
    its taps allow (max tap + 2: vLLM captures the inputs of layers below the last)."""
    num_layers = (hf.get("cospec") or {}).get("policy_num_layers") or max(taps) + 2
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=num_layers,
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"], rms_norm_eps=float(hf["rms_norm_eps"]),
        max_seq_len=hf["max_position_embeddings"], qkv_bias=bool(hf.get("attention_bias", False)),
        **rope_fields_from_hf(hf))


def read_eagle3_export(path: str | Path, *, device: torch.device | str | None = None
                       ) -> tuple[Eagle3Draft, Tensor | None]:
    """(draft, d2t) from an EAGLE-3 checkpoint directory; d2t is None for an identity map over the
    whole vocabulary. The inverse of `export_eagle3` up to the tap order (read back ascending)."""
    path = Path(path)
    hf = json.loads((path / CONFIG_NAME).read_text())
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{path}: num_hidden_layers={hf['num_hidden_layers']}, the draft has one")
    taps = _exported_taps(hf)
    tensors = load_file(path / WEIGHTS_NAME, device=str(device or "cpu"))
    d2t, _ = tensors.pop("d2t", None), tensors.pop("t2d", None)
    # SpecForge's and our layer name; vLLM's own (layers.0.*) is already ours.
    state = {OUR_LAYER + k.removeprefix(EXPORTED_LAYER) if k.startswith(EXPORTED_LAYER) else k: v
             for k, v in tensors.items()}
    o_bias = state.pop(OUR_LAYER + "self_attn.o_proj.bias", None)
    if o_bias is not None and bool(o_bias.any()):
        raise ValueError(f"{path}: a nonzero o_proj bias, which the draft does not have")
    policy_cfg = _policy_config(hf, taps)
    head_rows = hf.get("draft_vocab_size") or policy_cfg.vocab_size
    # Built on meta and the loaded tensors assigned: the weights are never allocated twice.
    reduced = head_rows != policy_cfg.vocab_size
    if reduced:
        if d2t is None:
            raise ValueError(f"{path}: a head of {head_rows} rows for a vocabulary of "
                             f"{policy_cfg.vocab_size} needs d2t")
        state["vocab_ids"] = torch.arange(head_rows, device=d2t.device) + d2t.long()
    placeholder = torch.arange(head_rows) if reduced else None  # replaced by the loaded ids
    with torch.device("meta"):
        draft = Eagle3Draft(policy_cfg, tap_layers=tuple(taps),
                            intermediate_size=hf["intermediate_size"], vocab_ids=placeholder)
    draft.load_state_dict(state, assign=True)  # strict: names the missing or unexpected tensors
    if d2t is not None and head_rows == policy_cfg.vocab_size and not bool(d2t.any()):
        d2t = None
    return draft, d2t
