import os
import sys

import pytest

# Tests run on 2 cores; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.dont_write_bytecode = True


@pytest.fixture(scope="session")
def c2i_engine(tmp_path_factory):
    """A tiny class-conditional engine (mc_sim_7b_63 tree), exported through the real CLI."""
    from engines import build_engine

    return build_engine(tmp_path_factory.mktemp("c2i"), "c2i")


@pytest.fixture(scope="session")
def t2i_engine(tmp_path_factory):
    """A tiny text-conditional engine (naive_extend_57 tree)."""
    from engines import build_engine

    return build_engine(tmp_path_factory.mktemp("t2i"), "t2i", tree="naive_extend_57")


@pytest.fixture(scope="session")
def chameleon_engines(tmp_path_factory):
    """Tiny Anole and Lumina-mGPT engines ({family: directory}), exported through the real CLI."""
    from engines import build_chameleon_engines

    return build_chameleon_engines(tmp_path_factory.mktemp("chameleon-engines"))


@pytest.fixture(scope="session")
def demo_engine(tmp_path_factory):
    """The README's main command, `lantern-export demo`, run once per session: its engine directory
    (the shipped demo model exported, checked and run) serves every test that needs a real engine
    with a drafter, a neighbor table and a VQ decoder."""
    from lantern.tools import export_cli

    out = tmp_path_factory.mktemp("demo") / "engine"
    assert export_cli.main(["demo", "--out", str(out), "--per-class", "1", "--threads", "1"]) == 0
    return out
