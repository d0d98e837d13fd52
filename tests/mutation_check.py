"""Mutation check: does the suite catch the slips a step rewrite could make?

Each mutant is a one-line change to the source (an exact text that must occur once in its file,
and its replacement). For every mutant the script copies the repository to a temporary directory,
applies the change there, and runs the tests named for it against the copy (the copy's own
`lantern` package comes first on PYTHONPATH, ahead of the editable install). A mutant is killed
when a test fails. Before any mutant, the same tests run on the unchanged copy and must pass, so a
kill means the change was caught, not that the test was already red.

    python tests/mutation_check.py                  # every mutant (about 10-20 minutes on 2 cores)
    python tests/mutation_check.py --only gen-verify-positions,cfg-interval-host
    python tests/mutation_check.py --list
    python tests/mutation_check.py --json out.json

Prints one line per mutant and a JSON summary; exits 1 if a mutant survived.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"export": "export", "runtime": "runtime", "tools": "tools"}  # lantern.<name> -> folder

CFG_TEST = "tests/test_generator.py::test_cfg_interval_switches_to_conditional_logits_at_its_index"
REFERENCES_DEVICE = ["tests/test_references.py::test_greedy_tokens_of_every_mode_match_a_full_forward[c2i-device]",
                     "tests/test_references.py::test_drafts_match_a_full_drafter_forward[c2i-device]"]

# (name, file, text, replacement, tests): `text` must occur exactly once in `file`.
MUTANTS = [
    # Positions: the slips a step rewrite is most likely to make.
    ("gen-verify-positions", "runtime/decoding.py",
     "self.positions(cache.length[:, None] + tree.depths[None, :])",
     "self.positions(cache.length[:, None] + 1 + tree.depths[None, :])",
     ["tests/test_references.py"]),
    ("gen-draft0-positions", "runtime/proposers.py",
     "first = d.plan.target_cache.length - counts[d.image_of_row] + 1",
     "first = d.plan.target_cache.length - counts[d.image_of_row] + 2",
     ["tests/test_references.py"]),
    ("gen-draft-depth-positions", "runtime/proposers.py",
     "d.positions(np.broadcast_to(root_slot[:, None] + level.depth, (B, T)))",
     "d.positions(np.broadcast_to(root_slot[:, None] + level.depth + 1, (B, T)))",
     ["tests/test_references.py"]),
    # The same slips in the device step's graphs (lantern.export.step_graphs: the torch runners
    # run these modules, ONNX Runtime their export), caught by the device cases of the references.
    ("torch-verify-positions", "export/step_graphs.py",
     '"verify.position_ids": self.positions(length[:, None] + self.depths[None, :], x["offset"])',
     '"verify.position_ids": self.positions(length[:, None] + 1 + self.depths[None, :], x["offset"])',
     REFERENCES_DEVICE),
    ("torch-draft0-positions", "export/step_graphs.py",
     'first = o["target_length"] - x["offset"] - counts[iob] + 1',
     'first = o["target_length"] - x["offset"] - counts[iob] + 2',
     REFERENCES_DEVICE),
    ("torch-draft-depth-positions", "export/step_graphs.py",
     "(root_position + self.d).clamp(0, self.max_position)",
     "(root_position + self.d + 1).clamp(0, self.max_position)",
     REFERENCES_DEVICE),
    # The step graphs' drafting: depth 1's parent is the root at draft0's column pending - 1, and
    # draft0's pending pairs see the earlier ones (each seeing only itself changes the root's
    # drafts; a pair seeing the next one changes nothing a one-layer drafter keeps: equivalent).
    ("torch-depth1-parent-column", "export/step_graphs.py",
     "parent_hidden = hidden.gather(1, last[:, None, None].expand(B, T, hidden.shape[2]))",
     "parent_hidden = hidden.gather(1, (last - 1).clamp(min=0)[:, None, None].expand(B, T, hidden.shape[2]))",
     REFERENCES_DEVICE),
    ("step-draft0-block-causal", "export/step_graphs.py",
     "causal = index[:, None] >= index[None, :]",
     "causal = index[:, None] == index[None, :]",
     ["tests/test_references.py::test_drafts_match_a_full_drafter_forward[c2i-device]"]),
    # The engine directory's integrity: a file changed while hashed, the neighbor table's k, plan hashes.
    ("hash-changed-guard-off", "runtime/integrity.py",
     "if _version(os.stat(path)) != key:", "if False:",
     ["tests/test_integrity.py::test_a_file_changed_between_its_stat_and_its_hash_is_not_remembered"]),
    ("neighbors-k-unchecked", "runtime/integrity.py",
     "if k is not None and table.shape[1] != k:", "if False:",
     ["tests/test_integrity.py::test_an_engine_whose_neighbor_table_has_another_k_than_its_manifest_is_refused"]),
    ("plan-sha-skipped", "runtime/manifest/io.py",
     ", (sorted(plans), REBUILD_PLANS)]", "]",
     ["tests/test_tensorrt_build.py::test_ar_engine_builds_ar_plans"]),
    # Settings reach the loop.
    ("settings-ignored", "runtime/generator.py",
     "settings = settings.resolve(self.manifest, self.directory)",
     "settings = GenerationSettings().resolve(self.manifest, self.directory)",
     ["tests/test_settings.py"]),
    # The CLI's options reach the engine, its checks decide, the server and client pass settings on.
    ("cli-temperature-dropped", "runtime/cli.py",
     "temperature=args.temperature, top_k=args.top_k", "temperature=1.0, top_k=args.top_k",
     ["tests/test_cli_commands.py::test_generate_option_reaches_the_engine"]),
    ("cli-cfg-interval-dropped", "runtime/cli.py",
     "cfg_interval=args.cfg_interval, tau=args.tau,", "cfg_interval=-1, tau=args.tau,",
     ["tests/test_cli_commands.py::test_generate_option_reaches_the_engine"]),
    ("cli-caption-mask-dropped", "runtime/cli.py",
     "caption=caption, caption_mask=mask,", "caption=caption, caption_mask=None,",
     ["tests/test_cli_commands.py::test_generate_option_reaches_the_engine"]),
    ("check-rtol-unscaled", "export/check_compare.py",
     '"ok": max_abs <= atol + rtol * scale', '"ok": max_abs <= atol + rtol',
     ["tests/test_cli_commands.py::test_check_tolerances_decide_the_verdict"]),
    ("client-n-dropped", "tools/serve_client.py",
     'payload = {"n": args.n,', 'payload = {"n": 1,',
     ["tests/test_serve_cli.py"]),
    # CFG interval: the boundary token.
    ("cfg-interval-host", "runtime/decoding.py",
     "late = token_index >= self.cfg_interval",
     "late = token_index > self.cfg_interval",
     [CFG_TEST]),
    ("cfg-interval-host-drafter", "runtime/proposers.py",
     "late = (d.count >= d.cfg_interval)[d.image_of_row]",
     "late = (d.count > d.cfg_interval)[d.image_of_row]",
     [CFG_TEST]),
    ("cfg-interval-device-drafter", "export/step_graphs.py",
     'late = (interval >= 0) & (x["count"][iob] >= interval)',
     'late = (interval >= 0) & (x["count"][iob] > interval)',
     [CFG_TEST]),
    ("cfg-interval-accept-graph", "export/accept_graphs.py",
     "((cfg_interval >= 0) & (body >= cfg_interval))", "((cfg_interval >= 0) & (body > cfg_interval))",
     [CFG_TEST]),
    ("cfg-interval-window-redraft", "export/accept_graphs.py",  # the same combination, as the window's re-drafts read it
     "((cfg_interval >= 0) & (body >= cfg_interval))", "((cfg_interval >= 0) & (body > cfg_interval))",
     ["tests/test_window_engine.py::test_onnxruntime_runs_the_window_on_its_graph_step_as_the_host_step"]),
    ("sampling-race-inverted", "runtime/sampling.py",
     "keys = -np.log(race) / probs.astype(np.float64)", "keys = -np.log(race) * probs.astype(np.float64)",
     ["tests/test_generator.py::test_relaxed_sampling_matches_the_specification"]),
    # The jacobi window: q must be what each draft was drawn from (exactness rests on it), and the
    # device step must read the streams as the host step does.
    ("jacobi-redraft-q-row", "runtime/jacobi.py",
     "np.take_along_axis(p, take[:, :, None], axis=1)",
     "np.take_along_axis(p, np.minimum(take + 1, W - 2)[:, :, None], axis=1)",
     ["tests/test_jacobi.py"]),
    ("jacobi-uniform-q-half", "runtime/jacobi.py",
     "q[n, i, :codes] = 1.0 / codes", "q[n, i, :codes // 2] = 2.0 / codes",
     ["tests/test_jacobi.py"]),
    ("step-forced-drafts", "export/step_graphs.py",
     "tokens = torch.where(is_forced[:, None], self.ids(column)[:, None], tokens)", "tokens = tokens + 0 * column[:, None]",
     ["tests/test_device_step.py::test_sampling_with_forced_tokens_on_the_device"]),
    ("step-table-next-chunk", "runtime/graph_step.py",
     "if self.draws and self.steps_run and self.steps_run % self.table_steps == 0:",
     "if self.draws and self.steps_run and self.steps_run % self.table_steps == 1:",
     ["tests/test_device_step.py::test_sampling_streams_in_chunks"]),
    ("torch-jacobi-redraft-uniforms", "export/step_jacobi.py",
     "u = self.race(x, 0, self.M)[:, 1:, 1].to(p.dtype)", "u = self.race(x, 0, self.M)[:, 1:, 0].to(p.dtype)",
     ["tests/test_device_jacobi.py"]),
    # What the net already guarded (acceptance, cache commits, streams), kept in the list so a
    # rewrite of the step is checked against all of it.
    ("lanternpp-bound-exclusive", "runtime/relaxation.py",
     "j = (cum <= bound[:, None]).sum(axis=1)", "j = (cum < bound[:, None]).sum(axis=1)",
     ["tests/test_accept.py"]),
    ("cache-commit-slot", "runtime/kvcache.py",
     "dst = self.length[r] + np.nonzero(keep)[1]", "dst = self.length[r] + np.nonzero(keep)[1] + 1",
     ["tests/test_generator.py", "tests/test_references.py"]),
    # Continuous batching: a joiner's state moved into its slot, all of it.
    ("continuous-stream-left-behind", "runtime/continuous.py",
     "d.streams.generators[n] = joiner.streams.generators[i]", "pass",
     ["tests/test_continuous.py"]),
    ("continuous-pending-left-behind", "runtime/continuous.py",
     "d.proposer.adopt(joiner.proposer, i, n)", "pass",
     ["tests/test_continuous.py"]),
    ("continuous-graph-stream-left-behind", "runtime/graph_step.py",
     'b.fill_rows(self.constants["table"], [image], row[None].astype(self.types["table"]))', "pass",
     ["tests/test_continuous.py"]),
    ("sampling-accept-node-target", "export/accept_graphs.py",
     "p = torch.where(moved[:, None], target_at(node), p)",
     "p = torch.where(moved[:, None], target_at(torch.zeros_like(node)), p)",
     ["tests/test_accept_graphs.py::test_the_sampling_module_in_float64_equals_the_numpy_rules"]),
    ("image-streams-shared", "runtime/streams.py",
     "return [int(seed) + i for i in range(images)]", "return [int(seed) for i in range(images)]",
     ["tests/test_streams.py"]),
]


# Mutants of code that builds the test engines (export, the engine directory's records, the demo
# command) run with engines built afresh; the others share engines built once from the unchanged
# copy (conftest's $LANTERN_TEST_ENGINES), which saves a minute or two per mutant.
BUILDS_ENGINES = ("export/", "tests/", "runtime/manifest/", "runtime/enginedir.py", "runtime/integrity.py",
                  "runtime/outdir.py", "tools/demo.py", "tools/export_cli.py")


def lines(text):
    return [line for line in text.splitlines() if line.strip()]


def make_copy(root):
    """The repository's sources and tests in `root`, and a `lantern` package over them."""
    ignore = shutil.ignore_patterns(".git", ".venv", "engines", "__pycache__", "*.egg-info", ".pytest_cache",
                                    ".hypothesis", "out")
    src = os.path.join(root, "repo")
    shutil.copytree(REPO, src, ignore=ignore)
    package = os.path.join(root, "pkg", "lantern")
    os.makedirs(package)
    open(os.path.join(package, "__init__.py"), "w").close()
    for name, folder in PACKAGES.items():
        os.symlink(os.path.join(src, folder), os.path.join(package, name))
    return src, os.path.join(root, "pkg")


def apply(src, file, text, replacement):
    path = os.path.join(src, file)
    with open(path) as f:
        code = f.read()
    count = code.count(text)
    if count != 1:
        raise SystemExit(f"mutation_check: {file}: the mutated text occurs {count} times, not once: {text!r}")
    code = code.replace(text, replacement)
    compile(code, path, "exec")  # a mutant must be valid Python: a syntax error kills nothing worth knowing
    with open(path, "w") as f:
        f.write(code)
    return code


def run_tests(src, pkg, tests, basetemp, timeout, engines=None):
    env = dict(os.environ, PYTHONPATH=pkg + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("LANTERN_TEST_ENGINES", None)
    if engines:
        env["LANTERN_TEST_ENGINES"] = engines
    probe = subprocess.run([sys.executable, "-c", "import lantern.runtime; print(lantern.runtime.__file__)"],
                           env=env, cwd=src, capture_output=True, text=True)
    if not probe.stdout.strip().startswith(pkg):
        raise SystemExit(f"mutation_check: the copy's lantern is not the one imported ({probe.stdout.strip()} "
                         f"{probe.stderr.strip()[-200:]})")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", f"--basetemp={basetemp}",
           *tests]
    start = time.time()
    try:
        r = subprocess.run(cmd, env=env, cwd=src, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, [], time.time() - start, "timeout"
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", r.stdout, flags=re.M)))
    summary = (lines(r.stdout) or ["(no output)"])[-1]
    return r.returncode, failed, time.time() - start, summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated mutant names")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--timeout", type=float, default=900, help="seconds per test run")
    a = p.parse_args(argv)
    known = {m[0]: m for m in MUTANTS}
    chosen = MUTANTS
    if a.only:
        wrong = [n for n in a.only.split(",") if n not in known]
        if wrong:
            p.error(f"unknown mutant(s) {', '.join(wrong)}; known: {', '.join(known)}")
        chosen = [known[n] for n in a.only.split(",")]
    if a.list:
        for name, file, text, replacement, tests in chosen:
            print(f"{name}: {file}: {text!r} -> {replacement!r}  [{' '.join(tests)}]")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="lantern-mutants-") as root:
        src, pkg = make_copy(root)
        engines = os.path.join(root, "engines")
        os.makedirs(engines)
        originals = {}
        baseline = {}
        for name, file, text, replacement, tests in chosen:
            key = tuple(tests)
            if key not in baseline:  # the unchanged copy must pass these tests first
                rc, failed, seconds, summary = run_tests(src, pkg, tests, os.path.join(root, "t"), a.timeout, engines)
                baseline[key] = rc == 0
                if rc != 0:
                    print(f"baseline FAILED for {' '.join(tests)}: {summary} {failed}", flush=True)
            if not baseline[key]:
                results.append(dict(mutant=name, file=file, status="no-baseline", tests=tests))
                continue
            path = os.path.join(src, file)
            originals.setdefault(path, open(path).read())
            apply(src, file, text, replacement)
            shared = None if file.startswith(BUILDS_ENGINES) else engines
            try:
                rc, failed, seconds, summary = run_tests(src, pkg, tests, os.path.join(root, "t"), a.timeout, shared)
            finally:
                with open(path, "w") as f:
                    f.write(originals[path])
            status = "survived" if rc == 0 else "killed"
            results.append(dict(mutant=name, file=file, change=[text, replacement], status=status,
                                killed_by=failed, seconds=round(seconds, 1), tests=tests, summary=summary))
            print(f"{status:8s} {name:32s} {seconds:6.1f}s  {', '.join(failed) or summary}", flush=True)
    survived = [r["mutant"] for r in results if r["status"] != "killed"]
    report = {"mutants": len(results), "killed": len(results) - len(survived), "not_killed": survived,
              "results": results}
    print(json.dumps({k: report[k] for k in ("mutants", "killed", "not_killed")}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
