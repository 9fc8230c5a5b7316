import pytest


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def training_text(tmp_path) -> str:
    from pydoc_data.topics import topics

    path = tmp_path / "train.txt"
    path.write_text("\n\n".join(topics[k] for k in sorted(topics)[40:120]))
    return str(path)
