import pytest


@pytest.fixture(scope="session")
def default_llm():
    """The embedded SmolLM2-135M-Instruct, loaded once for the whole session."""
    from jaxinfer import LLM

    return LLM(progress=False)
