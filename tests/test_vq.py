"""VQ tokenizer: architecture facts, strict loading of the real on-disk format, ONNX equivalence of
the decoder, and PNG output of decoded images."""
import argparse
import warnings

import numpy as np
import pytest
import torch

from lantern.export import vq
from lantern.runtime import png
from lantern.runtime.errors import LanternError


def tiny_config(**overrides):
    fields = dict(codebook_size=64, codebook_embed_dim=8, encoder_ch_mult=(1, 2), decoder_ch_mult=(1, 2),
                  z_channels=16, ch=32, num_res_blocks=1)
    fields.update(overrides)
    return vq.VQConfig(**fields)


def tiny_vq(seed=0, **overrides):
    """A random tiny tokenizer whose norms, biases and codebook rows are all non-trivial (the
    default init has unit GroupNorm weights, zero biases and unit-norm codes)."""
    torch.manual_seed(seed)
    model = vq.VQModel(tiny_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def save_raw(obj, path):
    torch.save(obj, path)
    return path


# ----------------------------------------------------------------------------- architecture

def test_vq16_layout_matches_llamagen():
    with torch.device("meta"):
        model = vq.VQModel(vq.vq_config("VQ-16"))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["quantize.embedding.weight"] == (16384, 8)
    assert shapes["quantize.codebook_used"] == (65536,)
    assert shapes["quant_conv.weight"] == (8, 256, 1, 1)
    assert shapes["post_quant_conv.weight"] == (256, 8, 1, 1)
    assert shapes["encoder.conv_in.weight"] == (128, 3, 3, 3)
    assert shapes["encoder.conv_out.weight"] == (256, 512, 3, 3)
    assert shapes["decoder.conv_in.weight"] == (512, 256, 3, 3)
    assert shapes["decoder.conv_out.weight"] == (3, 128, 3, 3)
    # Attention at the lowest resolution only: 2 blocks in the encoder's last level, 3 in the
    # decoder's first; one in each mid.
    attn = sorted({k.rsplit(".", 2)[0] for k in shapes if ".attn." in k})
    assert attn == [f"decoder.conv_blocks.0.attn.{i}" for i in range(3)] + \
                   [f"encoder.conv_blocks.4.attn.{i}" for i in range(2)]
    assert "encoder.mid.1.q.weight" in shapes and "decoder.mid.1.proj_out.weight" in shapes
    # Resampling between levels, none after the last.
    assert "encoder.conv_blocks.3.downsample.conv.weight" in shapes
    assert not any(k.startswith("encoder.conv_blocks.4.downsample") for k in shapes)
    assert "decoder.conv_blocks.3.upsample.conv.weight" in shapes
    assert not any(k.startswith("decoder.conv_blocks.4.upsample") for k in shapes)
    # 1x1 shortcut exactly where the width changes (128 -> 256 at level 2 of the encoder).
    assert shapes["encoder.conv_blocks.2.res.0.nin_shortcut.weight"] == (256, 128, 1, 1)
    assert "encoder.conv_blocks.2.res.1.nin_shortcut.weight" not in shapes
    # LlamaGen reports 72M parameters for its VQ-16 tokenizer.
    assert 71e6 < sum(p.numel() for p in model.parameters()) < 73e6
    assert vq.vq_config("VQ-16").downsample == 16 and vq.vq_config("VQ-8").downsample == 8


def test_blocks_follow_the_taming_formulas():
    """Each block against the formula written with different torch ops (SDPA, functional group
    norm with eps 1e-6, repeat_interleave for nearest upsampling, explicit bottom/right padding)."""
    torch.manual_seed(0)
    F = torch.nn.functional
    x = torch.randn(2, 64, 5, 6)
    with torch.no_grad():
        attn = vq.AttnBlock(64)
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
        y = F.group_norm(x, 32, attn.norm.weight, attn.norm.bias, eps=1e-6)
        q, k, v = (m(y).flatten(2).transpose(1, 2) for m in (attn.q, attn.k, attn.v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        torch.testing.assert_close(attn(x), x + attn.proj_out(o), atol=1e-5, rtol=1e-5)

        res = vq.ResnetBlock(64, 96, dropout=0.0)
        h = res.conv1(F.silu(F.group_norm(x, 32, res.norm1.weight, res.norm1.bias, eps=1e-6)))
        h = res.conv2(F.silu(F.group_norm(h, 32, res.norm2.weight, res.norm2.bias, eps=1e-6)))
        torch.testing.assert_close(res(x), res.nin_shortcut(x) + h, atol=1e-5, rtol=1e-5)

        up = vq.Upsample(64)
        torch.testing.assert_close(up(x), up.conv(x.repeat_interleave(2, 2).repeat_interleave(2, 3)))
        down = vq.Downsample(64)
        padded = torch.zeros(2, 64, 6, 7)
        padded[:, :, :5, :6] = x
        torch.testing.assert_close(down(x), F.conv2d(padded, down.conv.weight, down.conv.bias, stride=2))
        assert down(x).shape == (2, 64, 2, 3)


def test_unknown_config_name_lists_valid_ones():
    with pytest.raises(LanternError, match="VQ-16.*VQ-8"):
        vq.vq_config("VQ-32")


def test_bad_config_rejected():
    with pytest.raises(LanternError, match="GroupNorm"):
        vq.VQConfig(ch=48)
    with pytest.raises(LanternError, match="same number of levels"):
        vq.VQConfig(encoder_ch_mult=(1, 2), decoder_ch_mult=(1, 2, 2))


def test_shapes_and_code_vectors():
    model = tiny_vq()
    images = torch.rand(2, 3, 16, 24) * 2 - 1
    codes = model.encode(images)
    assert codes.shape == (2, 8, 12) and codes.dtype == torch.int64
    out = model.decode_codes(codes)
    assert out.shape == (2, 3, 16, 24)
    vectors = model.code_vectors()
    assert torch.allclose(vectors.norm(dim=1), torch.ones(64), atol=1e-6)
    raw = model.quantize.embedding.weight
    assert not torch.allclose(raw.norm(dim=1), torch.ones(64), atol=1e-3)  # the test means something
    assert torch.allclose(vectors, raw / raw.norm(dim=1, keepdim=True), atol=1e-7)
    plain = tiny_vq(codebook_l2_norm=False)
    assert torch.equal(plain.code_vectors(), plain.quantize.embedding.weight)


@pytest.mark.parametrize("l2", [True, False])
def test_encode_picks_nearest_code(l2):
    model = tiny_vq(codebook_l2_norm=l2)
    images = torch.rand(3, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        z = model.quant_conv(model.encoder(images))  # before any normalisation
        codes = model.encode(images)
    flat = z.permute(0, 2, 3, 1).reshape(-1, 8).double()
    book = model.quantize.embedding.weight.detach().double()
    if l2:
        flat, book = flat / flat.norm(dim=1, keepdim=True), book / book.norm(dim=1, keepdim=True)
    brute = torch.cdist(flat, book).argmin(dim=1)
    assert torch.equal(codes.reshape(-1), brute)


def test_decode_codes_is_lookup_then_decoder():
    model = tiny_vq()
    codes = torch.randint(0, 64, (2, 3, 5))
    vectors = model.code_vectors()[codes.reshape(-1)].reshape(2, 3, 5, 8).permute(0, 3, 1, 2)
    with torch.no_grad():
        expected = model.decoder(model.post_quant_conv(vectors))
        assert torch.equal(model.decode_codes(codes), expected)
    with pytest.raises(LanternError, match="batch, height, width"):
        model.decode_codes(codes.reshape(-1))


# ----------------------------------------------------------------------------- loading

def test_roundtrip_real_format_without_config(tmp_path):
    model = tiny_vq()
    path = tmp_path / "vq.pt"
    vq.save_vq(model, path)
    obj = torch.load(path, weights_only=True)
    assert list(obj) == ["model"] and "quantize.codebook_used" in obj["model"]
    assert [p.name for p in tmp_path.iterdir()] == ["vq.pt"]  # no temporary left behind

    loaded, info = vq.load_vq(path)
    assert loaded.config == model.config
    assert info["weights"] == "model" and info["config_source"].startswith("inferred")
    assert info["config"]["encoder_ch_mult"] == [1, 2] and info["config_name"] is None
    assert not loaded.training
    codes = torch.randint(0, 64, (2, 4, 4))
    with torch.no_grad():
        assert torch.equal(loaded.decode_codes(codes), model.decode_codes(codes))


def test_infers_asymmetric_and_named_configs(tmp_path):
    # Decoder blocks are stored lowest resolution first; the inferred ch_mult must undo that.
    model = tiny_vq(encoder_ch_mult=(1, 2, 3), decoder_ch_mult=(2, 1, 4), num_res_blocks=2,
                    codebook_show_usage=False)
    vq.save_vq(model, tmp_path / "a.pt")
    loaded, info = vq.load_vq(tmp_path / "a.pt")
    assert loaded.config == model.config and "quantize.codebook_used" not in loaded.state_dict()

    vq.save_vq(vq.VQModel(vq.vq_config("VQ-16-tiny")), tmp_path / "b.pt")
    assert vq.load_vq(tmp_path / "b.pt")[1]["config_name"] == "VQ-16-tiny"
    # A named or explicit config is used as given.
    assert vq.load_vq(tmp_path / "b.pt", config="VQ-16-tiny")[1]["config_source"] == "named VQ-16-tiny"


def test_model_ema_raw_and_safetensors(tmp_path):
    a, b = tiny_vq(seed=1), tiny_vq(seed=2)
    both = save_raw({"model": a.state_dict(), "ema": b.state_dict(), "steps": 10,
                     "args": argparse.Namespace(codebook_l2_norm=True)}, tmp_path / "both.pt")
    codes = torch.randint(0, 64, (1, 2, 2))
    with torch.no_grad():
        m, info = vq.load_vq(both)
        assert info["weights"] == "model" and torch.equal(m.decode_codes(codes), a.decode_codes(codes))
        m, info = vq.load_vq(both, weights="ema")
        assert info["weights"] == "ema" and torch.equal(m.decode_codes(codes), b.decode_codes(codes))
    only_ema = save_raw({"ema": b.state_dict()}, tmp_path / "ema.pt")
    assert vq.load_vq(only_ema)[1]["weights"] == "ema"
    with pytest.raises(LanternError, match="'model'"):
        vq.load_vq(only_ema, weights="model")
    raw = save_raw(a.state_dict(), tmp_path / "raw.pt")
    assert vq.load_vq(raw)[1]["weights"] == "raw"

    from safetensors.torch import save_file
    save_file(a.state_dict(), str(tmp_path / "raw.safetensors"))
    m, _ = vq.load_vq(tmp_path / "raw.safetensors")
    assert torch.equal(m.quantize.embedding.weight, a.quantize.embedding.weight)


def test_l2_flag_read_from_training_args(tmp_path):
    model = tiny_vq(codebook_l2_norm=False)
    path = save_raw({"model": model.state_dict(), "args": argparse.Namespace(codebook_l2_norm=False)},
                    tmp_path / "vq.pt")
    loaded, _ = vq.load_vq(path)
    assert loaded.config.codebook_l2_norm is False
    assert torch.equal(loaded.code_vectors(), model.quantize.embedding.weight)


def test_missing_keys_named_with_count(tmp_path):
    sd = tiny_vq().state_dict()
    dropped = sorted(k for k in sd if k.startswith("decoder.conv_out") or k.startswith("decoder.norm_out"))
    for k in dropped:
        del sd[k]
    path = save_raw({"model": sd}, tmp_path / "vq.pt")
    with pytest.raises(LanternError) as e:
        vq.load_vq(path)
    msg = str(e.value)
    assert "missing" in msg and f"({len(dropped)})" in msg and dropped[0] in msg and "\n" not in msg


def test_unexpected_keys_named(tmp_path):
    sd = tiny_vq().state_dict()
    sd["decoder.extra.weight"] = torch.zeros(3)
    sd["quantize.ema_count"] = torch.zeros(64)
    with pytest.raises(LanternError, match=r"unexpected.*decoder\.extra\.weight"):
        vq.load_vq(save_raw({"model": sd}, tmp_path / "vq.pt"))


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    path = tmp_path / "vq.pt"
    vq.save_vq(tiny_vq(), path)
    with pytest.raises(LanternError) as e:
        vq.load_vq(path, config=tiny_config(codebook_size=128))
    msg = str(e.value)
    assert "quantize.embedding.weight" in msg and "64, 8" in msg and "128, 8" in msg
    # A mis-shaped tensor inside a file whose config is inferred.
    sd = tiny_vq().state_dict()
    sd["decoder.conv_in.bias"] = torch.zeros(7)
    with pytest.raises(LanternError, match=r"decoder\.conv_in\.bias.*7"):
        vq.load_vq(save_raw(sd, tmp_path / "bad.pt"))


def test_not_a_vq_checkpoint(tmp_path):
    with pytest.raises(LanternError, match="not a VQ checkpoint"):
        vq.load_vq(save_raw({"foo": torch.zeros(2)}, tmp_path / "x.pt"))
    sd = tiny_vq().state_dict()
    del sd["encoder.conv_in.weight"]
    with pytest.raises(LanternError, match="cannot infer.*encoder.conv_in.weight"):
        vq.load_vq(save_raw(sd, tmp_path / "y.pt"))
    with pytest.raises(LanternError, match="no such file"):
        vq.load_vq(tmp_path / "absent.pt")


def test_truncated_file_is_one_clear_error(tmp_path):
    path = tmp_path / "vq.pt"
    vq.save_vq(tiny_vq(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(LanternError) as e:
        vq.load_vq(path)
    assert "truncated" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- ONNX

@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_decoder_onnx_matches_torch(tmp_path, dynamo):
    ort = pytest.importorskip("onnxruntime")
    if dynamo:
        pytest.importorskip("onnxscript")
    model = tiny_vq()
    codes = torch.randint(0, 64, (2, 4, 4))
    path = str(tmp_path / "decoder.onnx")
    if dynamo:
        dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("height"), 2: torch.export.Dim("width")}
        shapes = dict(dynamic_shapes=(dims,))
    else:
        shapes = dict(dynamic_axes={"codes": {0: "batch", 1: "height", 2: "width"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(vq.CodeDecoder(model), (codes,), path, input_names=["codes"],
                          output_names=["images"], opset_version=18, dynamo=dynamo, **shapes)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for c in (codes, torch.randint(0, 64, (1, 3, 5))):  # the traced shape and another one
        got = session.run(None, {"codes": c.numpy()})[0]
        with torch.no_grad():
            want = model.decode_codes(c).numpy()
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- PNG output

def test_to_uint8_mapping_and_layouts():
    x = np.array([-1.5, -1.0, 0.0, 1.0, 2.0, 0.9 / 127.5 - 1, 0.4 / 127.5 - 1])
    chw = np.broadcast_to(x[None, None, :], (3, 1, 7))
    # 127.5 (x + 1) rounded (halves up) and clipped: 0, 0, 128, 255, 255, 1, 0
    expected = np.array([0, 0, 128, 255, 255, 1, 0], dtype=np.uint8)
    out = png.to_uint8(chw)
    assert out.shape == (1, 7, 3) and out.dtype == np.uint8
    assert (out[0, :, 0] == expected).all()
    assert (png.to_uint8(chw.transpose(1, 2, 0)) == out).all()
    with pytest.raises(LanternError, match="CHW from HWC"):
        png.to_uint8(np.zeros((3, 4, 3)))
    assert png.to_uint8(np.zeros((3, 4, 3)), layout="hwc").shape == (3, 4, 3)
    with pytest.raises(LanternError, match="NaN"):
        png.to_uint8(np.full((3, 2, 2), np.nan))


def test_png_roundtrip_through_a_real_decoder(tmp_path):
    mpimg = pytest.importorskip("matplotlib.image")
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(13, 21, 3), dtype=np.uint8)
    path = tmp_path / "img.png"
    png.write_png(path, image)
    assert [p.name for p in tmp_path.iterdir()] == ["img.png"]
    back = mpimg.imread(str(path))  # float32 in [0, 1] for an 8-bit PNG
    assert back.shape == (13, 21, 3)
    assert (np.round(back * 255).astype(np.uint8) == image).all()
    with pytest.raises(LanternError, match="uint8"):
        png.write_png(tmp_path / "bad.png", image.astype(np.float32))
    with pytest.raises(LanternError, match="does not exist"):
        png.write_png(tmp_path / "no" / "dir.png", image)


def test_decoded_grid_to_png(tmp_path):
    mpimg = pytest.importorskip("matplotlib.image")
    model = tiny_vq()
    with torch.no_grad():
        images = model.decode_codes(torch.randint(0, 64, (3, 2, 2))).numpy()
    tiles = [png.to_uint8(im) for im in images]
    grid = png.image_grid(tiles, ncols=2, pad=1, pad_value=7)
    assert grid.shape == (1 + 2 * (4 + 1), 1 + 2 * (4 + 1), 3)
    assert (grid[1:5, 6:10] == tiles[1]).all() and (grid[6:10, 1:5] == tiles[2]).all()
    assert (grid[6:10, 6:10] == 7).all() and (grid[0] == 7).all()  # empty cell and padding
    png.write_png(tmp_path / "grid.png", grid)
    back = np.round(mpimg.imread(str(tmp_path / "grid.png")) * 255).astype(np.uint8)
    assert (back == grid).all()
    with pytest.raises(LanternError, match="image 1"):
        png.image_grid([tiles[0], tiles[1][:2]])
