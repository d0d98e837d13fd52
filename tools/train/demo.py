"""Build the trained demo model end to end: data -> VQ -> classifier -> target -> drafter -> card.

    python -m lantern.tools.train.demo --out export/demo_model

Writes into --out: vq.pt (LlamaGen VQ format), gpt.pt + gpt_config.json (LlamaGen .pt; the config
file is needed because the size is no released one), drafter/ (config.json + model.safetensors),
classifier.safetensors + classifier.json, metrics.json, MODEL_CARD.md and samples/*.png. Every
artefact is loaded back through the real loaders before the card is written. Deterministic from
--seed (on the same machine and torch build). `load_demo(directory)` loads everything.
"""
import argparse
import json
import os
import subprocess
import time

import torch

from lantern.export.checkpoints import load_drafter, save_drafter
from lantern.export.llamagen import count_parameters, ModelArgs
from lantern.export.vq import load_vq, save_vq
from lantern.runtime.png import image_grid, to_uint8, write_png
from lantern.tools.demo import DEMO_DIR
from lantern.tools.train import data as demo_data
from lantern.tools.train.classifier import accuracy, load_classifier, save_classifier, train_classifier
from lantern.tools.train.drafter import collect_generations, evaluate_drafter, train_drafter
from lantern.tools.train.target import demo_gpt_args, evaluate_target, load_demo_target, save_target, train_target
from lantern.tools.train.vq import demo_vq_config, encode_images, evaluate_vq, train_vq

CFG_SCALE = 3.0


def load_demo(directory=DEMO_DIR):
    """The shipped demo through the real loaders -> dict(vq, target, drafter, classifier)."""
    vq, _ = load_vq(os.path.join(directory, "vq.pt"))
    target, _ = load_demo_target(os.path.join(directory, "gpt.pt"))
    drafter, _ = load_drafter(os.path.join(directory, "drafter"), target.args)
    classifier = load_classifier(os.path.join(directory, "classifier.safetensors"))
    return {"vq": vq, "target": target, "drafter": drafter, "classifier": classifier}


def _tiles(images, zoom=3):
    return [to_uint8(im.numpy(), layout="chw").repeat(zoom, 0).repeat(zoom, 1) for im in images]


def _size_mb(path):
    if os.path.isdir(path):
        return sum(_size_mb(os.path.join(path, f)) for f in os.listdir(path))
    return os.path.getsize(path) / 2**20


def _git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def run(out, *, seed=0, train_images=30000, vq_steps=1000, target_steps=1500, drafter_generations=2048,
        drafter_steps=1500, classifier_steps=2000, reuse=(), log=print):
    os.makedirs(os.path.join(out, "samples"), exist_ok=True)
    timings, metrics = {}, {"seed": seed, "cfg_scale": CFG_SCALE, "torch": torch.__version__,
                            "threads": torch.get_num_threads(), "git_commit": _git_commit()}
    t0 = clock = time.time()

    def stage(name):
        nonlocal clock
        timings[name] = round(time.time() - clock, 1)
        log(f"== {name} done in {timings[name]:.0f} s (total {time.time() - t0:.0f} s)")
        clock = time.time()

    # 1. Data
    images, labels = demo_data.make_dataset(train_images, seed=seed)
    held_images, held_labels = demo_data.make_dataset(1500, seed=seed + 1000)
    x, y = demo_data.to_tensor(images), torch.from_numpy(labels)
    hx, hy = demo_data.to_tensor(held_images), torch.from_numpy(held_labels)
    metrics["data"] = {"train_images": train_images, "held_out_images": len(hx), "classes": demo_data.NUM_CLASSES,
                       "image_size": demo_data.IMAGE_SIZE, "class_names": list(demo_data.CLASS_NAMES)}
    stage("data")

    # 2. VQ tokenizer
    vq_path = os.path.join(out, "vq.pt")
    if "vq" in reuse:
        vq, _ = load_vq(vq_path)
        metrics["vq"] = _previous(out, "vq")
    else:
        vq, summary = train_vq(x, demo_vq_config(), steps=vq_steps, seed=seed, log=log)
        save_vq(vq, vq_path)
        metrics["vq"] = summary
    vq, info = load_vq(vq_path)
    metrics["vq"].update(evaluate_vq(vq, hx), parameters=info["parameters"], config=info["config"])
    log(f"vq: {metrics['vq']}")
    stage("vq")

    # 3. Classifier (real images only)
    cls_path = os.path.join(out, "classifier.safetensors")
    if "classifier" in reuse:
        metrics["classifier"] = _previous(out, "classifier")
    else:
        classifier, summary = train_classifier(x, y, demo_data.NUM_CLASSES, steps=classifier_steps, seed=seed, log=log)
        save_classifier(classifier, cls_path, demo_data.CLASS_NAMES)
        metrics["classifier"] = summary
    classifier = load_classifier(cls_path)
    with torch.no_grad():
        recon = torch.cat([vq.decode_codes(vq.encode(hx[i:i + 250])).clamp(-1, 1) for i in range(0, len(hx), 250)])
    metrics["classifier"].update(held_out_accuracy=accuracy(classifier, hx, hy),
                                 vq_reconstruction_accuracy=accuracy(classifier, recon, hy))
    log(f"classifier: {metrics['classifier']}")
    stage("classifier")

    # 4. Target
    gpt_path = os.path.join(out, "gpt.pt")
    grid = demo_data.IMAGE_SIZE // vq.config.downsample
    if "gpt" in reuse:
        metrics["target"] = _previous(out, "target")
    else:
        codes = encode_images(vq, x).flatten(1)
        args = demo_gpt_args(vq.config.codebook_size, demo_data.NUM_CLASSES, grid=grid)
        target, summary = train_target(codes, y, args, steps=target_steps, seed=seed, log=log)
        save_target(target, gpt_path, demo_data.IMAGE_SIZE, vq.config.downsample)
        metrics["target"] = summary
    target, info = load_demo_target(gpt_path)
    held_codes = encode_images(vq, hx).flatten(1)
    # Held-out generations (20 per class, classes interleaved): class accuracy, sample grid, and
    # the drafter's held-out set below.
    held_out = collect_generations(target, 20 * demo_data.NUM_CLASSES, cfg_scale=CFG_SCALE, seed=seed + 10_000)
    gen_labels = held_out["labels"]
    with torch.no_grad():
        gen_images = vq.decode_codes(held_out["tokens"].view(-1, grid, grid)).clamp(-1, 1)
    metrics["target"].update(held_out_loss=evaluate_target(target, held_codes, hy), config=info["config"],
                             generation_class_accuracy=accuracy(classifier, gen_images, gen_labels),
                             generation_settings={"cfg_scale": CFG_SCALE, "temperature": 1.0, "top_k": 0})
    log(f"target: {metrics['target']}")
    stage("target")

    # 5. Drafter
    drafter_dir = os.path.join(out, "drafter")
    if "drafter" in reuse:
        metrics["drafter"] = _previous(out, "drafter")
    else:
        data = collect_generations(target, drafter_generations, cfg_scale=CFG_SCALE, seed=seed + 2)
        drafter, summary = train_drafter(target, data, steps=drafter_steps, seed=seed, log=log)
        del data
        save_drafter(drafter, drafter_dir, fmt="safetensors")
        metrics["drafter"] = dict(summary, generations=drafter_generations)
    drafter, _ = load_drafter(drafter_dir, target.args)
    metrics["drafter"]["agreement"] = evaluate_drafter(drafter, target, held_out, CFG_SCALE)
    log(f"drafter: {metrics['drafter']}")
    stage("drafter")

    # 6. Sample grids (rows = classes)
    per = 10
    real = [hx[hy == c][:per] for c in range(demo_data.NUM_CLASSES)]
    write_png(os.path.join(out, "samples", "dataset.png"), image_grid(_tiles(torch.cat(real)), ncols=per))
    pairs = torch.stack([hx[:60], recon[:60]], dim=1).flatten(0, 1)
    write_png(os.path.join(out, "samples", "reconstructions.png"), image_grid(_tiles(pairs), ncols=20))
    generated = torch.cat([gen_images[gen_labels == c][:per] for c in range(demo_data.NUM_CLASSES)])
    write_png(os.path.join(out, "samples", f"generations_cfg{CFG_SCALE:g}.png"), image_grid(_tiles(generated), ncols=per))
    stage("samples")

    if reuse:  # a reused stage keeps the training time of the run that trained it
        previous = _previous(out, "timings_seconds")
        stage_of = {"vq": "vq", "classifier": "classifier", "gpt": "target", "drafter": "drafter"}
        timings.update({stage_of[r]: previous[stage_of[r]] for r in reuse})
        metrics["reused_stages"] = list(reuse)
    timings["total"] = round(sum(timings.values()), 1)
    metrics["timings_seconds"] = timings
    metrics["sizes_mb"] = {name: round(_size_mb(os.path.join(out, name)), 3) for name in
                           ("vq.pt", "gpt.pt", "gpt_config.json", "drafter", "classifier.safetensors", "classifier.json")}
    metrics["sizes_mb"]["total"] = round(sum(metrics["sizes_mb"].values()), 3)
    metrics["parameters"] = {"vq": metrics["vq"]["parameters"], "target": count_parameters(target),
                             "drafter": count_parameters(drafter),
                             "drafter_trainable": count_parameters(drafter) - drafter.embed_tokens.weight.numel(),
                             "classifier": sum(p.numel() for p in classifier.parameters())}
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    write_model_card(out, metrics)
    log(f"done in {timings['total']:.0f} s; metrics in {os.path.join(out, 'metrics.json')}")
    return metrics


def _previous(out, key):
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)[key]


def write_model_card(out, m):
    vq, tg, dr, cl, t = m["vq"], m["target"], m["drafter"], m["classifier"], m["timings_seconds"]
    vc, gc, ag = vq["config"], tg["config"], dr["agreement"]
    card = f"""# LANTERN demo model (procedural shapes, 32x32)

A complete, small, *trained* LlamaGen-style stack for demos, tests and quality checks of the
LANTERN++ toolchain on a CPU: a VQ tokenizer, a class-conditional GPT target, its EAGLE-1 /
LANTERN drafter and a classifier for quality metrics. Everything is generated from seed
{m['seed']}; nothing was downloaded. Built by `python -m lantern.tools.train.demo --out export/demo_model`
(torch {m['torch']}, {m['threads']} CPU thread(s); repository HEAD {m['git_commit']} when it ran).

## Data

{m['data']['classes']} classes = 5 shapes (circle, square, triangle, cross, ring) x 3 colours (red, green,
blue), drawn by `lantern.tools.train.data.make_dataset(n, seed)`: {m['data']['image_size']}x{m['data']['image_size']} RGB, jittered
position, size, rotation and hue, on a desaturated background with a random gradient, blotchy
low-frequency noise and pixel grain. Class id = shape * 3 + colour; names in `classifier.json`.
Training images: {m['data']['train_images']} (seed {m['seed']}); held-out: {m['data']['held_out_images']} (seed {m['seed'] + 1000}).

## Files

| file | what | loader | size |
|---|---|---|---|
| `vq.pt` | VQ tokenizer, LlamaGen VQ format `{{'model': state_dict}}` | `lantern.export.vq.load_vq` | {m['sizes_mb']['vq.pt']:.2f} MB |
| `gpt.pt` + `gpt_config.json` | target, LlamaGen `.pt` (`model`, `steps`, `args` Namespace) + ModelArgs | `load_target(gpt.pt, config_file=gpt_config.json)` | {m['sizes_mb']['gpt.pt']:.2f} MB |
| `drafter/` | drafter, LANTERN layout (config.json + model.safetensors) | `lantern.export.checkpoints.load_drafter` | {m['sizes_mb']['drafter']:.2f} MB |
| `classifier.safetensors` + `.json` | CNN classifier | `lantern.tools.train.classifier.load_classifier` | {m['sizes_mb']['classifier.safetensors']:.2f} MB |
| `metrics.json` | every number on this card | | |
| `samples/*.png` | dataset, VQ reconstructions (real / reconstructed pairs), target generations (CFG {m['cfg_scale']:g}); rows are classes | | |

Total: {m['sizes_mb']['total']:.1f} MB. `lantern.tools.train.demo.load_demo()` loads all four models.

## Models

- **VQ tokenizer** (LlamaGen VQ architecture, scaled down): codebook {vc['codebook_size']} x {vc['codebook_embed_dim']}, L2-normalised codes,
  ch {vc['ch']}, ch_mult {vc['encoder_ch_mult']}, z_channels {vc['z_channels']}, {vc['num_res_blocks']} res block per level -> {2 ** (len(vc['encoder_ch_mult']) - 1)}x
  downsampling, an 8x8 = 64-token grid per image. {m['parameters']['vq']:,} parameters. Trained {vq['steps']} steps x
  batch {vq['batch_size']} (Adam, lr {vq['lr']}, cosine) on L2 reconstruction + codebook loss + 0.25 commitment
  (straight-through), restarting dead codes every 100 steps ({vq['codes_restarted']} restarts in all).
  Final train losses: recon {vq['final_losses']['recon']:.4f}, codebook {vq['final_losses']['codebook']:.4f}, commit {vq['final_losses']['commit']:.4f}.
  Held-out: MSE {vq['mse']:.4f} (PSNR {vq['psnr_db']:.1f} dB on [-1, 1]), {vq['codes_used']}/{vc['codebook_size']} codes used, perplexity {vq['perplexity']:.0f}.
- **Target** (LlamaGen GPT, c2i): dim {gc['dim']}, {gc['n_layer']} layers, {gc['n_head']} heads, FFN {_ffn(gc)}, vocab {gc['vocab_size']},
  {gc['num_classes']} classes + null class (class dropout {gc['class_dropout_prob']}), 1 class token + {gc['block_size']} image tokens.
  {m['parameters']['target']:,} parameters. Trained {tg['steps']} steps x batch {tg['batch_size']} (AdamW, lr {tg['lr']}, betas (0.9, 0.95),
  wd 0.05, cosine, clip 1.0) with next-token cross-entropy and 10% label dropout to the null class.
  Final train loss {tg['final_train_loss']:.3f} nats/token; held-out loss {tg['held_out_loss']:.3f}.
  Samples with CFG {m['cfg_scale']:g}, temperature 1, no top-k: the classifier gives {100 * tg['generation_class_accuracy']:.1f}% of them the
  class they were conditioned on.
- **Drafter** (EAGLE-1 / LANTERN, one layer, no input norm, no final norm, target's output head):
  {m['parameters']['drafter']:,} parameters ({m['parameters']['drafter_trainable']:,} trained; the token embedding is a frozen copy of the
  target's). Self-distilled on {dr['generations']} target generations (CFG {m['cfg_scale']:g}, temperature 1), both CFG halves:
  soft cross-entropy to the target's next-token distribution through the frozen head + smooth-L1
  regression of the next hidden state; {dr['steps']} steps x batch {dr['batch_size']}. Final losses: distill
  {dr['final_losses']['distill']:.3f}, hidden {dr['final_losses']['hidden']:.3f}.
  Held-out target generations ({ag['positions']} positions): top-1 agreement with the target's greedy
  choice {100 * ag['top1_cfg']:.1f}% on CFG-combined logits ({100 * ag['top1_cond']:.1f}% conditional half, {100 * ag['top1_uncond']:.1f}% unconditional half;
  chance {100 * ag['chance']:.2f}%), target's choice in the drafter's top-5 {100 * ag['top5_cfg']:.1f}%, drafter top-1 = the token the
  target actually sampled {100 * ag['top1_matches_sampled']:.1f}%.
- **Classifier** (`Classifier`: conv 32-32-pool, 64-64-pool, 128, global mean, fc 128 = `features()`,
  fc {m['data']['classes']} = logits; input [B, 3, H, W] in [-1, 1]): {m['parameters']['classifier']:,} parameters, trained
  {cl['steps']} steps x batch {cl['batch_size']} on real images (light blur and noise augmentation). Held-out accuracy
  {100 * cl['held_out_accuracy']:.1f}% on real images, {100 * cl['vq_reconstruction_accuracy']:.1f}% on their VQ reconstructions.

## Training time

{', '.join(f'{k} {v:.0f} s' for k, v in t.items() if k != 'total')}; total {t['total'] / 60:.1f} min wall clock with
{m['threads']} torch thread(s) on a 2-core machine shared with other jobs (one thread is much faster
than two there: two threads that are descheduled in turn make every step wait).
{_reused_note(m)}
## Retraining

```
python -m lantern.tools.train.demo --out export/demo_model [--seed 0]
```
Stages can be reused from an earlier run with `--reuse vq,classifier,gpt,drafter` (their metrics
come from the old metrics.json). Results are deterministic for a seed on one machine and torch
build; other builds give slightly different weights. Limitations: a toy domain, not a benchmark;
32x32 images; the target is small and its samples are rougher than the data.
"""
    with open(os.path.join(out, "MODEL_CARD.md"), "w") as f:
        f.write(card)


def _reused_note(m):
    if not m.get("reused_stages"):
        return ""
    return (f"The {', '.join(m['reused_stages'])} stage(s) were reused (`--reuse`) from an earlier run of the same "
            "code; their times and training numbers are that run's.\n")


def _ffn(config):
    return ModelArgs(**config).ffn_hidden


def main():
    p = argparse.ArgumentParser(description="Train the whole demo model (VQ, target, drafter, classifier).")
    p.add_argument("--out", default=DEMO_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 is fastest on a shared 2-core machine")
    p.add_argument("--train-images", type=int, default=30000)
    p.add_argument("--vq-steps", type=int, default=1000)
    p.add_argument("--target-steps", type=int, default=1500)
    p.add_argument("--drafter-generations", type=int, default=2048)
    p.add_argument("--drafter-steps", type=int, default=1500)
    p.add_argument("--classifier-steps", type=int, default=2000)
    p.add_argument("--reuse", default="", help="comma-separated stages to load from --out instead of training: "
                                               "vq,classifier,gpt,drafter")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    run(a.out, seed=a.seed, train_images=a.train_images, vq_steps=a.vq_steps, target_steps=a.target_steps,
        drafter_generations=a.drafter_generations, drafter_steps=a.drafter_steps,
        classifier_steps=a.classifier_steps, reuse=_stages(a.reuse))


def _stages(text):
    stages = [s for s in text.split(",") if s]
    unknown = sorted(set(stages) - {"vq", "classifier", "gpt", "drafter"})
    if unknown:
        raise SystemExit(f"train_demo: unknown stage(s) {unknown} in --reuse; valid: vq, classifier, gpt, drafter")
    return stages


if __name__ == "__main__":
    main()
