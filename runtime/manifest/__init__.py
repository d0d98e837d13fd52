"""The engine directory format: the typed manifest that `lantern-export` writes and the runtime reads.

engines/NAME/
  manifest.json     this format (SCHEMA_VERSION), written last
  condition.onnx    class ids / caption -> condition embeddings (LlamaGen)
  target.onnx       the AR target: prefill, one-token steps and tree verification in one graph
  drafter.onnx      the drafter with CFG, filters and top-K in the graph (absent: `ar` only)
  commit.onnx       in-place engines: moves the accepted path's K/V inside the target's cache
  vq_decoder.onnx   code grid -> RGB in [-1, 1] (optional)
  neighbors.npy     latent neighbors [codes, k] of every code, nearest first (optional)
  *.onnx.data       external weights of a graph
  accept/*.onnx     older engines only: acceptance-only graphs (`Manifest.acceptance`, legacy: read
                    and verified, never written or run; the step graphs hold acceptance)
  step/TREE-HASH/*.onnx  the step graphs per draft tree and AR (`Manifest.step_graphs`, a
                    STEP_VERSION each; optional: a tree without them runs the host step)
  step/jacobiW-INIT/*.onnx  the step graphs of a Jacobi window of W slots and fresh drafts INIT
                    (`Manifest.window_graphs`; optional, `lantern-export accept --window W`)
  plans/KEY/*.plan  TensorRT plans built from the graphs by `lantern-export trt` (optional;
                    KEY = flavor and compute capabilities, e.g. tensorrt-rtx-SM89)

`Manifest` is the only way into a manifest: export builds one and writes it with `write`, the
runtime reads it with `read_manifest`, which validates every field (types, ranges, the graphs'
files, the modes the engine can serve) and refuses unknown fields and other schema versions with
a line that says to re-export. Nothing else in the code base reads manifest keys.

Every file is listed in `files` with its size and sha256: sizes are checked on every open,
hashes when asked (`read_manifest(..., verify=True)`, `lantern-export check`).

`tuned_trees` (optional) records the draft trees `lantern-run tune` chose on this engine:
{settings key: TunedSettings}. The key (`GenerationSettings.key`) names the generation settings that
change acceptance: the mode and its relaxation (lam or delta, k), greedy or sampling with its
temperature/top-k/top-p, and the CFG scale and interval (CFG on or off also changes the rows
every call carries). Each entry holds one TunedTree per batch size tuned for (latency depends
on the batch, acceptance does not) and names the backend the latency was measured on:
`Engine.generate` uses an entry only on that backend, with the tree of the tuned batch nearest
the request's image count, unless a tree is given. A TunedTree with no file means "no drafting"
(AR was predicted fastest for those settings on that machine).

The package along its seams: schema.py (how a record field is read and written), records.py (the
records), checks.py (what they must agree on), io.py (reading the file, the files it lists).
"""
from lantern.runtime.manifest.io import check_files, describe_files, read_manifest
from lantern.runtime.manifest.records import (GRAPH_FILES, QUANTIZABLE, SCHEMA_VERSION, AcceptanceGraphs,
                                              CacheBudget, Condition, FileRecord, Graph, Image, Manifest, Neighbors,
                                              PlanFile, PlanProfile, Quantization, Shape, StepGraphs, TensorRTPlans,
                                              TensorSpec, TunedSettings, TunedTree, Vocabulary, WindowGraphs,
                                              quantization_scheme, window_name)

__all__ = ["AcceptanceGraphs", "CacheBudget", "Condition", "FileRecord", "GRAPH_FILES", "Graph", "Image",
           "Manifest", "Neighbors", "PlanFile", "PlanProfile", "QUANTIZABLE", "Quantization", "SCHEMA_VERSION", "Shape",
           "StepGraphs", "TensorRTPlans", "TensorSpec", "TunedSettings", "TunedTree", "Vocabulary", "WindowGraphs",
           "check_files", "describe_files", "quantization_scheme", "read_manifest", "window_name"]
