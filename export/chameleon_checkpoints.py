"""Chameleon-family checkpoints: detect, load strictly, and write tiny random ones in the real
on-disk layouts (tests and demos go through the real loaders).

Layouts (directories):
  anole (Hugging Face)   config.json (architectures ChameleonForConditionalGeneration,
                         vocabulary_map, vq_config, ...) + model.safetensors, or shards listed in
                         model.safetensors.index.json; bf16. Keys model.embed_tokens.weight,
                         model.layers.{i}.self_attn.{q,k,v,o}_proj.weight,
                         model.layers.{i}.self_attn.{q,k}_norm.{weight,bias} [heads, head_dim],
                         model.layers.{i}.mlp.{gate,up,down}_proj.weight,
                         model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight,
                         lm_head.weight, and the VQ encoder's model.vqmodel.* (skipped: it only
                         tokenizes input images). transformers' convert_chameleon_weights_to_hf.py
                         writes one qk-norm row repeated over the heads.
  lumina_mgpt (xllmx)    the same keys with architectures ChameleonXLLMXForConditionalGeneration;
                         q/k norms are [model_parallel_size, head_dim] and are repeated over heads
                         (repeat_interleave(heads / mp)) at load, as Lumina's ChameleonLayerNorm
                         does in every forward (modeling_lumina_mgpt_kv.py: repeat_param). Lumina's
                         finetune_solver deletes model.vqmodel.*, so it usually has none.
  drafter (LANTERN)      config.json (the target's config with num_hidden_layers 1; "bias": false
                         when fc has no bias) + pytorch_model.bin (or model.safetensors): keys
                         embed_tokens.weight, fc.{weight,bias}, layers.{i}.* as above without the
                         `model.` prefix; EaModel loads it with strict=True. Both LANTERN drafters
                         say ChameleonForConditionalGeneration; the qk-norm layout is the target's
                         family's (cnets_lumina_mgpt.py builds the xllmx one).
  vq                     vqgan.yaml + vqgan.ckpt (lantern.export.chameleon_vq).

Loading builds the model on the meta device and assigns the file's tensors, so a checkpoint is
held in memory once (a 7B target in bf16: ~14 GB), never twice; with `defer` (what the export
uses) a safetensors checkpoint's large tensors are not held at all until each is written
(lantern.export.streaming). save_random_target writes a random target of any size tensor by tensor.
"""
import json
import os

import torch

from lantern.export import chameleon
from lantern.export.chameleon import ChameleonConfig, ChameleonDrafter, ChameleonTarget, DrafterConfig
from lantern.export.chameleon_vocabulary import text_vocabulary, vocabulary_map
from lantern.export.checkpoints import check_state_keys, peek_keys, read_json, read_state
from lantern.runtime.errors import LanternError
from lantern.export.streaming import DEFER_ELEMENTS

INDEX_FILE, SAFETENSORS_FILE, BIN_FILE = "model.safetensors.index.json", "model.safetensors", "pytorch_model.bin"
SKIPPED_TARGET_PREFIX = "model.vqmodel."  # the VQ encoder inside HF checkpoints


# ---------------------------------------------------------------------------------------------
# Detection


def detect(path):
    """What a Chameleon-family directory holds: {"role": "target"|"drafter"|"vq", "family",
    "layout", "weights"}. Targets come as safetensors (HF layout); a pytorch_model.bin or a
    safetensors file with `fc.weight` is a LANTERN drafter."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise LanternError(f"{path}: a Chameleon checkpoint is a directory (config.json + weights, or vqgan.yaml + vqgan.ckpt)")
    if os.path.isfile(os.path.join(path, "vqgan.yaml")):
        return {"role": "vq", "family": "chameleon", "layout": "taming", "weights": os.path.join(path, "vqgan.ckpt")}
    config = read_json(os.path.join(path, "config.json"))
    arch = (config.get("architectures") or [None])[0]
    if arch not in chameleon.ARCHITECTURES:
        raise LanternError(f"{path}: architecture {arch!r} is not a Chameleon model "
                           f"(expected {', '.join(chameleon.ARCHITECTURES)})")
    family, layout = chameleon.ARCHITECTURES[arch]
    weights = _weights_file(path)
    if weights.endswith(BIN_FILE) or "fc.weight" in peek_keys(weights):
        return {"role": "drafter", "family": None, "layout": None, "weights": weights}
    return {"role": "target", "family": family, "layout": layout, "weights": weights}


def _weights_file(directory):
    for name in (INDEX_FILE, SAFETENSORS_FILE, BIN_FILE):
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    raise LanternError(f"{directory}: no weights file (expected {INDEX_FILE}, {SAFETENSORS_FILE} or {BIN_FILE})")


def _read_tensors(weights, defer=None, skip=None):
    """All tensors of a weights file (or of every shard an index lists). defer: (DeferredWeights,
    dtype) to read safetensors lazily: large tensors become placeholders in `dtype` read when
    exported, the others are read now and cast to `dtype` (lantern.export.streaming). Keys starting
    with `skip` are listed (as None) but never read."""
    if weights.endswith(INDEX_FILE):
        directory = os.path.dirname(weights)
        state = {}
        for shard in sorted(set(read_json(weights).get("weight_map", {}).values())):
            state.update(_read_tensors(os.path.join(directory, shard), defer, skip))
        return state
    if defer is not None and weights.endswith(".safetensors"):
        return _read_deferred(weights, *defer, skip)
    state = read_state(weights)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise LanternError(f"{weights}: expected a flat dict of tensors")
    return dict(state)


def _read_deferred(weights, deferred, dtype, skip=None):
    from safetensors import safe_open

    def read(key):
        with safe_open(weights, "pt") as f:
            return f.get_tensor(key).to(dtype)

    if not os.path.isfile(weights):
        raise LanternError(f"{weights}: no such file")
    state = {}
    try:
        with safe_open(weights, "pt") as f:
            for key in f.keys():
                if skip and key.startswith(skip):
                    state[key] = None
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                numel = 1
                for n in shape:
                    numel *= n
                state[key] = deferred.placeholder(shape, dtype, lambda key=key: read(key)) \
                    if numel >= DEFER_ELEMENTS else f.get_tensor(key).to(dtype)
    except Exception as e:  # safetensors raises its own error type, which moved between versions
        raise LanternError(f"{weights}: unreadable or truncated safetensors file ({e})") from None
    return state


# ---------------------------------------------------------------------------------------------
# Strict loading onto a meta-device model


def _assign_strict(module, state, source):
    """Check keys and shapes against `module` (built on the meta device), then assign the tensors
    (no copy). Mixed float dtypes are unified to float32."""
    check_state_keys(module, state, source)
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) > 1:
        state = {k: v.float() for k, v in state.items()}
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()


def _expand_qk_norms(state, config, prefix, source):
    """xllmx layout -> per-head rows: q/k norm parameters [mp, head_dim] repeat_interleave'd to
    [heads, head_dim] (q) and [kv_heads, head_dim] (k)."""
    mp, hd = config.model_parallel_size, config.head_dim
    for i in range(config.num_hidden_layers):
        for name, heads in (("q_norm", config.num_attention_heads), ("k_norm", config.num_key_value_heads)):
            for part in ("weight", "bias"):
                key = f"{prefix}layers.{i}.self_attn.{name}.{part}"
                if key not in state:
                    continue  # reported as missing by _assign_strict
                if tuple(state[key].shape) != (mp, hd):
                    raise LanternError(f"{source}: {key} has shape {tuple(state[key].shape)} in the checkpoint but the "
                                       f"xllmx layout needs ({mp}, {hd}) (model_parallel_size, head_dim)")
                state[key] = state[key].repeat_interleave(heads // mp, dim=0)
    return state


# ---------------------------------------------------------------------------------------------
# Targets


def load_target(path, defer=None):
    """An Anole (HF) or Lumina-mGPT (xllmx) directory -> (ChameleonTarget, info).
    defer: (DeferredWeights, dtype): the large tensors of a safetensors checkpoint stay on disk
    until exported (lantern.export.streaming); the model is then already in `dtype`."""
    path = os.fspath(path)
    found = detect(path)
    if found["role"] != "target":
        raise LanternError(f"{path}: this is a {found['role']} checkpoint, not a Chameleon target")
    raw_config = read_json(os.path.join(path, "config.json"))
    config = ChameleonConfig.from_hf(raw_config, os.path.join(path, "config.json"))
    raw = _read_tensors(found["weights"], defer, skip=SKIPPED_TARGET_PREFIX)
    state = {}
    for key, value in raw.items():
        if key.startswith(SKIPPED_TARGET_PREFIX):
            continue
        state[key[len("model."):] if key.startswith("model.") else key] = value
    if config.qk_norm_layout == "xllmx":
        state = _expand_qk_norms(state, config, "", path)
    with torch.device("meta"):
        model = ChameleonTarget(config)
    _assign_strict(model, state, path)
    info = {"format": f"chameleon-{config.qk_norm_layout}", "role": "target", "family": config.family, "path": path,
            "weights": found["weights"], "config": config.to_dict(), "parameters": chameleon.count_parameters(model),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "skipped_keys": sum(1 for k in raw if k.startswith(SKIPPED_TARGET_PREFIX)),
            "image_token_mapping": "checked against vocabulary_map" if raw_config.get("vocabulary_map") else
                                   "assumed id = code + 4 (LANTERN's assumption; config.json has no vocabulary_map)"}
    if raw_config.get("mask_image_logits"):
        info["note"] = "config says mask_image_logits: true; LANTERN runs Lumina with it false, and so does this target"
    return model, info


# ---------------------------------------------------------------------------------------------
# Drafters


def load_drafter(path, target_config=None, defer=None):
    """A LANTERN drafter directory -> (ChameleonDrafter, info). With target_config, its family
    decides the qk-norm layout and the image-token range, and the drafter must fit the target;
    without, the layout is read off the q_norm shape ([heads, hd] = hf, else xllmx). defer: as
    load_target's."""
    path = os.fspath(path)
    found = detect(path)
    if found["role"] != "drafter":
        raise LanternError(f"{path}: this is a {found['role']} checkpoint, not a LANTERN drafter")
    raw_config = read_json(os.path.join(path, "config.json"))
    state = _read_tensors(found["weights"], defer)
    if target_config is not None:
        family, layout = target_config.family, target_config.qk_norm_layout
        image_range = dict(image_token_start=target_config.image_token_start, image_token_end=target_config.image_token_end)
    else:
        q_norm = state.get("layers.0.self_attn.q_norm.weight")
        layout = "hf" if q_norm is None or q_norm.shape[0] == raw_config.get("num_attention_heads") else "xllmx"
        family, image_range = ("anole" if layout == "hf" else "lumina_mgpt"), {}
    config = DrafterConfig.from_hf(raw_config, os.path.join(path, "config.json"), family=family, qk_norm_layout=layout,
                                   **image_range)
    if target_config is not None:
        chameleon.check_drafter_fits(config, target_config, path)
    if layout == "xllmx":
        state = _expand_qk_norms(state, config, "", path)
    with torch.device("meta"):
        model = ChameleonDrafter(config)
    _assign_strict(model, state, path)
    info = {"format": "lantern-drafter", "role": "drafter", "family": family, "path": path, "weights": found["weights"],
            "config": config.to_dict(), "parameters": chameleon.count_parameters(model),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
    return model, info


# ---------------------------------------------------------------------------------------------
# Writers (the real layouts; tensors stored in `dtype`, bf16 as released)


def save_text_tokenizer(path, vocab_size=65536, num_image_tokens=8192):
    """A tiny byte-level BPE text_tokenizer.json with Chameleon's ids for every special token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = text_vocabulary(vocab_size, num_image_tokens)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [name for name, i in vocab.items() if i < 4 or chameleon.IMAGE_END <= i < 9000]
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    tokenizer.save(os.fspath(path))


def _hf_config(config, architecture, with_vocabulary_map, extra=None):
    c = config
    out = {
        "architectures": [architecture], "model_type": "chameleon",
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": None, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
        "swin_norm": c.swin_norm, "model_parallel_size": c.model_parallel_size, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": chameleon.BOS, "pad_token_id": chameleon.PAD, "eos_token_id": chameleon.EOS,
        "boi_token_id": chameleon.IMAGE_START, "eoi_token_id": chameleon.IMAGE_END, "image_token_id": 8711,
        "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": True,
        # Written with both the taming names and transformers' names, as the conversion script
        # does; a tiny encoder config (the target never builds the VQ encoder).
        "vq_config": {"model_type": "chameleon_vqgan", "embed_dim": 8, "num_embeddings": c.num_image_tokens,
                      "n_embed": c.num_image_tokens, "double_latent": False, "double_z": False,
                      "latent_channels": 32, "z_channels": 32, "resolution": 64, "in_channels": 3,
                      "out_channels": 3, "out_ch": 3, "base_channels": 32, "ch": 32,
                      "channel_multiplier": [1, 2], "ch_mult": [1, 2], "num_res_blocks": 1,
                      "attn_resolutions": [], "dropout": 0.0, "attn_type": "vanilla"},
    }
    if with_vocabulary_map:
        out["vocabulary_map"] = vocabulary_map(c.vocab_size, c.num_image_tokens)
        if (c.image_token_start, c.image_token_end) != (4, 4 + c.num_image_tokens):
            raise LanternError("the writer lays image tokens out from id 4, as Chameleon's vocabulary does")
    out.update(extra or {})
    return out


def _collapse_qk_norms(state, config, prefix):
    """Per-head rows -> the xllmx [model_parallel_size, head_dim] layout; the rows of each shard's
    heads must be equal (that is all the layout can say)."""
    mp = config.model_parallel_size
    for i in range(config.num_hidden_layers):
        for name in ("q_norm", "k_norm"):
            for part in ("weight", "bias"):
                key = f"{prefix}layers.{i}.self_attn.{name}.{part}"
                rows = state[key]
                groups = rows.reshape(mp, rows.shape[0] // mp, rows.shape[1])
                if not torch.equal(groups, groups[:, :1].expand_as(groups)):
                    raise LanternError(f"{key}: rows differ within a model-parallel shard, so the xllmx layout "
                                       f"({mp} rows) cannot hold them; use tie_qk_norm_rows() first")
                state[key] = groups[:, 0].contiguous()
    return state


def tie_qk_norm_rows(model, model_parallel_size=None):
    """Make the qk-norm rows equal within each model-parallel shard (what a converted checkpoint
    has: one row per shard repeated over its heads), so the model fits both layouts."""
    mp = model_parallel_size or model.config.model_parallel_size
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                for p in (norm.weight, norm.bias):
                    groups = p.view(mp, p.shape[0] // mp, p.shape[1])
                    groups.copy_(groups[:, :1].expand_as(groups).clone())
    return model


def _write_weights(state, directory, shards, dtype):
    from safetensors.torch import save_file

    state = {k: v.detach().to(dtype).contiguous().clone() for k, v in state.items()}
    if shards <= 1:
        save_file(state, os.path.join(directory, SAFETENSORS_FILE), metadata={"format": "pt"})
        return
    keys = sorted(state)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[s::shards]
        save_file({k: state[k] for k in part}, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(v.numel() * v.element_size() for v in state.values())
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _target_state(model):
    return {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in model.state_dict().items()}


def save_hf_anole(model, directory, *, shards=1, dtype=torch.bfloat16, with_vocabulary_map=True, extra_state=None):
    """Write a target in the Hugging Face ChameleonForConditionalGeneration layout (Anole's).
    extra_state adds keys the loader must skip (e.g. model.vqmodel.* as real checkpoints have)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(_hf_config(model.config, "ChameleonForConditionalGeneration", with_vocabulary_map), f, indent=1)
    state = _target_state(model)
    state.update(extra_state or {})
    _write_weights(state, directory, shards, dtype)


def save_xllmx_lumina(model, directory, *, shards=1, dtype=torch.bfloat16, with_vocabulary_map=True):
    """Write a target in Lumina-mGPT's xllmx layout (qk norms [model_parallel_size, head_dim],
    Lumina's extra config fields, no model.vqmodel.*)."""
    os.makedirs(directory, exist_ok=True)
    extra = {"mask_image_logits": False, "dropout": 0.05, "z_loss_weight": 1e-5}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(_hf_config(model.config, "ChameleonXLLMXForConditionalGeneration", with_vocabulary_map, extra), f,
                  indent=1)
    _write_weights(_collapse_qk_norms(_target_state(model), model.config, "model."), directory, shards, dtype)


def save_random_target(config, directory, *, seed=0, dtype=torch.bfloat16):
    """A random target of `config` in its family's layout (Anole: HF; Lumina-mGPT: xllmx), written
    tensor by tensor: a 7B checkpoint without the model in memory. Values follow init_random's
    rules (norm weights near 1, norm biases near 0, the rest N(0, 0.02)), one generator per tensor
    seeded from `seed` and the tensor's index."""
    os.makedirs(directory, exist_ok=True)
    xllmx = config.qk_norm_layout == "xllmx"
    if xllmx:
        extra, architecture = {"mask_image_logits": False, "dropout": 0.05, "z_loss_weight": 1e-5}, \
            "ChameleonXLLMXForConditionalGeneration"
    else:
        extra, architecture = None, "ChameleonForConditionalGeneration"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(_hf_config(config, architecture, True, extra), f, indent=1)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in _target_state(ChameleonTarget(config)).items()}
    if xllmx:
        shapes = {k: (config.model_parallel_size, v[1]) if "_norm." in k and ".self_attn." in k else v
                  for k, v in shapes.items()}

    def make(index, key, shape):
        gen = torch.Generator().manual_seed(seed * 100003 + index)
        values = torch.randn(shape, generator=gen)
        if key.endswith("norm.weight"):
            return 1.0 + 0.1 * values
        return (0.1 if key.endswith("norm.bias") else 0.02) * values

    write_safetensors(os.path.join(directory, SAFETENSORS_FILE), shapes, dtype,
                      lambda index, key: make(index, key, shapes[key]))


def write_safetensors(path, shapes, dtype, make):
    """A safetensors file of tensors {key: shape} in `dtype`, written one tensor at a time:
    make(index, key) gives each (any float dtype; cast here). Keys are stored sorted, as
    safetensors' own writer does."""
    import struct

    codes = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    width = torch.tensor([], dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    keys = sorted(shapes)
    for key in keys:
        n = width
        for d in shapes[key]:
            n *= d
        header[key] = {"dtype": codes[dtype], "shape": list(shapes[key]), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for index, key in enumerate(keys):
            value = make(index, key).to(dtype).contiguous()
            if tuple(value.shape) != tuple(shapes[key]):
                raise RuntimeError(f"{key}: made shape {tuple(value.shape)}, expected {shapes[key]}")
            f.write(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
            del value
    os.replace(tmp, path)


def save_drafter(drafter, directory, *, fmt="bin", dtype=torch.bfloat16):
    """Write a drafter as LANTERN ships it: config.json + pytorch_model.bin (fmt="safetensors":
    model.safetensors). The qk-norm layout follows drafter.config.qk_norm_layout."""
    c = drafter.config
    os.makedirs(directory, exist_ok=True)
    extra = {} if c.fc_bias else {"bias": False}
    if c.family == "lumina_mgpt":
        extra["dropout"] = 0.05  # data/configs/lumina_mgpt_config.json has it
    with open(os.path.join(directory, "config.json"), "w") as f:
        # LANTERN's drafter configs carry no vocabulary_map (data/configs/anole_config.json).
        json.dump(_hf_config(c, "ChameleonForConditionalGeneration", False, extra), f, indent=1)
    state = {k: v.detach().to(dtype).contiguous().clone() for k, v in drafter.state_dict().items()}
    if c.qk_norm_layout == "xllmx":
        state = _collapse_qk_norms(state, c, "")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, os.path.join(directory, SAFETENSORS_FILE), metadata={"format": "pt"})
    elif fmt == "bin":
        torch.save(state, os.path.join(directory, BIN_FILE))
    else:
        raise LanternError(f"unknown drafter format {fmt!r}: 'bin' or 'safetensors'")


# ---------------------------------------------------------------------------------------------
# Tiny configs (tests, demos): Chameleon's vocabulary and special ids, small widths.


def tiny_config(family="anole", **overrides):
    layout = "hf" if family == "anole" else "xllmx"
    fields = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=160, vocab_size=65536, family=family, qk_norm_layout=layout)
    fields.update(overrides)
    return ChameleonConfig(**fields).validate()


def tiny_drafter_config(target_config, **overrides):
    fields = {**target_config.to_dict(), "num_hidden_layers": 1}
    fields.update(overrides)
    return DrafterConfig(**fields).validate()
