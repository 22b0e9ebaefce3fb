import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--all-variants", action="store_true", default=False,
        help="compile every kernel variant (all head dims, dtypes, causal, targets), not the CI subset",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def all_variants(request):
    return request.config.getoption("--all-variants")
