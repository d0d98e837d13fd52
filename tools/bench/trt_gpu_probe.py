"""GPU probe for the TensorRT build side: does this GPU run TensorRT(-RTX) plans, does a plan read
back what was built (`plan_io`), and does the fused cache-update + attention step compute what
the numpy reference does, with the cache updated in place? Prints JSON. Needs a GPU, torch with
CUDA (for device buffers only) and the flavor's wheel.

    python -m lantern.tools.bench.trt_gpu_probe [--flavor tensorrt-rtx] [--compute-capability current 89]

Prepared on a CPU-only machine and not yet run on a GPU: read its output, not its assumptions.
TensorRT-RTX 1.7 targets SM75/80/86/89/120/121 only, so on a Hopper GPU (SM90: H100, H200) the
expected answer is a one-line error per target, which is itself the fact to record.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np
from lantern.export import tensorrt_build as tb


def _reference(q, k, v, cache_k, cache_v, write_index, mask):
    q, k, v, ck, cv = (np.asarray(t, dtype=np.float64) for t in (q, k, v, cache_k, cache_v))
    ck, cv = ck.copy(), cv.copy()
    T = k.shape[2]
    for b, w in enumerate(write_index):
        ck[b, :, w:w + T], cv[b, :, w:w + T] = k[b], v[b]
    group = q.shape[1] // k.shape[1]
    kv_head = np.arange(q.shape[1]) // group
    scores = q @ ck[:, kv_head].transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    scores = np.where(mask, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return probs @ cv[:, kv_head], ck, cv


def run_step(trt, plan, feeds, alias_cache):
    """Run the in-place step plan once on device buffers; the presents bound to the caches'
    memory when alias_cache. Returns host copies of out, cache_k, cache_v and the presents."""
    import torch

    runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise RuntimeError("deserialize_cuda_engine returned None")
    context = engine.create_execution_context()
    device = {n: torch.from_numpy(a).cuda() for n, a in feeds.items()}
    for name, tensor in device.items():
        context.set_input_shape(name, tuple(tensor.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    out = torch.empty(feeds["q"].shape, dtype=torch.float16, device="cuda")
    context.set_tensor_address("out", out.data_ptr())
    presents = {}
    for cache, present in (("cache_k", "present_k"), ("cache_v", "present_v")):
        presents[present] = device[cache] if alias_cache else torch.empty_like(device[cache])
        context.set_tensor_address(present, presents[present].data_ptr())
    stream = torch.cuda.current_stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("execute_async_v3 returned False")
    stream.synchronize()
    return {"out": out.cpu().numpy(), "cache_k": device["cache_k"].cpu().numpy(),
            "present_k": presents["present_k"].cpu().numpy()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="tensorrt-rtx")
    parser.add_argument("--compute-capability", nargs="+", default=["current", "89", "120"])
    args = parser.parse_args(argv)

    import torch

    from lantern.export import cache_forms as ff

    result = {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
              "flavor": args.flavor}
    trt = tb.load_tensorrt(args.flavor)
    result["tensorrt_version"] = trt.__version__
    B, H, Hkv, T, P, hd = 2, 4, 2, 3, 12, 64
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((B, H, T, hd)), "k": rng.standard_normal((B, Hkv, T, hd)),
             "v": rng.standard_normal((B, Hkv, T, hd)), "cache_k": rng.standard_normal((B, Hkv, P, hd)),
             "cache_v": rng.standard_normal((B, Hkv, P, hd))}
    feeds = {n: a.astype(np.float16) for n, a in feeds.items()}
    feeds["write_index"] = np.array([5, 2], dtype=np.int64)
    mask = np.zeros((B, 1, T, P), dtype=bool)
    for b, w in enumerate(feeds["write_index"]):
        mask[b, :, :, :w] = True
        mask[b, :, :, w:w + T] = np.tril(np.ones((T, T), dtype=bool))
    feeds["mask"] = mask
    want_out, want_k, _ = _reference(**feeds)
    names = ["q", "k", "v", "cache_k", "cache_v", "write_index", "mask"]
    with tempfile.TemporaryDirectory() as tmp:
        path = ff.export(ff.AttentionStep(), [torch.from_numpy(feeds[n]) for n in names], os.path.join(tmp, "step.onnx"),
                         names, ["out", "present_k", "present_v"],
                         [{0: "B", 2: "T"}] * 3 + [{0: "B"}] * 3 + [{0: "B", 2: "T"}])
        profile = [tb.exact_profile({n: feeds[n].shape for n in names})]
        for cc in args.compute_capability:
            entry = result.setdefault("targets", {}).setdefault(str(cc), {})
            try:
                plan, record = tb.build_plan(path, profile, flavor=args.flavor,
                                             compute_capabilities=None if args.flavor == "tensorrt" else [cc])
                entry["plan_bytes"] = record["plan_bytes"]
                entry["fused_layers"] = record["fused_layers"]
                io = tb.plan_io(plan, flavor=args.flavor)
                entry["plan_io_matches_record"] = all(
                    io["inputs"][n]["dtype"] == record["io"]["inputs"][n]["dtype"]
                    and io["inputs"][n]["profiles"] == [[list(feeds[n].shape)] * 3] for n in names)
                for alias in (True, False):
                    got = run_step(trt, plan, {n: feeds[n] for n in names}, alias)
                    key = "aliased" if alias else "separate"
                    entry[f"{key}_out_max_abs_err"] = float(np.abs(got["out"].astype(np.float64) - want_out).max())
                    entry[f"{key}_present_exact"] = bool(np.array_equal(got["present_k"].astype(np.float64), want_k))
                    entry[f"{key}_cache_input_changed"] = not np.array_equal(got["cache_k"], feeds["cache_k"])
            except Exception as e:  # the probe records every failure and goes on
                entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:600]
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
