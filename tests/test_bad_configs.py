"""Bad config files, drafter configs and pickles through `lantern-export inspect`: one line, exit 2."""
import json

import pytest
import torch

from lantern.export import checkpoints, cli, llamagen
from lantern.runtime.errors import LanternError
from tiny import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    model = tiny_target()
    checkpoints.save_llamagen_pt(model, root / "c.pt")
    checkpoints.save_hf_target(model, root / "hf")
    checkpoints.save_drafter(tiny_drafter(model), root / "drafter")
    a = model.args
    config = {"dim": a.dim, "n_layer": a.n_layer, "n_head": a.n_head, "vocab_size": a.vocab_size,
              "num_classes": a.num_classes, "block_size": a.block_size, "multiple_of": a.multiple_of,
              "cls_token_num": 1, "model_type": "c2i"}
    (root / "good.json").write_text(json.dumps(config))
    return root, config


def one_line_error(capsys, argv):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lantern-export: error: "), captured.err
    assert "Traceback" not in captured.err and "weights_only" not in captured.err
    return err[0]


def test_the_good_config_loads(files, capsys):
    root, _ = files
    assert cli.main(["inspect", str(root / "c.pt"), "--config", str(root / "good.json")]) == 0


@pytest.mark.parametrize("field,value,message", [
    ("dim", "abc", "dim must be an integer in [1, 65536], got 'abc'"),
    ("dim", None, "dim must be an integer in [1, 65536], got None"),
    ("dim", 32.0, "dim must be an integer"),
    ("dim", True, "dim must be an integer"),
    ("n_head", 0, "n_head must be an integer in [1, 1024], got 0"),
    ("n_layer", -2, "n_layer must be an integer"),
    ("vocab_size", -1, "vocab_size must be an integer in [2, 16777216], got -1"),
    ("n_kv_head", 0, "n_kv_head must be an integer"),
    ("num_classes", 0, "num_classes must be an integer"),
    ("block_size", 0, "block_size must be an integer"),
    ("block_size", 15, "not a square number"),
    ("cls_token_num", "1", "cls_token_num must be an integer"),
    ("multiple_of", 0, "multiple_of must be an integer"),
    ("intermediate_size", -5, "intermediate_size must be an integer"),
    ("norm_eps", "x", "norm_eps must be a finite number in (0, 1]"),
    ("norm_eps", 0, "norm_eps must be in (0, 1]"),
    ("rope_base", float("nan"), "rope_base must be a finite number"),
    ("rope_base", -1.0, "rope_base must be in (0, 1e+12]"),
    ("class_dropout_prob", 2, "class_dropout_prob must be in [0, 1]"),
    ("ffn_dim_multiplier", "big", "ffn_dim_multiplier must be a finite number"),
    ("model_type", 5, "unknown model type 5"),
    ("dim", 30, "dim 30 is not divisible by n_head 4"),
    ("n_layer", 10**9, "n_layer must be an integer in [1, 1024]"),
])
def test_bad_config_fields(files, tmp_path, capsys, field, value, message):
    root, config = files
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**config, field: value}))
    line = one_line_error(capsys, ["inspect", str(root / "c.pt"), "--config", str(path)])
    assert message in line and str(path) in line


@pytest.mark.parametrize("option,value,message", [
    ("--image-size", "0", "image size must be a positive integer"),
    ("--downsample-size", "0", "downsample size must be a positive integer"),
    ("--image-size", "100", "not a multiple of the downsample size"),
])
def test_bad_size_options(files, capsys, option, value, message):
    root, _ = files
    assert message in one_line_error(capsys, ["inspect", str(root / "c.pt"), "--model", "GPT-B", option, value])


def test_bad_hf_target_configs(files, tmp_path, capsys):
    import shutil

    root, _ = files
    for patch, message in [({"num_attention_heads": 0}, "n_head must be an integer"),
                           ({"rms_norm_eps": "abc"}, "norm_eps must be a finite number"),
                           ([1, 2], "must be a JSON object")]:
        target = tmp_path / "hf"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(root / "hf", target)
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, **patch} if isinstance(patch, dict) else patch))
        assert message in one_line_error(capsys, ["inspect", str(target)])


@pytest.mark.parametrize("patch,message", [
    ({"num_attention_heads": 0}, "drafter config field n_head must be an integer in [1, 1024], got 0"),
    ({"rms_norm_eps": "abc"}, "drafter config field norm_eps must be a finite number"),
    ({"num_hidden_layers": 2}, "num_hidden_layers is 2; a LANTERN/EAGLE-1 drafter has exactly one"),
    ({"hidden_size": "32"}, "drafter config field dim must be an integer"),
    ({"num_attention_heads": 3}, "drafter dim 32 is not divisible by its 3 heads"),
    ({"bias": "yes"}, "bias must be true or false"),
    ({"intermediate_size": None}, "intermediate_size must be an integer"),
])
def test_bad_drafter_configs(files, tmp_path, capsys, patch, message):
    import shutil

    root, _ = files
    drafter = tmp_path / "drafter"
    shutil.copytree(root / "drafter", drafter)
    config = json.loads((drafter / "config.json").read_text())
    assert config["num_hidden_layers"] == 1  # the writer says what the checkpoint holds
    (drafter / "config.json").write_text(json.dumps({**config, **patch}))
    assert message in one_line_error(capsys, ["inspect", str(drafter)])


def test_drafter_args_are_validated_in_the_api_too():
    assert llamagen.DrafterArgs(dim=32, n_head=4, n_kv_head=None, intermediate_size=96, vocab_size=64).validate()
    with pytest.raises(LanternError, match="n_head must be"):
        llamagen.DrafterArgs(dim=32, n_head=0, n_kv_head=None, intermediate_size=96, vocab_size=64).validate()
    with pytest.raises(LanternError, match="vocab_size must be"):
        llamagen.make_config("GPT-B", vocab_size=-1)


class Exploit:
    def __reduce__(self):
        import os
        return (os.system, ("true",))


def test_a_refused_pickle_names_the_global_and_gives_no_unsafe_advice(tmp_path, capsys):
    import functools

    torch.save({"model": {}, "payload": Exploit()}, tmp_path / "evil.pt")
    line = one_line_error(capsys, ["inspect", str(tmp_path / "evil.pt")])
    assert "refused to load" in line and ("posix.system" in line or "os.system" in line)
    torch.save({"model": {"x": torch.zeros(1)}, "f": functools.partial(print)}, tmp_path / "partial.pt")
    line = one_line_error(capsys, ["inspect", str(tmp_path / "partial.pt")])
    assert "functools.partial" in line and "allow" in line
