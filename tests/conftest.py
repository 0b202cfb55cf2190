import os

import pytest

from tests.xla_flags import with_suite_level

# Engines here compile each shape bucket when a step first needs it (EngineConfig.warmup):
# most tests run a few prompts, and a background warm-up compiled every other bucket of
# every engine they built, on the cores the other worker's tests ran on (half of the
# compilation in the engine tests). Set here, not in scripts/test.sh, so that a direct
# pytest run and the tests' subprocesses (which inherit it) do the same. Tests of the
# other warm-ups ask for theirs.
os.environ.setdefault("JAXINFER_WARMUP", "on_demand")
# Before JAX starts its backend (it reads XLA_FLAGS then); tests/xla_flags.py says why.
os.environ["XLA_FLAGS"] = with_suite_level(os.environ.get("XLA_FLAGS", ""))


@pytest.fixture(scope="session")
def default_llm():
    """The embedded SmolLM2-135M-Instruct, loaded once for the whole session."""
    from jaxinfer import LLM

    return LLM(progress=False)


def pytest_collection_modifyitems(items):
    """Files holding a `slow` test first, each file's tests in their own
    order. scripts/test.sh's two workers take whole files in this order
    (--dist loadfile --no-loadscope-reorder), so the long files start early
    and the many short ones even out the end; xdist's own order sends the
    files with the most tests first, which puts the few-test, minutes-long
    multi-device files late."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
