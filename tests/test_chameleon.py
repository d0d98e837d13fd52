"""Chameleon family (Anole, Lumina-mGPT): tiny random models written in the real on-disk layouts
(bf16), loaded back through the real loaders, and checked against transformers'
ChameleonForConditionalGeneration, against straightforward reference implementations written
here, and against themselves (tree == path, incremental == full), on PyTorch and ONNX Runtime."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lantern.export import chameleon as ch
from lantern.export import chameleon_checkpoints as ck
from lantern.export import chameleon_vocabulary
from lantern.export import chameleon_vq as cvq
from lantern.runtime import chameleon_prompts as prompts
from lantern.runtime.errors import LanternError
from tiny import imitate_target, tiny_chameleon_target

IMAGE = slice(4, 8196)  # image-token ids of every checkpoint written here


def _target(seed=0, **overrides):
    return tiny_chameleon_target(ck.tiny_config(**overrides), seed=seed)  # peaked (tests/tiny.py)


def _drafter(target, seed=1, **overrides):
    drafter = ch.init_random(ch.ChameleonDrafter(ck.tiny_drafter_config(target.config, **overrides)), seed=seed).eval()
    return imitate_target(drafter, target)


def _bf16_round(model):
    """The model as it comes back from a bf16 checkpoint, in fp32 (for exact comparisons)."""
    return model.to(torch.bfloat16).float()


def _causal(B, T, P=0):
    return torch.ones(P + T, P + T, dtype=torch.bool).tril()[P:].expand(B, 1, T, P + T).clone()


def _run(model, ids, positions=None, mask=None):
    B, T = ids.shape
    positions = torch.arange(T).expand(B, T) if positions is None else positions
    mask = _causal(B, T) if mask is None else mask
    keys, values = model.empty_cache(B, dtype=torch.float32)
    with torch.no_grad():
        return model(ids, positions, mask, keys, values)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is ~10x faster than two on this shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """Every layout written once: Anole HF (single file, sharded + VQ-encoder keys), Lumina xllmx
    (model_parallel_size 2), drafters (.bin HF layout, safetensors xllmx layout), a VQ-GAN."""
    root = tmp_path_factory.mktemp("chameleon")
    anole = _target(seed=0, num_key_value_heads=2)
    lumina = ck.tie_qk_norm_rows(_target(seed=2, family="lumina_mgpt", model_parallel_size=2))
    anole_drafter = _drafter(anole, seed=1)
    lumina_drafter = ck.tie_qk_norm_rows(_drafter(lumina, seed=3, fc_bias=False))
    ck.save_hf_anole(anole, root / "anole")
    vq_encoder_keys = {"model.vqmodel.quantize.embedding.weight": torch.zeros(8192, 8),
                       "model.vqmodel.encoder.conv_in.weight": torch.zeros(32, 3, 3, 3)}
    ck.save_hf_anole(anole, root / "anole_sharded", shards=3, extra_state=vq_encoder_keys)
    ck.save_xllmx_lumina(lumina, root / "lumina", shards=2)
    ck.save_drafter(anole_drafter, root / "anole_drafter")
    ck.save_drafter(lumina_drafter, root / "lumina_drafter", fmt="safetensors")
    vq = cvq.init_random(cvq.ChameleonVQ(cvq.tiny_config()), seed=4).eval()
    cvq.save_vq(vq, root / "vq", extra_state={"encoder.conv_in.weight": torch.zeros(32, 3, 3, 3),
                                              "quant_conv.weight": torch.zeros(8, 32, 1, 1)})
    return {"root": root, "anole": anole, "lumina": lumina, "anole_drafter": anole_drafter,
            "lumina_drafter": lumina_drafter, "vq": vq}


# ---------------------------------------------------------------------------------------------
# Loaders: every layout round-trips (bf16 on disk), detection, strictness


@pytest.mark.parametrize("name, role, family", [("anole", "target", "anole"), ("anole_sharded", "target", "anole"),
                                                ("lumina", "target", "lumina_mgpt"), ("anole_drafter", "drafter", None),
                                                ("lumina_drafter", "drafter", None), ("vq", "vq", "chameleon")])
def test_detect(disk, name, role, family):
    found = ck.detect(disk["root"] / name)
    assert (found["role"], found["family"]) == (role, family)


@pytest.mark.parametrize("name, source", [("anole", "anole"), ("anole_sharded", "anole"), ("lumina", "lumina")])
def test_target_round_trip(disk, name, source):
    model, info = ck.load_target(disk["root"] / name)
    expected = disk[source]
    assert info["dtype"] == "bfloat16" and model.config == expected.config
    assert info["skipped_keys"] == (2 if name == "anole_sharded" else 0)
    got, want = model.state_dict(), expected.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == torch.bfloat16
        assert torch.equal(got[key], want[key].to(torch.bfloat16)), key


@pytest.mark.parametrize("name, target", [("anole_drafter", "anole"), ("lumina_drafter", "lumina")])
def test_drafter_round_trip(disk, name, target):
    target_config = disk[target].config
    model, info = ck.load_drafter(disk["root"] / name, target_config)
    expected = disk[name]
    assert info["dtype"] == "bfloat16" and model.config == expected.config
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value.to(torch.bfloat16)), key
    # Without the target, the qk-norm layout is read off the q_norm shape.
    alone, _ = ck.load_drafter(disk["root"] / name)
    assert alone.config.qk_norm_layout == target_config.qk_norm_layout
    assert torch.equal(alone.layers[0].self_attn.q_norm.weight, model.layers[0].self_attn.q_norm.weight)


def test_drafter_files_are_lanterns(disk):
    """A LANTERN drafter: pytorch_model.bin of {embed_tokens, fc, layers.0.*} and a config that
    says "bias": false only when fc has none."""
    state = torch.load(disk["root"] / "anole_drafter" / "pytorch_model.bin", weights_only=True)
    assert {"embed_tokens.weight", "fc.weight", "fc.bias", "layers.0.self_attn.q_norm.weight",
            "layers.0.input_layernorm.weight"} <= set(state)
    assert not any(k.startswith(("model.", "norm.", "lm_head")) for k in state)
    assert state["layers.0.self_attn.q_norm.weight"].shape == (4, 16)
    assert "bias" not in json.loads((disk["root"] / "anole_drafter" / "config.json").read_text())
    assert json.loads((disk["root"] / "lumina_drafter" / "config.json").read_text())["bias"] is False


def test_xllmx_layout_equals_hf_layout_with_repeated_rows(disk, tmp_path):
    """The same model saved as Lumina's xllmx ([mp, head_dim] qk norms) and as HF ([heads,
    head_dim], rows repeated) loads to the same parameters and the same outputs."""
    lumina = disk["lumina"]
    on_disk = json.loads((disk["root"] / "lumina" / "model.safetensors.index.json").read_text())["weight_map"]
    from safetensors import safe_open
    with safe_open(str(disk["root"] / "lumina" / on_disk["model.layers.0.self_attn.q_norm.weight"]), "pt") as f:
        assert tuple(f.get_tensor("model.layers.0.self_attn.q_norm.weight").shape) == (2, 16)
    hf = ch.ChameleonTarget(ck.tiny_config(model_parallel_size=2))
    hf.load_state_dict(lumina.state_dict())
    ck.save_hf_anole(hf, tmp_path / "as_hf")
    a, _ = ck.load_target(disk["root"] / "lumina")
    b, _ = ck.load_target(tmp_path / "as_hf")
    assert a.config.qk_norm_layout == "xllmx" and b.config.qk_norm_layout == "hf"
    for key, value in b.state_dict().items():
        assert torch.equal(a.state_dict()[key], value), key
    ids = torch.randint(0, 65536, (2, 6))
    assert torch.equal(_run(a.float(), ids)[0], _run(b.float(), ids)[0])


def test_xllmx_writer_refuses_untied_rows(tmp_path):
    with pytest.raises(LanternError, match="rows differ within a model-parallel shard"):
        ck.save_xllmx_lumina(_target(family="lumina_mgpt", model_parallel_size=2), tmp_path / "x")


def _rewrite(directory, edit):
    from safetensors.torch import load_file, save_file
    path = str(directory / "model.safetensors")
    state = load_file(path)
    edit(state)
    save_file(state, path)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), r"missing keys \(1\): layers.1.mlp.up_proj.weight"),
    (lambda s: s.update({"model.extra.weight": torch.zeros(2)}), r"unexpected keys \(1\): extra.weight"),
    (lambda s: s.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(1, 16, dtype=torch.bfloat16)}),
     r"layers.0.self_attn.q_norm.weight has shape \(1, 16\) in the checkpoint but \(4, 16\) in the config"),
])
def test_target_strict(disk, tmp_path, edit, message):
    ck.save_hf_anole(disk["anole"], tmp_path / "t")
    _rewrite(tmp_path / "t", edit)
    with pytest.raises(LanternError, match=message):
        ck.load_target(tmp_path / "t")


def test_xllmx_norm_shape_error(tmp_path):
    lumina = ck.tie_qk_norm_rows(_target(family="lumina_mgpt", model_parallel_size=2))
    ck.save_xllmx_lumina(lumina, tmp_path / "l")
    _rewrite(tmp_path / "l", lambda s: s.update({"model.layers.0.self_attn.k_norm.bias": torch.zeros(4, 16)}))
    with pytest.raises(LanternError, match=r"k_norm.bias has shape \(4, 16\) .* xllmx layout needs \(2, 16\)"):
        ck.load_target(tmp_path / "l")


def test_loader_refusals(disk, tmp_path):
    with pytest.raises(LanternError, match="not a Chameleon target"):
        ck.load_target(disk["root"] / "anole_drafter")
    with pytest.raises(LanternError, match="not a LANTERN drafter"):
        ck.load_drafter(disk["root"] / "anole")
    config = json.loads((disk["root"] / "anole" / "config.json").read_text())
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(LanternError, match="'LlamaForCausalLM' is not a Chameleon model"):
        ck.detect(tmp_path / "llama")
    with pytest.raises(LanternError, match="unsupported settings rope_scaling"):
        ch.ChameleonConfig.from_hf({**config, "rope_scaling": {"type": "linear", "factor": 2.0}})
    # A drafter of another width does not fit.
    with pytest.raises(LanternError, match="drafter hidden_size 64 does not fit the target's 32"):
        ck.load_drafter(disk["root"] / "anole_drafter", ck.tiny_config(hidden_size=32, num_attention_heads=2,
                                                                       num_key_value_heads=2))


def test_image_token_mapping_from_vocabulary_map(disk):
    """The id <-> code mapping derived from the IMGIMG names of config.json's vocabulary_map, as
    transformers' ChameleonImageVocabularyMapping derives it, is code = id - 4 (LANTERN's assumption)."""
    vocab = json.loads((disk["root"] / "anole" / "config.json").read_text())["vocabulary_map"]
    assert vocab["<image>"] == 8711 and "<reserved08707>" not in vocab
    assert vocab["<racm3:break>"] == 8197 and vocab["<eoss>"] == 8196 and vocab["<reserved08706>"] == 8710
    letters = {chr(ord("A") + i): str(i) for i in range(10)}
    bpe2img = {i: int("".join(letters[c] for c in name[len("IMGIMG"):-1]))
               for name, i in vocab.items() if name.startswith("IMGIMG")}
    assert len(bpe2img) == 8192 and all(code == i - 4 for i, code in bpe2img.items())
    assert ch.image_token_range(vocab) == (4, 8196)
    assert ch.image_code_of_name("IMGIMGBCDZ") == 123 and ch.image_token_name(123) == "IMGIMGBCDZ"
    swapped = dict(vocab)
    swapped[ch.image_token_name(0)], swapped[ch.image_token_name(1)] = 5, 4
    with pytest.raises(LanternError, match="image token id 4 has code 1, not 0"):
        ch.image_token_range(swapped)


# ---------------------------------------------------------------------------------------------
# Against transformers' ChameleonForConditionalGeneration on the same checkpoint


@pytest.mark.parametrize("swin", [False, True])
def test_matches_transformers(tmp_path, swin):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    model = _target(seed=5, num_key_value_heads=2, swin_norm=swin)
    ck.save_hf_anole(model, tmp_path / "t")
    tf = transformers.ChameleonForConditionalGeneration.from_pretrained(
        str(tmp_path / "t"), dtype=torch.float32, attn_implementation="eager").eval()
    ours = ck.load_target(tmp_path / "t")[0].float()
    # An Anole CFG prefill: a conditional row and the left-padded unconditional row.
    cond, uncond = prompts.anole_rows([[9300, 9301, 9302, 9303]])
    batch = prompts.batch_rows(cond + uncond)
    ids, pos = torch.from_numpy(batch.ids), torch.from_numpy(batch.positions)
    logits, hidden, _, _ = _run(ours, ids, pos, torch.from_numpy(batch.attention_mask()))
    with torch.no_grad():
        mask = torch.from_numpy(batch.visible).long()
        tf_hidden = tf.model(input_ids=ids, position_ids=pos, attention_mask=mask).last_hidden_state
        tf_logits = tf(input_ids=ids, position_ids=pos, attention_mask=mask).logits
    seen = torch.from_numpy(batch.visible)  # pad queries are garbage in both, and never used
    assert (tf_logits[..., IMAGE] == torch.finfo(torch.float32).min).all()  # tf's mask, undone below
    tol = 1e-4 * float(hidden.abs().max())
    assert float((hidden - tf_hidden)[seen].abs().max()) <= tol
    non_image = torch.ones(65536, dtype=torch.bool)
    non_image[IMAGE] = False
    assert float((logits[..., non_image] - tf_logits[..., non_image])[seen].abs().max()) <= 1e-4 * float(logits.abs().max())
    assert torch.allclose(logits[..., IMAGE], hidden @ tf.lm_head.weight[IMAGE].T, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# A straightforward reference, written independently from the state dict on disk


def _reference_forward(state, cfg, ids, positions, swin=False, drafter_input=None):
    """One sequence, causal, float64, loops over heads; RoPE as explicit rotations of the pairs
    (j, j + hd/2); qk-norm as mean/variance per head; GQA by integer division of the head index."""
    s = {k: v.double() for k, v in state.items()}
    prefix = "model." if "model.norm.weight" in s else ""
    H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = len(ids)

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def qk_norm(x, w, b):  # x [T, heads, hd]
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * w + b

    def rope(x):
        out = x.clone()
        for t in range(T):
            for j in range(hd // 2):
                angle = positions[t] * cfg.rope_theta ** (-2.0 * j / hd)
                c, s_ = math.cos(angle), math.sin(angle)
                a, b = x[t, :, j], x[t, :, j + hd // 2]
                out[t, :, j], out[t, :, j + hd // 2] = a * c - b * s_, b * c + a * s_
        return out

    x = s[f"{prefix}embed_tokens.weight"][torch.as_tensor(ids)]
    if drafter_input is not None:
        x = torch.cat([x, drafter_input.double()], dim=-1) @ s["fc.weight"].T + s.get("fc.bias", 0)
    layers = sum(1 for k in s if k.endswith("input_layernorm.weight"))
    for i in range(layers):
        p = f"{prefix}layers.{i}."
        attn_in = x if swin else rms(x, s[p + "input_layernorm.weight"])
        q = (attn_in @ s[p + "self_attn.q_proj.weight"].T).view(T, H, hd)
        k = (attn_in @ s[p + "self_attn.k_proj.weight"].T).view(T, Hkv, hd)
        v = (attn_in @ s[p + "self_attn.v_proj.weight"].T).view(T, Hkv, hd)
        q = rope(qk_norm(q, s[p + "self_attn.q_norm.weight"], s[p + "self_attn.q_norm.bias"]))
        k = rope(qk_norm(k, s[p + "self_attn.k_norm.weight"], s[p + "self_attn.k_norm.bias"]))
        heads = []
        for h in range(H):
            kv = h // (H // Hkv)
            scores = q[:, h] @ k[:, kv].T / math.sqrt(hd)
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v[:, kv])
        attn = torch.cat(heads, -1) @ s[p + "self_attn.o_proj.weight"].T
        h_ = x + (rms(attn, s[p + "input_layernorm.weight"]) if swin else attn)
        mlp_in = h_ if swin else rms(h_, s[p + "post_attention_layernorm.weight"])
        mlp = (F.silu(mlp_in @ s[p + "mlp.gate_proj.weight"].T) * (mlp_in @ s[p + "mlp.up_proj.weight"].T)) \
            @ s[p + "mlp.down_proj.weight"].T
        x = h_ + (rms(mlp, s[p + "post_attention_layernorm.weight"]) if swin else mlp)
    if drafter_input is not None:
        return x  # no final norm
    hidden = rms(x, s[f"{prefix}norm.weight"])
    return hidden @ s["lm_head.weight"].T, hidden


@pytest.mark.parametrize("overrides", [dict(num_key_value_heads=2), dict(swin_norm=True),
                                       dict(num_key_value_heads=1, swin_norm=True, rope_theta=500.0)])
def test_target_matches_reference(tmp_path, overrides):
    from safetensors.torch import load_file

    ck.save_hf_anole(_target(seed=6, **overrides), tmp_path / "t")
    model = ck.load_target(tmp_path / "t")[0].float()
    ids, pos = [9300, 17, 8197, 4000, 12], [3, 4, 5, 6, 9]  # positions need not start at 0
    logits, hidden, _, _ = _run(model, torch.tensor([ids]), torch.tensor([pos]))
    ref_logits, ref_hidden = _reference_forward(load_file(str(tmp_path / "t" / "model.safetensors")), model.config,
                                                ids, pos, swin=model.config.swin_norm)
    assert torch.allclose(hidden[0].double(), ref_hidden, atol=1e-4)
    assert torch.allclose(logits[0].double(), ref_logits, atol=1e-4)


def test_drafter_matches_reference(disk):
    drafter, _ = ck.load_drafter(disk["root"] / "anole_drafter", disk["anole"].config)
    drafter = drafter.float()
    ids, pos = [5000, 6000, 7000, 8197], [10, 11, 12, 13]
    target_hidden = torch.randn(1, 4, 64)
    keys, values = drafter.empty_cache(1, dtype=torch.float32)
    with torch.no_grad():
        hidden, new_k, _ = drafter(target_hidden, torch.tensor([ids]), torch.tensor([pos]), _causal(1, 4), keys, values)
    state = torch.load(disk["root"] / "anole_drafter" / "pytorch_model.bin", weights_only=True)
    ref = _reference_forward(state, drafter.config, ids, pos, drafter_input=target_hidden[0])
    assert torch.allclose(hidden[0].double(), ref, atol=1e-4)
    assert new_k.shape == (1, 1, 2, 4, 16)  # GQA: the target has 2 KV heads


# ---------------------------------------------------------------------------------------------
# The speculative forward contract: caches, trees, incremental decoding


def test_incremental_decoding_equals_full_forward():
    model = _bf16_round(_target(seed=7, num_key_value_heads=2))
    ids = torch.randint(0, 65536, (2, 9))
    full_logits, full_hidden, full_k, full_v = _run(model, ids)
    keys, values = model.empty_cache(2, dtype=torch.float32)
    P = 0
    with torch.no_grad():
        for start, end in ((0, 4), (4, 5), (5, 9)):  # prefill 4, one token, then 4 at once
            T = end - start
            logits, hidden, k, v = model(ids[:, start:end], torch.arange(start, end).expand(2, T), _causal(2, T, P),
                                         keys, values)
            assert torch.allclose(logits, full_logits[:, start:end], atol=1e-5)
            assert torch.allclose(hidden, full_hidden[:, start:end], atol=1e-5)
            assert torch.allclose(k, full_k[:, :, :, start:end], atol=1e-5)
            keys = [torch.cat([keys[i], k[i]], dim=2) for i in range(len(keys))]
            values = [torch.cat([values[i], v[i]], dim=2) for i in range(len(values))]
            P += T


def test_tree_node_equals_causal_path():
    """A static tree verified in one call (cache = a prompt, positions = prompt length + depth,
    mask = cache + ancestors) gives every node the logits of a causal forward over its path."""
    model = _bf16_round(_target(seed=8, swin_norm=True, num_key_value_heads=2))
    prompt = torch.tensor([[0, 9300, 9301, 8710, 8197]])
    P = prompt.shape[1]
    _, _, pk, pv = _run(model, prompt)
    keys, values = list(pk), list(pv)
    parents = [-1, 0, 0, 1, 1, 2, 3]  # root, two children, ...
    tokens = torch.tensor([[100, 200, 300, 400, 500, 600, 700]])
    depth = [0] * len(parents)
    for n, p in enumerate(parents):
        depth[n] = 0 if p < 0 else depth[p] + 1
    T = len(parents)
    mask = torch.zeros(1, 1, T, P + T, dtype=torch.bool)
    mask[..., :P] = True
    for n in range(T):
        a = n
        while a >= 0:
            mask[0, 0, n, P + a] = True
            a = parents[a]
    with torch.no_grad():
        tree_logits, tree_hidden, _, _ = model(tokens, torch.tensor([[P + d for d in depth]]), mask, keys, values)
    for n in range(T):
        path, a = [], n
        while a >= 0:
            path.insert(0, int(tokens[0, a]))
            a = parents[a]
        full_logits, full_hidden, _, _ = _run(model, torch.cat([prompt, torch.tensor([path])], dim=1))
        assert torch.allclose(tree_logits[0, n], full_logits[0, -1], atol=1e-5), n
        assert torch.allclose(tree_hidden[0, n], full_hidden[0, -1], atol=1e-5), n


def test_drafter_graph_drafts_image_tokens_only_with_cfg():
    """The drafter graph's top-K over the image rows of the head equals LANTERN's recipe on the
    full vocabulary: CFG, non-image ids to finfo.min, top-k; probabilities after temperature,
    top-k and top-p renormalised over the K."""
    target = _bf16_round(_target(seed=9))
    drafter = _bf16_round(_drafter(target, seed=10))
    graph = ch.DrafterGraph(drafter, target, candidates=8).eval()
    B, T = 4, 3  # rows 0, 1 conditional; 2, 3 their unconditional partners
    hidden_in, ids = torch.randn(B, T, 64), torch.randint(4, 8196, (B, T))
    pos = torch.arange(T).expand(B, T)
    keys, values = drafter.empty_cache(B, dtype=torch.float32)
    pair = torch.tensor([2, 3, 0, 1])
    scale, temp, top_k, top_p = torch.tensor([3.0]), torch.tensor([0.7]), torch.tensor([5]), torch.tensor([0.9])
    with torch.no_grad():
        hidden, _, _, topk_ids, topk_probs = graph(hidden_in, ids, pos, _causal(B, T), keys[0], values[0], pair, scale,
                                                   temp, top_k, top_p)
        logits = target.lm_head(hidden).float()
    cfg = logits[pair] + 3.0 * (logits - logits[pair])
    cfg[..., :4] = torch.finfo(torch.float32).min
    cfg[..., 8196:] = torch.finfo(torch.float32).min
    values_ref, ids_ref = torch.topk(cfg, 8, dim=-1)
    assert torch.equal(topk_ids, ids_ref)
    assert ((topk_ids >= 4) & (topk_ids < 8196)).all()
    p = torch.softmax(values_ref[..., :5] / 0.7, dim=-1)  # top_k 5 of the 8
    before = torch.cumsum(p, -1) - p
    p = torch.where(before > 0.9, torch.zeros_like(p), p)
    p = p / p.sum(-1, keepdim=True)
    assert torch.allclose(topk_probs[..., :5], p, atol=1e-6) and (topk_probs[..., 5:] == 0).all()


# ---------------------------------------------------------------------------------------------
# VQ-GAN


def _reference_decode(state, c, codes):
    """taming's decoder spelled out with functional ops straight from the checkpoint's keys."""
    s = state

    def gn(x, p):
        return F.group_norm(x, 32, s[p + ".weight"], s[p + ".bias"], eps=1e-6)

    def conv(x, p, pad):
        return F.conv2d(x, s[p + ".weight"], s[p + ".bias"], padding=pad)

    def resnet(x, p):
        h = conv(F.silu(gn(x, p + ".norm1")), p + ".conv1", 1)
        h = conv(F.silu(gn(h, p + ".norm2")), p + ".conv2", 1)
        return (conv(x, p + ".nin_shortcut", 0) if p + ".nin_shortcut.weight" in s else x) + h

    def attn(x, p):
        b, C, H, W = x.shape
        y = gn(x, p + ".norm")
        q, k, v = (conv(y, f"{p}.{n}", 0).reshape(b, C, H * W) for n in "qkv")
        w = torch.softmax(torch.einsum("bci,bcj->bij", q, k) / math.sqrt(C), dim=-1)
        return x + conv(torch.einsum("bij,bcj->bci", w, v).reshape(b, C, H, W), p + ".proj_out", 0)

    z = s["quantize.embedding.weight"][codes].permute(0, 3, 1, 2)
    h = conv(conv(z, "post_quant_conv", 0), "decoder.conv_in", 1)
    h = resnet(attn(resnet(h, "decoder.mid.block_1"), "decoder.mid.attn_1"), "decoder.mid.block_2")
    for level in reversed(range(len(c.ch_mult))):
        for j in range(c.num_res_blocks + 1):
            h = resnet(h, f"decoder.up.{level}.block.{j}")
            if f"decoder.up.{level}.attn.{j}.q.weight" in s:
                h = attn(h, f"decoder.up.{level}.attn.{j}")
        if level:
            h = conv(F.interpolate(h, scale_factor=2.0, mode="nearest"), f"decoder.up.{level}.upsample.conv", 1)
    return conv(F.silu(gn(h, "decoder.norm_out")), "decoder.conv_out", 1).clamp(-1, 1)


@pytest.mark.parametrize("attn_resolutions", [(), (8,)])
def test_vq_decoder_matches_reference(tmp_path, attn_resolutions):
    c = cvq.tiny_config(attn_resolutions=attn_resolutions)
    cvq.save_vq(cvq.init_random(cvq.ChameleonVQ(c), seed=11), tmp_path / "vq",
                extra_state={"encoder.conv_in.weight": torch.zeros(1), "loss.logvar": torch.zeros(1)})
    vq, info = cvq.load_vq(tmp_path / "vq")
    assert info["skipped_keys"] == 2 and vq.config == c
    state = torch.load(tmp_path / "vq" / "vqgan.ckpt", weights_only=True)["state_dict"]
    assert any(".attn." in k for k in state) == bool(attn_resolutions)
    codes = torch.randint(0, 8192, (2, 3, 4))
    with torch.no_grad():
        image = vq.decode_codes(codes)
        ref = _reference_decode(state, c, codes)
    assert image.shape == (2, 3, 48, 64)
    assert torch.allclose(image, ref, atol=1e-5)
    assert 0.05 < float((image.abs() < 1).float().mean())  # not all clamped


def test_vq_strict(tmp_path):
    vq = cvq.ChameleonVQ(cvq.tiny_config())
    state = vq.state_dict()
    state.pop("decoder.up.0.block.1.conv2.bias")
    state["decoder.mystery.weight"] = torch.zeros(1)
    cvq.save_vq(vq, tmp_path / "vq")
    torch.save({"state_dict": state}, tmp_path / "vq" / "vqgan.ckpt")
    with pytest.raises(LanternError, match=r"missing keys \(1\): decoder.up.0.block.1.conv2.bias.*"
                                           r"unexpected keys \(1\): decoder.mystery.weight"):
        cvq.load_vq(tmp_path / "vq")
    (tmp_path / "vq" / "vqgan.yaml").write_text("model: {params: {n_embed: 8}}")
    with pytest.raises(LanternError, match="not a taming VQModel config"):
        cvq.load_vq(tmp_path / "vq")


# ---------------------------------------------------------------------------------------------
# ONNX: target, drafter and VQ decoder export and run on ONNX Runtime like torch


def test_anole_rows_as_the_public_code_forms_them():
    cond, uncond = prompts.anole_rows([[5000, 5001, 5002], [6000]])
    batch, pair = prompts.cfg_batch(cond, uncond)
    # EaModel.generate: [0] + prompt + [8710, 8197], left-padded with 1; uncond [1]*(L-2) + [0, 8197].
    assert batch.ids.tolist() == [[0, 5000, 5001, 5002, 8710, 8197], [1, 1, 0, 6000, 8710, 8197],
                                  [1, 1, 1, 1, 0, 8197], [1, 1, 1, 1, 0, 8197]]
    assert batch.visible.tolist() == (batch.ids != 1).tolist()  # the public mask: ids != 1
    assert batch.positions.tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1]]
    assert batch.next_position.tolist() == [6, 4, 2, 2]  # cond L.., uncond 2..
    assert pair.tolist() == [2, 3, 0, 1]
    mask = batch.attention_mask()
    assert mask.shape == (4, 1, 6, 6)
    assert mask[2, 0, 5].tolist() == [False, False, False, False, True, True]  # uncond 8197 sees 0 and itself
    assert mask[2, 0, 1].tolist() == [False, True, False, False, False, False]  # a pad sees only itself


def test_lumina_rows_grid_tokens_and_positions():
    grid = (48, 48)  # 768 x 768
    assert prompts.lumina_prompt_text("a cat", grid) == \
        "Generate an image of 768x768 according to the following prompt:\na cat"
    assert prompts.lumina_prompt_text("x", (32, 48)).startswith("Generate an image of 768x512 ")  # width first
    assert prompts.lumina_grid_tokens(grid) == [8197, 8828, 8828]  # <reserved08824> = 8804 + 24
    cond, uncond = prompts.lumina_rows([[9300, 9301]], grid)
    assert cond == [[0, 9300, 9301, 8710, 8197, 8828, 8828]] and uncond == [[8197, 8828, 8828]]
    batch, _ = prompts.cfg_batch(cond, uncond)
    assert batch.positions[1].tolist() == [0, 0, 0, 0, 0, 1, 2]  # uncond restarts at 0 at the 8197
    assert (batch.positions[0] - batch.positions[1])[-3:].tolist() == [4, 4, 4]  # = index of the 8197
    assert batch.next_position.tolist() == [7, 3]
    with pytest.raises(LanternError, match="units of 2 latent rows"):
        prompts.lumina_grid_tokens((47, 48))


def test_forced_tokens_land_at_row_ends():
    h, w = 3, 4
    forced = prompts.forced_tokens("lumina_mgpt", (h, w))
    assert len(forced) == (w + 1) * h + 1 == 16
    assert forced.tolist() == [-1, -1, -1, -1, 8803] * 3 + [8196]
    # The same rule as inference_solver.py's MultiModalLogitsProcessor, t = body tokens so far.
    for t in range(len(forced)):
        rule = 8803 if (t + 1) % (w + 1) == 0 else (8196 if t + 1 == (w + 1) * h + 1 else -1)
        assert forced[t] == rule
    assert (prompts.forced_tokens("anole", (32, 32)) == -1).all() and prompts.body_length("anole", (32, 32)) == 1024
    assert prompts.body_length("lumina_mgpt", (48, 48)) == 2353


def test_codes_from_body():
    h, w = 2, 3
    codes = np.arange(h * w).reshape(h, w) * 100
    body = []
    for row in codes:
        body += [int(c) + 4 for c in row] + [8803]
    body.append(8196)
    assert prompts.codes_from_body("lumina_mgpt", body, (h, w)).tolist() == codes.tolist()
    assert prompts.codes_from_body("anole", codes.reshape(-1) + 4, (h, w)).tolist() == codes.tolist()
    body[3] = 50  # an image token where the line break belongs
    with pytest.raises(LanternError, match="line-break"):
        prompts.codes_from_body("lumina_mgpt", body, (h, w))


def test_text_tokenizer(tmp_path):
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (the export extra has it)")
    from tokenizers import pre_tokenizers

    from lantern.runtime.text_tokenizer import TextTokenizer

    assert chameleon_vocabulary.byte_level_alphabet() == set(pre_tokenizers.ByteLevel.alphabet())
    ck.save_text_tokenizer(tmp_path / "text_tokenizer.json")
    tok = TextTokenizer(tmp_path / "text_tokenizer.json")
    text = prompts.lumina_prompt_text("a red cat", (48, 48))
    ids = tok.encode(text)
    assert tok.decode(ids) == text and 0 not in ids and all(i >= 9000 for i in ids)
    assert tok.encode("a cat<reserved08706>")[-1] == 8710
    # Prompt ids alone (--prompt-ids) joined after the template prefix's ids give the same row.
    prefix = prompts.lumina_prompt_prefix((48, 48))
    assert tok.encode(prefix) + tok.encode("a red cat") == ids
    assert tok.token_id("<racm3:break>") == 8197
    bad = json.loads((tmp_path / "text_tokenizer.json").read_text())
    bad["model"]["vocab"]["<racm3:break>"], bad["model"]["vocab"]["<eoss>"] = 8196, 8197
    for added in bad["added_tokens"]:
        added["id"] = {8196: 8197, 8197: 8196}.get(added["id"], added["id"])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(LanternError, match="not Chameleon's text tokenizer"):
        TextTokenizer(tmp_path / "bad.json")
