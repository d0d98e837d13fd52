"""The reference models: KV-cache decoding, tree masks, RoPE, conditioning and CFG rows."""
import math

import pytest
import torch

from lantern.export import layers, llamagen
from tiny import causal_mask, positions, tiny_args, tiny_drafter, tiny_target

torch.set_grad_enabled(False)


def run(model, embeds, pos, mask, cache):
    return model(embeds, pos, mask, *cache)


def close(got, want):
    """Equal up to float32 rounding, which scales with the largest value (the peaked tiny
    models' logits are tens: an element near 0 beside them may differ by ~1e-5)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_incremental_decoding_equals_full_forward(n_kv_head):
    model = tiny_target(n_kv_head=n_kv_head)
    B, n_img = 2, 7
    cond = model.embed_condition(torch.tensor([3, model.null_class]))
    tokens = torch.randint(0, model.args.vocab_size, (B, n_img))
    embeds = torch.cat([cond, model.embed_tokens(tokens)], dim=1)
    T = embeds.shape[1]
    full_logits, full_hidden, _, _ = run(model, embeds, positions(B, 0, T), causal_mask(B, T), model.empty_cache(B))

    k, v = model.empty_cache(B)
    for t in range(T):
        logits, hidden, nk, nv = run(model, embeds[:, t:t + 1], positions(B, t, 1), causal_mask(B, 1, past=t), (k, v))
        k, v = torch.cat([k, nk], dim=3), torch.cat([v, nv], dim=3)
        close(logits[:, 0], full_logits[:, t])
        close(hidden[:, 0], full_hidden[:, t])


def test_cache_slots_beyond_the_mask_are_ignored():
    """The runtime preallocates the cache; slots it has not written must not matter."""
    model = tiny_target()
    B, past, capacity = 1, 3, 9
    embeds = model.embed_tokens(torch.randint(0, 64, (B, past + 1)))
    k, v = model.empty_cache(B)
    _, _, k, v = run(model, embeds[:, :past], positions(B, 0, past), causal_mask(B, past), (k, v))
    expected = run(model, embeds[:, past:], positions(B, past, 1), causal_mask(B, 1, past), (k, v))[0]
    garbage = torch.randn(k.shape[:3] + (capacity - past,) + k.shape[4:])
    big_k, big_v = torch.cat([k, garbage], dim=3), torch.cat([v, garbage], dim=3)
    mask = torch.zeros(B, 1, 1, capacity + 1, dtype=torch.bool)
    mask[..., :past] = True
    mask[..., -1] = True
    got = run(model, embeds[:, past:], positions(B, past, 1), mask, (big_k, big_v))[0]
    close(got, expected)


# A small branching tree given as parent indices (node 0 = root), written out by hand so this
# test does not depend on the runtime's tree module.
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 6]


def _ancestors(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_tree_node_logits_equal_causal_path(which):
    target = tiny_target(n_kv_head=2)
    drafter = tiny_drafter(target)
    B, past = 2, 5
    N = len(TREE_PARENTS)
    depth = [len(_ancestors(TREE_PARENTS, i)) - 1 for i in range(N)]
    node_tokens = torch.randint(0, 64, (B, N))
    prefix_tokens = torch.randint(0, 64, (B, past))
    hidden_in = torch.randn(B, past + N, target.args.dim)

    def forward(tokens, pos, mask, cache, h):
        if which == "target":
            logits, hidden, nk, nv = target(target.embed_tokens(tokens), pos, mask, *cache)
            return logits, nk, nv
        out, nk, nv = drafter(h, tokens, pos, mask, *cache, target.rope)
        return target.output(out), nk, nv

    cache = target.empty_cache(B) if which == "target" else drafter.empty_cache(B)
    _, k, v = forward(prefix_tokens, positions(B, 1, past), causal_mask(B, past), cache, hidden_in[:, :past])

    tree_mask = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N):
        tree_mask[i, _ancestors(TREE_PARENTS, i)] = True
    mask = torch.cat([torch.ones(N, past, dtype=torch.bool), tree_mask], dim=1).expand(B, 1, N, past + N)
    pos = (1 + past + torch.tensor(depth)).expand(B, N)
    tree_logits, _, _ = forward(node_tokens, pos, mask, (k, v), hidden_in[:, past:])

    for i in range(N):
        path = _ancestors(TREE_PARENTS, i)
        L = len(path)
        logits, _, _ = forward(node_tokens[:, path], positions(B, 1 + past, L), causal_mask(B, L, past), (k, v),
                               hidden_in[:, past:][:, path])
        close(tree_logits[:, i], logits[:, -1])


def test_rope_matches_complex_rotation_by_row_and_column():
    """Independent check of LlamaGen's 2D RoPE: pair j rotates by row·f_j (j < hd/4) or col·f_j."""
    args = tiny_args(dim=64, n_head=2)  # head_dim 32
    table = llamagen.rope_table(args)
    hd, grid, cls = args.head_dim, args.grid_size, args.cls_token_num
    freqs = [args.rope_base ** (-2 * j / (hd // 2)) for j in range(hd // 4)]
    x = torch.randn(1, cls + grid * grid, 1, hd)
    out = llamagen.apply_rope(x, table[None])
    for pos in range(cls + grid * grid):
        for pair in range(hd // 2):
            z = complex(x[0, pos, 0, 2 * pair].item(), x[0, pos, 0, 2 * pair + 1].item())
            if pos < cls:
                expected = 0j
            else:
                row, col = divmod(pos - cls, grid)
                angle = (row if pair < hd // 4 else col) * freqs[pair % (hd // 4)]
                expected = z * complex(math.cos(angle), math.sin(angle))
            got = complex(out[0, pos, 0, 2 * pair].item(), out[0, pos, 0, 2 * pair + 1].item())
            assert abs(got - expected) < 1e-5, (pos, pair)


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_condition_queries_and_keys_are_zero_after_rope(model_type):
    model = tiny_target(model_type)
    cls = model.args.cls_token_num
    captured = {}

    def hook(module, inputs, output):
        captured["qkv"] = output

    model.layers[0].attention.wqkv.register_forward_hook(hook)
    cond = model.embed_condition(torch.tensor([1]) if model_type == "c2i" else torch.randn(1, cls, 24))
    x = model.layers[0].attention_norm(cond)
    attn = model.layers[0].attention
    _, k, _ = attn(x, model.rope[positions(1, 0, cls)], causal_mask(1, cls), *[c[0] for c in model.empty_cache(1)])
    assert torch.count_nonzero(k) == 0
    q = captured["qkv"][..., : attn.n_head * attn.head_dim].view(1, cls, attn.n_head, attn.head_dim)
    assert torch.count_nonzero(llamagen.apply_rope(q, model.rope[positions(1, 0, cls)])) == 0
    assert torch.count_nonzero(captured["qkv"]) > 0  # zero because of RoPE, not because of the input


def test_cfg_unconditional_rows():
    c2i = tiny_target("c2i")
    null = c2i.unconditional(2)
    assert null.tolist() == [10, 10]
    torch.testing.assert_close(c2i.embed_condition(null)[:, 0], c2i.cls_embedding.embedding_table.weight[10].expand(2, -1))
    t2i = tiny_target("t2i")
    uncond = t2i.unconditional(2)
    torch.testing.assert_close(uncond[1], t2i.cls_embedding.uncond_embedding)
    torch.testing.assert_close(t2i.embed_condition(uncond)[0], t2i.cls_embedding.cap_proj(t2i.cls_embedding.uncond_embedding))


def test_c2i_without_null_row_refuses_cfg():
    model = tiny_target(class_dropout_prob=0.0)
    assert model.cls_embedding.embedding_table.weight.shape[0] == 10
    with pytest.raises(ValueError, match="null class"):
        model.unconditional(1)


def llamagen_t2i_mask(caption_mask, total):
    """The prefix mask LlamaGen's generate() builds for left-padded captions: causal, padded caption
    keys hidden from every query, and the diagonal forced on."""
    B, cls = caption_mask.shape
    mask = torch.tril(torch.ones(total, total, dtype=torch.bool)).expand(B, total, total).clone()
    mask[:, :, :cls] &= caption_mask[:, None, :]
    mask |= torch.eye(total, dtype=torch.bool)
    return mask[:, None]


def test_t2i_left_padded_caption_keys_are_invisible():
    model = tiny_target("t2i")
    cls, B, n_img = model.args.cls_token_num, 2, 4
    caption_mask = torch.ones(B, cls, dtype=torch.bool)
    caption_mask[0, :2] = False  # left padding: the first two caption tokens of image 0 are padding
    caption = torch.randn(B, cls, 24) * caption_mask[..., None]
    tokens = torch.randint(0, 64, (B, n_img))
    T = cls + n_img
    mask = llamagen_t2i_mask(caption_mask, T)

    def forward(cap):
        embeds = torch.cat([model.embed_condition(cap), model.embed_tokens(tokens)], dim=1)
        return model(embeds, positions(B, 0, T), mask, *model.empty_cache(B))[0]

    base = forward(caption)
    assert torch.isfinite(base).all()  # padded queries see themselves, so no empty softmax rows
    changed = caption.clone()
    changed[0, :2] = torch.randn(2, 24) * 10  # whatever sits in the padded slots
    moved = forward(changed)
    close(moved[0, 2:], base[0, 2:])
    torch.testing.assert_close(moved[1], base[1])
    # The same perturbation on visible caption tokens does change the image tokens' logits.
    changed[0, 3] += 5
    assert not torch.allclose(forward(changed)[0, cls:], base[0, cls:], atol=1e-4)


def test_ffn_width_and_named_configs():
    for name, (layers, heads, dim) in llamagen.GPT_CONFIGS.items():
        args = llamagen.make_config(name)
        assert (args.n_layer, args.n_head, args.dim) == (layers, heads, dim)
        assert args.ffn_hidden % 256 == 0 and args.ffn_hidden >= int(8 * dim / 3)
    assert llamagen.make_config("GPT-B").ffn_hidden == 2048
    assert llamagen.make_config("GPT-XL").ffn_hidden == 3584
    assert llamagen.make_config("GPT-3B").head_dim == 100
    assert llamagen.make_config("GPT-B", image_size=384).block_size == 576
    assert llamagen.make_config("GPT-XL", model_type="t2i").cls_token_num == 120


def test_parameter_counts_match_published_sizes():
    # LlamaGen's table: B 111M, L 343M, XL 775M (c2i, 1000 classes + null row, vocab 16384).
    for name, published in (("GPT-B", 111e6), ("GPT-L", 343e6), ("GPT-XL", 775e6)):
        with torch.device("meta"):
            model = llamagen.Transformer(llamagen.make_config(name))
        assert abs(llamagen.count_parameters(model) - published) / published < 0.01, name


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_split_attention_equals_sdpa_over_the_concatenated_cache(heads, kv_heads):
    """The graph attends to [cache, new] without concatenating them; check it against PyTorch's
    SDPA over the concatenation, with LlamaGen's repeat_interleave for grouped KV heads."""
    B, T, P, hd = 2, 5, 7, 8
    q = torch.randn(B, heads, T, hd)
    past_k, past_v = torch.randn(B, kv_heads, P, hd), torch.randn(B, kv_heads, P, hd)
    k, v = torch.randn(B, kv_heads, T, hd), torch.randn(B, kv_heads, T, hd)
    mask = torch.rand(B, 1, T, P + T) > 0.4
    mask[..., P:] |= torch.eye(T, dtype=torch.bool)
    rep = heads // kv_heads
    keys = torch.cat([past_k, k], dim=2).repeat_interleave(rep, dim=1)
    values = torch.cat([past_v, v], dim=2).repeat_interleave(rep, dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    torch.testing.assert_close(layers.attend(q, past_k, past_v, k, v, mask), expected, rtol=1e-5, atol=1e-5)
