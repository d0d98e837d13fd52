"""Every checkpoint format written in its real on-disk layout and loaded back through the loaders."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

from lantern.export import checkpoints, cli, llamagen
from tiny import causal_mask, positions, tiny_drafter, tiny_target

torch.set_grad_enabled(False)


def same_outputs(a, b, model_type="c2i"):
    B, T = 2, 5
    cond = torch.tensor([1, 2]) if model_type == "c2i" else torch.randn(B, a.args.cls_token_num, a.args.caption_dim)
    tokens = torch.randint(0, a.args.vocab_size, (B, T))
    for model in (a, b):
        embeds = torch.cat([model.embed_condition(cond), model.embed_tokens(tokens)], dim=1)
        n = embeds.shape[1]
        out = model(embeds, positions(B, 0, n), causal_mask(B, n), *model.empty_cache(B))
        if model is a:
            expected = out
    for x, y in zip(expected, out):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def tiny_namespace(model, **extra):
    a = model.args
    return argparse.Namespace(gpt_model=None, gpt_type=a.model_type, image_size=64, downsample_size=16,
                              num_classes=a.num_classes, cls_token_num=a.cls_token_num, vocab_size=a.vocab_size,
                              lr=1e-4, **extra)


def write_config(tmp_path, model):
    import json
    path = tmp_path / "gpt.json"
    a = model.args
    path.write_text(json.dumps({"dim": a.dim, "n_layer": a.n_layer, "n_head": a.n_head, "n_kv_head": a.n_kv_head,
                                "vocab_size": a.vocab_size, "num_classes": a.num_classes, "block_size": a.block_size,
                                "multiple_of": a.multiple_of, "caption_dim": a.caption_dim,
                                "cls_token_num": a.cls_token_num, "model_type": a.model_type,
                                "drop_path_rate": 0.0}))
    return str(path)


@pytest.mark.parametrize("key", ["model", "ema", None])
@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_llamagen_pt_round_trip(tmp_path, key, model_type):
    model = tiny_target(model_type, n_kv_head=2)
    path = tmp_path / "ckpt.pt"
    checkpoints.save_llamagen_pt(model, path, key=key, args_namespace=tiny_namespace(model),
                                 extra={"freqs_cis": torch.zeros(3)})
    assert checkpoints.detect_format(path) == "llamagen-pt"
    loaded, info = checkpoints.load_target(path, config_file=write_config(tmp_path, model),
                                           weights=key or "model")
    assert info["format"] == "llamagen-pt" and info["parameters"] == llamagen.count_parameters(model)
    same_outputs(model, loaded, model_type)


def test_llamagen_pt_ema_choice(tmp_path):
    model, other = tiny_target(seed=0), tiny_target(seed=5)
    path = tmp_path / "both.pt"
    torch.save({"model": model.state_dict(), "ema": other.state_dict(), "args": tiny_namespace(model)}, path)
    cfg = write_config(tmp_path, model)
    same_outputs(model, checkpoints.load_target(path, config_file=cfg)[0])
    same_outputs(other, checkpoints.load_target(path, config_file=cfg, weights="ema")[0])


def test_named_config_is_detected_from_shapes(tmp_path):
    with torch.device("meta"):
        args = llamagen.make_config("GPT-B", num_classes=1000)
    # Build a GPT-B-shaped state dict cheaply (zeros) and let the loader identify it.
    model = llamagen.Transformer(args)
    state = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    path = tmp_path / "gptb.pt"
    torch.save({"model": state, "args": argparse.Namespace(image_size=256)}, path)
    info = checkpoints.load_target(path)[1]
    assert info["config_name"] == "GPT-B" and info["config"]["dim"] == 768


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_lantern_hf_target_round_trip(tmp_path, shards, model_type):
    model = tiny_target(model_type, n_kv_head=2)
    checkpoints.save_hf_target(model, tmp_path / "hf", shards=shards)
    assert checkpoints.detect_format(tmp_path / "hf") == "lantern-hf"
    loaded, info = checkpoints.load_target(tmp_path / "hf")
    assert info["config"]["intermediate_size"] == model.args.ffn_hidden
    same_outputs(model, loaded, model_type)


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("fc_bias", [True, False])
def test_drafter_round_trip(tmp_path, fmt, fc_bias):
    target = tiny_target()
    drafter = tiny_drafter(target, fc_bias=fc_bias, norm_eps=1e-6)
    checkpoints.save_drafter(drafter, tmp_path / "d", fmt=fmt)
    assert checkpoints.detect_format(tmp_path / "d") == "drafter"
    loaded, info = checkpoints.load_drafter(tmp_path / "d", target.args)
    assert ("fc.bias" in loaded.state_dict()) == fc_bias
    h, ids = torch.randn(1, 4, 32), torch.randint(0, 64, (1, 4))
    args = (h, ids, positions(1, 1, 4), causal_mask(1, 4), *drafter.empty_cache(1), target.rope)
    for x, y in zip(drafter(*args), loaded(*args)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_drafter_that_does_not_fit_the_target(tmp_path):
    target = tiny_target()
    checkpoints.save_drafter(tiny_drafter(target), tmp_path / "d")
    with pytest.raises(ValueError, match="does not fit the target"):
        checkpoints.load_drafter(tmp_path / "d", tiny_target(dim=48, n_head=4).args)


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    model = tiny_target()
    path = tmp_path / "c.pt"
    checkpoints.save_llamagen_pt(model, path)
    cfg = write_config(tmp_path, tiny_target(n_kv_head=2))
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.wqkv\.weight has shape \(96, 32\) in the checkpoint but \(64, 32\)"):
        checkpoints.load_target(path, config_file=cfg)


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    model = tiny_target()
    state = model.state_dict()
    state.pop("norm.weight")
    state["mystery.weight"] = torch.zeros(2)
    path = tmp_path / "c.pt"
    torch.save({"model": state}, path)
    with pytest.raises(ValueError, match=r"missing keys \(1\): norm\.weight; unexpected keys \(1\): mystery\.weight"):
        checkpoints.load_target(path, config_file=write_config(tmp_path, model))


def test_malicious_pickle_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    marker = tmp_path / "pwned"
    torch.save({"model": {}, "payload": Exploit(str(marker))}, path)
    with pytest.raises(ValueError, match="refused to load"):
        checkpoints.load_target(path)
    assert not marker.exists()


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cli_inspect_and_errors(tmp_path, capsys):
    model = tiny_target()
    path = tmp_path / "c.pt"
    checkpoints.save_llamagen_pt(model, path, args_namespace=tiny_namespace(model))
    cfg = write_config(tmp_path, model)
    assert cli.main(["inspect", str(path), "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert "llamagen-pt" in out and f"{llamagen.count_parameters(model):,}" in out and "float32" in out

    truncated = tmp_path / "trunc.pt"
    truncated.write_bytes(path.read_bytes()[:200])
    for argv, message in [
        (["inspect", str(truncated)], "unreadable or truncated"),
        (["inspect", str(tmp_path / "nope.pt")], "no such file"),
        (["inspect", str(path), "--model", "GPT-Q"], "valid names: GPT-B, GPT-L"),
    ]:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_subprocess_exit_code(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lantern.export.cli", "inspect", str(tmp_path / "x.pt")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such file" in r.stderr


def test_runtime_imports_without_torch():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch': raise ImportError('torch is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import lantern.runtime, pkgutil, importlib\n"
            "for m in pkgutil.walk_packages(lantern.runtime.__path__, 'lantern.runtime.'):\n"
            "    if m.name.split('.')[-1] not in ('backend_torch',): importlib.import_module(m.name)\n"
            "assert 'torch' not in sys.modules\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
