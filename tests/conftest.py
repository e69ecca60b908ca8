import pytest


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory):
    """One Hugging Face cache for the session: the tiny dataset is tokenized once, not once per test."""
    return tmp_path_factory.mktemp("hf_home")
