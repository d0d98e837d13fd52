import fcntl
import json
import os
import pathlib
import sys

import pytest

# Tests run on 2 cores; keep torch from oversubscribing them. Two workers with two OpenMP threads
# each are four threads on two cores: spinning threads then stall each other (a torch test took
# 56 s beside the other worker, 6 s alone), so they sleep when idle (ONNX Runtime's sessions
# already do: allow_spinning=0). Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.dont_write_bytecode = True

# The files that take longest, in the order the workers should start them (pyproject: --dist
# loadfile --no-loadscope-reorder, so a worker takes whole files in this order and then the rest in
# collection order). Longest first (measured with --durations), so no long file starts last while
# the other core idles; the demo engine's first user and the other session engines' first user
# lead on different workers, so neither waits for the other's build.
LONGEST_FIRST = ["test_demo_command.py", "test_inplace_engines.py", "test_generator.py", "test_reliability.py",
                 "test_tensorrt_build.py", "test_export.py", "test_quantize.py", "test_serve.py", "test_serve_hardening.py",
                 "test_tune.py", "test_demo_embed.py", "test_references.py",
                 "test_real_size.py", "test_fuzz.py", "test_vq.py", "test_fused_forms.py", "test_placement.py",
                 "test_polygraphy.py", "test_image_service.py", "test_chameleon_engine.py",
                 "test_serve_cli.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


def built_once(tmp_path_factory, name, build):
    """A session fixture's directory, built once for the whole run: with pytest-xdist every worker
    is its own session, so the first to get here builds under a lock in the run's shared temporary
    directory and the others reuse what it built (read-only use: tests copy what they change).
    $LANTERN_TEST_ENGINES names a folder that keeps them across runs instead: the mutation check
    sets it for mutants of code the engines are not built with."""
    keep = os.environ.get("LANTERN_TEST_ENGINES")  # a folder kept across runs (tests/mutation_check.py)
    if os.environ.get("PYTEST_XDIST_WORKER") is None and not keep:
        return build(tmp_path_factory.mktemp(name))
    shared = (pathlib.Path(keep) if keep else tmp_path_factory.getbasetemp().parent) / f"shared-{name}"
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / "done.json"
        if not done.exists():
            (shared / "build").mkdir(parents=True, exist_ok=True)
            result = build(shared / "build")
            paths = result if isinstance(result, dict) else {"": result}
            done.write_text(json.dumps({"paths": {k: os.path.relpath(v, shared) for k, v in paths.items()},
                                        "path_type": isinstance(next(iter(paths.values())), pathlib.Path)}))
        record = json.loads(done.read_text())
        paths = {k: str(shared / v) for k, v in record["paths"].items()}  # str, as the builders return
        if record["path_type"]:
            paths = {k: pathlib.Path(v) for k, v in paths.items()}
        return paths[""] if "" in paths else paths


@pytest.fixture(scope="session", autouse=True)
def graph_cache(tmp_path_factory):
    """One graph cache for the run (`lantern-export onnx --graph-cache`, whose default is
    $LANTERN_GRAPH_CACHE), shared by the workers: a graph many tests export from the same
    weights (the tiny VQ decoders, the condition graphs, test_export's re-exports) is traced once
    per run. Exports that call export_engine themselves, or whose exporter a test replaces, trace
    as before."""
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "graph-cache"
    before = os.environ.get("LANTERN_GRAPH_CACHE")
    os.environ["LANTERN_GRAPH_CACHE"] = str(cache)
    yield cache
    if before is None:
        os.environ.pop("LANTERN_GRAPH_CACHE", None)
    else:
        os.environ["LANTERN_GRAPH_CACHE"] = before


@pytest.fixture(scope="session")
def c2i_engine(tmp_path_factory):
    """A tiny class-conditional engine (mc_sim_7b_63 tree), exported through the real CLI."""
    from engines import build_engine

    return built_once(tmp_path_factory, "c2i", lambda root: build_engine(root, "c2i"))


@pytest.fixture(scope="session")
def t2i_engine(tmp_path_factory):
    """A tiny text-conditional engine (naive_extend_57 tree)."""
    from engines import build_engine

    return built_once(tmp_path_factory, "t2i", lambda root: build_engine(root, "t2i", tree="naive_extend_57"))


@pytest.fixture(scope="session")
def fp16_engine(tmp_path_factory):
    """c2i checkpoints exported in fp16 without a VQ decoder (the other session engines are fp32):
    test_export's fp16 check and test_tensorrt_build's fp16 plans. Near-uniform weights (not the
    peaked ones): these tests hold fp16 numerics to check's fp16 tolerance, which is set for a
    trained model's activations; the peaked models' drafter hidden states reach ~20, where fp16's
    rounding alone moves its top-k probabilities by 0.027 (the bound is 0.011)."""
    from engines import build_engine

    return built_once(tmp_path_factory, "c2i-fp16-novq",
                      lambda root: build_engine(root, "c2i", with_vq=False, extra=["--dtype", "fp16"], peaked=False))


@pytest.fixture(scope="session")
def chameleon_engines(tmp_path_factory):
    """Tiny Anole and Lumina-mGPT engines ({family: directory}), exported through the real CLI."""
    from engines import build_chameleon_engines

    return built_once(tmp_path_factory, "chameleon-engines", build_chameleon_engines)


@pytest.fixture(scope="session")
def demo_engine(tmp_path_factory):
    """The README's main command, `lantern-export demo`, run once per session: its engine directory
    (the shipped demo model exported, checked and run) serves every test that needs a real engine
    with a drafter, a neighbor table and a VQ decoder."""
    from lantern.tools import export_cli

    def build(root):
        out = root / "engine"
        assert export_cli.main(["demo", "--out", str(out), "--per-class", "1", "--threads", "1"]) == 0
        return out

    return built_once(tmp_path_factory, "demo", build)
