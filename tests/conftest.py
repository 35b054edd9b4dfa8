import pytest

import agent


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The tokenizer made here from scratch (agent.make_tokenizer), shared by every test that needs one."""
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tok")
    agent.make_tokenizer(str(path))
    return AutoTokenizer.from_pretrained(str(path))
