"""Checkpoint formats: detect, load strictly, and write (tests and the demo use the writers, so
every format goes through the real loaders).

Formats:
  llamagen-pt   LlamaGen's own `.pt`: {'model'|'ema': state dict, 'args': Namespace, ...} or a raw
                (FSDP-consolidated) state dict, sometimes with a stray 'freqs_cis'.
  lantern-hf    LANTERN's Hugging-Face-style target: config.json + model.safetensors (single, or
                sharded with model.safetensors.index.json) or pytorch_model.bin.
  drafter       LANTERN/EAGLE drafter: config.json + pytorch_model.bin or model.safetensors.
  vq            LlamaGen VQ tokenizer `.pt` ({'model'|'ema': state dict}); see lantern.export.vq.
Loading is strict: missing, unexpected or mis-shaped keys are errors that name them.
"""
import json
import os

import torch

from lantern.export import llamagen
from lantern.export.safeload import load_pickle, load_state_file
from lantern.runtime.errors import LanternError

FORMATS = ("llamagen-pt", "lantern-hf", "drafter", "vq")
_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin")


# ---------------------------------------------------------------------------------------------
# Detection


def detect_format(path):
    path = os.fspath(path)
    if os.path.isdir(path):
        config = read_json(os.path.join(path, "config.json"))
        weights = _weights_file(path)
        keys = peek_keys(weights)
        if "fc.weight" in keys:
            return "drafter"
        if "lm_head.weight" in keys or "model.embed_tokens.weight" in keys or "hidden_size" in config:
            return "lantern-hf"
        raise LanternError(f"{path}: config.json and weights found but neither a LANTERN target nor a drafter")
    if not os.path.exists(path):
        raise LanternError(f"{path}: no such file or directory")
    obj = load_pickle(path)
    wrapped = [k for k in ("model", "ema") if isinstance(obj, dict) and isinstance(obj.get(k), dict)]
    keys = set(_state_dict_of(obj, path, wrapped[0] if wrapped else "model"))
    if "quantize.embedding.weight" in keys:
        return "vq"
    if "tok_embeddings.weight" in keys:
        return "llamagen-pt"
    raise LanternError(f"{path}: not a LlamaGen GPT or VQ checkpoint (no tok_embeddings.weight or quantize.embedding.weight)")


def _weights_file(directory):
    for name in _WEIGHT_FILES:
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    raise LanternError(f"{directory}: no weights file (expected one of {', '.join(_WEIGHT_FILES)})")


def peek_keys(weights):
    """The tensor names of a weights file (safetensors, a shard index, or a pickle) without
    loading the tensors where the format allows."""
    if weights.endswith(".index.json"):
        return set(read_json(weights).get("weight_map", {}))
    if weights.endswith(".safetensors"):
        from safetensors import safe_open
        try:
            with safe_open(weights, "pt") as f:
                return set(f.keys())
        except Exception as e:
            raise LanternError(f"{weights}: unreadable safetensors file ({e})") from None
    return set(load_pickle(weights))


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise LanternError(f"{path}: no such file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LanternError(f"{path}: cannot read JSON ({e})") from None


def _state_dict_of(obj, path, weights):
    """The state dict inside a LlamaGen .pt: obj[weights] ('model' or 'ema') or obj itself."""
    if not isinstance(obj, dict):
        raise LanternError(f"{path}: expected a dict of tensors, found {type(obj).__name__}")
    if weights in obj and isinstance(obj[weights], dict):
        return obj[weights]
    wrapped = [k for k in ("model", "ema") if isinstance(obj.get(k), dict)]
    if wrapped:
        raise LanternError(f"{path}: has no '{weights}' weights (it has: {', '.join(wrapped)})")
    return obj


# ---------------------------------------------------------------------------------------------
# Strict loading


def check_state_keys(module, state_dict, source):
    """The checkpoint's keys and shapes are exactly the module's, or LanternError naming the
    first differences."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_first(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_first(unexpected)}")
        raise LanternError(f"{source}: checkpoint does not match the model config; " + "; ".join(parts))
    for k, v in expected.items():
        if tuple(state_dict[k].shape) != tuple(v.shape):
            raise LanternError(f"{source}: {k} has shape {tuple(state_dict[k].shape)} in the checkpoint "
                               f"but {tuple(v.shape)} in the config")


def load_strict(module, state_dict, source):
    check_state_keys(module, state_dict, source)
    dtypes = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    module.to(dtype)
    module.load_state_dict(state_dict, strict=True)
    return module.eval()


def _first(keys, n=5):
    return ", ".join(keys[:n]) + (", ..." if len(keys) > n else "")


# ---------------------------------------------------------------------------------------------
# Targets


def load_target(path, fmt=None, *, name=None, config_file=None, image_size=None, downsample_size=None,
                model_type=None, num_classes=None, weights="model"):
    """A LlamaGen target from any supported format -> (Transformer, info dict)."""
    path = os.fspath(path)
    fmt = fmt or detect_format(path)
    if fmt == "llamagen-pt":
        model, info = _load_llamagen_pt(path, name, config_file, image_size, downsample_size,
                                        model_type, num_classes, weights)
    elif fmt == "lantern-hf":
        model, info = _load_hf_target(path, config_file)
    else:
        raise LanternError(f"{path}: is a {fmt} checkpoint, not a target model")
    info.update(role="target", family="llamagen", parameters=llamagen.count_parameters(model),
                dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
    return model, info


def _load_llamagen_pt(path, name, config_file, image_size, downsample_size, model_type, num_classes, weights):
    obj = load_pickle(path)
    state = dict(_state_dict_of(obj, path, weights))
    state.pop("freqs_cis", None)  # a stray RoPE buffer in some releases; we rebuild it
    saved = vars(obj["args"]) if isinstance(obj, dict) and hasattr(obj.get("args"), "__dict__") else {}
    if "tok_embeddings.weight" not in state:
        raise LanternError(f"{path}: no tok_embeddings.weight; not a LlamaGen GPT checkpoint")
    name = name or saved.get("gpt_model")
    if name is None and config_file is None:
        name = _name_from_shapes(state, path)
    model_type = model_type or saved.get("gpt_type") or ("t2i" if "cls_embedding.cap_proj.fc1.weight" in state else "c2i")
    overrides = {"vocab_size": state["tok_embeddings.weight"].shape[0]}
    if "cls_token_num" in saved and config_file is None:
        overrides["cls_token_num"] = saved["cls_token_num"]
    args = llamagen.make_config(
        name, config_file=config_file,
        image_size=_given(image_size, saved.get("image_size", 256)),
        downsample_size=_given(downsample_size, saved.get("downsample_size", 16)),
        model_type=model_type, num_classes=_given(num_classes, saved.get("num_classes", 1000)),
        **({} if config_file else overrides))
    model = load_strict(llamagen.Transformer(args), state, path)
    which = weights if isinstance(obj, dict) and weights in obj else "raw state dict"
    return model, {"format": "llamagen-pt", "path": path, "weights": which, "config": args.to_dict(),
                   "config_name": name}


def _given(option, fallback):
    """An option the user gave wins, even 0 (which is then refused, not silently replaced)."""
    return fallback if option is None else option


def _name_from_shapes(state, path):
    """Released models are identified by (dim, n_layer); custom ones need --config."""
    dim = state["tok_embeddings.weight"].shape[1]
    n_layer = len({k.split(".")[1] for k in state if k.startswith("layers.")})
    for config_name, (layers, _, d) in llamagen.GPT_CONFIGS.items():
        if (d, layers) == (dim, n_layer):
            return config_name
    raise LanternError(f"{path}: dim {dim} with {n_layer} layers is no released LlamaGen config; "
                       f"give --model NAME or --config FILE")


_HF_LAYER_MAP = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _hf_config_to_args(config, path):
    if not isinstance(config, dict):
        raise LanternError(f"{path}: config.json must be a JSON object of config fields")
    try:
        return llamagen.validate_config(llamagen.ModelArgs(
            dim=config["hidden_size"], n_layer=config["num_hidden_layers"], n_head=config["num_attention_heads"],
            n_kv_head=config.get("num_key_value_heads"), intermediate_size=config.get("intermediate_size"),
            norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_base=config.get("rope_base", config.get("rope_theta", 10000.0)),
            num_classes=config.get("num_classes", 1000), caption_dim=config.get("caption_dim", 2048),
            class_dropout_prob=config.get("class_dropout_p", 0.1), model_type=config.get("input_type", "c2i"),
            vocab_size=config["vocab_size"], cls_token_num=config.get("cls_token_num", 1),
            block_size=config.get("block_size", 256)), source=path)
    except KeyError as e:
        raise LanternError(f"{path}: config.json lacks {e.args[0]!r}") from None


def read_state(weights):
    """The tensors of a weights file, or of every shard a shard index (.index.json) lists."""
    if weights.endswith(".index.json"):
        state = {}
        for shard in sorted(set(read_json(weights).get("weight_map", {}).values())):
            state.update(load_state_file(os.path.join(os.path.dirname(weights), shard)))
        return state
    return load_state_file(weights)


def _read_weights(directory):
    weights = _weights_file(directory)
    return dict(read_state(weights)), weights


def _load_hf_target(directory, config_file=None):
    config = read_json(config_file or os.path.join(directory, "config.json"))
    args = _hf_config_to_args(config, directory)
    hf, weights = _read_weights(directory)
    state = {}
    for key, value in hf.items():
        if key == "lm_head.weight":
            state["output.weight"] = value
        elif key.startswith("model.layers.") and ".self_attn." in key and key.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
            continue  # fused below
        elif key.startswith("model.layers."):
            _, _, i, rest = key.split(".", 3)
            state[f"layers.{i}.{_HF_LAYER_MAP.get(rest, rest)}"] = value
        elif key.startswith("model."):
            state[{"model.embed_tokens.weight": "tok_embeddings.weight"}.get(key, key[len("model."):])] = value
        else:
            state[key] = value
    _fuse_qkv(hf, state, "model.layers.{i}.self_attn.{p}.weight", "layers.{i}.attention.wqkv.weight", directory)
    model = load_strict(llamagen.Transformer(args), state, directory)
    return model, {"format": "lantern-hf", "path": directory, "weights": weights, "config": args.to_dict()}


def _fuse_qkv(source, state, pattern, fused, where):
    layers = sorted({int(k.split(".")[-4]) for k in source if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))})
    for i in layers:
        parts = [pattern.format(i=i, p=p) for p in ("q_proj", "k_proj", "v_proj")]
        absent = [p for p in parts if p not in source]
        if absent:
            raise LanternError(f"{where}: checkpoint does not match the model config; missing keys: {_first(absent)}")
        state[fused.format(i=i)] = torch.cat([source[p] for p in parts], dim=0)


# ---------------------------------------------------------------------------------------------
# Drafters


def load_drafter(directory, target_args=None):
    """A LANTERN/EAGLE drafter directory -> (Drafter, info). With target_args, checks it fits."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise LanternError(f"{directory}: a drafter is a directory with config.json and weights")
    config_path = os.path.join(directory, "config.json")
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise LanternError(f"{config_path}: expected a JSON object of config fields")
    layers = config.get("num_hidden_layers", 1)
    if layers != 1 or isinstance(layers, bool):
        raise LanternError(f"{config_path}: num_hidden_layers is {layers!r}; a LANTERN/EAGLE-1 drafter has exactly "
                           f"one decoder layer")
    try:
        args = llamagen.DrafterArgs(
            dim=config["hidden_size"], n_head=config["num_attention_heads"],
            n_kv_head=config.get("num_key_value_heads"), intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
            fc_bias=config.get("bias", True)).validate(config_path)
    except KeyError as e:
        raise LanternError(f"{config_path} lacks {e.args[0]!r}") from None
    if target_args is not None and (args.dim, args.vocab_size) != (target_args.dim, target_args.vocab_size):
        raise LanternError(f"{directory}: drafter (dim {args.dim}, vocab {args.vocab_size}) does not fit the target "
                           f"(dim {target_args.dim}, vocab {target_args.vocab_size})")
    hf, weights = _read_weights(directory)
    state = {}
    for key, value in hf.items():
        if key.startswith("layers.0.") and key.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
            continue
        if key.startswith("layers.0."):
            rest = key[len("layers.0."):]
            state["layers.0." + _HF_LAYER_MAP.get(rest, rest)] = value
        else:
            state[key] = value
    _fuse_qkv(hf, state, "layers.{i}.self_attn.{p}.weight", "layers.{i}.attention.wqkv.weight", directory)
    model = load_strict(llamagen.Drafter(args), state, directory)
    return model, {"format": "drafter", "role": "drafter", "family": "llamagen", "path": directory,
                   "weights": weights, "config": args.to_dict(), "parameters": llamagen.count_parameters(model),
                   "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}


# ---------------------------------------------------------------------------------------------
# Writers (the real on-disk formats)


def save_llamagen_pt(model, path, *, key="model", args_namespace=None, extra=None):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    obj = state if key is None else {key: state, "steps": 0}
    if key is not None and args_namespace is not None:
        obj["args"] = args_namespace
    if extra:
        (obj if key is None else obj[key]).update(extra)
    torch.save(obj, path)


def _to_hf_layers(state, prefix):
    out = {}
    inverse = {v: k for k, v in _HF_LAYER_MAP.items()}
    for key, value in state.items():
        if not key.startswith("layers."):
            continue
        _, i, rest = key.split(".", 2)
        if rest == "attention.wqkv.weight":
            continue
        out[f"{prefix}layers.{i}.{inverse.get(rest, rest)}"] = value
    return out


def _split_qkv(model, state, prefix):
    out = {}
    for i, layer in enumerate(model.layers):
        attn = layer.attention
        q, k, v = state[f"layers.{i}.attention.wqkv.weight"].split(
            [attn.n_head * attn.head_dim, attn.n_kv_head * attn.head_dim, attn.n_kv_head * attn.head_dim])
        for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            out[f"{prefix}layers.{i}.self_attn.{name}.weight"] = t.contiguous()
    return out


def save_hf_target(model, directory, *, shards=1):
    from safetensors.torch import save_file

    a = model.args
    state = model.state_dict()
    hf = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"],
          "lm_head.weight": state["output.weight"]}
    hf.update({"model." + k: v for k, v in state.items() if k.startswith("cls_embedding.")})
    hf.update(_to_hf_layers(state, "model."))
    hf.update(_split_qkv(model, state, "model."))
    hf = {k: v.contiguous().clone() for k, v in hf.items()}
    os.makedirs(directory, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.dim,
              "num_hidden_layers": a.n_layer, "num_attention_heads": a.n_head, "num_key_value_heads": a.kv_heads,
              "intermediate_size": a.ffn_hidden, "rms_norm_eps": a.norm_eps, "rope_base": a.rope_base,
              "vocab_size": a.vocab_size, "num_classes": a.num_classes, "caption_dim": a.caption_dim,
              "class_dropout_p": a.class_dropout_prob, "input_type": a.model_type,
              "cls_token_num": a.cls_token_num, "block_size": a.block_size}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if shards <= 1:
        save_file(hf, os.path.join(directory, "model.safetensors"))
        return
    keys = sorted(hf)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[s::shards]
        save_file({k: hf[k] for k in part}, os.path.join(directory, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def save_drafter(drafter, directory, *, fmt="bin"):
    a = drafter.args
    state = drafter.state_dict()
    hf = {k: v for k, v in state.items() if not k.startswith("layers.")}
    hf.update(_to_hf_layers(state, ""))
    hf.update(_split_qkv(drafter, state, ""))
    hf = {k: v.contiguous().clone() for k, v in hf.items()}
    os.makedirs(directory, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.dim,
              "num_attention_heads": a.n_head, "num_key_value_heads": a.kv_heads, "num_hidden_layers": 1,
              "intermediate_size": a.intermediate_size, "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps,
              "bias": a.fc_bias}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(hf, os.path.join(directory, "model.safetensors"))
    else:
        torch.save(hf, os.path.join(directory, "pytorch_model.bin"))
