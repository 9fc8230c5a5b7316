import pytest


@pytest.fixture(autouse=True)
def distill_private_cache(private_cache):
    """Every distillation test keeps lmpress's cache in its own folder (``tests/conftest.py``)."""
