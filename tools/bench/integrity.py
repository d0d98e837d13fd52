"""What checking an engine's content hashes costs before serving (first open, later opens); JSON.

    python -m lantern.tools.bench.integrity engines/demo
    python -m lantern.tools.bench.integrity /tmp/xl --make gpt-xl   # random files of GPT-XL's sizes

first_open_cold: no remembered digests and the files evicted from the page cache (as after a
reboot or a fresh copy); first_open_warm: no remembered digests, files in the page cache (just
written or read); later_open: the digests remembered (lantern.runtime.integrity). `--make
gpt-xl` writes random bytes in the file sizes of a fp32 GPT-XL engine (schema 2: the target with
its embeddings, the drafter with the target's head, the class table, the VQ decoder, a k = 1000
neighbor table), sized from the models' parameter counts, and a manifest-style files record.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from lantern.runtime.integrity import HashCache, sha256_file, verify_files


def gpt_xl_sizes():
    """File sizes of a fp32 GPT-XL c2i engine, from the parameter counts (meta tensors, no memory)."""
    import torch

    from lantern.export import llamagen, vq

    args = llamagen.make_config("GPT-XL")
    with torch.device("meta"):
        target = llamagen.Transformer(args)
        drafter = llamagen.Drafter(llamagen.DrafterArgs.for_target(args))
        tokenizer = vq.VQModel(vq.VQConfig())

    def nbytes(module, prefixes=("",)):
        return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if n.startswith(prefixes))

    table = nbytes(target, ("cls_embedding",))
    head = target.output.weight.numel() * 4
    return {
        "target.onnx": 1 << 20, "target.onnx.data": nbytes(target) - table,
        "condition.onnx": table + 4096,
        "drafter.onnx": 1 << 18, "drafter.onnx.data": nbytes(drafter) + head,
        "vq_decoder.onnx": 1 << 18,
        "vq_decoder.onnx.data": nbytes(tokenizer, ("decoder", "post_quant_conv", "quantize")),
        "neighbors.npy": 128 + args.vocab_size * 1000 * 2,
    }


def make_files(directory, sizes, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    files = {}
    for name, size in sizes.items():
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(left, 64 << 20)
                f.write(rng.bytes(n))
                left -= n
        files[name] = {"size": size, "sha256": sha256_file(path)}
    with open(os.path.join(directory, "files.json"), "w") as f:
        json.dump(files, f, indent=1)
    return files


def evict(directory, names):
    """Drop the files' pages from the page cache (clean pages; no root needed)."""
    for name in names:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", help="engine directory (its manifest's files), or where --make writes")
    p.add_argument("--make", choices=["gpt-xl"], help="first write random files of this engine's sizes")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    if args.make:
        files = make_files(args.directory, gpt_xl_sizes())
    elif os.path.isfile(os.path.join(args.directory, "manifest.json")):
        with open(os.path.join(args.directory, "manifest.json")) as f:
            files = json.load(f)["files"]
    else:
        with open(os.path.join(args.directory, "files.json")) as f:
            files = json.load(f)
    total = sum(e["size"] for e in files.values())
    with tempfile.TemporaryDirectory() as tmp:
        cold, warm, later = [], [], []
        for i in range(args.repeats):
            cache = os.path.join(tmp, f"cold{i}.json")
            evict(args.directory, files)
            cold.append(timed(lambda: verify_files(args.directory, files, cache=cache)))
            cache = os.path.join(tmp, f"warm{i}.json")
            warm.append(timed(lambda: verify_files(args.directory, files, cache=cache)))
            later.append(timed(lambda: verify_files(args.directory, files, cache=cache)))
        assert len(HashCache(cache).entries) == len(files)
    result = {
        "directory": os.path.abspath(args.directory), "files": len(files), "bytes": total,
        "first_open_cold_s": statistics.median(cold), "first_open_warm_s": statistics.median(warm),
        "later_open_s": statistics.median(later),
        "hash_throughput_warm_GBps": total / statistics.median(warm) / 1e9,
        "repeats": args.repeats,
        "note": "medians; shared 2-core machine; cold = pages evicted with posix_fadvise(DONTNEED)",
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
