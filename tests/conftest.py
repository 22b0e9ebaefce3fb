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


@pytest.fixture(autouse=True)
def poison_backward_scratch(monkeypatch):
    """Every test runs the backward with its scratch buffers (the dQ accumulator) full of NaN
    (``interface.POISON_SCRATCH``): a kernel that reads a row nothing wrote, such as the SM90
    postprocess on a Q block no K/V block reached, shows up as NaN in the gradients."""
    from cute_attn import interface

    monkeypatch.setattr(interface, "POISON_SCRATCH", True)
